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

    def mark(self, phase: str) -> None:
        self.phase = phase

    def _loop(self) -> None:
        root = os.getpid()
        before, then = _read_procs(), time.monotonic()
        while not self._stop.wait(self.interval):
            after, now = _read_procs(), time.monotonic()
            ticks = sum(t - before.get(pid, (0, 0))[1] for pid, (_, t) in after.items()
                        if not _ours(pid, after, root))
            self.samples.setdefault(self.phase, []).append(ticks / TICKS / (now - then))
            before, then = after, now

    def summary(self) -> dict:
        return {phase: {"foreign_cpu_cores_mean": sum(s) / len(s),
                        "foreign_cpu_cores_max": max(s), "samples": len(s)}
                for phase, s in self.samples.items() if s}


def tainted_phases(summary: dict) -> list[str]:
    return [p for p, s in summary.items()
            if p != "setup" and s["foreign_cpu_cores_mean"] > WARN_CORES]


def wait_until_idle(timeout: float, log, threshold: float = 0.15) -> bool:
    """Before a phase: wait (up to `timeout` s) for the machine to be quiet; True if it is."""
    deadline = time.monotonic() + timeout
    while True:
        busy = cpu_busy_share(1.0)
        if busy is None or busy < threshold:
            return True
        if time.monotonic() >= deadline:
            log(f"bench: CPUs still {busy:.0%} busy after waiting {timeout:.0f}s; going on")
            return False
        log(f"bench: CPUs {busy:.0%} busy with something else; waiting")
        time.sleep(4.0)
