"""`loom bench --url URL`: the standard streaming load against a running server (and,
optionally, a peer at the same levels), as a table on the terminal, a JSON file and two PNG
plots: throughput and ITL against concurrency (bench/plot.py), and the TTFT and ITL
distributions of every level (bench/plot.py's `distribution`).

It drives servers on this machine only (127.0.0.1 / ::1; see bench/endpoint.py). The fuller
harness, with the model's own ceiling and Hugging Face's baseline beside the server, is
`python -m bench.run` in a checkout. Plots need matplotlib (the `bench` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time


def build_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("bench", help="benchmark a running server: table, JSON and plots",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    b.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    b.add_argument("--api-key", default=None,
                   help="the server's --api-key (default: $OPENAI_API_KEY)")
    b.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per request")
    b.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    b.add_argument("--prompt-seed", type=int, default=None,
                   help="the prompts' seed (default: a fresh one per run, so a server kept up "
                        "between runs meets no prompt it has cached; the JSON records it)")
    b.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32],
                   help="load levels: streaming clients at once")
    b.add_argument("--requests-per-client", type=int, default=2,
                   help="each level sends max(this x concurrency, 4) requests")
    b.add_argument("--level-timeout", type=float, default=600.0,
                   help="seconds after which a level sends no new request")
    b.add_argument("--peer-url", default=None,
                   help="also drive this server (same model) at the same levels, after URL")
    b.add_argument("--peer-name", default="peer", help="the peer's label")
    b.add_argument("--peer-model", default=None)
    b.add_argument("--out", default="bench-results",
                   help="directory for <time>.json, <time>.png and <time>-latency.png")
    return b


def main(args) -> int:
    try:
        import httpx  # noqa: F401
    except ImportError:
        print("loom bench: error: needs httpx (pip install 'loom-serve[bench]')", file=sys.stderr)
        return 1
    from bench.endpoint import NotLoopbackError, loopback_base_url, served_model

    if args.api_key:  # (read by every request the harness makes: bench/endpoint.py)
        os.environ["OPENAI_API_KEY"] = args.api_key

    if min(args.concurrency) < 1 or args.prompt_len < 1 or args.output_len < 1:
        print("loom bench: error: --concurrency, --prompt-len and --output-len must be positive",
              file=sys.stderr)
        return 1
    if args.prompt_seed is None:
        from bench.prompts import run_seed
        args.prompt_seed = run_seed()
    results = {"config": {"prompt_len": args.prompt_len, "output_len": args.output_len,
                          "concurrency": args.concurrency,
                          "requests_per_client": args.requests_per_client,
                          "peer_name": args.peer_name, "prompt_seed": args.prompt_seed},
               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        runs = [("server", args.url, args.model)]
        if args.peer_url:
            runs.append(("peer", args.peer_url, args.peer_model))
        for key, url, model in runs:
            base = loopback_base_url(url)
            model = model or served_model(base)
            label = "loom" if key == "server" else args.peer_name
            print(f"loom bench: {label} at {base} ({model}): levels {args.concurrency}",
                  file=sys.stderr, flush=True)
            results[key] = asyncio.run(drive(args, base, model, label))
            results[key].update(url=base, model=model, name=label)
    except (NotLoopbackError, RuntimeError, OSError) as exc:
        print(f"loom bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("loom bench: interrupted", file=sys.stderr)
        return 130
    results["config"]["model_name"] = results["server"]["model"]
    print(table(results))
    write_outputs(results, args.out)
    return 0


async def drive(args, base_url: str, model: str, label: str) -> dict:
    """Every level's summary (bench/load.py's) and its raw TTFT and ITL samples."""
    import httpx

    from bench.endpoint import http_client
    from bench.load import LoadConfig, _warm_up, requests_for, run_level, summarize_level
    from bench.prompts import PromptSource

    cfg = LoadConfig(base_url=base_url, model=model, prompt_len=args.prompt_len,
                     output_len=args.output_len, concurrency=args.concurrency,
                     requests_per_client=args.requests_per_client,
                     level_timeout=args.level_timeout, prompt_seed=args.prompt_seed)
    prompts = PromptSource(cfg.prompt_len, seed=cfg.prompt_seed)
    levels, samples = {}, {}
    limits = httpx.Limits(max_connections=max(cfg.concurrency) + 4)
    async with http_client(limits=limits, timeout=httpx.Timeout(cfg.level_timeout + cfg.grace,
                                                                connect=10.0)) as client:
        await _warm_up(client, cfg, prompts)  # one-time costs of the first step, not counted
        for c in cfg.concurrency:
            records, wall = await run_level(client, cfg, c, requests_for(cfg, c), prompts)
            levels[str(c)] = summary = summarize_level(c, records, wall)
            ok = [r for r in records if r.ok]
            samples[str(c)] = {"ttft_s": [r.ttft for r in ok if r.ttft is not None],
                               "itl_s": [gap for r in ok for gap in r.inter_chunk]}
            print(f"  {label} c={c}: {row(summary)[1]} tok/s, {summary['failed']} failed",
                  file=sys.stderr, flush=True)
    return {"levels": levels, "samples": samples}


COLUMNS = ("server", "c", "tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
           "ITL p99 ms", "E2E p50 ms", "ok", "failed")


def row(level: dict) -> list[str]:
    """A level's cells after the server's name, as printed (the test reads them back)."""
    def ms(key):
        value = level.get(key)
        return "-" if value is None else f"{value * 1e3:.1f}"

    def rate(key, digits):
        value = level.get(key)
        return "-" if value is None else f"{value:.{digits}f}"

    return [str(level["concurrency"]), rate("output_tok_s", 1), rate("requests_s", 2),
            ms("ttft_p50_s"), ms("ttft_p99_s"), ms("itl_p50_s"), ms("itl_p99_s"),
            ms("e2e_p50_s"), str(level["completed"]), str(level["failed"])]


def table(results: dict) -> str:
    rows = [list(COLUMNS)]
    for key in ("server", "peer"):
        record = results.get(key)
        if not record:
            continue
        for level in sorted(record["levels"].values(), key=lambda lv: lv["concurrency"]):
            rows.append([record["name"], *row(level)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_outputs(results: dict, out_dir: str) -> None:
    from bench.plot import write_distribution_plot, write_plot

    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, time.strftime("%Y%m%d-%H%M%S"))
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    print(f"loom bench: wrote {stem}.json", file=sys.stderr)
    write_plot(results, stem + ".png")
    write_distribution_plot(results, stem + "-latency.png")
