"""`python -m bench.run`: ceiling, server load and baseline, then one table and a JSON file.

Examples:
  python -m bench.run                                  # everything, defaults (P=256, N=128)
  python -m bench.run --prompt-len 64 --output-len 16 --concurrency 1 4    # a quick check
  python -m bench.run --url http://127.0.0.1:8000 --skip-ceiling --skip-baseline
  python -m bench.run --peer-url http://127.0.0.1:8100 --peer-name vllm   # loom and a peer

Next to the JSON file it writes a plot of the levels (bench/plot.py; needs matplotlib, the
`bench` extra): tokens/s and ITL p50 against concurrency, one line per server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import sys
import time

from bench import REPO_DIR, RESULTS_DIR, log, sigterm_as_interrupt
from bench.clean_runs import CleanRuns
from bench.endpoint import NotLoopbackError, loopback_base_url, served_model
from bench.environment import busy_warning, describe_environment
from bench.interference import InterferenceMonitor
from bench.plot import write_plot
from bench.prompts import run_seed
from bench.report import render, write_json


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens P")
    p.add_argument("--prompt-seed", type=int, default=None,
                   help="the served load's prompts (default: a fresh seed per run, so a server "
                        "kept up between runs meets no prompt it has cached; the JSON records it)")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens N")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32],
                   help="load levels; also the ceiling's batch sizes")
    p.add_argument("--skip-ceiling", action="store_true")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--skip-server", action="store_true")
    p.add_argument("--url", default=None,
                   help="drive this OpenAI-compatible server (127.0.0.1 only) instead of "
                        "starting loom")
    p.add_argument("--model", default=None,
                   help="model name sent in requests; default: the first of GET /v1/models")
    p.add_argument("--peer-url", default=None,
                   help="also drive this OpenAI-compatible server (127.0.0.1 only, already "
                        "running, same checkpoint) at the same levels, after loom")
    p.add_argument("--peer-name", default="peer", help="the peer's label in the report")
    p.add_argument("--peer-model", default=None,
                   help="model name for the peer; default: the first of its GET /v1/models")
    p.add_argument("--model-dir", default=None,
                   help="checkpoint for the ceiling, the baseline and loom; default: the "
                        "converted SmolLM2-135M-Instruct")
    p.add_argument("--serve-args", default="", help='extra `loom serve` flags, e.g. '
                   '"--max-num-batched-tokens 1024"')
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="ceiling's prefill chunk; default: --max-num-batched-tokens of "
                        "--serve-args, else 512 (loom's default)")
    p.add_argument("--requests-per-client", type=int, default=2,
                   help="each level sends max(this x concurrency, 4) requests")
    p.add_argument("--level-timeout", type=float, default=600.0,
                   help="seconds after which a level sends no new request")
    p.add_argument("--ttft-pairs", type=int, default=16,
                   help="after the load levels, this many c=1 TTFTs each paired with the "
                        "ceiling's prefill of the same prompt (0: none)")
    p.add_argument("--baseline-batch", type=int, default=16)
    p.add_argument("--baseline-requests", type=int, default=3)
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="before each measurement, wait up to this long for other processes to "
                        "leave the CPUs alone")
    p.add_argument("--retries", type=int, default=2,
                   help="measure a ceiling batch, load level or baseline run again (up to this "
                        "many times) when other processes used the CPU meanwhile")
    p.add_argument("--out", default=None, help="JSON path; default bench/results/<time>.json "
                   "(the plot goes beside it, as .png)")
    return p


def chunk_tokens(args) -> int:
    if args.chunk_tokens:
        return args.chunk_tokens
    flags = shlex.split(args.serve_args)
    for i, flag in enumerate(flags):
        if flag == "--max-num-batched-tokens" and i + 1 < len(flags):
            return int(flags[i + 1])
        if flag.startswith("--max-num-batched-tokens="):
            return int(flag.split("=", 1)[1])
    return 512


def resolve_model_dir(args) -> str:
    if args.model_dir:
        return os.path.abspath(os.path.expanduser(args.model_dir))
    from pipelines.checkpoint.default_model import ensure_default_model

    return ensure_default_model()


def load_ceiling(args, model_dir: str, clean: CleanRuns):
    from bench.ceiling import Ceiling, CeilingConfig

    return Ceiling(CeilingConfig(
        model_dir=model_dir, dtype=args.dtype, prompt_len=args.prompt_len,
        output_len=args.output_len, batch_sizes=list(dict.fromkeys(args.concurrency)),
        chunk_tokens=chunk_tokens(args),
    ), log=log, clean=clean)


def measure_remaining(ceiling) -> dict:
    if ceiling.record["prefill_one"] is None:
        ceiling.measure_prefill_one()
    for batch in ceiling.unmeasured():
        ceiling.measure_batch(batch)
    return ceiling.record


def run_baseline_phase(args, model_dir: str, clean: CleanRuns) -> dict:
    from bench.baseline import BaselineConfig, run_baseline

    return run_baseline(BaselineConfig(
        model_dir=model_dir, dtype=args.dtype, prompt_len=args.prompt_len,
        output_len=args.output_len, sequential_requests=args.baseline_requests,
        batch_size=args.baseline_batch,
    ), log=log, clean=clean)


def run_server_phase(args, model_dir: str | None, log_path: str, record: dict,
                     clean: CleanRuns, ceiling=None) -> dict:
    """Drive --url if given, else a loom we start (and always stop) ourselves. Fills `record`
    as it goes, so an interrupted run still reports the levels it finished. With `ceiling`,
    its batch B is measured right before and right after the level at concurrency B (loom
    idle meanwhile)."""
    if args.url:
        record.update(url=loopback_base_url(args.url), started_by_bench=False)
        count_as_work(record["url"], clean)
        drive(args, record, clean, args.model, before_level=_ceiling_batch(ceiling),
              after_level=ceiling.bracket_batch if ceiling is not None else None)
        measure_pairs(args, record, clean, ceiling)
        return record
    from bench.server import LoomServer

    extra = shlex.split(args.serve_args)
    # loom gets --model only when one was asked for, so its own default path is what is timed.
    loom_model = model_dir if args.model_dir else None
    log(f"server: starting loom serve (log: {log_path})")
    with LoomServer(args.dtype, loom_model, extra, log_path) as server:
        record.update(url=server.base_url, started_by_bench=True, startup_s=server.startup_s,
                      command=server.command, log=log_path)
        log(f"server: healthy after {server.startup_s:.1f} s ({' '.join(server.command)})")
        record["settle_s"] = settle = server.wait_quiet()
        log(f"server: idle {settle:.1f} s later (start-up tail: voice, KV page faults)")

        def before_level(c: int) -> None:
            if ceiling is not None:
                server.wait_quiet()
                _ceiling_batch(ceiling)(c)

        def after_level(c: int) -> None:
            if ceiling is not None:
                server.wait_quiet()
                ceiling.bracket_batch(c)

        drive(args, record, clean, args.model, before_level=before_level,
              after_level=after_level)
        server.wait_quiet()
        measure_pairs(args, record, clean, ceiling)
    return record


def measure_pairs(args, record: dict, clean: CleanRuns, ceiling) -> None:
    """TTFT at c=1 next to the ceiling's prefill of the same prompts (see ttft_pairs.py)."""
    if ceiling is None or args.ttft_pairs <= 0:
        return
    from bench.ttft_pairs import measure_ttft_pairs

    record["ttft_pairs"] = pairs = clean.run("ttft pairs", lambda: measure_ttft_pairs(
        ceiling, record["url"], record["model"], args.prompt_len, args.ttft_pairs))
    if not pairs["pairs"]:
        log(f"server: no TTFT pair measured: {'; '.join(pairs['errors'])}")
        return
    log(f"server: c=1 TTFT - prefill of the same prompt, median of {pairs['pairs']} pairs: "
        f"{pairs['ttft_over_prefill_ms_p50']:+.1f} ms (TTFT p50 {pairs['ttft_ms_p50']:.1f} ms, "
        f"prefill p50 {pairs['prefill_ms_p50']:.1f} ms)")


