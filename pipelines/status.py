"""Request status and pipeline task enums (mirrors max.pipelines.core)."""

from enum import Enum


class GenerationStatus(str, Enum):
    """Where a request's generation stands.

    `END_OF_SEQUENCE` covers every "natural" stop (EOS, a stop token id, a stop string);
    `MAXIMUM_LENGTH` covers `max_tokens` and the model's context length. The two map onto
    OpenAI's `finish_reason` "stop" and "length".
    """

    ACTIVE = "active"
    END_OF_SEQUENCE = "end_of_sequence"
    MAXIMUM_LENGTH = "maximum_length"
    CANCELLED = "cancelled"
    ERROR = "error"

    @property
    def is_done(self) -> bool:
        return self is not GenerationStatus.ACTIVE


# MAX's older name for the same enum.
TextGenerationStatus = GenerationStatus


class PipelineTask(str, Enum):
    TEXT_GENERATION = "text_generation"
    EMBEDDINGS_GENERATION = "embeddings_generation"
    AUDIO_GENERATION = "audio_generation"
    SPEECH_TOKEN_GENERATION = "speech_token_generation"
    PIXEL_GENERATION = "pixel_generation"
