"""Which cores each Loom process runs on.

The worker's threads do the math; the API and scheduler processes wake up once per step for a
millisecond or two. Unplaced, Linux wakes them on the core of the thread that woke them (the
worker's main thread, which just sent a result) and preempts it: the next forward pass then
waits for them (the worker sat idle between a third of its steps). Placed, the
worker's OpenMP threads are bound one per core, and the API and scheduler run on the cores the
worker does not use, or, when it uses them all, on every core but the one of the worker's main
thread: they take time from a helper thread, whose share of a parallel loop the main thread
takes over (the GEMM kernel hands out work dynamically).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
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
        # GNU OpenMP's spin before sleeping stays at its default. A short one (GOMP_SPINCOUNT
        # 10,000) freed the cores sooner after a step, but the forward passes paid for it:
        # the threads slept through the gaps between a step's parallel loops. Measured at
        # c=1, 2 alternated runs each: ITL / the plain loop's one-token forward 1.05, 1.05
        # with the default vs 1.13, 1.00; TTFT minus the worker's forward 4.1-4.4 vs
        # 4.3-6.8 ms; a bf16 prefill 1-10% slower with it.

    def enter_service(self) -> None:
        """In the API or scheduler process (after the worker has been started), before it
        starts threads (they inherit both settings)."""
        os.sched_setaffinity(0, self.service)
        shorten_time_slice()


# What the API and scheduler ask for: they run ~0.1-0.5 ms per wake-up.
SERVICE_SLICE_NS = 100_000


class _SchedAttr(ctypes.Structure):
    """struct sched_attr (SCHED_ATTR_SIZE_VER0) of sched_setattr(2)."""

    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32),
                ("sched_flags", ctypes.c_uint64), ("sched_nice", ctypes.c_int32),
                ("sched_priority", ctypes.c_uint32), ("sched_runtime", ctypes.c_uint64),
                ("sched_deadline", ctypes.c_uint64), ("sched_period", ctypes.c_uint64)]


_SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}


def shorten_time_slice(slice_ns: int = SERVICE_SLICE_NS) -> bool:
    """Ask Linux's EEVDF scheduler for a short time slice for this thread (and the threads it
    starts later); False where that is not possible.

    With the worker's threads on every core, each wake-up of the API, the scheduler or a
    ZeroMQ I/O thread has to take a core from one of them, and EEVDF lets a running thread
    finish its slice (milliseconds) before a woken thread of the same slice gets the core; one
    with a shorter slice gets it at once (Linux 6.12+): TTFT at c=1 comes closer to the
    prefill forward, throughput is unchanged (docs/performance.md, "The CPU model path"). The
    nice value, and so the CPU share, stay as they are.
    """
    number = _SYS_SCHED_SETATTR.get(platform.machine())
    if number is None or not sys.platform.startswith("linux"):
        return False
    attr = _SchedAttr(size=ctypes.sizeof(_SchedAttr), sched_policy=0,  # SCHED_OTHER
                      sched_nice=os.getpriority(os.PRIO_PROCESS, 0), sched_runtime=slice_ns)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(number, 0, ctypes.byref(attr), 0) == 0
    except (OSError, AttributeError):
        return False


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


@contextmanager
def short_time_slice():
    """The calling thread, and the threads it starts inside, run with the short slice; on
    leaving, the calling thread has the default slice again (its threads keep theirs)."""
    if not shorten_time_slice():
        yield
        return
    try:
        yield
    finally:
        shorten_time_slice(0)  # 0: the default slice again
