"""Audio generation's request, responses and decoder interface, as max.pipelines.core names them.

AudioGenerationRequest is what the API process makes of a /v1/audio/speech request; an
AudioGenerator (the worker's Piper voice, or a codec decoder such as SNAC behind a speech-token
language model) turns a batch of TTSContexts into each one's next AudioGenerationResponse;
AudioGeneratorOutput is a chunk of audio as a client of the pipeline receives it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec
import numpy as np

from pipelines.sampling_params import SamplingParams
from pipelines.status import GenerationStatus

if TYPE_CHECKING:
    from pipelines.speech_context import TTSContext


def _greedy() -> SamplingParams:
    return SamplingParams(top_k=1, top_p=1.0, temperature=1.0, seed=0)


@dataclass
class AudioGenerationRequest:
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    index: int = 0
    model: str = ""
    input: str | None = None  # the text to speak (at most 4096 characters)
    # Voice cloning: the reference audio's codec tokens and what it says.
    audio_prompt_tokens: list[int] = field(default_factory=list)
    audio_prompt_transcription: str = ""
    sampling_params: SamplingParams = field(default_factory=_greedy)
    _assistant_message_override: str | None = None
    # Token ids or a prompt string to use as is, instead of one built from the fields above.
    prompt: list[int] | str | None = None


class AudioGenerationResponse(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request's audio from one AudioGenerator step (mono samples, possibly none)."""

    final_status: GenerationStatus
    audio: np.ndarray | None = None

    @property
    def audio_data(self) -> np.ndarray:
        if self.audio is None:
            raise ValueError("this response has no audio")
        return self.audio

    @property
    def has_audio_data(self) -> bool:
        return self.audio is not None and len(self.audio) > 0

    @property
    def is_done(self) -> bool:
        return self.final_status.is_done


@dataclass
class AudioGeneratorOutput:
    """A chunk of audio as the pipeline's client sees it."""

    audio_data: Any  # samples (MAX: a torch.Tensor; Loom: a numpy array)
    metadata: dict[str, Any]  # sample_rate, chunk index, ...
    is_done: bool


@runtime_checkable
class AudioGenerator(Protocol):
    """Decodes the speech tokens of a batch of contexts into audio, a chunk per step."""

    def next_chunk(
        self, batch: dict[str, TTSContext], num_tokens: int
    ) -> dict[str, AudioGenerationResponse]:
        """Each context's next chunk (up to `num_tokens` speech tokens); moves its
        `decoded_index` past what was decoded."""
        ...

    def release(self, context: TTSContext) -> None: ...

    @property
    def decoder_sample_rate(self) -> int: ...
