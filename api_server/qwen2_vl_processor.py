"""Qwen2-VL's prompts: transformers' Qwen2VLProcessor expands each image's `<|image_pad|>`
into one token per merged patch (grid t x h x w / merge^2) and makes the pixel values (the
image resized to whole merge windows of patches, flattened patch by patch); this module cuts
them into the ImageMetadata of a TextAndVisionContext and computes the prompt's M-RoPE
positions, as transformers' `get_rope_index` does, once per request.

M-RoPE: a text token's three positions (temporal, height, width) are equal and count up by
one; an image's tokens take (start + t, start + row, start + column) of their merged patch,
and the text after the image continues at start + max(rows, columns). So a prompt's last
position is below its length, and generated tokens go on from max + 1 (the worker keeps that
offset, `rope_delta`).

The processor is transformers' own with its video half left out (video processors need
torchvision, which this server does not install; requests carry no videos).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from api_server.protocol import RequestError
from api_server.vision_processor import VisionPrompt
from pipelines.config import MediaLimits
from pipelines.vision_context import ImageMetadata

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def image_only_processor_class():
    """transformers' Qwen2VLProcessor without its video processor (its __init__ names the
    sub-processors it loads and checks; the call, expansion included, is transformers')."""
    from transformers import Qwen2VLProcessor as HFQwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageQwen2VLProcessor(HFQwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageQwen2VLProcessor


def load_processor(model_dir: str, tokenizer):
    from transformers import AutoImageProcessor

    images = AutoImageProcessor.from_pretrained(model_dir)
    if not tokenizer.chat_template:  # (Hub checkpoints may keep it in chat_template.json)
        tokenizer.chat_template = _processor_chat_template(model_dir)
    return image_only_processor_class()(images, tokenizer, chat_template=tokenizer.chat_template)


def _processor_chat_template(model_dir: str) -> str | None:
    try:
        with open(os.path.join(model_dir, "chat_template.json")) as f:
            template = json.load(f).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    return template if isinstance(template, str) else None


class Qwen2VLProcessor:
    def __init__(self, model_dir: str, limits: MediaLimits) -> None:
        from api_server.tokenizer import load_hf_tokenizer

        self.tokenizer = load_hf_tokenizer(model_dir)
        self.processor = load_processor(model_dir, self.tokenizer)
        self.limits = limits
        self.image_token = IMAGE_PLACEHOLDER  # what a template without image parts gets
        self.image_token_id = self.processor.image_token_id
        self.merge_size = self.processor.image_processor.merge_size
        self.chat_template = None  # the tokenizer's

    @property
    def vision_token_ids(self) -> list[int]:
        return [self.image_token_id]

    def process(self, prompt: str, images: list[Any]) -> VisionPrompt:
        """Token ids, images (pixel values float32 [patches, C x T x P x P] each) and
        extra_model_args: image_grid_thw int64 [images, 3] and rope_positions int32
        [3, prompt length] (blocking: run it off the event loop)."""
        try:
            out = self.processor(text=[prompt], images=images, add_special_tokens=False,
                                 return_tensors="np")
        except ValueError as exc:  # e.g. the prompt's image tokens and the images disagree
            raise RequestError(f"the images and the prompt do not fit together: {exc}",
                               param="messages") from None
        ids = np.asarray(out["input_ids"][0], dtype=np.int64)
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        grids = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
        runs = image_runs(ids, self.image_token_id)
        tokens = [int(t * h * w) // self.merge_size**2 for t, h, w in grids]
        if len(runs) != len(images) or [end - start for start, end in runs] != tokens:
            raise RequestError("the processor's image tokens and grids disagree",
                               param="messages")
        metadata, offset = [], 0
        for (start, end), grid in zip(runs, grids):
            patches = int(np.prod(grid))
            metadata.append(ImageMetadata(start_idx=start, end_idx=end, pixel_values=(
                np.ascontiguousarray(pixels[offset:offset + patches]))))
            offset += patches
        positions = mrope_positions(len(ids), runs, grids, self.merge_size)
        return VisionPrompt(ids, metadata, {"image_grid_thw": grids,
                                            "rope_positions": positions})


def image_runs(ids: np.ndarray, image_token_id: int) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive image tokens (one per image: images are
    wrapped in <|vision_start|> ... <|vision_end|>)."""
    positions = np.flatnonzero(ids == image_token_id)
    if not len(positions):
        return []
    breaks = np.flatnonzero(np.diff(positions) > 1)
    starts = np.r_[positions[0], positions[breaks + 1]]
    ends = np.r_[positions[breaks], positions[-1]] + 1
    return list(zip(starts.tolist(), ends.tolist()))


def mrope_positions(num_tokens: int, runs: list[tuple[int, int]], grids: np.ndarray,
                    merge_size: int) -> np.ndarray:
    """int32 [3, num_tokens]: transformers' get_rope_index for one sequence of text and
    images (`runs`: each image's tokens, `grids`: its (t, h, w) in patches)."""
    out = np.empty((3, num_tokens), dtype=np.int32)
    pos, idx = 0, 0
    for (start, end), (t, h, w) in zip(runs, grids.tolist()):
        out[:, idx:start] = pos + np.arange(start - idx)
        pos += start - idx
        grid = np.indices((t, h // merge_size, w // merge_size)).reshape(3, -1)
        out[:, start:end] = pos + grid
        pos += max(h, w) // merge_size
        idx = end
    out[:, idx:] = pos + np.arange(num_tokens - idx)
    return out