def _ceiling_batch(ceiling):
    if ceiling is None:
        return None
    def measure(c: int) -> None:
        if ceiling.record["prefill_one"] is None:  # next to the first level, too
            ceiling.measure_prefill_one()
        if c in ceiling.unmeasured():
            ceiling.measure_batch(c)

    return measure


def count_as_work(url: str, clean: CleanRuns) -> int | None:
    """The process serving `url` (one we did not start: a peer, or --url), whose CPU from now
    on is the work measured, not interference; its pid, when it can be found."""
    from urllib.parse import urlsplit

    from bench.procs import listening_pid

    pid = listening_pid(urlsplit(url).port or 80)
    if pid is not None and clean.monitor is not None:
        clean.monitor.count_as_ours(pid)
    return pid


def run_peer_phase(args, record: dict, clean: CleanRuns) -> dict:
    record.update(url=loopback_base_url(args.peer_url), name=args.peer_name)
    pid = count_as_work(record["url"], clean)
    log(f"{args.peer_name}: driving {record['url']} (pid {pid})")
    drive(args, record, clean, args.peer_model, label=args.peer_name)
    return record


def drive(args, record: dict, clean: CleanRuns, model: str | None, label: str = "server",
          before_level=None, after_level=None) -> None:
    from bench.load import LoadConfig, run_load

    base_url = record["url"]
    record["model"] = model = model or served_model(base_url)
    cfg = LoadConfig(base_url=base_url, model=model, prompt_len=args.prompt_len,
                     output_len=args.output_len, concurrency=args.concurrency,
                     requests_per_client=args.requests_per_client,
                     level_timeout=args.level_timeout, prompt_seed=args.prompt_seed)
    record["levels"] = {}
    asyncio.run(run_load(cfg, record["levels"], log=log, clean=clean, label=label,
                         before_level=before_level, after_level=after_level))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prompt_seed is None:
        args.prompt_seed = run_seed()
    if args.prompt_len < 1 or args.output_len < 2 or min(args.concurrency) < 1:
        # One output token would leave no decode step to time, nor any inter-token latency.
        parser.error("--prompt-len must be >= 1, --output-len >= 2, --concurrency values >= 1")
    for url in (args.url, args.peer_url):
        if not url:
            continue
        try:
            loopback_base_url(url)
        except NotLoopbackError as exc:
            print(f"bench: error: {exc}", file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)  # the `with LoomServer` stops loom
    out = args.out or os.path.join(RESULTS_DIR, time.strftime("%Y%m%d-%H%M%S") + ".json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    env = describe_environment(REPO_DIR)
    if warning := busy_warning(env):
        log(warning)
    results = {"config": _config(args), "environment": env}
    status = 0
    with InterferenceMonitor() as monitor:
        try:
            _run_phases(args, results, os.path.splitext(out)[0] + ".server.log", monitor)
        except KeyboardInterrupt:
            log("bench: interrupted; reporting what was measured")
            results["interrupted"] = True
            status = 130
    results["interference"] = monitor.summary()
    results["config"]["model_name"] = _model_name(results)
    print(render(results), flush=True)
    write_json(results, out)
    log(f"bench: wrote {out}")
    write_plot(results, os.path.splitext(out)[0] + ".png")
    return status or (1 if results.get("errors") else 0)


def _run_phases(args, results: dict, server_log: str, monitor: InterferenceMonitor) -> None:
    needs_dir = not (args.skip_ceiling and args.skip_baseline and (args.skip_server or args.url))
    model_dir = resolve_model_dir(args) if needs_dir else None
    results["config"]["model_dir"] = model_dir
    if not args.skip_server:
        results["server"] = {}  # filled level by level
    if args.peer_url:
        results["peer"] = {}
    clean = CleanRuns(monitor, retries=args.retries, wait_idle=args.wait_idle, log=log)
    # The ceiling's model stays loaded through the server phase: each batch size is measured
    # just before the load level it is compared with (see Ceiling).
    ceiling = None

    def load_the_ceiling() -> dict:
        nonlocal ceiling
        ceiling = load_ceiling(args, model_dir, clean)
        if args.skip_server:
            measure_remaining(ceiling)
            ceiling.close()
        return ceiling.record

    def server() -> dict:
        try:
            return run_server_phase(args, model_dir, server_log, results["server"], clean,
                                    ceiling)
        finally:
            if ceiling is not None and ceiling.loop is not None:
                # what a failed server left unmeasured; then the model's memory is freed
                monitor.mark("ceiling")
                _run_phase(results, "ceiling", lambda: measure_remaining(ceiling))
                ceiling.close()

    phases = [
        ("ceiling", args.skip_ceiling, load_the_ceiling),
        ("server", args.skip_server, server),
        ("peer", not args.peer_url, lambda: run_peer_phase(args, results["peer"], clean)),
        ("baseline", args.skip_baseline, lambda: run_baseline_phase(args, model_dir, clean)),
    ]
    for name, skip, phase in phases:
        if skip:
            continue
        clean.settle()  # so that loading and start-up are measured on a quiet machine too
        monitor.mark(name)
        _run_phase(results, name, phase)
    monitor.mark("done")


def _run_phase(results: dict, name: str, phase) -> None:
    """A failing phase is reported and the others still run: a server that will not start
    should not throw away the ceiling measured before it."""
    try:
        results[name] = phase()
    except Exception as exc:
        log(f"bench: {name} failed: {type(exc).__name__}: {exc}")
        results.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"


def _config(args) -> dict:
    return {"dtype": args.dtype, "prompt_len": args.prompt_len, "output_len": args.output_len,
            "concurrency": args.concurrency, "url": args.url, "serve_args": args.serve_args,
            "chunk_tokens": chunk_tokens(args), "requests_per_client": args.requests_per_client,
            "level_timeout_s": args.level_timeout, "baseline_batch": args.baseline_batch,
            "baseline_requests": args.baseline_requests, "wait_idle_s": args.wait_idle,
            "retries": args.retries, "ttft_pairs": args.ttft_pairs, "peer_url": args.peer_url,
            "peer_name": args.peer_name, "prompt_seed": args.prompt_seed}


def _model_name(results: dict) -> str:
    served = (results.get("server") or {}).get("model")
    model_dir = results["config"].get("model_dir")
    return served or (os.path.basename(model_dir.rstrip("/")) if model_dir else "?")


if __name__ == "__main__":
    sys.exit(main())
