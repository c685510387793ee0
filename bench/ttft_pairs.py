"""TTFT at concurrency 1 against the model's own prefill of the same prompt, side by side.

The c=1 load level gives a handful of TTFTs, and the ceiling's prefill is measured minutes
away from them: on this shared machine a 256-token prefill moves by 10-50 ms between runs
(360-412 ms in one run), far more than the few milliseconds a server adds. So the target
"TTFT within 5 ms of the model's prefill for that prompt" is measured in pairs: the ceiling
prefills prompt i in the bench process, then the server is sent the same prompt (token ids,
never seen before, so no prefix cache helps), and each pair gives one difference. The
median of the differences is the server's own cost; the order inside a pair alternates so
that neither side always runs first.

Where the server is loom, its /metrics also give the worker's own forward time for each
request (scraped around it): TTFT minus that is what the server adds, free of the machine's
drift between the two sides of a pair.
"""

from __future__ import annotations

import asyncio

from bench.endpoint import http_client
from bench.http_stream import StreamingConnection
from bench.prompts import prompt_ids
from bench.server_metrics import PREFIX, scrape
from bench.sse import RequestRecord, completion_body, stream_completion
from bench.stats import median, percentile
from processes.cpu_placement import short_time_slice

PROMPT_INDEX_BASE = 2_000_000  # clear of the load test's and the ceiling's own prompts
OUTPUT_TOKENS = 4  # enough for a first text-carrying chunk whatever the detokenizer holds back


def measure_ttft_pairs(ceiling, base_url: str, model: str, prompt_len: int,
                       pairs: int = 8, timeout: float = 120.0) -> dict:
    """`pairs` (prefill, TTFT) measurements on the same prompts; times in ms."""
    return asyncio.run(_measure(ceiling, base_url, model, prompt_len, pairs, timeout))


async def _measure(ceiling, base_url: str, model: str, prompt_len: int, pairs: int,
                   timeout: float) -> dict:
    conn = StreamingConnection(base_url)
    metrics = http_client()
    prefill_ms, ttft_ms, forward_ms, errors = [], [], [], []
    try:
        # one unpaired request first: the connection and the server's first-request costs
        await _ttft(conn, base_url, model, prompt_ids(PROMPT_INDEX_BASE - 1, prompt_len),
                    timeout)
        for i in range(pairs):
            ids = prompt_ids(PROMPT_INDEX_BASE + i, prompt_len)
            if i % 2 == 0:
                prefill = ceiling.prefill_ms(ids)
            before = await scrape(metrics, base_url)
            ttft = await _ttft(conn, base_url, model, ids, timeout)
            after = await scrape(metrics, base_url)
            if i % 2 == 1:
                prefill = ceiling.prefill_ms(ids)
            if isinstance(ttft, str):
                errors.append(ttft)
                continue
            prefill_ms.append(prefill)
            ttft_ms.append(ttft)
            forward_ms.append(_prefill_forward_ms(before, after))
    finally:
        await conn.close()
        await metrics.aclose()
    diffs = [t - p for t, p in zip(ttft_ms, prefill_ms)]
    added = [t - f for t, f in zip(ttft_ms, forward_ms) if f is not None]
    return {
        "pairs": len(diffs), "errors": errors[:5], "prompt_len": prompt_len,
        "prefill_ms": prefill_ms, "ttft_ms": ttft_ms, "server_forward_ms": forward_ms,
        "prefill_ms_p50": median(prefill_ms), "ttft_ms_p50": median(ttft_ms),
        "ttft_over_prefill_ms_p50": median(diffs),
        "ttft_over_prefill_ms_p90": percentile(diffs, 90),
        # loom only: TTFT minus the worker's forward for the very same request
        "ttft_over_server_forward_ms_p50": median(added),
        "ttft_over_server_forward_ms_p90": percentile(added, 90),
    }


def _prefill_forward_ms(before: dict | None, after: dict | None) -> float | None:
    """The worker's prefill forward time between two scrapes of loom's /metrics."""
    name = PREFIX + "model_forward_time_seconds_sum:prefill"
    count = PREFIX + "model_forward_time_seconds_count:prefill"
    if not before or not after or after.get(count, 0) - before.get(count, 0) < 1:
        return None
    return (after[name] - before.get(name, 0.0)) * 1e3


async def _ttft(conn, base_url: str, model: str, ids: list[int], timeout: float):
    """The request's TTFT in ms, or an error message."""
    record = RequestRecord(len(ids))
    body = completion_body(model, ids, OUTPUT_TOKENS)
    with short_time_slice():  # as the load generator does (see load.run_level)
        try:
            await asyncio.wait_for(stream_completion(conn, base_url, body, record), timeout)
        except asyncio.TimeoutError:
            return "timed out"
    if not record.ok or record.ttft is None:
        return record.error or "no text in the response"
    return record.ttft * 1e3
