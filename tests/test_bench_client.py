"""The load generator's lean HTTP client (bench/http_stream.py) against a real loom server:
same tokens and usage as httpx sees, errors recorded, connections kept alive. And the harness's
helpers that need no server: its plot, the /metrics parser, finding a port's process."""

import asyncio
import json

import httpx
import pytest

from bench.http_stream import StreamingConnection
from bench.sse import RequestRecord, completion_body, stream_completion


def test_streams_like_httpx_and_records_errors(tiny_server):
    srv = tiny_server
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


def test_ttft_pairs_measure_the_same_prompt_on_both_sides(tiny_model_dir, tiny_server):
    """bench.ttft_pairs: each pair is the plain loop's prefill and the server's TTFT of one
    prompt, and the worker's own forward for that very request comes from loom's /metrics
    (of the session's shared tiny server: its prefix cache counters are read as deltas)."""
    from bench.ceiling import Ceiling, CeilingConfig
    from bench.server_metrics import parse_prometheus
    from bench.ttft_pairs import measure_ttft_pairs

    ceiling = Ceiling(CeilingConfig(model_dir=tiny_model_dir, dtype="float32", prompt_len=24,
                                    output_len=4, batch_sizes=[1]), log=lambda *a: None)
    srv = tiny_server
    try:
        model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        before = parse_prometheus(httpx.get(srv.url + "/metrics").text)
        result = measure_ttft_pairs(ceiling, srv.url, model, prompt_len=24, pairs=3)
        metrics = parse_prometheus(httpx.get(srv.url + "/metrics").text)
    finally:
        ceiling.close()
    assert result["pairs"] == 3 and not result["errors"]
    assert all(ms > 0 for ms in result["prefill_ms"])
    forwards = result["server_forward_ms"]
    assert None not in forwards and len(forwards) == 3
    # The first token cannot reach the client before the forward that made it has ended.
    assert all(t > f > 0 for t, f in zip(result["ttft_ms"], forwards))
    assert result["ttft_over_server_forward_ms_p50"] > 0
    # distinct prompts: nothing was served from the prefix cache
    queries, hits = "loom:prefix_cache_queries_total", "loom:prefix_cache_hits_total"
    assert metrics[queries] - before.get(queries, 0) >= 3 * 24
    assert metrics[hits] - before.get(hits, 0) == 0


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


def test_plot_draws_a_png_of_the_levels(tmp_path):
    """bench.plot: a result's levels (loom and a peer) as a PNG beside the JSON."""
    pytest.importorskip("matplotlib")
    from bench.plot import main, plot, server_lines

    def levels(tok_s, itl_ms):
        return {str(c): {"concurrency": c, "output_tok_s": t,
                         "itl_p50_s": None if i is None else i / 1e3}
                for c, t, i in zip((1, 4, 16), tok_s, itl_ms)}

    result = {"config": {"model_name": "tiny", "dtype": "float32", "prompt_len": 8,
                         "output_len": 4},
              "server": {"levels": levels((30.0, 90.0, 150.0), (25.0, 30.0, None))},
              "peer": {"name": "vllm", "levels": levels((20.0, 45.0, 70.0), (40.0, 60.0, 130.0))}}
    lines = server_lines(result)
    assert [line["label"] for line in lines] == ["loom", "vllm"]
    assert lines[0]["concurrency"] == [1, 4, 16] and lines[0]["itl_p50_ms"][1] == 30.0
    path = tmp_path / "result.png"
    assert plot(result, str(path)) == str(path)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
    # the command line: a JSON file in, the PNG beside it
    (tmp_path / "old.json").write_text(json.dumps(result))
    assert main([str(tmp_path / "old.json")]) == 0
    assert (tmp_path / "old.png").read_bytes().startswith(b"\x89PNG")


def test_prometheus_text_parsed_once_two_ways():
    """bench.server_metrics: one parser for loom's /metrics, read per label set (the soak)
    or summed with prefill/decode and histogram bounds kept apart (the load levels)."""
    from bench.server_metrics import by_label, parse_prometheus, parse_series, series_total

    text = "\n".join([
        "# HELP loom:http_requests_total requests",
        'loom:http_requests_total{path="/v1/completions",status="200"} 7.0',
        'loom:http_requests_total{path="/v1/completions",status="400"} 1.0',
        'loom:http_requests_total{path="/v1/chat",status="200"} 2.0',
        'loom:model_forward_time_seconds_sum{step="prefill"} 0.5',
        'loom:model_forward_time_seconds_sum{step="decode"} 1.5',
        'loom:step_overhead_seconds_bucket{le="0.001"} 3.0',
        'loom:step_overhead_seconds_bucket{le="+Inf"} 4.0',
        "loom:kv_cache_usage_perc 0.25",
        "process_cpu_seconds_total 12.0",
    ])
    series = parse_series(text)
    assert series_total(series, "loom:http_requests_total") == 10.0
    assert by_label(series, "loom:http_requests_total", "status") == {"200": 9.0, "400": 1.0}
    assert series_total(series, "loom:kv_cache_usage_perc") == 0.25
    assert "process_cpu_seconds_total" not in series
    flat = parse_prometheus(text)
    assert flat["loom:http_requests_total"] == 10.0
    assert flat["loom:model_forward_time_seconds_sum:prefill"] == 0.5
    assert flat["loom:model_forward_time_seconds_sum:decode"] == 1.5
    assert flat["loom:step_overhead_seconds_bucket|+Inf"] == 4.0


def test_listening_pid_finds_this_process():
    """bench.procs.listening_pid: the process listening on a port (a peer, a --url server)."""
    import os
    import socket

    from bench.procs import listening_pid

    if not os.path.isdir("/proc"):
        pytest.skip("needs /proc")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert listening_pid(sock.getsockname()[1]) == os.getpid()


def test_each_run_meets_no_prompt_an_earlier_run_left_in_the_cache(tiny_server):
    """A served load draws its prompts from a seed of its own: a server kept up between runs
    (a peer, often) answers no second run from its prefix cache, which would flatter that run
    (bench/prompts.py). The same seed twice does hit the cache, so the check can fail."""
    from bench.load import LoadConfig, run_load
    from bench.prompts import PromptSource, prompt_ids, run_seed

    def cache_hits() -> float:
        text = httpx.get(tiny_server.url + "/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("loom:prefix_cache_hits_total{"))

    def run(seed: int) -> None:
        cfg = LoadConfig(base_url=tiny_server.url, model="tiny", prompt_len=48, output_len=2,
                         concurrency=[2], prompt_seed=seed)
        asyncio.run(run_load(cfg, {}, log=lambda *_: None))

    seed = run_seed()
    assert PromptSource(48, seed=seed).next() == prompt_ids(0, 48, seed)  # the JSON's seed repeats it
    run(seed)
    before = cache_hits()
    run(run_seed())
    assert cache_hits() == before
    run(seed)
    assert cache_hits() >= before + 32  # (whole 16-token blocks of the repeated prompts)
