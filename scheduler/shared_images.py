"""One copy of each image's pixels in the scheduler, however many requests carry it.

The n choices of a request arrive as n contexts, each with its own decoded copy of the same
pixel arrays (and a follow-up turn of a conversation brings its image again): the scheduler
keeps each for the request's whole life (a preempted request encodes its images again), so n
choices of 4 large images would hold n copies. Contexts are matched by the image's content
hash (blake2b, computed by the API process, with its shape and dtype), the key the prefix cache
already trusts; the table holds no image alive by itself. The API process sends an image it
has already sent by reference (empty pixel_values), resolved here; `share` is False when one
is no longer held (IMAGES_NOT_HELD).
"""

from __future__ import annotations

import weakref

import numpy as np

from pipelines.vision_context import TextAndVisionContext


class SharedImages:
    def __init__(self) -> None:
        self._arrays: weakref.WeakValueDictionary[tuple, np.ndarray] = \
            weakref.WeakValueDictionary()

    def share(self, ctx: TextAndVisionContext) -> bool:
        """Point the context's images at the copies already held, and offer its own; False
        if an image sent by reference is not held (any more)."""
        for img in ctx.images:
            pixels = img.pixel_values
            key = (img.image_hash, pixels.dtype.str)
            held = self._arrays.get(key)
            if held is None and pixels.size == 0:
                return False
            if held is None:
                self._arrays[key] = pixels
            else:
                img.pixel_values = held
        return True
