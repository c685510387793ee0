"""TextAndVisionContext: a TextContext whose prompt holds images, as max.pipelines.core has it.

Each image is a run of the prompt's tokens, `ImageMetadata(start_idx, end_idx)`: from its first
vision token to one past its last. The model replaces the vision tokens of that run (the
positions whose token is one of `vision_token_ids`) with the image's embeddings, in order; a
run may hold other tokens between them (Idefics3 separates its tiles with
`<fake_token_around_image><row_1_col_2>` tags, which stay text). For example:

    idx:       0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19
    token_ids: 51 52 53 54 97 98 98 98 98 99 55 56 57 58 97 98 98 98 98 99
                              ^-- img0 --^                 ^-- img1 --^
    images:    ImageMetadata(start_idx=5, end_idx=9), ImageMetadata(start_idx=15, end_idx=19)

`image_idx` is the first image not yet fully processed (start_idx < its end_idx). As MAX's
newest version requires, no prefill chunk starts inside an image: the scheduler ends a chunk
at the start of an image it would split, takes an image longer than the step budget whole,
and cuts a prefix-cache hit that ends inside an image back to the image's start
(`scheduler/scheduler.py`, `image_aligned_chunk`). So the step that feeds an image's first
token feeds all of it, and the worker encodes it in that step.

The context crosses the wire like TextContext (its own msgspec tag); pixel values travel as
numpy arrays in msgpack-numpy's format.
"""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np

from pipelines.context import TextContext

# Keys that stand for an image's vision tokens in the prefix cache's hashes are negative, so
# they never equal a real token id (nor FUTURE_TOKEN, -1).
_FIRST_IMAGE_KEY = -2
_KEY_RANGE = 1 << 62


class InputError(ValueError):
    """A context that the model can't take (MAX's exception for it)."""


def hash_image(pixel_values: np.ndarray) -> int:
    """A 63-bit content hash of an image's pixel values (with their shape and dtype)."""
    arr = np.ascontiguousarray(pixel_values)
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{arr.dtype.str}{arr.shape}".encode())
    digest.update(arr.data)
    return int.from_bytes(digest.digest(), "little") >> 1


# A context may send an image by reference, its pixel_values empty, when the scheduler already
# holds the same image (the other choices of a request): if it no longer does, the scheduler
# answers the request with this error and the API process sends the context again, whole.
IMAGES_NOT_HELD = "the scheduler does not hold this request's images"


class ImageMetadata(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One image of a prompt: its token run [start_idx, end_idx) and its pixel values, in the
    layout its model's vision encoder takes (Idefics3: float32 [tiles, channels, H, W])."""

    start_idx: int
    end_idx: int
    pixel_values: np.ndarray
    image_hash: int | None = None  # hash_image(pixel_values); computed when not given

    def __post_init__(self) -> None:
        if not 0 <= self.start_idx < self.end_idx:
            raise ValueError(f"an image needs 0 <= start_idx < end_idx, not "
                             f"[{self.start_idx}, {self.end_idx})")
        if self.image_hash is None:
            self.image_hash = hash_image(self.pixel_values)


class TextAndVisionContext(TextContext, kw_only=True, omit_defaults=True, eq=False):
    vision_token_ids: list[int]
    images: list[ImageMetadata] = msgspec.field(default_factory=list)
    # Model-specific arrays (MAX's name); Idefics3 needs none, Qwen2-VL image_grid_thw
    # [images, 3] and rope_positions [3, prompt length] (api_server/qwen2_vl_processor.py).
    extra_model_args: dict[str, np.ndarray] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._validate_images()

    def _validate_images(self) -> None:
        """MAX's checks: sorted, non-overlapping runs inside the prompt that start and end on
        a vision token (only the ends are checked: a full scan costs a pass per context). A
        malformed context from the wire fails its decode here and is dropped."""
        for prev, nxt in zip(self.images[:-1], self.images[1:]):
            if nxt.start_idx < prev.end_idx:
                raise ValueError("images must be sorted and non-overlapping")
        for img in self.images:
            if img.end_idx > self.prompt_length:
                raise ValueError("images must lie inside the prompt")
            if (int(self.tokens[img.start_idx]) not in self.vision_token_ids
                    or int(self.tokens[img.end_idx - 1]) not in self.vision_token_ids):
                raise ValueError(f"images must start and end with a vision token "
                                 f"({self.vision_token_ids})")

    # ---- MAX's vision properties ------------------------------------------------------------
    @property
    def image_idx(self) -> int:
        """Index of the next image not yet fully processed."""
        for i, img in enumerate(self.images):
            if self.start_idx < img.end_idx:
                return i
        return len(self.images)

    @property
    def next_images(self) -> list[ImageMetadata]:
        """The images not yet fully processed."""
        return self.images[self.image_idx:]

    @property
    def needs_vision_encoding(self) -> bool:
        return self.image_idx < len(self.images)

    def compute_image_aligned_idx(self, idx: int) -> int:
        """`idx`, moved down to the start of the image it lies inside, if any."""
        for img in self.images:
            if img.start_idx <= idx < img.end_idx:
                return img.start_idx
        return idx

    def images_starting_in(self, start: int, end: int) -> list[tuple[int, ImageMetadata]]:
        """(index, image) of the images whose first token is in [start, end): the ones a step
        feeding those tokens must have encoded."""
        return [(i, img) for i, img in enumerate(self.images) if start <= img.start_idx < end]

    def vision_token_mask(self, img: ImageMetadata) -> np.ndarray:
        """Which tokens of the image's run take an embedding row (bool, one per token)."""
        run = self.tokens[img.start_idx:img.end_idx]
        return np.isin(run, self.vision_token_ids)

    @property
    def prefix_cache_tokens(self) -> np.ndarray:
        """The tokens the prefix cache hashes: each image's vision tokens replaced by a key
        derived from its pixels. The placeholder ids are the same for every image, so without
        this two requests with different images would share KV blocks; with it, the same
        image (a follow-up turn of a conversation) still reuses them."""
        keyed = self.tokens.copy()
        for img in self.images:
            key = _FIRST_IMAGE_KEY - (img.image_hash % _KEY_RANGE)
            run = keyed[img.start_idx:img.end_idx]
            run[np.isin(run, self.vision_token_ids)] = key
        return keyed
