"""vLLM's /tokenize and /detokenize, and GET /v1/models/{model}."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from api_server.chat_template import template_options
from api_server.off_loop import parse_body
from api_server.openai_routes import chat_messages
from api_server.protocol import ChatMessage, RequestError
from api_server.serving_context import ServingContext, error_response, json_response


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


class ExtraRoutes:
    def __init__(self, serving: ServingContext) -> None:
        self.serving = serving
        self.tokenizer = serving.tokenizer

    async def get_model(self, request: Request) -> Response:
        model = request.path_params["model"]
        loras = self.serving.loras
        for card in [*self.serving.extra_model_cards(self.serving.created),
                     *(loras.model_cards(self.serving.created) if loras else [])]:
            if card["id"] == model:
                return json_response(card)
        try:
            self.serving.check_model(model)
        except RequestError as exc:
            return error_response(exc)
        return json_response(self.serving.model_card())

    async def tokenize(self, request: Request) -> Response:
        try:
            req = await parse_body(await request.body(), TokenizeRequest)
            self.serving.check_model(req.model)
            if (req.prompt is None) == (req.messages is None):
                raise RequestError("give exactly one of prompt or messages", param="prompt")
            if req.messages is not None:
                # The same rendering as /v1/chat/completions, so the counts agree.
                options = template_options(req.chat_template_kwargs, req.add_generation_prompt,
                                           self.serving.trust_request_chat_template)
                text = await self.tokenizer.render_prompt(chat_messages(req.messages),
                                                          None, options)
                ids = (await self.tokenizer.encode(text, add_special_tokens=False)).tolist()
            else:
                ids = (await self.tokenizer.encode(
                    req.prompt, add_special_tokens=req.add_special_tokens)).tolist()
        except RequestError as exc:
            return error_response(exc)
        return json_response({"count": len(ids), "max_model_len": self.serving.max_model_len,
                              "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        try:
            req = await parse_body(await request.body(), DetokenizeRequest)
            self.serving.check_model(req.model)
            if len(req.tokens) > 4 * self.serving.max_model_len:
                raise RequestError(f"at most {4 * self.serving.max_model_len} tokens",
                                   param="tokens")
            if any(not 0 <= t < self.tokenizer.vocab_size for t in req.tokens):
                raise RequestError("tokens holds ids outside the vocabulary", param="tokens")
        except RequestError as exc:
            return error_response(exc)
        return json_response({"prompt": self.tokenizer.delegate.decode(req.tokens)})
