"""One streamed /v1/completions request, with the arrival time of every chunk.

Token accounting: a chunk's text may hold several tokens (or none, while the detokenizer holds
back half a character), so chunks are only timestamps; the request's token count comes from
the final usage chunk (stream_options.include_usage), and falls back to the number of
text-carrying chunks only for servers that do not send usage.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from bench.http_stream import StreamingConnection


@dataclass
class RequestRecord:
    prompt_tokens: int
    started: float = 0.0  # time.perf_counter() when the request was sent
    chunk_times: list[float] = field(default_factory=list)  # chunks carrying text
    finished: float | None = None
    completion_tokens: int | None = None  # from usage
    usage_reported: bool = False
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished is not None

    @property
    def tokens(self) -> int:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.started if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.finished - self.started if self.finished is not None else None

    @property
    def inter_chunk(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def time_per_output_token(self) -> float | None:
        """(last chunk - first chunk) / (tokens - 1): per-token decode time, whatever the
        chunking; equals the mean inter-chunk gap when every chunk is one token."""
        if len(self.chunk_times) < 2 or self.tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.tokens - 1)


def completion_body(model: str, prompt: list[int] | str, max_tokens: int) -> dict:
    return {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }


async def stream_completion(client, base_url: str, body: dict, record: RequestRecord) -> None:
    """Send `body`, filling `record` as chunks arrive (so a cancelled request keeps what it
    got). Errors are recorded, not raised: one failed request must not end the level.
    `client` is an httpx.AsyncClient, or a StreamingConnection (http_stream.py), the load
    generator's lean client."""
    if isinstance(client, StreamingConnection):
        return await _stream_raw(client, body, record)
    record.started = time.perf_counter()
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:200]}"
                return
            async for line in response.aiter_lines():
                if line.startswith("data:") and _take_data(line[5:].strip(), record):
                    break
        if record.error is None:
            record.finished = time.perf_counter()
    except Exception as exc:  # transport errors, bad JSON: this request failed, go on
        record.error = f"{type(exc).__name__}: {exc}"


async def _stream_raw(conn: StreamingConnection, body: dict, record: RequestRecord) -> None:
    payload = json.dumps(body).encode()
    record.started = time.perf_counter()
    try:
        events = conn.post_sse("/v1/completions", payload)
        try:
            async for status, data in events:
                if data is None:
                    continue
                if status != 200:
                    record.error = f"HTTP {status}: {data.decode(errors='replace')[:200]}"
                    return
                if _take_data(data, record):
                    break
        finally:
            await events.aclose()
        if record.error is None:
            record.finished = time.perf_counter()
    except Exception as exc:  # transport errors, bad JSON: this request failed, go on
        record.error = f"{type(exc).__name__}: {exc}"


def _take_data(data: str | bytes, record: RequestRecord) -> bool:
    """Applies one SSE event's data to the record; True at the end of the stream."""
    now = time.perf_counter()
    if data in ("[DONE]", b"[DONE]"):
        return True
    chunk = json.loads(data)
    if "error" in chunk:
        record.error = f"server error: {chunk['error'].get('message', chunk['error'])}"
        return True
    for choice in chunk.get("choices") or []:
        if choice.get("text"):
            record.chunk_times.append(now)
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    usage = chunk.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        record.completion_tokens = int(usage["completion_tokens"])
        record.usage_reported = True
    return False
