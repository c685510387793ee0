"""Which cores each Loom process runs on.

The worker's threads do the math; the API and scheduler processes wake up once per step for a
millisecond or two. Unplaced, Linux wakes them on the core of the thread that woke them (the
worker's main thread, which just sent a result) and preempts it: the next forward pass then
waits for them (measured: the worker idle ~0.8 ms between a third of its steps). Placed, the
worker's OpenMP threads are bound one per core, and the API and scheduler run on the cores the
worker does not use, or, when it uses them all, on every core but the one of the worker's main
thread: they take time from a helper thread, whose share of a parallel loop the main thread
takes over (the GEMM kernel hands out work dynamically).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

# In the worker: all its cores. OpenMP binds the main thread to the first one as torch loads,
# and threads inherit their creator's binding, so thread pools the worker starts besides
# OpenMP's (ZeroMQ's, llguidance's, onnxruntime's) are started under `worker_threads()`.
_worker_cores: tuple[int, ...] | None = None


@dataclass(frozen=True)
class CpuPlacement:
    worker: tuple[int, ...]  # one core per worker thread, the main thread's first
    service: tuple[int, ...]  # API and scheduler processes

    @classmethod
    def plan(cls, worker_threads: int) -> "CpuPlacement | None":
        """None when there is nothing to place (one core, or affinity not supported)."""
        try:
            cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return None
        if len(cpus) < 2:
            return None
        worker = tuple(cpus[: max(1, min(worker_threads, len(cpus)))])
        service = tuple(cpus[len(worker):]) or tuple(cpus[1:])
        return cls(worker, service)

    def enter_worker(self) -> None:
        """In the worker, before OpenMP starts (before torch is imported): bind its threads."""
        global _worker_cores
        _worker_cores = self.worker
        os.sched_setaffinity(0, self.worker)
        os.environ["OMP_PLACES"] = ",".join(f"{{{cpu}}}" for cpu in self.worker)
        os.environ["OMP_PROC_BIND"] = "close"

    def enter_service(self) -> None:
        """In the API or scheduler process (after the worker has been started)."""
        os.sched_setaffinity(0, self.service)


@contextmanager
def worker_threads():
    """Threads started inside may run on all of the worker's cores, not only its main
    thread's."""
    if _worker_cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, _worker_cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
