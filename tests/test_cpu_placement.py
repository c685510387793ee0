"""Which cores the worker, API and scheduler processes get."""

import os

import pytest

from pipelines.cpu_placement import CpuPlacement
from tests.helpers import start_server


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
def test_served_processes_keep_off_the_worker_main_thread(tiny_model_dir):
    srv = start_server(tiny_model_dir)
    try:
        first = min(os.sched_getaffinity(0))
        api = srv.proc.pid
        children = [int(p) for p in open(f"/proc/{api}/task/{api}/children").read().split()]
        affinities = {pid: os.sched_getaffinity(pid) for pid in [api] + children}
        assert first not in affinities[api]
        # The worker's main thread is bound to the first core, the scheduler is not on it.
        assert any(a == {first} for a in affinities.values())
        assert sum(first not in a for a in affinities.values()) >= 2  # API and scheduler
    finally:
        srv.stop()
