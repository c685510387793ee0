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


def test_ttft_pairs_measure_the_same_prompt_on_both_sides(tiny_model_dir):
    """bench.ttft_pairs: each pair is the plain loop's prefill and the server's TTFT of one
    prompt, and the worker's own forward for that very request comes from loom's /metrics."""
    from bench.ceiling import Ceiling, CeilingConfig
    from bench.server_metrics import parse_prometheus
    from bench.ttft_pairs import measure_ttft_pairs

    ceiling = Ceiling(CeilingConfig(model_dir=tiny_model_dir, dtype="float32", prompt_len=24,
                                    output_len=4, batch_sizes=[1]), log=lambda *a: None)
    srv = start_server(tiny_model_dir)
    try:
        model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        result = measure_ttft_pairs(ceiling, srv.url, model, prompt_len=24, pairs=3)
        metrics = parse_prometheus(httpx.get(srv.url + "/metrics").text)
    finally:
        srv.stop()
        ceiling.close()
    assert result["pairs"] == 3 and not result["errors"]
    assert all(ms > 0 for ms in result["prefill_ms"])
    forwards = result["server_forward_ms"]
    assert None not in forwards and len(forwards) == 3
    # The first token cannot reach the client before the forward that made it has ended.
    assert all(t > f > 0 for t, f in zip(result["ttft_ms"], forwards))
    assert result["ttft_over_server_forward_ms_p50"] > 0
    # distinct prompts: nothing was served from the prefix cache
    assert metrics["loom:prefix_cache_queries_total"] >= 3 * 24
    assert metrics["loom:prefix_cache_hits_total"] == 0


def test_ceiling_batch_bracketed_by_a_second_run_is_their_mean(tiny_model_dir):
    """bench.run measures the ceiling's batch B right before and right after the load level
    at concurrency B; the batch's figures are then the mean of the two runs."""
    from bench.ceiling import Ceiling, CeilingConfig

    ceiling = Ceiling(CeilingConfig(model_dir=tiny_model_dir, dtype="float32", prompt_len=24,
                                    output_len=6, batch_sizes=[2]), log=lambda *a: None)
    try:
        before = ceiling.measure_batch(2)
        both = ceiling.bracket_batch(2)
        assert ceiling.bracket_batch(2) is both  # a third call measures nothing more
    finally:
        ceiling.close()
    first, second = both["runs"]
    assert first == before and second["batch"] == 2 and second["decode_steps"] == 5
    assert both["prefill_s"] == (first["prefill_s"] + second["prefill_s"]) / 2
    assert both["decode_s"] == (first["decode_s"] + second["decode_s"]) / 2
    expected = 2 * 6 / (both["prefill_s"] + both["decode_s"])
    assert abs(both["prefill_and_decode_tok_s"] - expected) < 1e-9 * expected
    assert min(first["prefill_and_decode_tok_s"], second["prefill_and_decode_tok_s"]) \
        <= both["prefill_and_decode_tok_s"] \
        <= max(first["prefill_and_decode_tok_s"], second["prefill_and_decode_tok_s"])
