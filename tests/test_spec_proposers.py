"""Speculative decoding's proposers (worker/speculative/): n-gram prompt lookup and suffix
decoding propose what followed the request's last tokens, nothing on text that does not
repeat, bounded and released with the request; the acceptance history adapts the length."""

import numpy as np
import pytest

from scheduler.speculative.acceptance import AcceptanceHistory
from scheduler.speculative.ngram import NgramProposer
from scheduler.speculative.suffix import SuffixProposer

rng = np.random.default_rng(28)


def random_text(n, vocab=50_000):
    return rng.integers(0, vocab, n)


def reference_ngram(tokens, k, max_n, min_n):
    """Longest n first, most recent occurrence first, by brute force."""
    tokens = list(tokens)
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n:end] == tokens[length - n:]:
                extended = tokens[:]
                while len(extended) < end + k:  # (a copy overlapping its own output)
                    extended.append(extended[len(extended) - (length - end)])
                return extended[end:end + k]
    return []


# -- n-gram --------------------------------------------------------------------------------


def test_ngram_proposes_the_continuation_of_a_repeated_passage():
    passage = random_text(300)
    proposer = NgramProposer(num_speculative_tokens=6)
    for copied in range(5, 100):
        tokens = np.concatenate([passage, passage[:copied]])
        assert proposer.propose("r", tokens).tolist() == passage[copied:copied + 6].tolist()
    proposer.release("r")
    assert proposer.num_requests == 0


def test_ngram_prefers_the_longest_then_the_most_recent_match():
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_max=4,
                             prompt_lookup_min=2)
    # "1 2" last followed 8, but "5 1 2" (longer) followed 7.
    tokens = np.array([5, 1, 2, 7, 3, 1, 2, 8, 5, 1, 2])
    assert proposer.propose("a", tokens).tolist() == [7, 3, 1]
    # Two equally long matches: the more recent one.
    tokens = np.array([1, 2, 9, 4, 1, 2, 8, 4, 1, 2])
    assert proposer.propose("b", tokens).tolist() == [8, 4, 1]


def test_ngram_repetition_goes_on_repeating():
    proposer = NgramProposer(num_speculative_tokens=5)
    assert proposer.propose("a", np.array([9, 1, 1, 1, 1])).tolist() == [1] * 5
    assert proposer.propose("b", np.array([9, 3, 4, 3, 4, 3, 4])).tolist() == [3, 4, 3, 4, 3]


def test_ngram_proposes_nothing_on_text_that_does_not_repeat():
    proposer = NgramProposer(num_speculative_tokens=5)
    tokens = random_text(2_200)
    assert all(len(proposer.propose("r", tokens[:n])) == 0 for n in range(2_000, 2_200))


def test_ngram_incremental_index_matches_brute_force_through_rollbacks():
    proposer = NgramProposer(num_speculative_tokens=4, prompt_lookup_max=4,
                             prompt_lookup_min=1, max_chain=10**9)
    tokens = list(random_text(40, vocab=6))
    for step in range(400):
        if step % 37 == 36:  # (a rollback, then other tokens)
            del tokens[-3:]
            proposer.rollback("r", len(tokens))
        tokens.append(int(rng.integers(0, 6)))
        got = proposer.propose("r", np.array(tokens), max_tokens=4).tolist()
        assert got == reference_ngram(tokens, 4, 4, 1), step


def test_ngram_memory_grows_with_the_request_and_is_released():
    proposer = NgramProposer(num_speculative_tokens=5)
    tokens = random_text(20_000)
    proposer.propose("r", tokens[:10_000])
    half = proposer.memory_bytes("r")
    proposer.propose("r", tokens)
    assert proposer.memory_bytes("r") < 250 * 20_000  # (about 20 bytes a token + n-grams)
    assert proposer.memory_bytes("r") < 3 * half
    proposer.release("r")
    assert proposer.num_requests == 0 and proposer.memory_bytes("r") == 0


# -- suffix --------------------------------------------------------------------------------


def reference_suffix(tokens, k, depth, factor, min_prob):
    """Arctic Inference's path speculation over the request's own tokens, by brute force:
    for each match length, count occurrences (the request's own last tokens included) and
    follow the most frequent next token."""
    tokens = list(tokens)
    length = len(tokens)
    pattern = tokens[max(0, length - depth):]
    best, best_score = [], 0.0
    for m in range(1, len(pattern)):
        suffix = pattern[-m:]
        ends = [e for e in range(m, length + 1) if tokens[e - m:e] == suffix]
        if len(ends) <= 1:  # (only the request's own last tokens)
            break
        cap = max(0, min(k, int(m * factor + 1e-6), depth - m))
        draft, prob, score = [], 1.0, 0.0
        while len(draft) < cap:
            following = [tokens[e] for e in ends if e < length]
            if not following:
                break
            values, counts = np.unique(following, return_counts=True)
            token, count = int(values[counts.argmax()]), int(counts.max())
            prob *= count / len(ends)
            if prob < min_prob:
                break
            draft.append(token)
            score += prob
            ends = [e + 1 for e in ends if e < length and tokens[e] == token]
        if score >= best_score:
            best, best_score = draft, score
    return best, best_score


