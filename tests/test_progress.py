"""pipelines/progress.py: a bar with an ETA on a terminal, plain lines otherwise (the cold
start's lines through a real server: tests/test_kernel_cache.py)."""

from __future__ import annotations

import io
import logging
import re
import time

from pipelines.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_with_an_eta_redrawn_in_place():
    screen = Terminal()
    with Progress("converting model.gguf", total=4, unit="parts", stream=screen) as progress:
        progress.advance()
        time.sleep(0.6)  # (redrawn every 0.25 s)
    text = screen.getvalue()
    drawn = [frame for frame in text.split("\r") if "[" in frame]
    assert drawn and all(f.startswith("\033[K") for f in drawn)  # each frame over the last
    assert "converting model.gguf [######" in text and "1/4 parts" in text and "ETA" in text
    assert re.search(r"\r\033\[Kconverting model.gguf: done in \d+\.\ds\n$", text), text


def test_elsewhere_plain_lines_every_interval(monkeypatch, caplog):
    monkeypatch.setenv("LOOM_PROGRESS_INTERVAL", "0.2")
    caplog.set_level(logging.INFO, logger="loom.progress")
    pipe = io.StringIO()  # not a terminal
    with Progress("compiling native kernel decoder", stream=pipe):
        time.sleep(0.7)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "compiling native kernel decoder ..."
    assert len([line for line in lines if line.endswith("s") and "done" not in line]) >= 2
    assert lines[-1].startswith("compiling native kernel decoder: done in ")
    assert "\r" not in pipe.getvalue()


def test_a_step_left_unfinished_by_its_generator_says_stopped(caplog):
    """The KV cache's faults run a piece at a time from a generator; a server stopped before
    they end says so, not that they failed."""
    caplog.set_level(logging.INFO, logger="loom.progress")

    def pieces():
        with Progress("faulting in the KV cache", total=3, unit="blocks", stream=io.StringIO()):
            yield from range(3)

    steps = pieces()
    next(steps)
    steps.close()
    assert caplog.records[-1].getMessage().startswith("faulting in the KV cache: stopped in ")
