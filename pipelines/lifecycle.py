"""What every Loom process does at start: logging, and dying with its parent."""

from __future__ import annotations

import ctypes
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
