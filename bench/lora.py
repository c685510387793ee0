"""`python -m bench.lora`: decode tokens/s at c=16 with requests spread over 4 LoRA adapters,
against the base model alone, on one server (--enable-lora --max-num-loras 4).

The adapters are random PEFT-format adapters of the served model's shapes (rank 16, every
target projection), written to a temporary directory. Three phases, each `--requests`
requests at concurrency `--concurrency`, `--output-len` tokens each: all on the base model,
all on one adapter, round-robin over the four; `--rounds` rounds of the three in turn, so a
shared machine's load falls on all alike. tokens/s = completion tokens / wall time; each
phase's median over the rounds, its ratio against the base's median. Beside it, tokens per
CPU-second of the server's processes: what a phase costs, which other processes' share of
the cores does not move (their use of caches and memory bandwidth still does).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import tempfile
import time

import numpy as np

from bench import RESULTS_DIR
from bench.endpoint import http_client, served_model
from bench.prompts import prompt_ids
from bench.server import LoomServer
from bench.sse import RequestRecord, completion_body, stream_completion

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(target: str, config, rank: int, seed: int) -> str:
    """A random LoRA adapter in PEFT's files for a base of `config` (a ModelConfig)."""
    from safetensors.numpy import save_file

    from pipelines.lora import base_shapes

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (out_features, in_features) in base_shapes(config).items():
            where = "self_attn" if module in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{where}.{module}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(
                0, in_features ** -0.5, (rank, in_features)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(
                0, 0.01, (out_features, rank)).astype(np.float32)
    os.makedirs(target, exist_ok=True)
    save_file(tensors, os.path.join(target, "adapter_model.safetensors"))
    with open(os.path.join(target, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(TARGETS), "bias": "none"}, f)
    return target


async def phase(base_url: str, models: list[str], requests: int, concurrency: int,
                prompt_len: int, output_len: int, first_prompt: int, cpu_seconds) -> dict:
    """Prompts first_prompt.. onwards: prompts no earlier phase sent, so no phase finds its
    prompts in the prefix cache."""
    queue = list(range(first_prompt, first_prompt + requests))
    records: list[RequestRecord] = []

    async def client_loop(client):
        while queue:
            i = queue.pop()
            record = RequestRecord(prompt_tokens=prompt_len)
            await stream_completion(client, base_url, completion_body(
                models[i % len(models)], prompt_ids(i, prompt_len), output_len), record)
            records.append(record)

    async with http_client(timeout=600) as client:
        started, cpu = time.perf_counter(), cpu_seconds()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    errors = [r.error for r in records if r.error]
    if errors:
        raise RuntimeError(errors[0])
    tokens = sum(r.completion_tokens or 0 for r in records)
    return {"models": models, "requests": requests, "tokens": tokens, "seconds": wall,
            "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__)
    p.add_argument("--model", default=None, help="default: the default GGUF model")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--serve-args", default="")
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "lora.json"))
    args = p.parse_args()
    from pipelines.checkpoint.default_model import find_gguf
    from pipelines.checkpoint.model_config import load_model_config

    model_path = args.model or find_gguf()
    config = load_model_config(model_path)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with tempfile.TemporaryDirectory() as root:
        names = [f"adapter{i}" for i in range(4)]
        paths = [f"{name}={write_adapter(os.path.join(root, name), config, args.rank, i)}"
                 for i, name in enumerate(names)]
        serve_args = ["--enable-lora", "--max-num-loras", "4", "--max-lora-rank",
                      str(args.rank), "--lora-paths", *paths, *args.serve_args.split()]
        log = os.path.splitext(args.out)[0] + ".server.log"
        with LoomServer(None, args.model, serve_args, log) as server:
            base = served_model(server.base_url)

            first_prompts = itertools.count(0, args.requests)

            def run(models):
                return asyncio.run(phase(server.base_url, models, args.requests,
                                         args.concurrency, args.prompt_len, args.output_len,
                                         next(first_prompts), server.cpu_seconds))

            run([base])  # (warm-up: kernels, first allocations)
            phases = {"base": [base], "one_adapter": names[:1], "four_adapters": names}
            rounds = [{name: run(models) for name, models in phases.items()}
                      for _ in range(args.rounds)]
    results = {name: {key: [r[name][key] for r in rounds]
                      for key in ("tokens_per_s", "tokens_per_cpu_s")} for name in phases}
    print(f"load average {os.getloadavg()[0]:.1f}; per round, median, against the base's "
          f"median")
    for key in ("tokens_per_s", "tokens_per_cpu_s"):
        base = float(np.median(results["base"][key]))
        for name, result in results.items():
            median = float(np.median(result[key]))
            result[f"{key}_median"], result[f"{key}_vs_base"] = median, median / base
            per_round = ", ".join(f"{t:.1f}" for t in result[key])
            print(f"{key:16s} {name:14s} {per_round:24s} {median:7.1f}  {median / base:.2f}x")
    with open(args.out, "w") as f:
        json.dump({"concurrency": args.concurrency, "rank": args.rank,
                   "prompt_len": args.prompt_len, "output_len": args.output_len,
                   "load_average": os.getloadavg(), **results}, f, indent=2)


if __name__ == "__main__":
    main()
