"""Loom's shared domain types: the names and meanings of max.pipelines.core."""

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
from pipelines.status import GenerationStatus, PipelineTask, TextGenerationStatus
from pipelines.vision_context import ImageMetadata, InputError, TextAndVisionContext

__all__ = [
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
