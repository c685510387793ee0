"""Measuring a unit (a ceiling batch, a load level, a baseline run) until nothing else ran.

When other processes took CPU while a unit was measured, it is measured again (after waiting
for quiet, with --wait-idle), up to `retries` more times; the cleanest attempt is kept and
labelled with the foreign CPU it saw, so a tainted number is never silently reported.

    for attempt in clean.attempts("server c=4"):
        attempt.result = measure()          # sync or async, the caller's business
    result = clean.best_result()
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator

from bench.interference import WARN_CORES, InterferenceMonitor, wait_until_idle


@dataclass
class Attempt:
    label: str
    number: int
    result: Any = None
    foreign_cores: float | None = None


class CleanRuns:
    def __init__(self, monitor: InterferenceMonitor | None = None, retries: int = 0,
                 wait_idle: float = 0.0, log=print) -> None:
        self.monitor = monitor
        self.retries = retries
        self.wait_idle = wait_idle
        self.log = log
        self.best: Attempt | None = None
        self.made = 0

    def settle(self) -> None:
        """With --wait-idle, let whatever else runs on the machine finish first."""
        if self.wait_idle and self.monitor is not None:
            self.monitor.mark("waiting")
            wait_until_idle(self.wait_idle, self.log, self.monitor)

    def attempts(self, label: str) -> Iterator[Attempt]:
        self.best, self.made = None, 0
        for number in range(1, self.retries + 2):
            self.settle()
            attempt = Attempt(label, number)
            self.made = number
            if self.monitor is None:
                self.best = attempt
                yield attempt
                return
            self.monitor.mark(label)
            started, cpu_before = time.monotonic(), self.monitor.sample()
            yield attempt
            elapsed = time.monotonic() - started
            attempt.foreign_cores = (self.monitor.sample() - cpu_before) / max(elapsed, 1e-9)
            if self.best is None or attempt.foreign_cores < self.best.foreign_cores:
                self.best = attempt
            if attempt.foreign_cores <= WARN_CORES:
                return
            again = "measuring again" if number <= self.retries else "keeping the cleanest"
            self.log(f"bench: {label}: other processes used {attempt.foreign_cores:.2f} cores "
                     f"meanwhile; {again}")

    def best_result(self) -> Any:
        """The cleanest attempt's result; a dict result is labelled with its interference."""
        result = self.best.result
        if isinstance(result, dict):
            result["foreign_cpu_cores"] = self.best.foreign_cores
            result["attempts"] = self.made
        return result

    def run(self, label: str, measure) -> Any:
        for attempt in self.attempts(label):
            attempt.result = measure()
        return self.best_result()
