"""TextTokenizer: the PipelineTokenizer of text models, on a Hugging Face tokenizer.

`new_context` renders chat messages with the checkpoint's chat template, tokenizes, checks the
prompt against the model's context length and builds the TextContext sent to the scheduler.

For a vision-language checkpoint (api_server/vision_processor.py) it also takes `image_url`
parts: the images are fetched and decoded (api_server/image_inputs.py), the template renders
an image token where each was, and transformers' processor expands those and makes the pixel
values: the context is then a TextAndVisionContext.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from typing import Any

import msgspec
import numpy as np

from api_server.chat_template import TemplateSandbox
from api_server.image_budget import ImagePixelBudget
from api_server.image_inputs import ImagePart, load_images, take_image_parts
from api_server.off_loop import OFF_LOOP
from api_server.protocol import RequestError, check_depth
from api_server.vision_processor import VisionPrompt, load_vision_processor
from pipelines.config import MediaLimits
from pipelines.context import TextContext
from pipelines.request import TokenGeneratorRequest
from pipelines.vision_context import TextAndVisionContext


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
    def __init__(self, model_dir: str, max_model_len: int, eos_token_ids: list[int],
                 media_limits: MediaLimits | None = None) -> None:
        # A vision model's processor brings its tokenizer: the one whose ids it expands.
        media_limits = media_limits or MediaLimits()
        self.vision = load_vision_processor(model_dir, media_limits)
        self.image_budget = ImagePixelBudget(media_limits.max_image_pixels_in_flight)
        self.delegate = self.vision.tokenizer if self.vision else load_hf_tokenizer(model_dir)
        if self.vision is not None and self.vision.chat_template:
            self.delegate.chat_template = self.vision.chat_template
        self.max_model_len = max_model_len
        eos = set(eos_token_ids)
        if self.delegate.eos_token_id is not None:
            eos.add(self.delegate.eos_token_id)
        self.eos_token_ids = eos
        self.vocab_size = len(self.delegate)
        template = self.delegate.chat_template or ""
        self.template_takes_tools = isinstance(template, str) and "tools" in template
        # A vision template that walks content parts (SmolVLM's) gets them; other templates
        # get text with the image token where each image was.
        self.template_takes_parts = self.vision is not None and isinstance(template, str) \
            and ("'image'" in template or '"image"' in template)
        # No token is longer than the longest vocabulary entry (in characters of its string
        # form, which decodes to at most as many), so a text over this many characters can't
        # fit the context: it is refused before the template and the tokenizer spend time on
        # it. Twice, for normalizers that change the text's length.
        longest = max((len(t) for t in self.delegate.get_vocab()), default=1)
        self.max_prompt_chars = 2 * longest * max_model_len + 1024
        # Client-sent chat templates (--trust-request-chat-template) render here.
        self.request_templates: TemplateSandbox | None = None

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

    @property
    def takes_images(self) -> bool:
        return self.vision is not None

    async def encode(self, prompt: str, add_special_tokens: bool = False) -> np.ndarray:
        self.check_prompt_chars(len(prompt), "prompt")
        if len(prompt) > INLINE_TOKENIZE_CHARS:  # ~10+ ms: not on the event loop
            ids = await OFF_LOOP.run(self.delegate.encode, prompt,
                                     add_special_tokens=add_special_tokens)
        else:
            ids = self.delegate.encode(prompt, add_special_tokens=add_special_tokens)
        return np.asarray(ids, dtype=np.int64)

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise RequestError(
                f"the prompt is {num_chars} characters long, more than this model's context "
                f"of {self.max_model_len} tokens can hold", param=param,
                code="context_length_exceeded")

    async def decode(self, context: TextContext, encoded: Any, **kwargs: Any) -> str:
        return self.delegate.decode(encoded, **kwargs)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, **template_kwargs: Any) -> str:
        """Render with the checkpoint's own template (trusted), on the calling thread."""
        messages = self._checked_messages(messages)
        if self.delegate.chat_template is None:
            raise RequestError("this model has no chat template; use /v1/completions",
                               param="messages")
        try:
            return self.delegate.apply_chat_template(
                messages, tools=tools, tokenize=False,
                add_generation_prompt=add_generation_prompt, **template_kwargs,
            )
        except RequestError:
            raise
        except Exception as exc:  # the template rejected the conversation
            raise RequestError(f"the chat template could not render the messages: {exc}",
                               param="messages") from None

    async def render_prompt(self, messages: list[dict], tools: list[dict] | None = None,
                            options: dict[str, Any] | None = None) -> str:
        """The prompt text of a conversation: the checkpoint's template, or a template the
        request sent (only present in `options` when the operator allowed it), which renders
        in the sandbox process."""
        options = dict(options or {})
        template = options.pop("chat_template", None)
        if template is None:  # (Jinja: milliseconds per request, seconds for large ones)
            return await OFF_LOOP.run(self.render_chat, messages, tools=tools, **options)
        if self.request_templates is None:
            raise RequestError("this server does not render chat templates sent in requests",
                               param="chat_template_kwargs.chat_template")
        messages = self._checked_messages(messages)
        variables = {**self.delegate.special_tokens_map, **options}
        return await self.request_templates.render(template, messages, tools, variables)

    def _checked_messages(self, messages: list[dict]) -> list[dict]:
        if not messages:
            raise RequestError("messages must not be empty", param="messages")
        image_token = self.vision.image_token if self.vision is not None else None
        messages = [_flatten_content(m, i, image_token, self.template_takes_parts)
                    for i, m in enumerate(messages)]
        chars = sum(_content_chars(m.get("content")) for m in messages)
        self.check_prompt_chars(chars, "messages")
        return messages

    async def _vision_inputs(self, text: str, parts: list[ImagePart]) -> VisionPrompt:
        """Fetch and decode the images, then let the model's processor expand the prompt
        (Pillow and the resizing release the GIL: off the event loop). Their pixel arrays
        count against the server's pixels in flight for as long as they live."""
        def work():
            images, reservation = load_images(parts, self.vision.limits, self.image_budget)
            try:
                prompt = self.vision.process(text, images)
            except BaseException:
                reservation.release()
                raise
            reservation.hold([image.pixel_values for image in prompt.images])
            return prompt

        return await asyncio.to_thread(work)

    async def new_context(self, request: TokenGeneratorRequest) -> TextContext:
        vision: VisionPrompt | None = None
        if request.images:
            if request.messages is None:
                raise RequestError("images go with messages: each fills a {\"type\": "
                                   "\"image\"} part, or follows the last user message",
                                   param="images")
            if self.vision is None:
                raise RequestError(TEXT_ONLY, param="images")
        if request.messages is not None:
            messages, parts = list(request.messages), []
            if request.images:
                messages = with_image_parts(messages, request.images)
            if self.vision is not None:
                messages, parts = take_image_parts(messages, self.vision.limits)
            text = await self.render_prompt(messages, request.tools,
                                            request.chat_template_options)
            if parts:
                vision = await self._vision_inputs(text, parts)
                ids = vision.token_ids
            else:
                ids = await self.encode(text, add_special_tokens=False)
        elif isinstance(request.prompt, str):
            ids = await self.encode(request.prompt, add_special_tokens=True)
        elif request.prompt is not None:
            try:
                ids = np.asarray(list(request.prompt), dtype=np.int64)
            except OverflowError:  # (an id past int64: JSON numbers have no bound)
                ids = None
            if ids is None or len(ids) and (ids.min() < 0 or ids.max() >= self.vocab_size):
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
        fields = dict(
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
            cache_salt=request.cache_salt,
            speculative_decoding=request.speculative_decoding,
        )
        if vision is not None and vision.images:
            return TextAndVisionContext(**fields, vision_token_ids=self.vision.vision_token_ids,
                                        images=vision.images,
                                        extra_model_args=vision.extra_model_args)
        return TextContext(**fields)

    def choice_context(self, first: TextContext, request: TokenGeneratorRequest) -> TextContext:
        """Another choice (n > 1) of `first`'s prompt: its tokens, and its images' pixel
        arrays shared rather than decoded again; the request's own id and sampling."""
        params = request.sampling_params
        if first.json_schema is not None and params.ignore_eos:
            params = msgspec.structs.replace(params, ignore_eos=False)  # (as new_context)
        prompt_length = first.prompt_length
        room = self.max_model_len - prompt_length
        if params.max_new_tokens is not None and params.max_new_tokens > room:
            raise RequestError(
                f"max_tokens={params.max_new_tokens} plus the {prompt_length}-token prompt "
                f"exceeds this model's context of {self.max_model_len} tokens",
                param="max_tokens", code="context_length_exceeded")
        fields = dict(
            request_id=request.id,
            max_length=prompt_length + (room if params.max_new_tokens is None
                                        else params.max_new_tokens),
            tokens=first.prompt_tokens,
            eos_token_ids=set(first.eos_token_ids),
            ignore_eos=params.ignore_eos,
            sampling_params=params,
            model_name=first.model_name,
            log_probabilities=first.log_probabilities,
            log_probabilities_echo=first.log_probabilities_echo,
            json_schema=first.json_schema,
            cache_salt=first.cache_salt,
            lora=first.lora,
            speculative_decoding=first.speculative_decoding,
        )
        if isinstance(first, TextAndVisionContext):
            return TextAndVisionContext(**fields, vision_token_ids=first.vision_token_ids,
                                        images=list(first.images),
                                        extra_model_args=dict(first.extra_model_args))
        return TextContext(**fields)


