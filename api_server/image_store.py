"""Generated images kept for `GET /v1/images/{id}/content` (MAX's route), for requests that
ask for `response_format: "url"`: bounded in number and lifetime, oldest dropped first, in
memory only (a restart forgets them)."""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict


class ImageStore:
    def __init__(self, max_images: int = 256, ttl_seconds: float = 3600.0) -> None:
        self.max_images = max_images
        self.ttl_seconds = ttl_seconds
        self._images: OrderedDict[str, tuple[float, bytes, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._images)

    def put(self, data: bytes, media_type: str) -> str:
        self._expire()
        image_id = f"img_{uuid.uuid4().hex}"
        self._images[image_id] = (time.monotonic() + self.ttl_seconds, data, media_type)
        while len(self._images) > self.max_images:
            self._images.popitem(last=False)
        return image_id

    def get(self, image_id: str) -> tuple[bytes, str] | None:
        self._expire()
        entry = self._images.get(image_id)
        return None if entry is None else entry[1:]

    def _expire(self) -> None:
        now = time.monotonic()
        while self._images and next(iter(self._images.values()))[0] <= now:
            self._images.popitem(last=False)
