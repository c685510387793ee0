"""`python -m bench.soak`: a long mixed load, then a check that nothing leaked.

Sends --requests (default 10,000) mixed requests (see bench/soak_mix.py: completions and chat,
streamed or not, 5-1,000-token prompts, 1-200-token outputs, stop strings, temperatures 0 and
1 with seeds, ~10 % cancelled by the client mid-way) at a bounded concurrency, after a warm-up,
and reports:

- errors: requests that failed other than by their deliberate cancellation (target 0), by
  cause, and requests/s;
- leaked KV blocks: once the load has ended and the server is idle, loom:kv_cache_usage_perc
  must be back to 0 and loom:num_requests_running / _waiting too;
- the RSS of every loom process (the API server and its children, from /proc) after the
  warm-up and after the load, and its growth (target < 5 %).

The warm-up is --warmup mixed requests plus, when the server's log says how many KV blocks it
has, one pass of long max_tokens=1 prompts that hands every KV block out once: the KV cache is
a zero-filled mapping that becomes resident block by block, and without that pass the worker's
RSS would "grow" by the part of the cache the warm-up had not reached yet. The worker's RSS
outside that mapping is reported as well.

Bounded: no new request after --max-time seconds (warm-up included); requests still running
--grace seconds later are cancelled and reported as cut off; every request has a
--request-timeout. Traffic goes to 127.0.0.1 only.

Examples:
  python -m bench.soak --requests 300                 # a quick check
  python -m bench.soak                                # the full soak (10,000 requests)
  python -m bench.soak --url http://127.0.0.1:8000 --requests 2000 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from urllib.parse import urlsplit

from bench import REPO_DIR, RESULTS_DIR, log, sigterm_as_interrupt
from bench.endpoint import NotLoopbackError, loopback_base_url, served_model
from bench.environment import busy_warning, cpu_busy_share, describe_environment
from bench.interference import wait_until_idle
from bench.procs import listening_pid
from bench.soak_report import conclude, kv_info_from_log, passed, render
from bench.soak_run import Soak

# The soak in modules: soak_mix.py makes the requests, soak_load.py sends and checks them (a
# phase at a time), soak_run.py runs the phases and takes the readings, soak_report.py judges
# and prints; this one is the command line.


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=10_000, help="requests after the warm-up")
    p.add_argument("--warmup", type=int, default=200, help="mixed warm-up requests")
    p.add_argument("--no-kv-touch", action="store_true",
                   help="skip the warm-up pass that makes the whole KV cache resident")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    p.add_argument("--max-time", type=float, default=3600.0,
                   help="seconds (warm-up included) after which no new request is sent")
    p.add_argument("--grace", type=float, default=60.0,
                   help="seconds requests still running at --max-time get before being cut off")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds after which a request counts as failed (client timeout)")
    p.add_argument("--cancel-fraction", type=float, default=0.10,
                   help="share of requests the client abandons mid-way")
    p.add_argument("--seed", type=int, default=2024, help="seed of the request mix")
    p.add_argument("--idle-timeout", type=float, default=30.0,
                   help="seconds to wait for the server to report an empty KV cache and no "
                        "running or waiting request once the load has ended")
    p.add_argument("--sample-interval", type=float, default=30.0,
                   help="seconds between progress lines / timeline samples (metrics, RSS)")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="before starting, wait up to this long for other processes to leave "
                        "the CPUs alone (they are reported either way)")
    p.add_argument("--url", default=None,
                   help="drive this running server (127.0.0.1 only) instead of starting loom")
    p.add_argument("--server-pid", type=int, default=None,
                   help="with --url: the API server's pid, for RSS (default: whoever listens "
                        "on the port)")
    p.add_argument("--server-log", default=None,
                   help="with --url: the server's log, for its KV cache size and warnings")
    p.add_argument("--model", default=None,
                   help="model name sent in requests; default: the first of GET /v1/models")
    p.add_argument("--model-dir", default=None, help="checkpoint for loom serve --model")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--serve-args", default="", help='extra `loom serve` flags, e.g. '
                   '"--max-num-seqs 32"')
    p.add_argument("--out", default=None,
                   help="JSON path; default bench/results/soak-<timestamp>.json")
    return p


def _config(args) -> dict:
    return {k: getattr(args, k) for k in (
        "requests", "warmup", "no_kv_touch", "concurrency", "max_time", "grace",
        "request_timeout", "cancel_fraction", "seed", "idle_timeout", "wait_idle", "url",
        "model_dir", "dtype", "serve_args")}


def _git_dirty(repo: str) -> int | None:
    try:
        out = subprocess.run(["git", "status", "--porcelain"], check=False, cwd=repo,
                             capture_output=True, text=True, timeout=10)
        return len(out.stdout.splitlines())
    except (OSError, subprocess.TimeoutExpired):
        return None


def drive(args, results: dict, base_url: str, server_pid: int | None,
          log_path: str | None) -> None:
    results["url"] = base_url
    results["model"] = model = args.model or served_model(base_url)
    results["server_pid"] = server_pid
    results["kv_cache"] = kv_info = kv_info_from_log(log_path)
    if kv_info:
        log(f"soak: server KV cache: {kv_info['num_blocks']} blocks x {kv_info['block_size']} "
            f"tokens ({kv_info['kv_gib']} GiB)")
    elif not args.no_kv_touch:
        log("soak: the server's KV cache size is unknown (no log): no KV-touch pass; the "
            "worker's RSS outside the KV mapping is the number to watch")
    soak = Soak(args, base_url, model, server_pid, kv_info, results)
    asyncio.run(soak.run())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.warmup < 0:
        parser.error("--requests and --concurrency must be >= 1, --warmup >= 0")
    if args.url:
        try:
            base_url = loopback_base_url(args.url)
        except NotLoopbackError as exc:
            print(f"soak: error: {exc}", file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or os.path.join(RESULTS_DIR, f"soak-{stamp}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    log_path = os.path.splitext(out)[0] + ".server.log"
    env = describe_environment(REPO_DIR)
    env["git_dirty_files"] = _git_dirty(REPO_DIR)
    if warning := busy_warning(env):
        log(warning)
    results: dict = {"config": _config(args), "environment": env,
                     "started_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    started = time.monotonic()
    status = 0
    server_log = None
    try:
        if args.wait_idle:
            results["waited_for_idle"] = wait_until_idle(args.wait_idle, log)
            results["environment"]["cpu_busy_after_wait"] = cpu_busy_share()
        if args.url:
            port = urlsplit(base_url).port or 80
            pid = args.server_pid or listening_pid(port)
            if pid is None:
                log(f"soak: cannot find the process listening on port {port}: no RSS "
                    "(give --server-pid)")
            server_log = args.server_log
            results["started_by_soak"] = False
            drive(args, results, base_url, pid, server_log)
        else:
            from bench.server import LoomServer

            server_log = log_path
            log(f"soak: starting loom serve (log: {log_path})")
            with LoomServer(args.dtype, os.path.abspath(args.model_dir) if args.model_dir
                            else None, shlex.split(args.serve_args), log_path) as server:
                results.update(started_by_soak=True, startup_s=server.startup_s,
                               command=server.command, server_log=log_path)
                log(f"soak: healthy after {server.startup_s:.1f} s")
                try:
                    drive(args, results, server.base_url, server.process.pid, log_path)
                finally:
                    alive = server.process.poll() is None
                    results["server_alive_at_end"] = alive
                    if not alive:
                        log(f"soak: the server exited during the run (code "
                            f"{server.process.returncode})")
                stop_code = server.stop()
                results["server_exit_code"] = stop_code
    except KeyboardInterrupt:
        log("soak: interrupted; reporting what was measured")
        results["interrupted"] = True
        status = 130
    except Exception as exc:  # noqa: BLE001 - reported with what was measured so far
        log(f"soak: failed: {type(exc).__name__}: {exc}")
        results["failure"] = f"{type(exc).__name__}: {exc}"
        status = 1
    results["total_s"] = time.monotonic() - started
    verdicts = conclude(results, server_log)
    print(render(results), flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    log(f"soak: wrote {out}")
    return status or (0 if passed(verdicts) else 1)


if __name__ == "__main__":
    sys.exit(main())
