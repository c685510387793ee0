"""What the numbers depend on besides the code: cores, load, versions, the commit."""

from __future__ import annotations

import os
import platform
import subprocess
import time


def describe_environment(repo_dir: str) -> dict:
    return {
        "cpu_count": os.cpu_count(),
        "load_average_1m": _load_average(),
        "cpu_busy_at_start": cpu_busy_share(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "git_commit": _git_commit(repo_dir),
    }


def busy_warning(env: dict) -> str | None:
    """A warning when something else is already using the CPU: on a small machine another
    process running torch threads makes every number here several times worse."""
    busy = env.get("cpu_busy_at_start")
    if busy is not None and busy > 0.2:
        return (f"warning: the CPUs were {busy:.0%} busy before the benchmark started; "
                "something else is running, the numbers will be low")
    return None


def cpu_busy_share(interval: float = 1.0) -> float | None:
    """Fraction of all cores' time spent busy over `interval`, from /proc/stat (the load
    average lags by minutes, this is what is happening now)."""
    first = _cpu_times()
    if first is None:
        return None
    time.sleep(interval)
    second = _cpu_times()
    total = sum(second) - sum(first)
    idle = (second[3] + second[4]) - (first[3] + first[4])  # idle + iowait
    return 1 - idle / total if total > 0 else None


def _cpu_times() -> list[int] | None:
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _git_commit(repo_dir: str) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_dir, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None
