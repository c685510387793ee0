"""The recent outputs of finished requests, for suffix decoding's proposals across requests
(an agent's repeated tool calls, boilerplate): their tokens in one store, and where each pair
of tokens (bigram) occurs in them.

Bounded: at most `max_outputs` outputs and `max_tokens` tokens; the oldest output goes first
(vLLM's suffix cache evicts in the same order). A lookup reads the `max_occurrences` most recent
occurrences of a bigram, so its cost does not grow with the cache.
"""

from __future__ import annotations

import bisect
from array import array
from collections import deque

import numpy as np

from scheduler.speculative.token_buffer import NO_TOKEN


def bigram_keys(tokens: np.ndarray) -> list[int]:
    """One int per adjacent pair (token ids are below 2**31)."""
    tokens = tokens.astype(np.int64)
    return ((tokens[:-1] << 32) | tokens[1:]).tolist()


class OutputCache:
    def __init__(self, max_outputs: int, max_tokens: int = 1 << 20,
                 max_occurrences: int = 64):
        self.max_outputs = max_outputs
        self.max_tokens = max_tokens
        self.max_occurrences = max_occurrences
        # Positions are absolute (they only grow); the store holds them from `_base` on.
        self._store = np.full(1024, NO_TOKEN, dtype=np.int32)
        self._base = 0
        self._end = 0
        self._outputs: deque[tuple[int, int]] = deque()  # (start, end) of each, oldest first
        # bigram -> absolute ends (the position after the pair) of its occurrences, ascending;
        # those before the oldest cached output are dropped lazily.
        self._occurrences: dict[int, array] = {}

    def add(self, output: np.ndarray) -> None:
        if self.max_outputs <= 0 or not 2 <= len(output) <= self.max_tokens:
            return
        start = self._end + 1  # (a -1 between outputs: no continuation runs across)
        self._write(start, output)
        for end, key in enumerate(bigram_keys(output), start + 2):
            occurrences = self._occurrences.get(key)
            if occurrences is None:
                occurrences = self._occurrences[key] = array("q")
            occurrences.append(end)
        self._outputs.append((start, self._end))
        while (len(self._outputs) > self.max_outputs
               or self._end - self._outputs[0][0] > self.max_tokens):
            self._outputs.popleft()
        if self.live_start - self._base > max(self._end - self.live_start, 1 << 16):
            self._compact()

    @property
    def live_start(self) -> int:
        return self._outputs[0][0] if self._outputs else self._end

    @property
    def num_outputs(self) -> int:
        return len(self._outputs)

    @property
    def num_tokens(self) -> int:
        return sum(end - start for start, end in self._outputs)

    @property
    def store(self) -> np.ndarray:
        """The tokens (-1 between outputs and after the last); index = position - offset."""
        return self._store

    @property
    def offset(self) -> int:
        return self._base

    def occurrences(self, last_two: np.ndarray) -> np.ndarray:
        """Store indices just past the most recent occurrences of these two tokens, ascending."""
        found = self._occurrences.get((int(last_two[0]) << 32) | int(last_two[1]))
        if not found:
            return np.zeros(0, dtype=np.int64)
        first = max(bisect.bisect_left(found, self.live_start + 2),
                    len(found) - self.max_occurrences)
        return np.frombuffer(found, dtype=np.int64)[first:] - self._base

    def _write(self, start: int, output: np.ndarray) -> None:
        end = start + len(output)
        if end - self._base >= len(self._store):
            grown = np.full(max(2 * len(self._store), end - self._base + 1), NO_TOKEN,
                            dtype=np.int32)
            grown[:self._end - self._base] = self._store[:self._end - self._base]
            self._store = grown
        self._store[start - self._base:end - self._base] = output
        self._end = end

    def _compact(self) -> None:
        """Drop the evicted outputs' tokens and occurrences (amortized: when they are most of
        the store)."""
        live = self.live_start - 1
        kept = self._store[live - self._base:self._end - self._base]
        self._store = np.full(max(2 * len(kept), 1024), NO_TOKEN, dtype=np.int32)
        self._store[:len(kept)] = kept
        self._base = live
        for key in list(self._occurrences):
            found = self._occurrences[key]
            stale = bisect.bisect_left(found, live + 2)
            if stale == len(found):
                del self._occurrences[key]
            elif stale:
                del found[:stale]
