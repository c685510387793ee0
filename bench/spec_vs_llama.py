"""`python -m bench.spec_vs_llama`: speculative decoding at c=1 against llama.cpp's own.

The copy-heavy chat prompts of `bench.spec_decode` (repeat prose, rename a variable in code,
fix typos), greedy, one at a time, sent alternately to loom with n-gram/suffix speculation and
to llama-server with each of its n-gram speculation types (`--spec-type ngram-simple`,
`ngram-map-k`, `ngram-mod`, `ngram-cache`; each at its own defaults) and without speculation,
on the same GGUF file, each server alone on the machine while it answers. Every server is
started once and kept warm; the rounds rotate the order. Reports output tokens/s (completion
tokens over the request's wall time, the prompt's prefill included, as a user waits for it;
median over rounds and prompts) and the acceptance each reports, and loom's best over
llama-server's best.

llama-server: build it as docs/performance.md says and pass --binary (or have it on PATH).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import httpx

from bench import RESULTS_DIR
from bench.endpoint import served_model
from bench.llama_server import LlamaServer, default_binary, default_gguf
from bench.server import LoomServer
from bench.spec_decode import passages

LLAMA_SPEC_TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")


def ask(client: httpx.Client, base_url: str, model: str, task: str, passage: str,
        max_tokens: int) -> dict:
    body = {"model": model, "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"{task}\n\n{passage}"}]}
    started = time.perf_counter()
    r = client.post(f"{base_url}/v1/chat/completions", json=body)
    r.raise_for_status()
    seconds = time.perf_counter() - started
    answer = r.json()
    tokens = answer["usage"]["completion_tokens"]
    spec = answer["usage"].get("speculative_decoding") or {}
    timings = answer.get("timings") or {}  # (llama-server's)
    draft = spec.get("num_draft_tokens", timings.get("draft_n", 0))
    accepted = spec.get("num_accepted_tokens", timings.get("draft_n_accepted", 0))
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "draft": draft, "accepted": accepted}


def summarise(runs: list[dict]) -> dict:
    draft = sum(r["draft"] for r in runs)
    accepted = sum(r["accepted"] for r in runs)
    return {"tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in runs),
            "tokens_per_s_each": [round(r["tokens_per_s"], 2) for r in runs],
            "completion_tokens": [r["tokens"] for r in runs],
            "draft_tokens": draft, "accepted_tokens": accepted,
            "acceptance_rate": accepted / draft if draft else None}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.spec_vs_llama", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", default=default_binary())
    p.add_argument("--gguf", default=None, help="default: the default model's GGUF file")
    p.add_argument("--loom-methods", default="ngram,suffix")
    p.add_argument("--llama-spec-types", default=",".join(LLAMA_SPEC_TYPES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "spec_vs_llama.json"))
    args = p.parse_args()
    if not args.binary:
        p.error("no llama-server: pass --binary")
    gguf = args.gguf or default_gguf()
    stem = os.path.splitext(args.out)[0]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    servers = {}
    try:
        for method in args.loom_methods.split(","):
            servers[f"loom {method}"] = LoomServer(
                None, gguf, ["--speculative-method", method], f"{stem}.loom-{method}.log")
        for port, kind in enumerate(args.llama_spec_types.split(","), start=8110):
            extra = [] if kind == "none" else ["--spec-type", kind]
            servers[f"llama-server {kind}"] = LlamaServer(
                args.binary, gguf, port=port, parallel=1, ctx_size=4096, extra_args=extra,
                log_path=f"{stem}.llama-{kind}.log", die_with_parent=True)
        for server in servers.values():
            server.__enter__()
        runs: dict[str, list[dict]] = {name: [] for name in servers}
        names = list(servers)
        with httpx.Client(trust_env=False, timeout=600) as client:
            models = {name: served_model(s.base_url) for name, s in servers.items()}
            for name in names:  # (warm)
                ask(client, servers[name].base_url, models[name], "Say hi.", "", 8)
            for rnd in range(args.rounds):
                order = names[rnd % len(names):] + names[:rnd % len(names)]
                for task, passage in passages():
                    for name in order:
                        runs[name].append(ask(client, servers[name].base_url, models[name],
                                              task, passage, args.max_tokens))
    finally:
        for server in servers.values():
            server.stop()
    result = {name: summarise(r) for name, r in runs.items()}
    best = {side: max((n for n in result if n.startswith(side)),
                      key=lambda n: result[n]["tokens_per_s_median"])
            for side in ("loom", "llama-server")}
    result["best"] = best
    result["loom_over_llama_server"] = (result[best["loom"]]["tokens_per_s_median"]
                                        / result[best["llama-server"]]["tokens_per_s_median"])
    result["command"] = {name: getattr(s, "command", None) for name, s in servers.items()}
    for name in names:
        r = result[name]
        rate = r["acceptance_rate"]
        print(f"{name:>26}: {r['tokens_per_s_median']:6.1f} tokens/s, acceptance "
              f"{'-' if rate is None else f'{rate:.2f}'} ({r['accepted_tokens']}/"
              f"{r['draft_tokens']}), tokens {r['completion_tokens']}")
    print(f"best: {best['loom']} / {best['llama-server']} = "
          f"{result['loom_over_llama_server']:.2f}x")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
