"""The API process's side of a vision-language model: transformers' own processor turns the
rendered prompt and the decoded images into token ids (each image's `<image>` placeholder
expanded) and pixel values, exactly as transformers prepares them for its model, and this
module cuts that into the `ImageMetadata` of a TextAndVisionContext.

Idefics3 (SmolVLM) here: each image becomes tiles (crops plus the whole image, each the
vision encoder's full size) and a token run of `<fake_token_around_image><row_i_col_j>` tags
with `image_seq_len` `<image>` tokens per tile, ending with the whole image's
`<global-img>` tile. Qwen2-VL: api_server/qwen2_vl_processor.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from api_server.protocol import RequestError
from pipelines.config import MediaLimits
from pipelines.vision_context import ImageMetadata

# Vision-language architectures, by the model_type their configs may name instead.
VISION_ARCHITECTURES = {"idefics3": "Idefics3ForConditionalGeneration",
                        "qwen2_vl": "Qwen2VLForConditionalGeneration"}


@dataclass
class VisionPrompt:
    """A prompt with its images, as a TextAndVisionContext takes it."""

    token_ids: np.ndarray
    images: list[ImageMetadata]
    extra_model_args: dict[str, np.ndarray] = field(default_factory=dict)


def vision_architecture(model_dir: str) -> str | None:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    for arch in raw.get("architectures") or []:
        if arch in VISION_ARCHITECTURES.values():
            return arch
    return VISION_ARCHITECTURES.get(raw.get("model_type"))


class Idefics3Processor:
    """transformers' Idefics3Processor (via AutoProcessor), and how its outputs map onto
    ImageMetadata."""

    def __init__(self, model_dir: str, limits: MediaLimits) -> None:
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.limits = limits
        self.tokenizer = self.processor.tokenizer
        self.image_token = self.processor.image_token
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.global_image_token_id = self.tokenizer.convert_tokens_to_ids(
            self.processor.global_image_tag)
        self.image_seq_len = self.processor.image_seq_len
        template = self.processor.chat_template
        self.chat_template = template if isinstance(template, str) else None

    @property
    def vision_token_ids(self) -> list[int]:
        return [self.image_token_id]

    def process(self, prompt: str, images: list[Any]) -> VisionPrompt:
        """The token ids and images of a rendered prompt holding one image token per image
        (blocking, ~ms per tile: run it off the event loop)."""
        try:
            out = self.processor(text=[prompt], images=[images], add_special_tokens=False,
                                 return_tensors="np")
        except ValueError as exc:  # e.g. the prompt's image tokens and the images disagree
            raise RequestError(f"the images and the prompt do not fit together: {exc}",
                               param="messages") from None
        ids = np.asarray(out["input_ids"][0], dtype=np.int64)
        pixels = np.asarray(out["pixel_values"][0], dtype=np.float32)  # [tiles, C, H, W]
        mask = out.get("pixel_attention_mask")
        if mask is not None and not np.asarray(mask).all():
            # (Its processor resizes every tile to the full size: padding never happens.)
            raise RequestError("image tiles with padding are not supported", param="messages")
        return VisionPrompt(ids, self.image_metadata(ids, pixels, len(images)))

    def image_metadata(self, ids: np.ndarray, pixels: np.ndarray,
                       num_images: int) -> list[ImageMetadata]:
        """Each image's token run, from its first `<image>` token to its last, and its tiles.
        An image ends with the run of `<image>` tokens that follows `<global-img>`."""
        is_image = ids == self.image_token_id
        positions = np.flatnonzero(is_image)
        # Starts of runs of consecutive <image> tokens, and which follow <global-img>.
        run_starts = positions[np.r_[True, np.diff(positions) > 1]] if len(positions) else \
            positions
        global_runs = [s for s in run_starts.tolist()
                       if s > 0 and ids[s - 1] == self.global_image_token_id]
        if len(global_runs) != num_images:
            raise RequestError(f"the prompt holds {len(global_runs)} expanded images, not "
                               f"{num_images}", param="messages")
        images, start, tile = [], int(positions[0]) if len(positions) else 0, 0
        for run in global_runs:
            end = run + self.image_seq_len
            count = int(is_image[start:end].sum())
            tiles = count // self.image_seq_len
            if count % self.image_seq_len or tile + tiles > len(pixels):
                raise RequestError("the processor's image tokens and tiles disagree",
                                   param="messages")
            images.append(ImageMetadata(start_idx=start, end_idx=end,
                                        pixel_values=np.ascontiguousarray(
                                            pixels[tile:tile + tiles])))
            tile += tiles
            following = positions[positions >= end]
            start = int(following[0]) if len(following) else end
        return images


def load_vision_processor(model_dir: str, limits: MediaLimits):
    """The checkpoint's processor (Idefics3Processor, Qwen2VLProcessor), or None for a text
    model. Each offers tokenizer, chat_template, image_token, vision_token_ids, limits and
    process(prompt, images) -> VisionPrompt."""
    arch = vision_architecture(model_dir)
    if arch == "Qwen2VLForConditionalGeneration":
        from api_server.qwen2_vl_processor import Qwen2VLProcessor

        return Qwen2VLProcessor(model_dir, limits)
    return Idefics3Processor(model_dir, limits) if arch is not None else None
