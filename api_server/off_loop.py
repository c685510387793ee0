"""Work too heavy for the event loop: decoding large request bodies, walking and converting
what they hold, rendering chat templates and tokenizing.

The event loop answers every client (and `/live`, which a liveness probe restarts the pod
on); a request that spends seconds on it stalls them all. Such work runs on a few threads
with a bounded queue: past the bound a request gets a 503 with Retry-After, rather than a
backlog that grows without limit.

Threads are enough only where the work lets go of the GIL often: Jinja and Python walks do
(the interpreter switches threads every few milliseconds), the tokenizer and `regex` with
`concurrent=True` release it, but msgspec decodes a body in one call that holds it
throughout. So a large body's shape is bounded before it is decoded (`check_json_shape`):
its arrays and objects, strings and values are counted, and a body with more than any
request needs is refused. The caps keep one decode on one core under ~50 ms; without
them 16 MiB of `[]` held the GIL for 2 s.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import regex

from api_server.protocol import RequestError, decode_body

T = TypeVar("T")

# Bodies up to this size decode on the event loop (well under a millisecond's work).
INLINE_BODY_BYTES = 64 << 10

# What a body may hold (counted outside strings). Generous for any honest request (4,096
# messages with their parts, 128 tools with large schemas, 64 prompts of 32k token ids);
# each cap alone keeps msgspec's decode under ~50 ms on one core.
MAX_JSON_CONTAINERS = 65_536  # arrays and objects: ~0.35 us each to decode (lists, GC)
MAX_JSON_STRINGS = 262_144  # keys included: ~0.1 us each
MAX_JSON_VALUES = 2_097_152  # everything, numbers included: ~0.02-0.05 us each

OFF_LOOP_THREADS = 4
MAX_PENDING = 256  # jobs queued or running, all requests together

# A JSON string: its brackets, commas and quotes are not structure.
_STRING = regex.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"')


class OffLoop:
    """A small thread pool with a bounded queue, for one request's heavy step at a time."""

    def __init__(self, threads: int = OFF_LOOP_THREADS, max_pending: int = MAX_PENDING) -> None:
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="loom-off-loop")
        self.max_pending = max_pending
        self.pending = 0  # counted down by the thread, so a cancelled wait can't leak a slot
        self._lock = threading.Lock()

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        with self._lock:
            if self.pending >= self.max_pending:
                raise RequestError("the server is busy preparing other requests; retry shortly",
                                   status=503, code="server_busy")
            self.pending += 1
        job = functools.partial(self._job, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.executor, job)

    def _job(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            with self._lock:
                self.pending -= 1


OFF_LOOP = OffLoop()


def is_large(body: bytes) -> bool:
    """Whether what a body holds is worth a trip off the loop to decode and walk."""
    return len(body) > INLINE_BODY_BYTES


async def off_loop_if(large: bool, fn: Callable[..., T], /, *args: Any) -> T:
    """`fn(*args)`: on the pool for a large request, inline (no thread hop) otherwise."""
    return await OFF_LOOP.run(fn, *args) if large else fn(*args)


async def parse_body(body: bytes, type_: type) -> Any:
    """`decode_body`, off the event loop when the body is large, after its shape is checked."""
    if not is_large(body):
        return decode_body(body, type_)
    return await OFF_LOOP.run(_checked_decode, body, type_)


def _checked_decode(body: bytes, type_: type) -> Any:
    check_json_shape(body)
    return decode_body(body, type_)


def check_json_shape(body: bytes) -> None:
    """Refuse a body holding more arrays and objects, strings or values than MAX_JSON_*.

    Counting the raw bytes over-counts (brackets and commas inside strings); only when that
    count is over a cap are the strings taken out (with the GIL released) and it counted
    again, exactly."""
    if _within_caps(*_shape(body)):
        return
    quotes = body.count(b'"') - body.count(b'\\"')  # unescaped quotes: at least this many
    if quotes // 2 <= MAX_JSON_STRINGS:  # (many strings: refused without the slower count)
        containers, strings, values = _shape(_STRING.sub(b'""', body, concurrent=True))
        if _within_caps(containers, strings, values):
            return
    raise RequestError(
        f"the request body holds more JSON values than any request needs (at most "
        f"{MAX_JSON_CONTAINERS} arrays and objects, {MAX_JSON_STRINGS} strings and "
        f"{MAX_JSON_VALUES} values in all)", code="limit_exceeded")


def _shape(body: bytes) -> tuple[int, int, int]:
    containers = body.count(b"[") + body.count(b"{")
    # Every value but the first of each array or object follows a comma.
    return containers, body.count(b'"') // 2, body.count(b",") + containers + 1


def _within_caps(containers: int, strings: int, values: int) -> bool:
    return (containers <= MAX_JSON_CONTAINERS and strings <= MAX_JSON_STRINGS
            and values <= MAX_JSON_VALUES)
