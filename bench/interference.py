"""Other processes' CPU use while we measure.

On a 2-core machine one concurrent test run makes every number several times worse, so the
benchmark accounts for the CPU time of every process outside its own tree (this process,
loom and loom's children, and a peer server it drives), per phase and per measured unit (see
clean_runs.py).
"""

from __future__ import annotations

import os
import threading
import time

from bench.environment import cpu_busy_share
from bench.procs import TICKS, in_tree, read_procs

WARN_CORES = 0.1  # foreign CPU above this (in cores, averaged over a measurement) taints it


class InterferenceMonitor:
    """Accumulates foreign CPU-seconds, sampled by a background thread every `interval` and
    on demand (sample()), attributed to the phase named by mark()."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self.phase = "setup"
        self.phases: dict[str, dict] = {}
        self.total_cpu_s = 0.0  # foreign CPU-seconds since start
        self.latest: float | None = None  # foreign cores over the last full interval
        self.enabled = os.path.isdir("/proc")
        self._lock = threading.Lock()
        self._procs: dict | None = None
        self._then = 0.0
        self._roots = {os.getpid()}  # process trees whose CPU is ours
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="interference", daemon=True)

    def __enter__(self) -> "InterferenceMonitor":
        if self.enabled:
            self.sample()
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def count_as_ours(self, pid: int) -> None:
        """From now on the tree of `pid` (a peer server under test) is not interference."""
        with self._lock:
            self._roots.add(pid)

    def mark(self, phase: str) -> None:
        self.sample()  # close the previous phase's books at the boundary
        self.phase = phase

    def sample(self) -> float:
        """Brings the books up to now; returns the foreign CPU-seconds so far."""
        if not self.enabled:
            return 0.0
        with self._lock:
            procs, now = read_procs(), time.monotonic()
            if self._procs is not None:
                ticks = sum(t - self._procs.get(pid, (0, 0))[1] for pid, (_, t) in procs.items()
                            if not in_tree(pid, procs, self._roots))
                self._book(ticks / TICKS, now - self._then)
            self._procs, self._then = procs, now
            return self.total_cpu_s

    def _book(self, cpu_s: float, wall_s: float) -> None:
        self.total_cpu_s += cpu_s
        phase = self.phases.setdefault(self.phase, {"cpu_s": 0.0, "wall_s": 0.0, "max_cores": 0.0})
        phase["cpu_s"] += cpu_s
        phase["wall_s"] += wall_s
        if wall_s >= 0.5 * self.interval:  # short on-demand slices are too noisy for a max
            self.latest = cpu_s / wall_s
            phase["max_cores"] = max(phase["max_cores"], self.latest)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def summary(self) -> dict:
        return {name: {"foreign_cpu_cores_mean": p["cpu_s"] / p["wall_s"],
                       "foreign_cpu_cores_max": p["max_cores"], "seconds": p["wall_s"]}
                for name, p in self.phases.items() if p["wall_s"] > 0}

    def overall(self) -> dict:
        """The same figures over all phases together."""
        wall = sum(p["wall_s"] for p in self.phases.values())
        return {"foreign_cpu_cores_mean": self.total_cpu_s / wall if wall else None,
                "foreign_cpu_cores_max": max((p["max_cores"] for p in self.phases.values()),
                                             default=0.0),
                "seconds": wall}


def wait_until_idle(timeout: float, log, monitor: InterferenceMonitor | None = None,
                    threshold: float = WARN_CORES, quiet_for: int = 5) -> bool:
    """Wait (up to `timeout` s) until other processes have used less than `threshold` cores
    for `quiet_for` seconds in a row; True if they did. Our own processes (an idle loom
    between levels) do not count when the monitor is running."""
    deadline = time.monotonic() + timeout
    quiet = 0
    last_log = 0.0
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
        if busy >= threshold and time.monotonic() - last_log > 30:
            log(f"bench: other processes use {busy:.1f} cores; waiting")
            last_log = time.monotonic()
    return True
