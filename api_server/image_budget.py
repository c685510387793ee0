"""The API process's image memory, bounded server-wide: pixels in flight.

A request's images are counted from their headers before any is decoded (a 90 KiB PNG can
unpack to 2048 x 2048 pixels, and the processor's float arrays take 4 bytes a value): if the
pixels already in flight leave no room, the request gets 429 (Retry-After) and nothing is
decoded. Once the processor has made the pixel arrays the contexts carry, the reservation
becomes their size (a small image upscaled to tiles holds more than its header said) and is
held until the arrays are freed: the contexts of every choice share one set of arrays, which
live until the request ends, and the scheduler holds its copy as long (the other choices'
contexts send their images by reference to it: api_server/engine_client.py).
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

import numpy as np

from api_server.protocol import RequestError


class PixelReservation:
    """Pixels counted against a budget until `release` (or the arrays `hold` names are gone)."""

    def __init__(self, budget: ImagePixelBudget, pixels: int) -> None:
        self.budget = budget
        self.pixels = pixels

    def release(self) -> None:
        self.budget.give_back(self.pixels)
        self.pixels = 0

    def hold(self, arrays: list[np.ndarray]) -> None:
        """Count the pixels of `arrays` (values / 3 channels) instead, each array's share
        until it is freed. Past the budget if need be: the work is done, and the next request
        is the one refused."""
        self.release()
        for array in arrays:
            pixels = array.size // 3
            with self.budget.lock:
                self.budget.in_flight += pixels
            weakref.finalize(array, self.budget.give_back, pixels)


class ImagePixelBudget:
    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        # Reserved on the loading threads, given back wherever the last array is freed.
        self.lock = threading.Lock()
        self.on_decoded: Callable[[int], object] = lambda count: None  # (metrics)

    def reserve(self, pixels: int, param: str) -> PixelReservation:
        """`pixels` more in flight, or a RequestError: 400 (naming `param`) if they could
        never fit, 429 if they do not fit now."""
        if pixels > self.max_in_flight:
            raise RequestError(
                f"the request's images hold {pixels} pixels; the server holds at most "
                f"{self.max_in_flight} in flight (--max-image-pixels-in-flight)", param=param,
                code="limit_exceeded")
        with self.lock:
            if self.in_flight + pixels > self.max_in_flight:
                raise RequestError(
                    f"too many image pixels in flight ({self.in_flight}); retry later",
                    status=429, code="images_busy")
            self.in_flight += pixels
        return PixelReservation(self, pixels)

    def give_back(self, pixels: int) -> None:
        with self.lock:
            self.in_flight -= pixels
