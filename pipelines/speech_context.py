"""TTSContext: one /v1/audio/speech request, as max.pipelines.core lays it out. (Loom's word
for the concept is "speech"; the class keeps MAX's name.)

A TextContext whose generated tokens are speech tokens: the language model's side appends them
with `update_speech_tokens`, and an AudioGenerator decodes them into audio chunk by chunk
(`next_speech_tokens`, then `decoded_index` moved past the chunk). Each chunk re-decodes
`buffer` tokens before `decoded_index`, so a codec decoder whose output near a border depends
on its neighbours (SNAC's convolutions) sees the same context as it would decoding the whole
sequence; the decoder then drops the audio of those buffer tokens.

Piper, Loom's phoneme voice, uses the same context: the API process phonemizes the text into
sentence segments (the first one short so the first audio comes quickly), which are the speech
tokens, all known up front (`status` ends at creation); `segment_lengths` lets the decoder take
one sentence per chunk.

Two statuses: `status` (and `is_done`) is the language model's, as for any TextContext, so
the text scheduler runs a TTSContext as it runs text; `audio_generation_status` is the
audio's, done once every whole frame of speech tokens has been decoded.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec
import numpy as np

from pipelines.context import TextContext
from pipelines.status import GenerationStatus

# The speech token buffer grows by this many tokens (MAX's SPEECH_TOKEN_audio_chunk_size).
SPEECH_TOKEN_AUDIO_CHUNK_SIZE = 128


def _no_tokens() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


def _speech_token_buffer() -> np.ndarray:
    return np.zeros(SPEECH_TOKEN_AUDIO_CHUNK_SIZE, dtype=np.int64)


class TTSContext(TextContext, kw_only=True, omit_defaults=True, eq=False):
    # Voice cloning: the reference audio's codec tokens (placed in the prompt by the tokenizer).
    audio_prompt_tokens: np.ndarray = msgspec.field(default_factory=_no_tokens)
    buffer_speech_tokens: np.ndarray | None = None
    audio_buffer: np.ndarray | None = None
    # Samples the last chunk decoded past the audio it returned (decoders whose frames don't
    # end on token borders carry them over).
    prev_samples_beyond_offset: int = 0
    streaming: bool = False
    _speech_token_size: int = SPEECH_TOKEN_AUDIO_CHUNK_SIZE
    _speech_token_end_idx: int = 0
    _speech_tokens: np.ndarray = msgspec.field(default_factory=_speech_token_buffer)
    decoded_index: int = 0  # speech tokens whose audio has been returned
    _block_counter: int = 0
    _arrival_time: float = msgspec.field(default_factory=time.monotonic)
    audio_generation_status: GenerationStatus = GenerationStatus.ACTIVE
    # Loom's: the voice and speed asked for, and Piper's sentence borders in the speech tokens.
    voice: str = ""
    speed: float = 1.0
    segment_lengths: list[int] = msgspec.field(default_factory=list)
    _audio_chunks: int = 0  # audio chunks returned so far
    _lm_read_idx: int = -1  # generated tokens read into the speech tokens (-1: none yet)

    @property
    def speech_tokens(self) -> np.ndarray:
        return self._speech_tokens[: self._speech_token_end_idx]

    @property
    def block_counter(self) -> int:
        """How many blocks of speech tokens `update_speech_tokens` has received."""
        return self._block_counter

    def update_speech_tokens(self, new_tokens: np.ndarray) -> None:
        """Append newly generated speech tokens."""
        new_tokens = np.asarray(new_tokens, dtype=np.int64).reshape(-1)
        end = self._speech_token_end_idx + len(new_tokens)
        if end > self._speech_token_size:
            grow = -(-(end - self._speech_token_size) // SPEECH_TOKEN_AUDIO_CHUNK_SIZE)
            self._speech_token_size += grow * SPEECH_TOKEN_AUDIO_CHUNK_SIZE
            self._speech_tokens = np.resize(self._speech_tokens, self._speech_token_size)
        self._speech_tokens[self._speech_token_end_idx:end] = new_tokens
        self._speech_token_end_idx = end
        self._block_counter += 1

    def has_undecoded_speech_tokens(self, exclude_last_n: int = 0) -> bool:
        return self.decoded_index < self._speech_token_end_idx - exclude_last_n

    def next_speech_tokens(
        self, audio_chunk_size: int | None = None, buffer: int | None = None
    ) -> tuple[np.ndarray, int]:
        """The next unseen speech tokens (at most `audio_chunk_size`), preceded by up to
        `buffer` already decoded ones, and how many of those precede them. Does not move
        `decoded_index`: the caller sets it once the chunk's audio is out."""
        start = self.decoded_index
        if buffer is not None:
            start = max(0, start - buffer)
        end = self._speech_token_end_idx
        if audio_chunk_size is not None:
            end = min(end, self.decoded_index + audio_chunk_size)
        return self._speech_tokens[start:end], self.decoded_index - start

    def update_audio_generation_status(self, status: GenerationStatus) -> None:
        self.audio_generation_status = status

    # ---- Piper: phoneme segments ------------------------------------------------------------
    @classmethod
    def from_phoneme_segments(cls, segments: Sequence[np.ndarray], **fields) -> TTSContext:
        """A Piper request: every phoneme of every segment is a speech token, known now."""
        segments = [np.asarray(s, dtype=np.int64).reshape(-1) for s in segments]
        phonemes = np.concatenate(segments) if segments else _no_tokens()
        fields.setdefault("streaming", True)
        ctx = cls(tokens=phonemes, max_length=len(phonemes),
                  segment_lengths=[len(s) for s in segments], **fields)
        for segment in segments:
            ctx.update_speech_tokens(segment)
        ctx.status = GenerationStatus.END_OF_SEQUENCE  # no language model to wait for
        return ctx

    def next_segment_length(self) -> int:
        """Phonemes in the first segment not yet decoded (Piper decodes one per chunk)."""
        end = 0
        for length in self.segment_lengths:
            end += length
            if end > self.decoded_index:
                return end - self.decoded_index
        return 0
