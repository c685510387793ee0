"""N-gram proposals (prompt lookup, vLLM's `ngram`, llama.cpp's lookup decoding): find the
last n tokens of the request (n from prompt_lookup_max down to prompt_lookup_min, longest
first) earlier in its prompt or output, most recent occurrence first, and propose what
followed them there (a repetition that reaches the end repeats: "a b a b" proposes "a b a b").

Each request keeps a hash chain over its tokens, as LZ77 compressors do: `head` maps each
n-gram of the shortest length to the end of its most recent occurrence, `prev[e]` links an
occurrence to the previous one with the same n-gram. Appending a token indexes one n-gram; a
lookup follows at most `max_chain` links from the most recent occurrence, extending each match
backwards to find the longest. So a step costs O(new tokens + max_chain) whatever the request's
length, and its memory is about 20 bytes a token (its tokens, the links, one dict entry per
distinct n-gram), released with the request.
"""

from __future__ import annotations

import numpy as np

from scheduler.speculative.token_buffer import TokenBuffer


class NgramIndex:
    """One request's tokens and the hash chain over its n-grams of length `key_length`."""

    def __init__(self, key_length: int, max_length: int, max_chain: int):
        self.key_length = key_length
        self.max_length = max_length  # longest match looked for
        self.max_chain = max_chain
        self.buffer = TokenBuffer()
        self.head: dict[bytes, int] = {}
        self.prev = np.full(self.buffer.array.shape, -1, dtype=np.int32)

    def extend(self, tokens: np.ndarray) -> None:
        start = self.buffer.length
        self.buffer.extend(tokens)
        if len(self.prev) < len(self.buffer.array):
            self.prev = np.concatenate(
                [self.prev, np.full(len(self.buffer.array) - len(self.prev), -1, np.int32)])
        # An occurrence ending at e is indexed once the token at e (its continuation) exists.
        first_end = max(self.key_length, start)
        last_end = self.buffer.length - 1
        if first_end > last_end:
            return
        n, array = self.key_length, self.buffer.array
        if last_end - first_end < 8:  # (a decode step's few tokens)
            keys = [array[end - n:end].tobytes() for end in range(first_end, last_end + 1)]
        else:  # (a prompt: each n-gram's bytes at once)
            windows = np.lib.stride_tricks.sliding_window_view(array[first_end - n:last_end], n)
            keys = np.ascontiguousarray(windows).view(np.dtype((np.void, 4 * n)))
            keys = keys.ravel().tolist()
        head, prev = self.head, self.prev
        for end, key in enumerate(keys, first_end):
            prev[end] = head.get(key, -1)
            head[key] = end

    def truncate(self, length: int) -> None:
        """Forget the tokens from `length` on (a rollback): their occurrences head their
        chains, so each chain's head goes back one link."""
        n, array = self.key_length, self.buffer.array
        for end in range(self.buffer.length - 1, max(length, n) - 1, -1):
            key = array[end - n:end].tobytes()
            if self.prev[end] >= 0:
                self.head[key] = int(self.prev[end])
            else:
                del self.head[key]
            self.prev[end] = -1
        self.buffer.truncate(length)

    def propose(self, max_tokens: int) -> np.ndarray:
        array, length, n = self.buffer.array, self.buffer.length, self.key_length
        if length <= n or max_tokens <= 0:
            return array[:0]
        end = self.head.get(array[length - n:length].tobytes(), -1)
        best_end, best_match = -1, 0
        for _ in range(self.max_chain):
            if end < 0:
                break
            match = n
            while (match < self.max_length and end - match > 0
                   and array[end - match - 1] == array[length - match - 1]):
                match += 1
            if match > best_match:  # (ties: the more recent one, met first)
                best_end, best_match = end, match
                if match == self.max_length:
                    break
            end = int(self.prev[end])
        if best_end < 0:
            return array[:0]
        if length - best_end >= max_tokens:
            return array[best_end:best_end + max_tokens].copy()
        # What followed runs into the request's own last tokens (a repetition: "a b a b"): it
        # goes on repeating them, as an LZ77 copy that overlaps its own output does.
        period = array[best_end:length]
        return np.tile(period, -(-max_tokens // len(period)))[:max_tokens]

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes + self.prev.nbytes + 100 * len(self.head)


class NgramProposer:
    """Proposals for every running request; each request's index lives from its first
    proposal until `release`."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int = 4,
                 prompt_lookup_min: int = 2, max_chain: int = 64):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_max = prompt_lookup_max
        self.prompt_lookup_min = prompt_lookup_min
        self.max_chain = max_chain
        self._requests: dict[str, NgramIndex] = {}

    def add_request(self, request_id: str, prompt: np.ndarray) -> None:
        """Index the prompt now (else the first proposal does)."""
        self._requests[request_id] = NgramIndex(
            self.prompt_lookup_min, self.prompt_lookup_max, self.max_chain)
        self._requests[request_id].extend(prompt)

    def propose(self, request_id: str, tokens: np.ndarray,
                max_tokens: int | None = None) -> np.ndarray:
        """Up to `max_tokens` (default: num_speculative_tokens) tokens to follow `tokens`, the
        request's prompt and output so far; each call's `tokens` extends the last one's
        (`rollback` for the exception). Empty: nothing to propose."""
        index = self._requests.get(request_id)
        if index is None:
            index = self._requests[request_id] = NgramIndex(
                self.prompt_lookup_min, self.prompt_lookup_max, self.max_chain)
        if len(tokens) < index.buffer.length:
            raise ValueError(f"{request_id}: tokens shrank without a rollback")
        index.extend(tokens[index.buffer.length:])
        return index.propose(self.num_speculative_tokens if max_tokens is None
                             else max_tokens)

    def rollback(self, request_id: str, length: int) -> None:
        """The request's tokens are now only its first `length`."""
        index = self._requests.get(request_id)
        if index is not None and length < index.buffer.length:
            index.truncate(length)

    def release(self, request_id: str, cache_output: bool = True) -> None:
        """(cache_output: the suffix proposer's; n-grams are the request's own.)"""
        self._requests.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def memory_bytes(self, request_id: str) -> int:
        """About what one request's index holds."""
        index = self._requests.get(request_id)
        return 0 if index is None else index.nbytes
