"""Suffix decoding (Oliaro et al. 2024; vLLM's `suffix`, from Arctic Inference): propose the
most frequent continuation of the request's last tokens, as found in the request itself
(prompt and output) and in the recent outputs of other requests (output_cache.py).

Arctic Inference keeps suffix trees of depth `max_tree_depth`; a node's count is the number of
occurrences of its string. Here the occurrences themselves stand in for the nodes: the places
where the last two tokens occur, how far back each agrees with the request's last tokens (one
vectorized comparison), hence the occurrences of every match length m; a walk down the
continuations keeps the occurrences that follow the most frequent next token, the token's
probability being its share of the node's count. The rules are Arctic's: a match of m tokens
proposes at most min(num tokens, m * max_spec_factor, depth - m) tokens, the walk stops below
min_token_prob, and of all match lengths the draft with the highest score (the sum of its
tokens' probabilities) wins, ties going to the longer match; the request's draft and the
other requests' compete the same way (tests/test_spec_proposers.py checks the request's
against a brute-force walk).

Differences: an output joins the cache when its request finishes (Arctic adds tokens as they
are generated); the cache's matches start at two tokens and read the most recent 64
occurrences of the last two tokens (a bounded cost per step). A request's own matches are
found by scanning its tokens: microseconds for thousands of tokens, and no index to keep.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from scheduler.speculative.output_cache import OutputCache
from scheduler.speculative.token_buffer import TokenBuffer


@dataclass
class SuffixDraft:
    tokens: np.ndarray
    score: float = 0.0  # sum of the tokens' estimated probabilities
    match_length: int = 0


NO_DRAFT = SuffixDraft(np.zeros(0, dtype=np.int32))


def narrow_matches(corpus: np.ndarray, ends: np.ndarray, pattern: np.ndarray, matched: int,
                   max_match: int) -> dict[int, np.ndarray]:
    """Match length -> the occurrences (indices of the token after each) of the last that many
    tokens of `pattern`, from `ends`, the occurrences of its last `matched`, to `max_match`.
    Lengths with the same occurrences share one array (their walks are the same)."""
    if not len(ends) or max_match < matched:
        return {}
    # How far back each occurrence agrees with the pattern, all at once.
    # (Index -1 is the -1 past the corpus's end: a match stops there, before reading further
    # negative indices.)
    before = corpus[ends[:, None] - np.arange(1, max_match + 1)]
    lengths = (before == pattern[::-1][:max_match]).cumprod(axis=1).sum(axis=1)
    # (Every occurrence matches at least `matched`; few distinct lengths beyond.)
    levels, shared, low = {}, ends, matched
    for length in sorted(set(lengths.tolist())):
        for m in range(low, length + 1):
            levels[m] = shared
        low = length + 1
        shared = ends[lengths > length]
    return levels


def walk(corpus: np.ndarray, ends: np.ndarray, max_tokens: int, min_prob: float,
         open_ends: int = 0) -> tuple[list[int], list[float]]:
    """The most frequent continuation of the occurrences ending before `ends`, one token at a
    time while its probability stays >= min_prob; `open_ends` more occurrences end the
    sequence (they count, with no continuation). Returns the tokens and their probabilities."""
    tokens: list[int] = []
    probs: list[float] = []
    if max_tokens <= 0 or not len(ends):
        return tokens, probs
    # What follows each occurrence (-1 past its sequence's end; the store ends with -1).
    rows = corpus[np.minimum(ends[:, None] + np.arange(max_tokens), len(corpus) - 1)]
    prob, count, j = 1.0, len(ends) + open_ends, 0
    while j < max_tokens and len(rows):
        head = rows[0, j:]
        run = int(((rows[:, j:] == head).all(axis=0) & (head >= 0)).cumprod().sum())
        if run:  # (every occurrence goes on the same way: copying, or a single occurrence)
            prob *= len(rows) / count
            if prob < min_prob:
                break
            tokens.extend(head[:run].tolist())
            probs.extend([prob] * run)
            count, j = len(rows), j + run
            continue
        column = rows[:, j]
        counts = Counter(column[column >= 0].tolist())  # (np.unique costs more, this small)
        if not counts:
            break
        token, token_count = max(counts.items(), key=lambda item: (item[1], -item[0]))
        prob *= token_count / count
        if prob < min_prob:
            break
        tokens.append(token)
        probs.append(prob)
        rows = rows[column == token]
        count, j = len(rows), j + 1
    return tokens, probs


def best_draft(corpus: np.ndarray, levels: dict[int, np.ndarray], max_tokens: int,
               max_depth: int, max_spec_factor: float, min_prob: float,
               open_ends: int = 0) -> SuffixDraft:
    caps = {m: max(0, min(max_tokens, int(m * max_spec_factor + 1e-6), max_depth - m))
            for m in levels}
    cap_up_to, group_cap, most = {}, {}, 0  # (the best any match up to m can do)
    for m, cap in caps.items():
        cap_up_to[m] = most = max(most, cap)
        group_cap[id(levels[m])] = max(group_cap.get(id(levels[m]), 0), cap)
    # id of the occurrences -> the walk's tokens and its score after each
    walks: dict[int, tuple[list[int], list[float]]] = {}
    best_score, best_tokens, best_match = 0.0, [], 0
    for m in reversed(caps):  # longest first: a shorter match must do better
        if cap_up_to[m] <= best_score:
            break
        if caps[m] <= best_score:
            continue
        ends = levels[m]
        if id(ends) not in walks:  # (a walk with a smaller cap is a prefix of this one)
            tokens, probs = walk(corpus, ends, group_cap[id(ends)], min_prob, open_ends)
            walks[id(ends)] = tokens, list(accumulate(probs))
        tokens, scores = walks[id(ends)]
        cap = min(caps[m], len(tokens))
        if cap and scores[cap - 1] > best_score:
            best_score, best_tokens, best_match = scores[cap - 1], tokens[:cap], m
    if not best_tokens:
        return NO_DRAFT
    return SuffixDraft(np.asarray(best_tokens, dtype=np.int32), best_score, best_match)


class SuffixProposer:
    """Proposals for every running request: `add_request` with its prompt (so that `release`
    caches its output alone), then `propose` each step, `release` when it ends."""

    def __init__(self, num_speculative_tokens: int, max_tree_depth: int = 24,
                 max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, max_cached_tokens: int = 1 << 20):
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.outputs = OutputCache(max_cached_requests, max_cached_tokens)
        self._requests: dict[str, tuple[TokenBuffer, int]] = {}  # (tokens, prompt length)

    def add_request(self, request_id: str, prompt: np.ndarray) -> None:
        buffer = TokenBuffer(2 * len(prompt))
        buffer.extend(prompt)
        self._requests[request_id] = (buffer, len(prompt))

    def propose(self, request_id: str, tokens: np.ndarray,
                max_tokens: int | None = None) -> np.ndarray:
        return self.draft(request_id, tokens, max_tokens).tokens

    def draft(self, request_id: str, tokens: np.ndarray,
              max_tokens: int | None = None) -> SuffixDraft:
        """The best draft to follow `tokens`, the request's prompt and output so far (each
        call's extends the last one's; `rollback` for the exception)."""
        if request_id not in self._requests:
            self.add_request(request_id, tokens)
        buffer, _ = self._requests[request_id]
        if len(tokens) < buffer.length:
            raise ValueError(f"{request_id}: tokens shrank without a rollback")
        buffer.extend(tokens[buffer.length:])
        max_tokens = self.num_speculative_tokens if max_tokens is None else max_tokens
        length = buffer.length
        if length < 2 or max_tokens <= 0:
            return NO_DRAFT
        corpus = buffer.array
        pattern = corpus[max(0, length - self.max_tree_depth):length]
        max_match = len(pattern) - 1
        rules = (max_tokens, self.max_tree_depth, self.max_spec_factor, self.min_token_prob)
        # The request: its own last tokens are one more occurrence, ending the sequence. Its
        # matches of two tokens and more first (few occurrences to narrow down) ...
        draft = NO_DRAFT
        if max_match >= 2:
            ends = np.flatnonzero((corpus[:length - 2] == corpus[length - 2])
                                  & (corpus[1:length - 1] == corpus[length - 1])) + 2
            draft = best_draft(corpus, narrow_matches(corpus, ends, pattern, 2, max_match),
                               *rules, open_ends=1)
        # ... then of its last token alone, where the few tokens such a match may propose
        # could do better.
        if min(max_tokens, int(self.max_spec_factor + 1e-6), self.max_tree_depth - 1) \
                > draft.score:
            ends = np.flatnonzero(corpus[:length - 1] == corpus[length - 1]) + 1
            single = best_draft(corpus, {1: ends} if len(ends) else {}, *rules, open_ends=1)
            if single.score > draft.score:
                draft = single
        if max_match >= 2 and self.outputs.num_outputs:
            store = self.outputs.store
            levels = narrow_matches(store, self.outputs.occurrences(pattern[-2:]), pattern, 2,
                                    max_match)
            other = best_draft(store, levels, *rules)
            if other.score > draft.score:
                draft = other
        return draft

    def rollback(self, request_id: str, length: int) -> None:
        entry = self._requests.get(request_id)
        if entry is not None and length < entry[0].length:
            entry[0].truncate(length)

    def release(self, request_id: str, cache_output: bool = True) -> None:
        """The request is done: its output joins the cache of other requests' proposals
        (unless it failed or was cancelled: cache_output False)."""
        entry = self._requests.pop(request_id, None)
        if entry is not None and cache_output:
            buffer, prompt_length = entry
            self.outputs.add(buffer.tokens[prompt_length:])

    @property
    def num_requests(self) -> int:
        return len(self._requests)