def test_suffix_matches_a_brute_force_suffix_tree_walk():
    proposer = SuffixProposer(num_speculative_tokens=8, max_tree_depth=12)
    tokens = list(random_text(30, vocab=5))
    for step in range(300):
        tokens.append(int(rng.integers(0, 5)))
        draft = proposer.draft("r", np.array(tokens))
        expected, score = reference_suffix(tokens, 8, 12, 1.0, 0.1)
        assert draft.tokens.tolist() == expected, step
        assert draft.score == pytest.approx(score)


def test_suffix_proposes_the_continuation_of_a_repeated_passage():
    passage = random_text(300)
    proposer = SuffixProposer(num_speculative_tokens=8)
    proposer.add_request("r", passage)
    for copied in range(8, 100):
        tokens = np.concatenate([passage, passage[:copied]])
        assert proposer.propose("r", tokens).tolist() == passage[copied:copied + 8].tolist()


def test_suffix_length_adapts_to_the_match_and_its_certainty():
    passage = random_text(300)
    proposer = SuffixProposer(num_speculative_tokens=16, max_spec_factor=0.5)
    tokens = np.concatenate([passage, passage[:6]])
    # A 6-token match proposes at most 6 * 0.5 tokens.
    assert proposer.propose("r", tokens).tolist() == passage[6:9].tolist()
    assert len(proposer.propose("r", tokens, max_tokens=2)) == 2
    # After "7 8": 1 three times, 2 twice: 1 is proposed, with probability 3/6 (the request's
    # own "7 8" counts); then nothing above min_token_prob follows it.
    unsure = SuffixProposer(num_speculative_tokens=4, min_token_prob=0.3)
    tokens = np.array([7, 8, 1, 50, 7, 8, 2, 51, 7, 8, 1, 52, 7, 8, 2, 53, 7, 8, 1, 54, 7, 8])
    draft = unsure.draft("u", tokens)
    assert draft.tokens.tolist() == [1] and draft.score == pytest.approx(0.5)


def test_suffix_proposes_little_on_text_that_does_not_repeat():
    proposer = SuffixProposer(num_speculative_tokens=8)
    tokens = random_text(2_200)
    drafts = [proposer.propose("r", tokens[:n]) for n in range(2_000, 2_200)]
    # (A last token seen once before proposes its one follower, at probability 1/2.)
    assert all(len(d) <= 1 for d in drafts) and sum(map(len, drafts)) < 20


def test_suffix_proposes_from_other_requests_finished_outputs():
    answer = random_text(200)
    proposer = SuffixProposer(num_speculative_tokens=8)
    first_prompt = random_text(50)
    proposer.add_request("first", first_prompt)
    proposer.propose("first", np.concatenate([first_prompt, answer]))
    proposer.release("first")
    # (Its output is cached, not its prompt.)
    assert proposer.num_requests == 0 and proposer.outputs.num_tokens == 200
    prompt = random_text(100)
    proposer.add_request("second", prompt)
    tokens = np.concatenate([prompt, answer[:10]])
    assert proposer.propose("second", tokens).tolist() == answer[10:18].tolist()

    cancelled = SuffixProposer(num_speculative_tokens=8)
    off = SuffixProposer(num_speculative_tokens=8, max_cached_requests=0)
    for proposer in (cancelled, off):
        proposer.add_request("first", first_prompt)
        proposer.propose("first", np.concatenate([first_prompt, answer]))
        proposer.release("first", cache_output=proposer is off)
    for proposer in (cancelled, off):
        proposer.add_request("second", prompt)
        assert len(proposer.propose("second", tokens)) == 0


def reference_cached(outputs, context, k, depth, factor, min_prob):
    """Arctic Inference's walk over other requests' outputs (matches of 2 tokens and more),
    by brute force: each output a sequence of its own."""
    pattern = list(context[-depth:])
    best, best_score = [], 0.0
    for m in range(2, len(pattern)):
        ends = [(o, e) for o in outputs for e in range(m, len(o) + 1)
                if list(o[e - m:e]) == pattern[-m:]]
        if not ends:
            break
        cap = max(0, min(k, int(m * factor + 1e-6), depth - m))
        draft, prob, score = [], 1.0, 0.0
        while len(draft) < cap and ends:
            following = [int(o[e]) for o, e in ends if e < len(o)]
            if not following:
                break
            values, counts = np.unique(following, return_counts=True)
            token, count = int(values[counts.argmax()]), int(counts.max())
            prob *= count / len(ends)
            if prob < min_prob:
                break
            draft.append(token)
            score += prob
            ends = [(o, e + 1) for o, e in ends if e < len(o) and o[e] == token]
        if score >= best_score:
            best, best_score = draft, score
    return best, best_score


