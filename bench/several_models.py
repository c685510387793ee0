"""The default GGUF (SmolLM2-135M-Instruct) and Gemma 3 270M from one server (issue 32).

    python -m bench.several_models [--json PATH]

One `loom serve --model smollm2=... --model gemma3=gemma-3-270m --model-idle-timeout S`:
- each model's load time at start (loom:model_load_duration_seconds);
- greedy answers to requests to both models at once, each equal to the same model's answer
  from a single-model server (started after, one at a time, its start time recorded);
- the processes' resident memory with both loaded, and after both unloaded on idle;
- the first request to a model not loaded: time to its first token, load included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time

import httpx

from bench.proc_memory import descendants, status_kb
from bench.server import LoomServer

PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "def fibonacci(n):"]
MAX_TOKENS = 16
IDLE_TIMEOUT = 10.0


def models() -> dict[str, str]:
    from pipelines.checkpoint.default_model import find_gguf, gemma3_gguf

    return {"smollm2": find_gguf(), "gemma3": gemma3_gguf()}


async def answers(url: str, jobs: list[tuple[str, str]]) -> list[str]:
    """Each prompt to every model at once: the models run side by side, each on a batch of
    one (a batch's composition can move a quantized model's near-ties)."""
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(model, prompt):
            r = await client.post(url + "/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
            r.raise_for_status()
            return r.json()["choices"][0]["text"]

        texts = []
        for prompt in PROMPTS:
            models = [m for m, p in jobs if p == prompt]
            texts += await asyncio.gather(*(one(m, prompt) for m in models))
        return texts


def metric_sum(url: str, name: str) -> dict[str, float]:
    out = {}
    for m in re.finditer(rf'^{re.escape(name)}\{{model_name="([^"]+)"\}} (\S+)$',
                         httpx.get(url + "/metrics").text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def rss_mib(root: int) -> float:
    return sum(status_kb(pid).get("VmRSS", 0) for pid in [root, *descendants(root)]) / 1024


def first_token_seconds(url: str, model: str) -> float:
    started = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", timeout=300, json={
            "model": model, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.monotonic() - started
    raise RuntimeError("no token")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    paths = models()
    log = os.path.join(tempfile.gettempdir(), "loom-bench-several-models.log")
    specs = [arg for name, path in paths.items() for arg in ("--model", f"{name}={path}")]
    jobs = [(m, p) for p in PROMPTS for m in paths]
    result: dict = {}
    with LoomServer(None, None, specs + ["--model-idle-timeout", str(IDLE_TIMEOUT),
                                         "--no-speech"], log) as server:
        url = server.base_url
        result["startup_s"] = round(server.startup_s, 2)
        result["load_s_at_start"] = metric_sum(url, "loom:model_load_duration_seconds_sum")
        together = asyncio.run(answers(url, jobs))
        result["rss_mib_both_loaded"] = round(rss_mib(server.process.pid))
        deadline = time.monotonic() + IDLE_TIMEOUT + 60
        while any(c["loaded"] for c in httpx.get(url + "/v1/models").json()["data"]):
            if time.monotonic() > deadline:
                raise RuntimeError("the models did not unload on idle")
            time.sleep(0.5)
        time.sleep(1.0)  # (the children reaped)
        result["rss_mib_both_unloaded"] = round(rss_mib(server.process.pid))
        result["first_token_s_not_loaded"] = {m: round(first_token_seconds(url, m), 2)
                                              for m in paths}
    alone = {}
    for name, path in paths.items():
        with LoomServer(None, None, ["--model", path, "--served-model-name", name,
                                     "--no-speech"], log) as server:
            alone[name] = asyncio.run(answers(server.base_url,
                                              [(name, p) for p in PROMPTS]))
            result.setdefault("single_model_server_startup_s", {})[name] = \
                round(server.startup_s, 2)
    mismatches = [{"model": m, "prompt": p, "together": text, "alone": alone[m][PROMPTS.index(p)]}
                  for (m, p), text in zip(jobs, together) if text != alone[m][PROMPTS.index(p)]]
    result["answers_equal_single_model_servers"] = not mismatches
    result["mismatches"] = mismatches
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
