"""`python -m bench.spec_decode`: speculative decoding on a copy-heavy load at c=1.

Chat requests that repeat, correct or edit a 300-600-token passage (prose, a code file) or
extract fields from it as JSON, and an agent's turn (a tools list, the calls it made with JSON
arguments and their results; asked to make them again for another file),
one at a time, greedy, on one server started with `--speculative-method` (ngram by default): each prompt is
sent with speculation and with the `speculative_decoding: false` opt-out, alternately, so
both are measured in the same run on the same warm server. Reports output tokens/s (median
of the repeats) of each, the acceptance (from the usage extension), and the worker's mean
time per step: one-token decode steps of the opt-out requests, and steps with more than one
token per sequence (the verify steps, and the prompts' prefills, one per request). Starts
loom (the default GGUF model) unless --url names a loopback server started with speculation.

`--method draft --draft-model PATH` proposes with a draft model; `--draft-layers N` makes one
instead: the first N layers of the default checkpoint (SmolLM2-135M-Instruct, float32) with its
final norm and tied head, no training (no smaller SmolLM2 ships in a package here).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

import httpx

from bench import RESULTS_DIR
from bench.endpoint import loopback_base_url, served_model
from bench.server import LoomServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def truncated_checkpoint(source: str, num_layers: int, target: str) -> str:
    """`source`'s first `num_layers` layers, its final norm and head, as a checkpoint
    directory with its tokenizer (made once)."""
    import shutil

    from safetensors.torch import load_file, save_file

    if os.path.isfile(os.path.join(target, "model.safetensors")):
        return target
    os.makedirs(target, exist_ok=True)
    weights = load_file(os.path.join(source, "model.safetensors"))
    kept = {name: tensor for name, tensor in weights.items()
            if not name.startswith("model.layers.")
            or int(name.split(".")[2]) < num_layers}
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = num_layers
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(config, f)
    for name in os.listdir(source):
        if name.startswith("tokenizer") or name in ("chat_template.jinja",
                                                     "generation_config.json"):
            shutil.copy(os.path.join(source, name), target)
    save_file(kept, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    return target


def prose(path: str, chars: int = 1800) -> str:
    """The first paragraphs of running text of a Markdown file (no headings, code, tables or
    lists): what a user asks a model to copy or edit."""
    with open(path) as f:
        paragraphs = [p.strip() for p in f.read().split("\n\n")]
    text = " ".join(p.replace("\n", " ") for p in paragraphs
                    if p and p[0] not in "#|`-<>*!" and "```" not in p)
    return text[:chars]


def passages() -> list[tuple[str, str]]:
    """(task, passage): prose to repeat and to correct, code to edit and to extract fields
    from as JSON, 300-600 tokens each."""
    text = prose(os.path.join(ROOT, "docs", "architecture.md"))
    with open(os.path.join(ROOT, "scheduler", "block_manager.py")) as f:
        code = f.read()[:1800]
    return [("Repeat the following text exactly, word for word:", text),
            ("Rewrite this Python code with the variable `table` renamed to `row`; change "
             "nothing else:", code),
            ("Copy this text and fix its typos:", text.replace("the ", "teh ", 6)),
            ("List every function and method defined in this code as a JSON array of objects "
             'with the keys "name" and "arguments" (the parameter list exactly as written):',
             code)]


TOOLS = """You are a coding agent working in a Python repository. You act by calling tools: \
answer with tool calls only, one JSON object per line, {"tool": NAME, "arguments": {...}}.
Tools:
- read_file(path: string, start_line: integer, end_line: integer): the lines of a file.
- search(query: string, path: string, max_results: integer): lines that contain the query, \
as path:line: text."""


def agent_turns() -> list[dict]:
    """An agent's conversation (~700 tokens): the tools, the calls it made with their results
    (this repository's own lines), then the same calls asked for another file: what the
    answer repeats is the earlier calls' JSON with other arguments. (SmolLM2-135M answers a
    multi-turn transcript's last question with a sentence, not calls: the transcript is
    given in one message, as a log to redo.)"""
    def call(tool: str, **arguments) -> str:
        return json.dumps({"tool": tool, "arguments": arguments})

    path = "scheduler/block_manager.py"
    with open(os.path.join(ROOT, path)) as f:
        source = f.readlines()
    found = [f"{path}:{i}: {text.strip()}" for i, text in enumerate(source, 1)
             if "def " in text][:5]
    log = []
    for start in (1, 13, 25):
        log += [call("read_file", path=path, start_line=start, end_line=start + 11),
                "Result:\n" + "".join(source[start - 1:start + 11]).rstrip()]
    log = [call("search", query="def ", path=path, max_results=5),
           "Result:\n" + "\n".join(found)] + log
    calls = "\n".join(line for line in log if not line.startswith("Result:"))
    other = "worker/kv_cache.py"
    return [
        {"role": "system", "content": TOOLS},
        {"role": "user", "content": "Your tool calls so far, with their results:\n\n"
                                    + "\n".join(log) + f"\n\nMake the same tool calls for "
                                    f"{other} instead of {path}, in the same order, one per "
                                    "line; change nothing else."
                                    f"\n\nThe calls were:\n{calls}"},
    ]


def workloads() -> list[tuple[str, list[dict]]]:
    """(name, chat messages) of each task: the passages' and the agent's."""
    tasks = [(task, [{"role": "user", "content": f"{task}\n\n{passage}"}])
             for task, passage in passages()]
    return tasks + [("Agent: the same tool calls (JSON) for another file",
                     agent_turns())]


def complete(client: httpx.Client, base_url: str, model: str, messages: list[dict],
             max_tokens: int, speculate: bool) -> dict:
    """One streamed request: its whole time, and its time after the first token (speculation
    changes only the decode; the prefill of a prompt seen before is a prefix-cache hit, so a
    task's first request pays it and the second does not)."""
    body = {"model": model, "temperature": 0, "max_tokens": max_tokens,
            "messages": messages, "speculative_decoding": speculate, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = usage = None
    with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            usage = chunk.get("usage") or usage
            if first is None and any(c.get("delta", {}).get("content")
                                     for c in chunk.get("choices", [])):
                first = time.perf_counter()
    elapsed = time.perf_counter() - started
    spec = usage.get("speculative_decoding", {})
    return {"seconds": elapsed, "decode_seconds": elapsed - ((first or started) - started),
            "tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"],
            "draft": spec.get("num_draft_tokens", 0),
            "accepted": spec.get("num_accepted_tokens", 0)}


def decode_rate(run: dict) -> float:
    """Tokens per second after the first one (the decode speed a reader of a stream sees;
    NaN for an answer of one token, which has no decode to time)."""
    if run["tokens"] < 2 or run["decode_seconds"] <= 0:
        return float("nan")
    return (run["tokens"] - 1) / run["decode_seconds"]


def forward_times(client: httpx.Client, base_url: str) -> dict[str, tuple[float, float]]:
    """loom:model_forward_time_seconds' (sum, count) by step kind."""
    text = client.get(f"{base_url}/metrics").text
    out = {}
    for step in ("prefill", "decode"):
        sums = re.findall(r'loom:model_forward_time_seconds_sum\{[^}]*step="%s"[^}]*\}\s+(\S+)'
                          % step, text)
        counts = re.findall(r'loom:model_forward_time_seconds_count\{[^}]*step="%s"[^}]*\}'
                            r'\s+(\S+)' % step, text)
        out[step] = (sum(map(float, sums)), sum(map(float, counts)))
    return out


def mean_step_ms(before: dict, after: dict, step: str) -> float | None:
    seconds = after[step][0] - before[step][0]
    count = after[step][1] - before[step][1]
    return 1000 * seconds / count if count else None


def measure(base_url: str, model: str, repeats: int, max_tokens: int) -> dict:
    runs: dict[bool, list[dict]] = {True: [], False: []}
    with httpx.Client(trust_env=False, timeout=600) as client:
        tasks = workloads()
        for speculate in (True, False):  # (warm: both paths, and the server's idle work)
            complete(client, base_url, model, tasks[1][1], 32, speculate)
        step_ms = {True: {"prefill": [0.0, 0.0], "decode": [0.0, 0.0]},
                   False: {"prefill": [0.0, 0.0], "decode": [0.0, 0.0]}}
        for _ in range(repeats):
            for _, messages in tasks:
                for speculate in (True, False):
                    before = forward_times(client, base_url)
                    runs[speculate].append(complete(client, base_url, model, messages,
                                                    max_tokens, speculate))
                    after = forward_times(client, base_url)
                    for kind in ("prefill", "decode"):
                        step_ms[speculate][kind][0] += after[kind][0] - before[kind][0]
                        step_ms[speculate][kind][1] += after[kind][1] - before[kind][1]
    result = {}
    for speculate, name in ((True, "speculative"), (False, "plain")):
        rates = [r["tokens"] / r["seconds"] for r in runs[speculate]]
        decode_rates = [decode_rate(r) for r in runs[speculate]]
        draft = sum(r["draft"] for r in runs[speculate])
        accepted = sum(r["accepted"] for r in runs[speculate])
        means = {kind: (1000 * s / n if n else None)
                 for kind, (s, n) in step_ms[speculate].items()}
        result[name] = {
            "tokens_per_s_median": statistics.median(rates),
            "tokens_per_s_each": rates,
            "decode_tokens_per_s_median": statistics.median(decode_rates),
            "completion_tokens": [r["tokens"] for r in runs[speculate]],
            "prompt_tokens": [r["prompt_tokens"] for r in runs[speculate]],
            "draft_tokens": draft, "accepted_tokens": accepted,
            "acceptance_rate": accepted / draft if draft else None,
            "step_ms_multi_token": means["prefill"], "step_ms_one_token": means["decode"],
            "steps_multi_token": step_ms[speculate]["prefill"][1],
            "steps_one_token": step_ms[speculate]["decode"][1],
        }
    result["speedup"] = (result["speculative"]["tokens_per_s_median"]
                         / result["plain"]["tokens_per_s_median"])
    result["decode_speedup"] = (result["speculative"]["decode_tokens_per_s_median"]
                                / result["plain"]["decode_tokens_per_s_median"])
    tasks = [task for task, _ in workloads()]
    result["by_task"] = []
    for i, task in enumerate(tasks):
        mine = {flag: runs[flag][i::len(tasks)] for flag in (True, False)}
        draft = sum(r["draft"] for r in mine[True])
        accepted = sum(r["accepted"] for r in mine[True])
        rates = {flag: statistics.median(r["tokens"] / r["seconds"] for r in mine[flag])
                 for flag in (True, False)}
        result["by_task"].append({
            "task": task, "completion_tokens": [r["tokens"] for r in mine[True]],
            "speculative_tokens_per_s": rates[True], "plain_tokens_per_s": rates[False],
            "speedup": rates[True] / rates[False],
            # round 1: the prompt never seen before; later rounds: the same prompt again
            "speedup_by_round": [a["tokens"] / a["seconds"] / (b["tokens"] / b["seconds"])
                                 for a, b in zip(mine[True], mine[False])],
            # after the first token: the same prefill cost excluded from both (in round 1
            # the speculative request pays the prompt's prefill, the plain one hits the cache)
            "decode_speedup_by_round": [decode_rate(a) / decode_rate(b)
                                        for a, b in zip(mine[True], mine[False])],
            "acceptance_rate": accepted / draft if draft else None})
    return result


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.spec_decode", description=__doc__)
    p.add_argument("--method", default="ngram", choices=("ngram", "suffix", "draft"))
    p.add_argument("--draft-model", default=None, help="draft: its checkpoint or GGUF file")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="draft: the first N layers of the default checkpoint")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--url", default=None)
    p.add_argument("--serve-args", default="")
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "spec_decode.json"))
    args = p.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def run(base_url: str) -> dict:
        return measure(base_url, served_model(base_url), args.repeats, args.max_tokens)

    if args.url:
        result = run(loopback_base_url(args.url))
    else:
        log = os.path.splitext(args.out)[0] + ".server.log"
        serve = ["--speculative-method", args.method, *args.serve_args.split()]
        if args.method == "draft":
            serve += ["--draft-model-path", draft_model(args)]
        with LoomServer(None, None, serve, log) as server:
            result = run(server.base_url)
    result["method"] = args.method
    if args.method == "draft":
        result["draft_model"] = args.draft_model or f"first {args.draft_layers} layers"
    for name in ("speculative", "plain"):
        r = result[name]
        print(f"{name:>12}: {r['tokens_per_s_median']:6.1f} tokens/s (median of "
              f"{len(r['tokens_per_s_each'])}), acceptance "
              f"{r['acceptance_rate'] if r['acceptance_rate'] is not None else '-'}, step ms: "
              f"one-token {r['step_ms_one_token']}, multi-token {r['step_ms_multi_token']} "
              f"({r['steps_one_token']:.0f} / {r['steps_multi_token']:.0f} steps)")
    for t in result["by_task"]:
        rate = t["acceptance_rate"]
        rounds = " / ".join(f"{x:.2f}x" for x in t["speedup_by_round"])
        decode = " / ".join(f"{x:.2f}x" for x in t["decode_speedup_by_round"])
        print(f"{t['speedup']:5.2f}x (by round {rounds}; after the first token {decode})  "
              f"{t['speculative_tokens_per_s']:6.1f} / "
              f"{t['plain_tokens_per_s']:6.1f} tokens/s, acceptance "
              f"{'-' if rate is None else f'{rate:.2f}'}, tokens {t['completion_tokens']}: "
              f"{t['task'][:50]}")
    print(f"speedup {result['speedup']:.2f}x, after the first token "
          f"{result['decode_speedup']:.2f}x ({args.method})")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


def draft_model(args: argparse.Namespace) -> str:
    if args.draft_model:
        return args.draft_model
    if not args.draft_layers:
        raise SystemExit("--method draft needs --draft-model or --draft-layers")
    from pipelines.checkpoint.cache_dirs import cache_root
    from pipelines.checkpoint.default_model import ensure_default_model

    target = os.path.join(cache_root(), "models", f"SmolLM2-135M-first-{args.draft_layers}")
    return truncated_checkpoint(ensure_default_model(), args.draft_layers, target)


if __name__ == "__main__":
    main()
