"""How many requests' audio chunks one decoder step takes: as many as fit in about one
chunk's time, so a speech step never stalls text decode much longer than one chunk does.

A batch costs what the device makes it cost: on a GPU sixteen chunks take about as long as
one; on a CPU a batch of four takes four times one (SNAC's convolutions are compute-bound
there). The steps say which: the limit starts at one, doubles while a step of the limit's
size took at most SLACK times a lone chunk, and halves when a step took longer; a size found
too slow is tried again only every RETRY_STEPS steps (the machine's load changes)."""

from __future__ import annotations

SLACK = 1.5  # a chunk's window varies (the first has no buffer): 8 to 12 frames
RETRY_STEPS = 64


class ChunkBatchLimit:
    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.limit = 1
        self.lone_chunk_seconds: float | None = None  # moving average of one-request steps
        self._too_slow = max_batch + 1  # the smallest batch found over budget
        self._since_too_slow = 0

    def record(self, batch: int, seconds: float) -> None:
        """A decoder step of `batch` requests took `seconds`."""
        if batch == 1:
            previous = self.lone_chunk_seconds
            self.lone_chunk_seconds = seconds if previous is None \
                else 0.8 * previous + 0.2 * seconds
        if self.lone_chunk_seconds is None:
            return
        self._since_too_slow += 1
        if self._since_too_slow >= RETRY_STEPS:
            self._too_slow = self.max_batch + 1
        if batch > 1 and seconds > SLACK * self.lone_chunk_seconds:
            self._too_slow, self._since_too_slow = batch, 0
            self.limit = max(1, batch // 2)
        elif batch >= self.limit and 2 * self.limit < self._too_slow:
            self.limit = min(self.max_batch, 2 * self.limit)
