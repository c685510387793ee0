"""The load generator's lean HTTP client (bench/http_stream.py) against a real loom server:
same tokens and usage as httpx sees, errors recorded, connections kept alive."""

import asyncio

import httpx

from bench.http_stream import StreamingConnection
from bench.sse import RequestRecord, completion_body, stream_completion
from tests.helpers import start_server


def test_streams_like_httpx_and_records_errors(tiny_model_dir):
    srv = start_server(tiny_model_dir)
    try:
        model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]

        async def run():
            conn = StreamingConnection(srv.url)
            lean = [RequestRecord(8) for _ in range(3)]
            for record in lean:  # one kept-alive connection, requests one after another
                await stream_completion(conn, srv.url, completion_body(model, list(range(5, 13)),
                                                                       12), record)
            writer = conn._writer
            await stream_completion(conn, srv.url, completion_body(model, [5, 6], 3), lean[0])
            assert conn._writer is writer  # still the same connection
            bad = RequestRecord(2)
            await stream_completion(conn, srv.url, completion_body("no-such-model", [5], 3), bad)
            await conn.close()
            async with httpx.AsyncClient() as client:
                reference = RequestRecord(8)
                await stream_completion(client, srv.url,
                                        completion_body(model, list(range(5, 13)), 12), reference)
            return lean, bad, reference

        lean, bad, reference = asyncio.run(run())
        for record in lean[1:]:
            assert record.ok and record.usage_reported and record.tokens == 12
            assert record.finish_reason == reference.finish_reason == "length"
            assert len(record.chunk_times) == len(reference.chunk_times)
            assert record.ttft is not None and record.ttft > 0
        assert not bad.ok and "HTTP 404" in bad.error
    finally:
        srv.stop()
