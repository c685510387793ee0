"""Loom's benchmark harness (not part of the pytest suite): `python -m bench.run --help`.

Three measurements of the same model, prompt length P and output length N:
  ceiling   the model's own forward passes in a plain loop (no server): what Loom could reach
  server    `loom serve` (or any OpenAI-compatible server on 127.0.0.1) under streaming load
  baseline  Hugging Face `generate`, what a user would write without a server

The other entry points (`python -m bench.<name> --help`): soak, structured, prefix_cache,
speech, voice, vision, images, image_step_ab, quant_linear, llama_server, plot. What they all
share lives here.
"""

from __future__ import annotations

import os
import sys

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_DIR, "bench", "results")


def log(message: str) -> None:
    """Progress and warnings go to stderr; stdout carries the report."""
    print(message, file=sys.stderr, flush=True)


def sigterm_as_interrupt(signum, frame):
    """A SIGTERM handler: the same path as Ctrl-C, so `with` blocks still stop the servers
    they started and the run reports what it measured."""
    raise KeyboardInterrupt
