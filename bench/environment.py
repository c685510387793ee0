"""What the numbers depend on besides the code: cores, load, versions, the commit."""

from __future__ import annotations

import os
import platform
import subprocess


def describe_environment(repo_dir: str) -> dict:
    return {
        "cpu_count": os.cpu_count(),
        "load_average_1m": _load_average(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "git_commit": _git_commit(repo_dir),
    }


def busy_warning(env: dict) -> str | None:
    """A warning when something else is already using the CPU: on a small machine another
    process running torch halves (or worse) every number here."""
    load, cores = env.get("load_average_1m"), env.get("cpu_count") or 1
    if load is not None and load > 0.5 * cores:
        return (f"warning: 1-minute load average is {load:.2f} on {cores} cores; "
                "something else is running, the numbers will be low")
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
