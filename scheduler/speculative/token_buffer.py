"""A request's tokens as the proposers keep them: an int32 array grown by doubling, -1 past
the end (so reading a continuation stops there)."""

from __future__ import annotations

import numpy as np

NO_TOKEN = -1


class TokenBuffer:
    def __init__(self, capacity: int = 256):
        self.array = np.full(max(capacity, 16), NO_TOKEN, dtype=np.int32)
        self.length = 0

    def extend(self, tokens: np.ndarray) -> None:
        end = self.length + len(tokens)
        if end >= len(self.array):  # (one -1 always follows the last token)
            grown = np.full(max(2 * len(self.array), end + 1), NO_TOKEN, dtype=np.int32)
            grown[:self.length] = self.array[:self.length]
            self.array = grown
        self.array[self.length:end] = tokens
        self.length = end

    def truncate(self, length: int) -> None:
        self.array[length:self.length] = NO_TOKEN
        self.length = length

    @property
    def tokens(self) -> np.ndarray:
        return self.array[:self.length]

    @property
    def nbytes(self) -> int:
        return self.array.nbytes
