"""`python -m bench.router`: one loom replica against two behind the SGLang Model Gateway
(`sglang-router`), on a prefix-heavy load.

Every request is one of --prefixes shared prefixes (a long system prompt) plus a short unique
suffix. Three set-ups on the same machine, the same total KV cache memory:
  single       one replica on every core;
  round_robin  two replicas, each pinned to half the cores, behind the router's round robin;
  cache_aware  the same two behind its cache-aware policy (requests with a shared prefix go to
               the replica that served it).
Each replica of a pair has half the KV memory, room for about half the prefixes: where a
prefix is sent decides whether its blocks are still cached there. Reports TTFT (p50, p90),
output tokens/s and the replicas' prefix-cache hit rate (loom:prefix_cache_hits_total /
queries). On a 2-core machine absolute scaling is not the point; the policies' TTFT is.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time

from bench import RESULTS_DIR, log
from bench.endpoint import http_client, served_model, wait_healthy
from bench.prompts import prompt_ids
from bench.server import LoomServer, free_port, stop_session
from bench.server_metrics import parse_series, scrape, series_total
from bench.sse import RequestRecord, completion_body, stream_completion

SETUPS = ("single", "round_robin", "cache_aware")


class Router:
    """`python -m sglang_router.launch_router` over `worker_urls`, stopped on exit."""

    def __init__(self, worker_urls: list[str], policy: str, log_path: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "sglang_router.launch_router",
                        "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
                        "--log-level", "warn", "--prometheus-host", "127.0.0.1",
                        "--prometheus-port", str(free_port()), "--worker-urls", *worker_urls]
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "Router":
        with open(self.log_path, "wb") as out:
            self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        wait_healthy(self.base_url, 60, alive=lambda: self.process.poll() is None)
        return self

    def __exit__(self, *exc) -> None:
        stop_session(self.process, 10)


async def text_of(client, replica_url: str, model: str, ids: list[int]) -> str:
    """Prompts go as text: the router takes string prompts only (and matches prefixes on
    their characters)."""
    response = await client.post(f"{replica_url}/detokenize",
                                 json={"model": model, "tokens": ids})
    response.raise_for_status()
    return response.json()["prompt"]


async def run_load(base_url: str, replica_url: str, model: str, args) -> dict:
    rng = random.Random(args.seed)
    order = [rng.randrange(args.prefixes) for _ in range(args.requests)]
    queue: asyncio.Queue = asyncio.Queue()
    records: list[RequestRecord] = []

    async def client_loop(client):
        while not queue.empty():
            prompt = queue.get_nowait()
            record = RequestRecord(prompt_tokens=args.prefix_len + args.suffix_len)
            records.append(record)
            await stream_completion(client, base_url,
                                    completion_body(model, prompt, args.output_len), record)

    async with http_client(timeout=600) as client:
        prefixes = [await text_of(client, replica_url, model,
                                  prompt_ids(4 * 10**6 + k, args.prefix_len))
                    for k in range(args.prefixes)]
        for i, k in enumerate(order):
            suffix = await text_of(client, replica_url, model,
                                   prompt_ids(5 * 10**6 + i, args.suffix_len))
            queue.put_nowait(prefixes[k] + " " + suffix)
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(args.concurrency)))
        wall = time.perf_counter() - started
    ok = [r for r in records if r.ok]
    ttfts = sorted(r.ttft for r in ok if r.ttft is not None)
    return {"requests": len(records), "failed": len(records) - len(ok), "wall_s": wall,
            "tok_s": sum(r.tokens for r in ok) / wall,
            "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))]}


async def prefix_hits(urls: list[str]) -> dict:
    hits = queries = 0.0
    async with http_client(timeout=30) as client:
        for url in urls:
            series = await scrape(client, url, parse_series)
            hits += series_total(series, "loom:prefix_cache_hits_total") or 0.0
            queries += series_total(series, "loom:prefix_cache_queries_total") or 0.0
    return {"prefix_cache_hit_rate": hits / queries if queries else None}


def replica_args(args, kv_memory: int, threads: int) -> list[str]:
    return ["--kv-cache-memory", str(kv_memory), "--num-threads", str(threads), "--no-speech",
            "--max-model-len", str(args.max_model_len), *args.serve_args.split()]


def measure_setup(setup: str, args) -> dict:
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    logs = os.path.join(RESULTS_DIR, "router")
    os.makedirs(logs, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if setup == "single":
            server = stack.enter_context(LoomServer(
                None, args.model, replica_args(args, args.kv_cache_memory, len(cores)),
                os.path.join(logs, "single.log")))
            urls, entry = [server.base_url], server.base_url
        else:
            groups = [cores[:half], cores[half:] or cores[:half]]
            servers = [stack.enter_context(LoomServer(
                None, args.model, replica_args(args, args.kv_cache_memory // 2, len(group)),
                os.path.join(logs, f"{setup}-{i}.log"), cpus=",".join(map(str, group))))
                for i, group in enumerate(groups)]
            urls = [s.base_url for s in servers]
            router = stack.enter_context(Router(urls, setup, os.path.join(logs, f"{setup}.log")))
            entry = router.base_url
        model = served_model(urls[0])
        result = asyncio.run(run_load(entry, urls[0], model, args))
        result.update(asyncio.run(prefix_hits(urls)))
    return {"setup": setup, **result}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    p.add_argument("--model", default=None, help="loom serve --model (default: its default)")
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=768)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--kv-cache-memory", type=int, default=320 << 20,
                   help="bytes of KV cache in all (each replica of a pair gets half)")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="each replica's (its KV cache must hold one such sequence)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", help="more loom serve flags for every replica")
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "router.json"))
    args = p.parse_args()
    results = []
    for setup in args.setups:
        log(f"router bench: {setup} ...")
        results.append(measure_setup(setup, args))
        r = results[-1]
        hit = r["prefix_cache_hit_rate"]
        print(f"{setup:12s} TTFT p50 {r['ttft_p50_ms']:7.0f} ms, p90 {r['ttft_p90_ms']:7.0f} ms, "
              f"{r['tok_s']:6.1f} tok/s, prefix-cache hits "
              f"{'-' if hit is None else f'{100 * hit:.0f}%'}, {r['failed']} failed", flush=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
