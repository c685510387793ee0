"""TTSContext: one /v1/audio/speech request, from the API process to the worker. (Loom's word
for the concept is "speech"; the class keeps MAX's name.)

The API process turns the text into phoneme-id segments (sentences, the first one short so the
first audio comes quickly); the scheduler hands the worker one segment at a time, interleaved
with text generation; each segment's audio streams back as soon as it is made. The fields keep
MAX's names (max.pipelines) where they apply (`streaming`, `decoded_index`, `audio_generation_status`).
"""

from __future__ import annotations

import time
import uuid

import msgspec
import numpy as np

from pipelines.status import GenerationStatus


class TTSContext(msgspec.Struct, tag=True, kw_only=True, eq=False):
    segments: list[np.ndarray]  # int64 phoneme ids, one array per segment
    request_id: str = msgspec.field(default_factory=lambda: uuid.uuid4().hex)
    model_name: str = ""
    voice: str = ""
    speed: float = 1.0
    streaming: bool = True
    decoded_index: int = 0  # segments synthesized so far
    audio_generation_status: GenerationStatus = GenerationStatus.ACTIVE
    _arrival_time: float = msgspec.field(default_factory=time.monotonic)

    @property
    def is_done(self) -> bool:
        return self.decoded_index >= len(self.segments)

    @property
    def prompt_length(self) -> int:
        """Phonemes to synthesize: what admission control counts for speech."""
        return int(sum(len(s) for s in self.segments))

    def next_segment(self) -> np.ndarray:
        return self.segments[self.decoded_index]
