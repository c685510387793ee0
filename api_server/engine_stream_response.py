"""The server-sent-events response of a text generation whose engine requests were submitted
before the response started."""

from __future__ import annotations

import msgspec
from starlette.responses import StreamingResponse

from api_server.engine_client import EngineClient

_json = msgspec.json.Encoder()


def named_event(name: str, data: dict) -> bytes:
    """One server-sent event with an `event:` name (Responses' and Anthropic's streams)."""
    return b"event: " + name.encode() + b"\ndata: " + _json.encode(data) + b"\n\n"


class EngineStreamResponse(StreamingResponse):
    """Streams `content`. The requests in `submitted` were sent to the engine before this
    response was built, so the headers are written while the scheduler already works on them
    (they reach it ~0.35 ms sooner).

    If the response ends before its body starts (an ASGI 2.4 server raises on the header write
    when the client has left), the body's generators never run and nothing else would cancel
    those requests: whichever way the response ends, the ones still unread are withdrawn here.
    """

    def __init__(self, content, engine: EngineClient, submitted: list[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.engine = engine
        self.submitted = submitted

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.engine.withdraw(self.submitted)
