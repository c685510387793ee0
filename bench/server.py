"""Starting and stopping `loom serve` as a subprocess, for the load test.

The server is always stopped, whatever happens in between: SIGTERM first (loom shuts its
worker and scheduler down in order), SIGKILL if it lingers, and a final SIGKILL to the
process group we created in case a child outlived it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from bench.endpoint import wait_healthy
from bench.procs import TICKS, in_tree, read_procs


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def loom_command(port: int, dtype: str | None, model_dir: str | None, extra: list[str]) -> list[str]:
    # The console script next to this interpreter is the `loom` a user runs; fall back to the
    # module when the package was not installed with its scripts.
    script = os.path.join(os.path.dirname(sys.executable), "loom")
    base = [script] if os.access(script, os.X_OK) else [sys.executable, "-m", "api_server.cli"]
    cmd = base + ["serve", "--host", "127.0.0.1", "--port", str(port)]
    if dtype:  # None: the model's own weights (the default model's GGUF blocks)
        cmd += ["--dtype", dtype]
    if model_dir:
        cmd += ["--model", model_dir]
    return cmd + extra


class LoomServer:
    """`with LoomServer(...) as server:` starts loom, waits for /health, stops it on exit."""

    def __init__(self, dtype: str | None, model_dir: str | None, extra_args: list[str], log_path: str,
                 startup_timeout: float = 300.0, stop_timeout: float = 20.0,
                 cpus: str | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = loom_command(self.port, dtype, model_dir, extra_args)
        if cpus is not None:  # a replica on its share of the cores (taskset's list syntax)
            self.command = ["taskset", "-c", cpus] + self.command
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.process: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def __enter__(self) -> "LoomServer":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        log = open(self.log_path, "wb")
        started = time.monotonic()
        # A session of its own: a Ctrl-C in the terminal reaches only us, and we stop the
        # server in order instead of it dying mid-way.
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        healthy_at = wait_healthy(self.base_url, self.startup_timeout,
                                  alive=lambda: self.process.poll() is None)
        self.startup_s = healthy_at - started

    def cpu_seconds(self) -> float:
        """CPU time used so far by loom and its children (scheduler, worker)."""
        procs = read_procs()
        roots = {self.process.pid}
        ours = (ticks for pid, (_, ticks) in procs.items() if in_tree(pid, procs, roots))
        return sum(ours) / TICKS

    def wait_quiet(self, timeout: float = 60.0, window: float = 0.5,
                   max_cores: float = 0.05) -> float:
        """Wait until loom has been idle for a `window` (its start-up tail: the voice loading
        in the background, the worker faulting KV pages in while idle); seconds waited.
        What loom does at start-up is not what a load level or the ceiling should share
        the CPUs with."""
        started = time.monotonic()
        before = self.cpu_seconds()
        while time.monotonic() - started < timeout:
            time.sleep(window)
            now = self.cpu_seconds()
            if now - before <= max_cores * window:
                break
            before = now
        return time.monotonic() - started

    def stop(self) -> int | None:
        return stop_session(self.process, self.stop_timeout)


def stop_session(proc: subprocess.Popen | None, timeout: float) -> int | None:
    """SIGTERM, SIGKILL after `timeout`, then SIGKILL to the session the process leads (it was
    started with start_new_session): stragglers only. Returns its exit code."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return proc.returncode
