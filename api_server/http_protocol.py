"""uvicorn's httptools protocol with the limits it lacks: request head size and header count
(431), a deadline for the head (slowloris), and a cap on open connections.

uvicorn bounds none of these with httptools (its h11-only `h11_max_incomplete_event_size`
does not apply, `limit_concurrency` answers 503 only once a head is complete, and its
keep-alive timeout only runs between requests): a head that never ends grows the parser's
buffers without limit, and a connection that never finishes its head is held forever.
"""

from __future__ import annotations

import logging
import resource

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pipelines.config import HttpLimits

logger = logging.getLogger("loom")
_json = msgspec.json.Encoder()
# Descriptors the API process needs besides its connections: ZeroMQ, files, the tokenizer's.
_RESERVED_FDS = 256
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large",
            503: b"Service Unavailable"}


class _HeadRefused(Exception):
    """Raised from a parser callback to stop parsing a head that breaks a limit."""


class ConnectionTable:
    """The server's connections that are waiting for a request head (new, idle keep-alive or
    still sending it), oldest first: at the connection cap one of these gives way to a new
    connection, never a connection whose request is being served."""

    def __init__(self) -> None:
        self.waiting: dict[BoundedHttpToolsProtocol, None] = {}

    def mark_waiting(self, conn: BoundedHttpToolsProtocol) -> None:
        self.waiting.pop(conn, None)
        self.waiting[conn] = None

    def mark_busy(self, conn: BoundedHttpToolsProtocol) -> None:
        self.waiting.pop(conn, None)

    def oldest_waiting(self) -> BoundedHttpToolsProtocol | None:
        return next(iter(self.waiting), None)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    limits = HttpLimits()
    table: ConnectionTable

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_bytes = 0
        self._num_headers = 0
        self._reading_head = True
        self._head_refusal: tuple[int, str, str] | None = None
        self._head_deadline = None
        if len(self.connections) > self.limits.max_connections:
            oldest = self.table.oldest_waiting()
            if oldest is None:  # every connection is serving a request: this one waits
                self._refuse(503, "too many open connections (--max-connections); retry",
                             "too_many_connections")
                return
            oldest.transport.close()
            self.table.mark_busy(oldest)
        self.table.mark_waiting(self)
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self.table.mark_busy(self)
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # Counted before parsing, since httptools buffers an unfinished header field itself;
        # a head that completes in this chunk resets the count (on_headers_complete).
        if self._reading_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if (self._reading_head and self._head_bytes > self.limits.max_header_bytes
                and not self.transport.is_closing()):
            self._refuse(431, f"the request head exceeds {self.limits.max_header_bytes} "
                              f"bytes (--max-header-bytes)", "request_header_fields_too_large")

    # Parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._reading_head:  # the next request on a kept-alive connection
            self._reading_head = True
            self._head_bytes = self._num_headers = 0
        self._arm_head_deadline()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers > self.limits.max_headers:
            self._head_refusal = (431, f"more than {self.limits.max_headers} header fields "
                                       f"(--max-headers)", "request_header_fields_too_large")
            raise _HeadRefused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._head_bytes = 0
        self._cancel_head_deadline()
        self.table.mark_busy(self)
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.cycle.response_complete:
            self.table.mark_waiting(self)  # idle keep-alive: first to give way at the cap

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to any parser error, a callback's _HeadRefused included.
        if self._head_refusal is not None:
            self._refuse(*self._head_refusal)
        else:
            super().send_400_response(msg)

    # The head deadline
    def _arm_head_deadline(self) -> None:
        if self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.limits.header_timeout,
                                                       self._head_timed_out)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing() or not self._reading_head:
            return
        if self._head_bytes:
            self._refuse(408, f"the request head took longer than {self.limits.header_timeout:g}"
                              f"s (--header-timeout)", "request_timeout")
        else:  # nothing was asked: no answer owed
            self.transport.close()

    def _refuse(self, status: int, message: str, code: str) -> None:
        body = _json.encode({"error": {"message": message, "type": "invalid_request_error",
                                       "param": None, "code": code}})
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n" % (status, _REASONS[status], len(body)))
        self.transport.write(head + body)
        self.transport.close()


def bounded_http_protocol(limits: HttpLimits) -> type[BoundedHttpToolsProtocol]:
    """The protocol class for uvicorn.Config(http=...), with its own connection table."""
    return type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,),
                {"limits": limits, "table": ConnectionTable()})


def fit_descriptor_limit(limits: HttpLimits) -> HttpLimits:
    """Raise the soft open-files limit so that --max-connections can be reached (1,024 is a
    common default: slow clients would exhaust it and block every accept first, and the cap,
    which closes an idle connection for a new one, would never act); lower the cap to what
    the hard limit allows."""
    want = limits.max_connections + _RESERVED_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        if hard != resource.RLIM_INFINITY:
            want = min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    if soft == resource.RLIM_INFINITY or soft >= limits.max_connections + _RESERVED_FDS:
        return limits
    fitted = max(1, soft - _RESERVED_FDS)
    logger.warning("--max-connections %d lowered to %d: the open-files limit is %d (raise "
                   "`ulimit -n`)", limits.max_connections, fitted, soft)
    return msgspec.structs.replace(limits, max_connections=fitted)

