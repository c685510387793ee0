"""`python -m bench.structured`: the cost of constrained decoding.

The same load twice at one concurrency: requests whose output must match a JSON schema, then
unconstrained requests, request i generating exactly as many tokens as constrained request i
did (ignore_eos), so both loads have the same schedule and only the constraint differs.
Reports output tokens/s of both and their ratio (the target is >= 0.95), the median over
--repeats alternating runs. Starts loom unless --url names a loopback server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from bench import RESULTS_DIR
from bench.endpoint import http_client, loopback_base_url, served_model
from bench.prompts import prompt_ids
from bench.server import LoomServer

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 24},
                 "minItems": 12, "maxItems": 12},
        "kind": {"enum": ["book", "film", "game"]},
    },
    "required": ["title", "rating", "tags", "kind"],
    "additionalProperties": False,
}


async def run_level(base_url, model, concurrency, requests, body_for) -> dict:
    tokens, queue = [0] * requests, asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)

    async def client_loop(client):
        while not queue.empty():
            i = queue.get_nowait()
            r = await client.post(base_url + "/v1/completions", json=body_for(i))
            r.raise_for_status()
            tokens[i] = r.json()["usage"]["completion_tokens"]

    async with http_client(timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return {"requests": requests, "tokens": sum(tokens), "wall_s": wall,
            "tok_s": sum(tokens) / wall, "mean_tokens": sum(tokens) / len(tokens),
            "lengths": tokens}


def measure(base_url: str, concurrency: int, requests: int, prompt_len: int,
            repeats: int) -> dict:
    model = served_model(base_url)
    prompt = lambda i: prompt_ids(5 * 10**6 + i, prompt_len)  # noqa: E731

    def constrained(i, offset=0):
        return {"model": model, "prompt": prompt(offset + i), "max_tokens": 400, "temperature": 1.0,
                "seed": i, "response_format": {"type": "json_schema", "json_schema": {
                    "name": "item", "schema": SCHEMA}}}

    runs = []
    for k in range(repeats):
        # Fresh prompts for every load, so that neither finds its prompts in the prefix cache.
        structured = asyncio.run(run_level(base_url, model, concurrency, requests,
                                           lambda i, k=k: constrained(i, 2 * k * requests)))
        lengths = structured["lengths"]

        def plain(i, lengths=lengths, offset=(2 * k + 1) * requests):
            return {"model": model, "prompt": prompt(offset + i), "max_tokens": lengths[i],
                    "temperature": 1.0, "seed": i, "ignore_eos": True}

        unconstrained = asyncio.run(run_level(base_url, model, concurrency, requests, plain))
        runs.append({"structured": structured, "unconstrained": unconstrained,
                     "ratio": structured["tok_s"] / unconstrained["tok_s"]})
        print(f"  structured {structured['tok_s']:.1f} tok/s, unconstrained "
              f"{unconstrained['tok_s']:.1f} tok/s, ratio {runs[-1]['ratio']:.3f}", flush=True)
    median = sorted(runs, key=lambda r: r["ratio"])[len(runs) // 2]
    return {"concurrency": concurrency, **median, "ratios": [r["ratio"] for r in runs]}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--url", default=None)
    p.add_argument("--serve-args", default="")
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "structured.json"))
    args = p.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if args.url:
        result = measure(loopback_base_url(args.url), args.concurrency, args.requests,
                         args.prompt_len, args.repeats)
    else:
        log = os.path.splitext(args.out)[0] + ".server.log"
        with LoomServer(args.dtype, None, args.serve_args.split(), log) as server:
            result = measure(server.base_url, args.concurrency, args.requests, args.prompt_len,
                             args.repeats)
    s, u = result["structured"], result["unconstrained"]
    print(f"c={result['concurrency']}: structured {s['tok_s']:.1f} tok/s "
          f"({s['mean_tokens']:.0f} tokens/request), unconstrained {u['tok_s']:.1f} tok/s, "
          f"ratio {result['ratio']:.2f} (median of {len(result['ratios'])})")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
