"""Loom's shared domain types: the names and meanings of max.pipelines.core."""

from pipelines.audio_generation import (
    AudioGenerationRequest,
    AudioGenerationResponse,
    AudioGenerator,
    AudioGeneratorOutput,
)
from pipelines.context import TextContext
from pipelines.interfaces import PipelineTokenizer, TokenGenerator
from pipelines.pixel_context import GenerationOutput, PixelContext
from pipelines.request import (
    TokenGeneratorRequest,
    TokenGeneratorRequestFunction,
    TokenGeneratorRequestMessage,
    TokenGeneratorRequestTool,
    TokenGeneratorResponseFormat,
)
from pipelines.response import LogProbabilities, TextGenerationOutput, TextResponse
from pipelines.sampling_params import SamplingParams, SamplingParamsError
from pipelines.speech_context import TTSContext
from pipelines.status import GenerationStatus, PipelineTask, TextGenerationStatus
from pipelines.vision_context import ImageMetadata, InputError, TextAndVisionContext

__all__ = [
    "AudioGenerationRequest",
    "AudioGenerationResponse",
    "AudioGenerator",
    "AudioGeneratorOutput",
    "GenerationOutput",
    "GenerationStatus",
    "ImageMetadata",
    "InputError",
    "LogProbabilities",
    "PipelineTask",
    "PixelContext",
    "PipelineTokenizer",
    "SamplingParams",
    "SamplingParamsError",
    "TTSContext",
    "TextAndVisionContext",
    "TextContext",
    "TextGenerationOutput",
    "TextGenerationStatus",
    "TextResponse",
    "TokenGenerator",
    "TokenGeneratorRequest",
    "TokenGeneratorRequestFunction",
    "TokenGeneratorRequestMessage",
    "TokenGeneratorRequestTool",
    "TokenGeneratorResponseFormat",
]
