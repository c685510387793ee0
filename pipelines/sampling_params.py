"""SamplingParams: the per-request sampling controls of max.pipelines.core."""

from __future__ import annotations

import msgspec

SAMPLING_EPS = 1e-5


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Request-specific sampling parameters, with the names, defaults and meanings of max.pipelines.

    `top_k=1` (the default) is greedy decoding; `top_k<=0` disables the top-k filter.
    `temperature=0` is also greedy.
    """

    top_k: int = 1
    top_p: float = 1.0
    min_p: float = 0.0
    temperature: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int = 0
    # Extension (OpenAI's logit_bias): added to the token's logit before sampling.
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        # Each check names the field so the API can return it as the offending `param`.
        if self.temperature < 0:
            raise SamplingParamsError("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise SamplingParamsError("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise SamplingParamsError("repetition_penalty", "must be > 0")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise SamplingParamsError("max_new_tokens", "must be >= 0")
        if self.min_new_tokens < 0:
            raise SamplingParamsError("min_new_tokens", "must be >= 0")

    @property
    def is_greedy(self) -> bool:
        # (A temperature this small is greedy too, as in vLLM: dividing the logits by it
        # would overflow float32 to inf, and the softmax to NaN.)
        return self.top_k == 1 or self.temperature < SAMPLING_EPS


class SamplingParamsError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param