# Longer prompts are tokenized on a worker thread (the tokenizer releases the GIL), so a
# megabyte of text doesn't hold up every other client's stream.
INLINE_TOKENIZE_CHARS = 32_768
TEXT_ONLY = "this model reads text only, not images"


def with_image_parts(messages: list[dict], images: list[bytes]) -> list[dict]:
    """MAX's `TokenGeneratorRequest.images` as image parts of the messages: each fills the
    next bare `{"type": "image"}` part, in order; the rest follow the last user message's
    content. They then pass the same limits and checks as image_url parts."""
    pending = [ImagePart(f"images[{i}]", "data:;base64," + base64.b64encode(data).decode())
               for i, data in enumerate(images)]
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [pending.pop(0) if pending and isinstance(part, dict)
                       and part.get("type") == "image" and len(part) == 1 else part
                       for part in content]
            message = {**message, "content": content}
        out.append(message)
    if pending:
        last = max((i for i, m in enumerate(out) if m.get("role") == "user"), default=None)
        if last is None:
            raise RequestError("images need a user message to go with", param="images")
        content = out[last].get("content")
        if not isinstance(content, list):
            content = [{"type": "text", "text": content}] if content else []
        out[last] = {**out[last], "content": [*content, *pending]}
    return out


def _flatten_content(message: dict, index: int, image_token: str | None = None,
                     keep_parts: bool = False) -> dict:
    """Chat templates expect string content: join a list of text parts (each image, for a
    vision model, as its image token). A template that walks parts (`keep_parts`) gets
    text and image parts, a string as one text part."""
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            # An image reaches here only on a text model (a vision model's were taken out).
            if isinstance(part, ImagePart):  # (from /v1/responses or /v1/messages)
                raise RequestError(TEXT_ONLY, param=part.param)
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                raise RequestError(TEXT_ONLY, param=f"messages[{index}].content[{i}]")
            if kind == "image" and image_token is not None:  # (from take_image_parts)
                parts.append({"type": "image"})
            elif kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                takes = "text and images" if image_token is not None else "text"
                raise RequestError(
                    f"unsupported content part of type {kind!r}; this model takes {takes}",
                    param=f"messages[{index}].content[{i}]")
        if keep_parts:
            message = {**message, "content": parts}
        else:
            message = {**message, "content": "".join(
                p["text"] if p["type"] == "text" else image_token for p in parts)}
    elif keep_parts:
        message = {**message, "content": [{"type": "text", "text": content or ""}]}
    elif content is None:
        message = {**message, "content": ""}
    calls = message.get("tool_calls")
    if calls:
        message = {**message, "tool_calls": [_parsed_arguments(c, i) for i, c in enumerate(calls)]}
    return message


def _content_chars(content) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text", "")) for p in content)
    return 0


def _parsed_arguments(call: dict, index: int) -> dict:
    """Templates render a call's arguments as a mapping; OpenAI clients send JSON text."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError("each tool call needs a function with a name",
                           param=f"messages.tool_calls[{index}].function")
    if isinstance(fn.get("arguments"), str):
        try:
            arguments = json.loads(fn["arguments"])
        except (ValueError, RecursionError):
            arguments = fn["arguments"]  # not JSON: the template gets the text
        check_depth(arguments, f"messages.tool_calls[{index}].function.arguments")
        fn = {**fn, "arguments": arguments}
    return {**call, "function": fn}
