"""A lean HTTP/1.1 client for the load generator's streamed requests.

The load generator shares the machine's cores with the server it measures, so what it spends
per streamed token is taken from the server: through httpx it was ~0.16 ms of CPU per SSE
chunk, as much as loom's whole API process. This speaks just enough HTTP/1.1 for a streamed
POST on a kept-alive connection (chunked, Content-Length or close-delimited bodies) with
asyncio's streams, and hands the SSE events' data lines to the caller as they arrive.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from bench.endpoint import auth_headers


class HTTPStreamError(Exception):
    pass


class StreamingConnection:
    """One kept-alive connection to `base_url`; requests on it run one after another."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise HTTPStreamError(f"only http:// is supported here, not {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.host_header = parts.netloc
        self.auth = "".join(f"{k}: {v}\r\n" for k, v in auth_headers().items())
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except OSError:
                pass
        self._reader = self._writer = None

    async def post_sse(self, path: str, body: bytes):
        """POST `body` (JSON); yields (status, None) first, then each SSE `data:` payload
        (bytes) as it arrives; for a non-200 status, then the whole body once."""
        if self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
            sock = self._writer.get_extra_info("socket")
            if sock is not None:  # no Nagle delay on the request (as the httpx client had)
                import socket

                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host_header}\r\n{self.auth}"
                f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self._writer.write(head + body)
        reader = self._reader
        try:
            status, headers = await self._read_head(reader)
            yield status, None
            chunks = self._body(reader, headers)
            if status != 200:
                yield status, b"".join([c async for c in chunks])
                return
            pending = b""
            async for data in chunks:
                pending += data
                *events, pending = pending.replace(b"\r\n", b"\n").split(b"\n\n")
                for event in events:
                    for line in event.split(b"\n"):
                        if line.startswith(b"data:"):
                            yield status, line[5:].strip()
            if headers.get("connection", "").lower() == "close":
                await self.close()
        except BaseException:
            await self.close()  # the stream's state is unknown: start a new connection
            raise

    @staticmethod
    async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            raise HTTPStreamError("the server closed the connection") from exc
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        return status, headers

    async def _body(self, reader: asyncio.StreamReader, headers: dict[str, str]):
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")  # (no trailers are sent to us)
                    return
                data = await reader.readexactly(size + 2)
                yield data[:-2]
        elif "content-length" in headers:
            yield await reader.readexactly(int(headers["content-length"]))
        else:  # delimited by the server closing the connection
            while data := await reader.read(65536):
                yield data
            await self.close()