def test_suffix_cache_walk_matches_brute_force():
    from scheduler.speculative.suffix import best_draft, narrow_matches

    proposer = SuffixProposer(num_speculative_tokens=6, max_tree_depth=10,
                              max_cached_requests=12)
    outputs = [random_text(int(rng.integers(2, 25)), vocab=4) for _ in range(20)]
    for i, output in enumerate(outputs):
        proposer.add_request(i, np.array([7]))
        proposer.propose(i, np.concatenate([[7], output]))
        proposer.release(i)
    cache = proposer.outputs
    assert cache.num_outputs == 12
    for _ in range(200):
        context = random_text(int(rng.integers(3, 14)), vocab=4)
        pattern = context[-10:]
        levels = narrow_matches(cache.store, cache.occurrences(pattern[-2:]), pattern, 2,
                                len(pattern) - 1)
        draft = best_draft(cache.store, levels, 6, 10, 1.0, 0.1)
        expected, score = reference_cached(outputs[-12:], context, 6, 10, 1.0, 0.1)
        assert draft.tokens.tolist() == expected, (context, draft)
        assert draft.score == pytest.approx(score)


def test_suffix_cache_keeps_the_newest_outputs_within_its_bounds():
    proposer = SuffixProposer(num_speculative_tokens=4, max_cached_requests=50)
    outputs = [random_text(500) for _ in range(400)]
    for i, output in enumerate(outputs):
        proposer.add_request(f"r{i}", output[:1])
        proposer.propose(f"r{i}", output)
        proposer.release(f"r{i}")
    cache = proposer.outputs
    assert cache.num_outputs == 50 and cache.num_tokens == 50 * 499
    assert len(cache.store) <= 4 * 50 * 500 + 65536 * 2  # (evicted outputs are compacted away)
    newest, evicted = outputs[-1], outputs[0]
    for name, output, expected in (("new", newest, newest[20:24]), ("old", evicted, [])):
        proposer.add_request(name, random_text(30))
        tokens = np.concatenate([random_text(30), output[15:20]])
        assert proposer.propose(name, tokens).tolist() == list(expected)


def test_suffix_rollback_forgets_the_rejected_tokens():
    passage = random_text(100)
    proposer = SuffixProposer(num_speculative_tokens=4)
    tokens = np.concatenate([passage, passage[:10]])
    proposer.propose("r", np.concatenate([tokens, [1, 2, 3]]))
    proposer.rollback("r", len(tokens))
    assert proposer.propose("r", tokens).tolist() == passage[10:14].tolist()


# -- acceptance ----------------------------------------------------------------------------


def test_acceptance_history_adapts_the_proposal_length():
    history = AcceptanceHistory(max_tokens=6, window=4)
    assert history.next_length == 6 and history.recent_acceptance_rate is None
    for accepted in (1, 0, 2, 0, 0, 0, 0):
        history.record(proposed=history.next_length, accepted=accepted)
    assert history.next_length == 1  # (one fewer after each partial acceptance, at least 1)
    history.record(proposed=1, accepted=1)
    history.record(proposed=3, accepted=3)
    assert history.next_length == 5  # (two more after each full acceptance)
    history.record(proposed=5, accepted=5)
    assert history.next_length == 6  # (at most the configured number)
    assert history.recent_accepted == [0, 1, 3, 5]
    assert history.recent_acceptance_rate == pytest.approx(9 / 10)
    history.record(proposed=0, accepted=0)  # (nothing proposed: nothing learned)
    assert history.recent_accepted == [0, 1, 3, 5]
    assert (history.num_draft_tokens, history.num_accepted_tokens) == (6 + 5 + 4 + 3 + 2 + 1
                                                                       + 1 + 1 + 3 + 5, 12)
    assert history.accepted_per_position == [5, 3, 2, 1, 1, 0]
    with pytest.raises(ValueError):
        history.record(proposed=2, accepted=3)


def test_the_configuration_makes_its_proposer():
    from pipelines.config import PipelineConfig
    from scheduler.speculative.proposer import make_proposer

    config = PipelineConfig().replace(prompt_lookup_max=3, suffix_decoding_min_token_prob=0.2,
                                      num_speculative_tokens=7)
    assert make_proposer(config.speculative_config) is None
    ngram = make_proposer(config.replace(speculative_method="ngram").speculative_config)
    suffix = make_proposer(config.replace(speculative_method="suffix").speculative_config)
    assert (ngram.num_speculative_tokens, ngram.prompt_lookup_max) == (7, 3)
    assert (suffix.num_speculative_tokens, suffix.min_token_prob) == (7, 0.2)
    passage = random_text(50)
    for proposer in (ngram, suffix):  # (the same calls)
        proposer.add_request("r", passage)
        tokens = np.concatenate([passage, passage[:10]])
        assert proposer.propose("r", tokens).tolist() == passage[10:17].tolist()
        proposer.rollback("r", len(passage))
        proposer.release("r", cache_output=False)
        assert proposer.num_requests == 0
