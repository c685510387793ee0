"""POST /v1/images/generations: OpenAI's Images API on a FLUX-family model.

The request becomes one PixelContext (PixelGenerationTokenizer.new_context: tokens, schedule,
seeded noise); the scheduler runs it as denoising steps batched with other image requests;
the last step's pixels come back as uint8 arrays and are encoded here. Extensions beyond
OpenAI's fields: `seed`, `negative_prompt`, `num_inference_steps`, `guidance_scale`,
`true_cfg_scale`.
"""

from __future__ import annotations

import base64
import io
import re
import time
import uuid

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from api_server.engine_client import EngineClient, EngineDeadError, GenerationFailed
from api_server.image_store import ImageStore
from api_server.off_loop import OFF_LOOP, parse_body
from api_server.pixel_tokenizer import PixelGenerationRequest, PixelGenerationTokenizer
from api_server.protocol import RequestError
from api_server.server_state import ServerState
from api_server.serving_context import error_response, json_response

FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
MAX_PARTIAL_IMAGES = 3
_json = msgspec.json.Encoder()


class ImagesRequest(msgspec.Struct, kw_only=True):
    prompt: str
    model: str | None = None
    n: int = 1
    size: str = "auto"
    response_format: str = "b64_json"
    output_format: str = "png"
    output_compression: int | None = None
    quality: str | None = None
    background: str | None = None
    moderation: str | None = None
    style: str | None = None
    user: str | None = None
    stream: bool = False
    partial_images: int = 0  # previews streamed before the image (OpenAI's: 0 to 3)
    # Extensions.
    seed: int | None = None
    negative_prompt: str | None = None
    num_inference_steps: int = 28
    guidance_scale: float = 3.5
    true_cfg_scale: float = 1.0


def encode_image(pixels: np.ndarray, output_format: str, compression: int | None) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    options = {} if compression is None or output_format == "png" else {"quality": compression}
    Image.fromarray(pixels).save(buf, format=FORMATS[output_format], **options)
    return buf.getvalue()


