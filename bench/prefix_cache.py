"""`python -m bench.prefix_cache`: time to first token with and without a prefix-cache hit.

Pairs of requests share a 1,024-token prefix and differ in a short suffix; the first of a pair
prefills everything, the second finds the prefix's KV blocks cached. Reports TTFT of both
(median over pairs) and their ratio. Starts loom unless --url names a loopback server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics

from bench import RESULTS_DIR
from bench.endpoint import http_client, loopback_base_url, served_model
from bench.prompts import prompt_ids
from bench.server import LoomServer
from bench.sse import RequestRecord, completion_body, stream_completion


async def measure(base_url: str, model: str, prefix_len: int, suffix_len: int, pairs: int,
                  output_len: int) -> dict:
    first, second = [], []
    async with http_client(timeout=300) as client:
        warm = RequestRecord(prompt_tokens=64)
        await stream_completion(client, base_url, completion_body(model, prompt_ids(10**6, 64), 2),
                                warm)
        for pair in range(pairs):
            prefix = prompt_ids(2 * 10**6 + pair, prefix_len)
            for k, bucket in enumerate((first, second)):
                ids = prefix + prompt_ids(3 * 10**6 + 2 * pair + k, suffix_len)
                record = RequestRecord(prompt_tokens=len(ids))
                await stream_completion(client, base_url,
                                        completion_body(model, ids, output_len), record)
                if record.error:
                    raise RuntimeError(record.error)
                bucket.append(record.ttft)
    cold, warm_ttft = statistics.median(first), statistics.median(second)
    return {"prefix_len": prefix_len, "suffix_len": suffix_len, "pairs": pairs,
            "ttft_cold_ms": 1000 * cold, "ttft_cached_ms": 1000 * warm_ttft,
            "speedup": cold / warm_ttft}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--url", default=None)
    p.add_argument("--serve-args", default="")
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "prefix_cache.json"))
    args = p.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def run(base_url: str) -> dict:
        return asyncio.run(measure(base_url, served_model(base_url), args.prefix_len,
                                   args.suffix_len, args.pairs, args.output_len))

    if args.url:
        result = run(loopback_base_url(args.url))
    else:
        log = os.path.splitext(args.out)[0] + ".server.log"
        with LoomServer(args.dtype, None, args.serve_args.split(), log) as server:
            result = run(server.base_url)
    print(f"prefix {result['prefix_len']} + suffix {result['suffix_len']} tokens, "
          f"{result['pairs']} pairs: TTFT cold {result['ttft_cold_ms']:.1f} ms, "
          f"cached {result['ttft_cached_ms']:.1f} ms, speedup {result['speedup']:.1f}x")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
