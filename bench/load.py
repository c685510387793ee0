"""Closed-loop streaming load: C clients, each sending its next request when the last ends.

Every level is bounded twice: by a number of requests, and by time (no new request after
`level_timeout`, and requests still running `grace` seconds later are cancelled), so a stuck
server can slow the benchmark down but never hang it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

import httpx

from bench.clean_runs import CleanRuns
from bench.endpoint import http_client
from bench.http_stream import StreamingConnection
from bench.prompts import SEED, PromptSource
from bench.server_metrics import level_breakdown, scrape
from bench.sse import RequestRecord, completion_body, stream_completion
from bench.stats import percentile
from processes.cpu_placement import short_time_slice


@dataclass
class LoadConfig:
    base_url: str
    model: str
    prompt_len: int
    output_len: int
    concurrency: list[int]
    requests_per_client: int = 2
    min_requests: int = 4
    level_timeout: float = 600.0
    grace: float = 120.0
    prompt_seed: int = SEED  # a run passes its own (bench/prompts.py's run_seed)


def requests_for(cfg: LoadConfig, concurrency: int) -> int:
    return max(cfg.requests_per_client * concurrency, cfg.min_requests)


async def run_load(cfg: LoadConfig, levels: dict, log=print,
                   clean: CleanRuns | None = None, label: str = "server",
                   before_level: Callable[[int], None] | None = None,
                   after_level: Callable[[int], None] | None = None) -> None:
    """Runs every level, adding each one's summary to `levels` (keyed by concurrency) as soon
    as it ends. A level disturbed by other processes is run again (see clean_runs.py); its
    waiting for quiet may block the loop, which is fine: nothing else is in flight then.
    `before_level(c)` and `after_level(c)` run (blocking) right before and after level c:
    the ceiling's batch c, side by side."""
    clean = clean or CleanRuns()
    prompts = PromptSource(cfg.prompt_len, seed=cfg.prompt_seed)
    limits = httpx.Limits(max_connections=max(cfg.concurrency) + 4, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.level_timeout + cfg.grace, connect=10.0)
    async with http_client(limits=limits, timeout=timeout) as client:
        # One request first, not counted: the server's first step pays one-time costs.
        await _warm_up(client, cfg, prompts)
        for c in cfg.concurrency:
            if before_level is not None:
                before_level(c)
            for attempt in clean.attempts(f"{label} c={c}"):
                attempt.result = await _measure_level(client, cfg, c, prompts)
            levels[str(c)] = summary = clean.best_result()
            log(f"{label}: c={c:>3}: {summary['output_tok_s'] or 0:8.1f} tok/s, TTFT p50 "
                f"{_ms(summary['ttft_p50_s'])}, ITL p50 {_ms(summary['itl_p50_s'])}, "
                f"{summary['failed']} failed")
            if after_level is not None:
                after_level(c)


async def _measure_level(client, cfg: LoadConfig, concurrency: int, prompts) -> dict:
    before = await scrape(client, cfg.base_url)
    records, wall = await run_level(client, cfg, concurrency, requests_for(cfg, concurrency),
                                    prompts)
    summary = summarize_level(concurrency, records, wall)
    summary["server_metrics"] = level_breakdown(before, await scrape(client, cfg.base_url), wall)
    return summary


async def _warm_up(client, cfg: LoadConfig, prompts: PromptSource) -> None:
    record = RequestRecord(cfg.prompt_len)
    body = completion_body(cfg.model, prompts.next(), min(cfg.output_len, 8))
    await asyncio.wait_for(stream_completion(client, cfg.base_url, body, record), cfg.grace)
    if not record.ok:
        raise RuntimeError(f"warm-up request failed: {record.error}")


async def run_level(client, cfg: LoadConfig, concurrency: int, total: int,
                    prompts: PromptSource) -> tuple[list[RequestRecord], float]:
    """Returns every request's record and the level's wall time (first send to last end)."""
    started = time.perf_counter()
    stop_sending = started + cfg.level_timeout
    hard_stop = stop_sending + cfg.grace
    records: list[RequestRecord] = []

    async def one_client() -> None:
        # Each simulated client streams over its own kept-alive connection, through the lean
        # client (http_stream.py): what the load generator spends per token, the server loses.
        conn = StreamingConnection(cfg.base_url) if cfg.base_url.startswith("http:") else client
        try:
            while len(records) < total and time.perf_counter() < stop_sending:
                record = RequestRecord(cfg.prompt_len)
                records.append(record)
                body = completion_body(cfg.model, prompts.next(), cfg.output_len)
                left = hard_stop - time.perf_counter()
                try:
                    await asyncio.wait_for(stream_completion(conn, cfg.base_url, body, record),
                                           left)
                except asyncio.TimeoutError:
                    record.error = "cancelled at the level's time bound"
        finally:
            if conn is not client:
                await conn.close()

    # The load generator shares this machine's cores with the server's model threads. Like
    # loom's API process, it asks Linux for a short time slice while it measures, so its
    # wake-ups take a core at once instead of after a model thread's slice: what it measures
    # is the server's latency, not its own wait for a core (c=1, same server: time from the
    # end of the prefill forward to the first chunk at the client, median 1.8-3.6 -> 1.4 ms).
    with short_time_slice():
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
    ends = [r.finished for r in records if r.finished is not None]
    wall = (max(ends) if ends else time.perf_counter()) - started
    return records, wall


def summarize_level(concurrency: int, records: list[RequestRecord], wall: float) -> dict:
    ok = [r for r in records if r.ok]
    tokens = sum(r.tokens for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    itl = [gap for r in ok for gap in r.inter_chunk]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    e2e = [r.e2e for r in ok]
    tpot = [r.time_per_output_token for r in ok if r.time_per_output_token is not None]
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "usage_reported": all(r.usage_reported for r in ok),
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall if wall > 0 else None,
        "requests_s": len(ok) / wall if wall > 0 else None,
        "tokens_per_chunk": tokens / chunks if chunks else None,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else None,
        "itl_mean_s": sum(itl) / len(itl) if itl else None,
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"
