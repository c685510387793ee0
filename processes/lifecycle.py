"""What every Loom process does at start: logging, and dying with its parent."""

from __future__ import annotations

import ctypes
import gc
import importlib
import logging
import os
import signal
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so no orphan outlives
    `loom serve` even after a kill -9."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    # The parent may already have gone between fork and prctl.
    if os.getppid() == 1:
        os._exit(1)


def ignore_interrupts() -> None:
    """Children leave Ctrl-C and SIGTERM to the parent, which drains in-flight requests first
    and then stops them (a terminal's Ctrl-C or systemd's SIGTERM reach the whole group)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def freeze_startup_heap() -> None:
    """Move everything start-up allocated (modules, the model's Python objects, the tokenizer)
    out of the garbage collector's reach, as vLLM and SGLang do.

    Python's full (generation 2) collection walks every tracked object. Serving creates a few
    thousand per step, so full collections are rare while serving, but with the start-up heap
    (hundreds of thousands of objects) in them each one stalls for tens of milliseconds: the
    worker mid-step, the API process between two SSE chunks. Frozen objects are never scanned
    again; what serving allocates later is collected as before. No collection first: start-up
    leaves almost no garbage, and a collection over its heap would lengthen start-up."""
    gc.freeze()


def run_role(entry_point: str, *args) -> None:
    """A child process' target: the role's entry point named "module:function" (as
    "worker.process:run_worker"), imported in the child. The process that spawns the roles
    (`loom serve`, in the API process) names them instead of importing them, so it loads
    neither the worker's PyTorch nor the scheduler's code."""
    module, _, function = entry_point.partition(":")
    getattr(importlib.import_module(module), function)(*args)
