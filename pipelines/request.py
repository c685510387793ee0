"""What the API process builds from an HTTP request before tokenizing it (max.pipelines' names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Sequence, TypedDict

from pipelines.sampling_params import SamplingParams


class TokenGeneratorRequestFunction(TypedDict, total=False):
    name: str
    description: str
    parameters: dict


class TokenGeneratorRequestTool(TypedDict):
    type: str
    function: TokenGeneratorRequestFunction


class TokenGeneratorResponseFormat(TypedDict, total=False):
    type: str
    json_schema: dict | str  # the schema, or its JSON text once validated


class TokenGeneratorRequestMessage(TypedDict, total=False):
    role: Literal["system", "user", "assistant", "tool"]
    # A string, or a list of parts such as {"type": "text", "text": "..."}.
    content: str | list[dict[str, Any]]
    tool_calls: list[dict[str, Any]]
    tool_call_id: str
    name: str


@dataclass
class TokenGeneratorRequest:
    id: str
    index: int
    model_name: str
    prompt: str | Sequence[int] | None = None
    messages: list[TokenGeneratorRequestMessage] | None = None
    images: list[bytes] | None = None
    tools: list[TokenGeneratorRequestTool] | None = None
    response_format: TokenGeneratorResponseFormat | None = None
    timestamp_ns: int = 0
    request_path: str = "/"
    logprobs: int = 0
    echo: bool = False
    stop: str | list[str] | None = None
    chat_template_options: dict[str, Any] | None = None
    cache_salt: str | None = None  # vLLM's: separates tenants in the prefix cache
    speculative_decoding: bool = True  # extension: False, the request never proposes tokens
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
