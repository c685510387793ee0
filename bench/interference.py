"""Other processes' CPU use while we measure: on a 2-core machine one concurrent test run
makes every number several times worse, so each phase records how much CPU was taken by
processes outside the benchmark's own tree (this process, loom and loom's children)."""

from __future__ import annotations

import os
import threading
import time

from bench.environment import cpu_busy_share

TICKS = os.sysconf("SC_CLK_TCK")
WARN_CORES = 0.1  # foreign CPU above this (in cores, averaged over a phase) taints it


def _read_procs() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, utime + stime in clock ticks), for every process we can read."""
    procs = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        procs[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return procs


def _ours(pid: int, procs: dict, root: int) -> bool:
    while pid > 1 and pid in procs:
        if pid == root:
            return True
        pid = procs[pid][0]
    return False


class InterferenceMonitor:
    """A background thread sampling foreign CPU use, attributed to the phase set by mark()."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self.phase = "setup"
        self.samples: dict[str, list[float]] = {}
        self.latest: float | None = None  # foreign cores in the last interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="interference", daemon=True)

    def __enter__(self) -> "InterferenceMonitor":
        if os.path.isdir("/proc"):
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def mark(self, phase: str) -> None:
        self.phase = phase

    def _loop(self) -> None:
        root = os.getpid()
        before, then = _read_procs(), time.monotonic()
        while not self._stop.wait(self.interval):
            after, now = _read_procs(), time.monotonic()
            ticks = sum(t - before.get(pid, (0, 0))[1] for pid, (_, t) in after.items()
                        if not _ours(pid, after, root))
            self.latest = ticks / TICKS / (now - then)
            self.samples.setdefault(self.phase, []).append(self.latest)
            before, then = after, now

    def summary(self) -> dict:
        return {phase: {"foreign_cpu_cores_mean": sum(s) / len(s),
                        "foreign_cpu_cores_max": max(s), "samples": len(s)}
                for phase, s in self.samples.items() if s}


UNMEASURED = {"setup", "waiting", "done"}


def tainted_phases(summary: dict) -> list[str]:
    return [p for p, s in summary.items()
            if p not in UNMEASURED and s["foreign_cpu_cores_mean"] > WARN_CORES]


def wait_until_idle(timeout: float, log, monitor: InterferenceMonitor | None = None,
                    threshold: float = 0.1, quiet_for: int = 3) -> bool:
    """Before a phase: wait (up to `timeout` s) until other processes have used less than
    `threshold` cores for `quiet_for` seconds in a row; True if they did. Our own processes
    (an idle loom between levels) do not count when the monitor is running."""
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < quiet_for:
        if monitor is not None and monitor.running:
            time.sleep(monitor.interval)
            busy = monitor.latest or 0.0
        else:
            busy = (cpu_busy_share(1.0) or 0.0) * (os.cpu_count() or 1)
        quiet = quiet + 1 if busy < threshold else 0
        if time.monotonic() >= deadline:
            log(f"bench: other processes still use {busy:.1f} cores after {timeout:.0f}s; going on")
            return False
        if busy >= threshold and int(time.monotonic()) % 10 == 0:
            log(f"bench: other processes use {busy:.1f} cores; waiting")
    return True
