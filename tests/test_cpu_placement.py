"""Which cores the worker, API and scheduler processes get."""

import os
import threading

import pytest

from processes.cpu_placement import SERVICE_SLICE_NS, CpuPlacement, short_time_slice


@pytest.mark.parametrize("cpus,threads,worker,service", [
    ([0, 1], 2, (0, 1), (1,)),  # the worker owns every core: services avoid its main thread's
    ([0, 1], 1, (0,), (1,)),
    (list(range(8)), 8, tuple(range(8)), tuple(range(1, 8))),
    (list(range(8)), 4, (0, 1, 2, 3), (4, 5, 6, 7)),  # spare cores go to the services
    ([2, 5, 7], 16, (2, 5, 7), (5, 7)),  # a cpuset: its own core numbers, threads capped
])
def test_plan(monkeypatch, cpus, threads, worker, service):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cpus))
    assert CpuPlacement.plan(threads) == CpuPlacement(worker, service)


def test_one_core_is_not_placed(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert CpuPlacement.plan(1) is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: nothing to place")
def test_served_processes_keep_off_the_worker_main_thread(tiny_server):
    srv = tiny_server
    first = min(os.sched_getaffinity(0))
    api = srv.proc.pid
    children = [int(p) for p in open(f"/proc/{api}/task/{api}/children").read().split()]
    affinities = {pid: os.sched_getaffinity(pid) for pid in [api] + children}
    assert first not in affinities[api]
    # The worker's main thread is bound to the first core, the scheduler is not on it.
    assert any(a == {first} for a in affinities.values())
    assert sum(first not in a for a in affinities.values()) >= 2  # API and scheduler
    if slice_of(api, api) is not None and _slices_supported():
        # The API and scheduler wake up on a short slice; the worker's math keeps the
        # default one (a short slice there would hand the cores to the services sooner
        # still, and cost the forward pass more preemptions).
        main_slices = sorted(slice_of(pid, pid) for pid in [api] + children)
        assert main_slices.count(SERVICE_SLICE_NS) == 2
        assert main_slices[-1] > SERVICE_SLICE_NS


def slice_of(pid: int, tid: int) -> int | None:
    """The thread's EEVDF time slice in ns, where the kernel reports it."""
    try:
        with open(f"/proc/{pid}/task/{tid}/sched") as f:
            for line in f:
                if line.startswith("se.slice"):
                    return int(line.split(":")[1])
    except OSError:
        pass
    return None


def _slices_supported() -> bool:
    seen = []

    def look():
        seen.append(slice_of(os.getpid(), threading.get_native_id()))

    with short_time_slice():
        thread = threading.Thread(target=look)
        thread.start()
        thread.join()
    return seen == [SERVICE_SLICE_NS]


def test_short_time_slice_reaches_new_threads_only():
    me = threading.get_native_id()
    before = slice_of(os.getpid(), me)
    if before is None or not _slices_supported():
        pytest.skip("this kernel has no per-thread time slices (Linux 6.12+)")
    assert before > SERVICE_SLICE_NS
    assert slice_of(os.getpid(), me) == before  # the caller got its own slice back