class ImagesRoute:
    def __init__(self, engine: EngineClient, state: ServerState,
                 tokenizer: PixelGenerationTokenizer, model_name: str, metrics=None,
                 default_size: int = 1024) -> None:
        self.engine, self.state, self.tokenizer = engine, state, tokenizer
        self.metrics = metrics
        self.store = ImageStore()
        self.model_name = model_name
        self.default_size = min(default_size, tokenizer.max_image_size)

    def model_card(self, created: int) -> dict:
        """/v1/models' card of the image model served beside a text model."""
        return {"id": self.model_name, "object": "model", "created": created,
                "owned_by": "loom", "root": self.model_name, "parent": None, "task": "image",
                "max_image_size": self.tokenizer.max_image_size}

    def _size(self, size: str) -> tuple[int, int]:
        if size == "auto":
            return self.default_size, self.default_size
        match = re.fullmatch(r"(\d{1,5})x(\d{1,5})", size)
        if match is None:
            raise RequestError(f"size must be WIDTHxHEIGHT or auto, not {size[:40]!r}",
                               param="size")
        return int(match[2]), int(match[1])

    def _request(self, req: ImagesRequest, request_id: str) -> PixelGenerationRequest:
        if req.model is not None and req.model != self.model_name:
            raise RequestError(f"the model `{req.model}` does not exist", param="model",
                               status=404, code="model_not_found")
        if req.response_format not in ("b64_json", "url") or (
                req.stream and req.response_format != "b64_json"):
            raise RequestError("response_format must be b64_json or url (url: not streamed)",
                               param="response_format")
        if req.output_format not in FORMATS:
            raise RequestError("output_format must be png, jpeg or webp", param="output_format")
        if req.output_compression is not None and not 0 <= req.output_compression <= 100:
            raise RequestError("output_compression must be from 0 to 100",
                               param="output_compression")
        if not 0 <= req.partial_images <= MAX_PARTIAL_IMAGES:
            raise RequestError(f"partial_images must be from 0 to {MAX_PARTIAL_IMAGES}",
                               param="partial_images")
        if req.partial_images and not req.stream:
            raise RequestError("partial_images needs stream: true", param="partial_images")
        if req.seed is not None and not 0 <= req.seed < 2 ** 63:
            raise RequestError("seed must be from 0 to 2**63 - 1", param="seed")
        if not 0 <= req.guidance_scale <= 100 or not 1 <= req.true_cfg_scale <= 100:
            raise RequestError("guidance_scale must be from 0 to 100 and true_cfg_scale from "
                               "1 to 100", param="guidance_scale")
        height, width = self._size(req.size)
        return PixelGenerationRequest(
            prompt=req.prompt, negative_prompt=req.negative_prompt, height=height, width=width,
            num_inference_steps=req.num_inference_steps, guidance_scale=req.guidance_scale,
            true_cfg_scale=req.true_cfg_scale, num_images_per_prompt=req.n, seed=req.seed,
            request_id=request_id, model_name=self.model_name)

    async def create(self, request: Request) -> Response:
        created = int(time.time())
        try:
            req = await parse_body(await request.body(), ImagesRequest)
            self.state.check_available()
            self._check_queue_room()
            pixel_request = self._request(req, f"img-{uuid.uuid4().hex}")
            ctx = await OFF_LOOP.run(self.tokenizer.new_context, pixel_request)
            if req.partial_images:
                ctx.extra_params["partial_images"] = np.array([req.partial_images])
            if req.stream:
                return StreamingResponse(self._events(req, ctx), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            images = None
            async for out in self._paint(ctx):
                if out.is_done:
                    images = out.images
            data = [self._datum(await self._encode(img, req), req, request)
                    for img in images]
        except RequestError as exc:
            return error_response(exc)
        except (GenerationFailed, EngineDeadError) as exc:
            return error_response(RequestError(f"image generation failed: {exc}", status=500))
        return json_response({"created": created, "data": data,
                              "output_format": req.output_format,
                              "size": f"{ctx.width}x{ctx.height}", "usage": self._usage(ctx)})

    def _check_queue_room(self) -> None:
        """Image requests in flight count against --max-queued-requests (each holds its
        latents and embeddings in the worker while it runs)."""
        queued = len(self.engine.pixel_streams)
        if queued + 1 > self.state.limits.max_queued_requests:
            raise RequestError(f"too many image requests in flight ({queued}); retry later",
                               status=429, code="queue_full")

    def _datum(self, image: bytes, req: ImagesRequest, request: Request) -> dict:
        if req.response_format == "b64_json":
            return {"b64_json": base64.b64encode(image).decode("ascii")}
        image_id = self.store.put(image, f"image/{req.output_format}")
        return {"url": f"{str(request.base_url).rstrip('/')}/v1/images/{image_id}/content"}

    async def content(self, request: Request) -> Response:
        """GET /v1/images/{id}/content: an image generated with response_format url."""
        found = self.store.get(request.path_params["image_id"])
        if found is None:
            return error_response(RequestError(
                "no such image (images are kept for a limited time and number)",
                param="image_id", status=404, code="image_not_found"))
        return Response(found[0], media_type=found[1])

    async def _paint(self, ctx):
        """engine.paint, counted: steps, time to the first step, images."""
        started, steps = time.monotonic(), 0
        async for out in self.engine.paint(ctx):
            if self.metrics is not None:
                if steps == 0:
                    self.metrics.image_first_step.observe(time.monotonic() - started)
                self.metrics.denoising_steps.inc(out.steps_executed - steps)
                if out.is_done and out.images is not None:
                    self.metrics.generated_images.inc(len(out.images))
            steps = out.steps_executed
            yield out

    async def _encode(self, pixels: np.ndarray, req: ImagesRequest) -> bytes:
        return await OFF_LOOP.run(encode_image, pixels, req.output_format,
                                  req.output_compression)

    def _usage(self, ctx) -> dict:
        text_tokens = int(np.count_nonzero(ctx.tokens_2 != self.tokenizer.pad_id_2))
        return {"input_tokens": text_tokens, "output_tokens": 0, "total_tokens": text_tokens,
                "input_tokens_details": {"text_tokens": text_tokens, "image_tokens": 0}}

    async def _events(self, req: ImagesRequest, ctx):
        """OpenAI's image stream: `image_generation.partial_image` events (previews decoded at
        intermediate steps), then one `image_generation.completed` per image. A client that
        leaves ends the generator, and `paint` cancels the request in the scheduler."""
        common = {"background": "opaque", "output_format": req.output_format,
                  "quality": "auto", "size": f"{ctx.width}x{ctx.height}"}
        partial_index = 0
        try:
            async for out in self._paint(ctx):
                if out.images is None:
                    continue
                kind = "completed" if out.is_done else "partial_image"
                for pixels in out.images:
                    event = {"type": f"image_generation.{kind}",
                             "b64_json": base64.b64encode(
                                 await self._encode(pixels, req)).decode("ascii"),
                             "created_at": int(time.time()), **common}
                    if out.is_done:
                        event["usage"] = self._usage(ctx)
                    else:
                        event["partial_image_index"] = partial_index
                    yield f"event: image_generation.{kind}\ndata: ".encode() \
                        + _json.encode(event) + b"\n\n"
                if not out.is_done:
                    partial_index += 1
        except (GenerationFailed, EngineDeadError) as exc:
            error = {"type": "error", "error": {"message": f"image generation failed: {exc}",
                                                "type": "server_error", "param": None,
                                                "code": None}}
            yield b"event: error\ndata: " + _json.encode(error) + b"\n\n"
