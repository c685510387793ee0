"""Progress of a long start-up step (kernel builds, GGUF conversion, model loading): a bar
with an ETA redrawn on a terminal, a log line every few seconds otherwise, so a first start
never sits silent for minutes.

A step with a known `total` reports done/total and an ETA from its pace so far; one without
(a compiler run, a wait for another process) reports the time it has taken. A background
thread does the reporting: the step's own code only calls `advance()`, if anything.
LOOM_PROGRESS_INTERVAL sets the seconds between plain log lines (default 2).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

logger = logging.getLogger("loom.progress")
_BAR = 24


def _interval() -> float:
    try:
        return max(0.1, float(os.environ.get("LOOM_PROGRESS_INTERVAL", "2")))
    except ValueError:
        return 2.0


class Progress:
    """`with Progress("converting model.gguf", total=n) as p: ... p.advance()`."""

    def __init__(self, what: str, total: int | None = None, unit: str = "",
                 stream=None) -> None:
        self.what, self.total, self.unit = what, total, unit
        self.done = 0
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started = time.monotonic()

    def advance(self, n: int = 1) -> None:
        self.done += n

    def __enter__(self) -> Progress:
        self.started = time.monotonic()
        if not self.tty:
            self._say(f"{self.what} ...")
        self._thread = threading.Thread(target=self._report, name="progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        elapsed = time.monotonic() - self.started
        # (GeneratorExit: a step run a piece at a time by a generator, closed unfinished.)
        outcome = "done" if exc_type is None else \
            "stopped" if exc_type is GeneratorExit else "failed"
        if self.tty:
            self.stream.write(f"\r\033[K{self.what}: {outcome} in {elapsed:.1f}s\n")
            self.stream.flush()
        else:
            self._say(f"{self.what}: {outcome} in {elapsed:.1f}s")

    def line(self) -> str:
        """What the step has done so far, in words: `3/7 files, 12s, ETA 16s`."""
        elapsed = time.monotonic() - self.started
        if not self.total:
            return f"{elapsed:.0f}s"
        unit = f" {self.unit}" if self.unit else ""
        eta = ""
        if 0 < self.done < self.total:
            eta = f", ETA {elapsed / self.done * (self.total - self.done):.0f}s"
        return f"{self.done}/{self.total}{unit}, {elapsed:.0f}s{eta}"

    def bar(self) -> str:
        if not self.total:
            spin = int(time.monotonic() * 4) % _BAR
            return "[" + " " * spin + "=" + " " * (_BAR - spin - 1) + "]"
        filled = min(_BAR, _BAR * self.done // self.total)
        return "[" + "#" * filled + "." * (_BAR - filled) + "]"

    def _report(self) -> None:
        interval = 0.25 if self.tty else _interval()
        while not self._stop.wait(interval):
            if self.tty:
                self.stream.write(f"\r\033[K{self.what} {self.bar()} {self.line()}")
                self.stream.flush()
            else:
                self._say(f"{self.what}: {self.line()}")

    def _say(self, text: str) -> None:
        # Through logging where a process set it up (loom serve's roles), else on the stream
        # (a command run on its own, such as the default model's conversion).
        if logging.getLogger().handlers:
            logger.info("%s", text)
        else:
            print(f"loom: {text}", file=self.stream, flush=True)
