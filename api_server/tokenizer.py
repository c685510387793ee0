"""TextTokenizer: the PipelineTokenizer of text models, on a Hugging Face tokenizer.

`new_context` renders chat messages with the checkpoint's chat template, tokenizes, checks the
prompt against the model's context length and builds the TextContext sent to the scheduler.
"""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec
import numpy as np

from api_server.protocol import RequestError
from pipelines.context import TextContext
from pipelines.request import TokenGeneratorRequest


def load_hf_tokenizer(model_dir: str):
    """The checkpoint's tokenizer, the class AutoTokenizer would pick, without AutoTokenizer.

    AutoTokenizer resolves the class through the model's AutoConfig, whose import pulls in
    PyTorch and most of transformers: 6.5 s here for SmolLM2's tokenizer against 1.5 s when
    the class named in tokenizer_config.json is taken from transformers' lazy top-level
    module, and the API process (which needs no PyTorch) was the last one ready at start-up.
    """
    import transformers

    name = _tokenizer_class_name(model_dir)
    if name:  # AutoTokenizer's preference: the fast class where there is one
        for candidate in dict.fromkeys((name.removesuffix("Fast") + "Fast", name)):
            cls = getattr(transformers, candidate, None)
            if cls is not None:
                return cls.from_pretrained(model_dir)
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def _tokenizer_class_name(model_dir: str) -> str | None:
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        return None
    return name if isinstance(name, str) and name.isidentifier() else None


class TextTokenizer:
    def __init__(self, model_dir: str, max_model_len: int, eos_token_ids: list[int]) -> None:
        self.delegate = load_hf_tokenizer(model_dir)
        self.max_model_len = max_model_len
        eos = set(eos_token_ids)
        if self.delegate.eos_token_id is not None:
            eos.add(self.delegate.eos_token_id)
        self.eos_token_ids = eos
        self.vocab_size = len(self.delegate)
        template = self.delegate.chat_template or ""
        self.template_takes_tools = isinstance(template, str) and "tools" in template

    def warm_up(self) -> None:
        """Compile the chat template and run the tokenizer once, so the first request does not
        pay for it (~15 ms for the Jinja compile alone)."""
        if self.delegate.chat_template is not None:
            try:
                self.render_chat([{"role": "user", "content": "Hi"}])
            except RequestError:  # a template with other expectations: it compiled all the same
                pass
        self.delegate.decode(self.delegate.encode("Hi"))

    @property
    def eos(self) -> int:
        return self.delegate.eos_token_id

    @property
    def expects_content_wrapping(self) -> bool:
        return False

    async def encode(self, prompt: str, add_special_tokens: bool = False) -> np.ndarray:
        ids = self.delegate.encode(prompt, add_special_tokens=add_special_tokens)
        return np.asarray(ids, dtype=np.int64)

    async def decode(self, context: TextContext, encoded: Any, **kwargs: Any) -> str:
        return self.delegate.decode(encoded, **kwargs)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, **template_kwargs: Any) -> str:
        if not messages:
            raise RequestError("messages must not be empty", param="messages")
        if self.delegate.chat_template is None:
            raise RequestError("this model has no chat template; use /v1/completions",
                               param="messages")
        try:
            return self.delegate.apply_chat_template(
                [_flatten_content(m) for m in messages], tools=tools, tokenize=False,
                add_generation_prompt=add_generation_prompt, **template_kwargs,
            )
        except RequestError:
            raise
        except Exception as exc:  # the template rejected the conversation
            raise RequestError(f"the chat template could not render the messages: {exc}",
                               param="messages") from None

    async def new_context(self, request: TokenGeneratorRequest) -> TextContext:
        if request.messages is not None:
            text = self.render_chat(list(request.messages), tools=request.tools,
                                    **(request.chat_template_options or {}))
            ids = await self.encode(text, add_special_tokens=False)
        elif isinstance(request.prompt, str):
            ids = await self.encode(request.prompt, add_special_tokens=True)
        elif request.prompt is not None:
            ids = np.asarray(list(request.prompt), dtype=np.int64)
            if len(ids) and (ids.min() < 0 or ids.max() >= self.vocab_size):
                raise RequestError(
                    f"prompt holds token ids outside the vocabulary [0, {self.vocab_size})",
                    param="prompt")
        else:
            raise RequestError("either prompt or messages is required", param="prompt")
        if len(ids) == 0:
            raise RequestError("the prompt is empty after tokenization", param="prompt")
        params = request.sampling_params
        room = self.max_model_len - len(ids)
        if room <= 0:
            raise RequestError(
                f"the prompt is {len(ids)} tokens long; this model's context is "
                f"{self.max_model_len} tokens", param="messages" if request.messages else "prompt",
                code="context_length_exceeded")
        if params.max_new_tokens is not None and params.max_new_tokens > room:
            raise RequestError(
                f"max_tokens={params.max_new_tokens} plus the {len(ids)}-token prompt exceeds "
                f"this model's context of {self.max_model_len} tokens", param="max_tokens",
                code="context_length_exceeded")
        max_new = room if params.max_new_tokens is None else params.max_new_tokens
        json_schema = (request.response_format or {}).get("json_schema")
        if json_schema is not None and params.ignore_eos:
            # The grammar ends the output with EOS; ignoring it would run past the grammar.
            params = msgspec.structs.replace(params, ignore_eos=False)
        return TextContext(
            request_id=request.id,
            max_length=len(ids) + max_new,
            tokens=ids,
            eos_token_ids=set(self.eos_token_ids),
            ignore_eos=params.ignore_eos,
            sampling_params=params,
            model_name=request.model_name,
            log_probabilities=request.logprobs,
            log_probabilities_echo=request.echo,
            json_schema=json_schema,
        )


def _flatten_content(message: dict) -> dict:
    """Chat templates expect string content: join a list of text parts."""
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(
                    f"unsupported content part of type {part.get('type')!r}; this model takes text",
                    param=f"messages.content[{i}]")
            texts.append(part["text"])
        message = {**message, "content": "".join(texts)}
    elif content is None:
        message = {**message, "content": ""}
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {}
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass
    return message
