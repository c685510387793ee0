"""Loom's benchmark harness (not part of the pytest suite): `python -m bench.run --help`.

Three measurements of the same model, prompt length P and output length N:
  ceiling   the model's own forward passes in a plain loop (no server): what Loom could reach
  server    `loom serve` (or any OpenAI-compatible server on 127.0.0.1) under streaming load
  baseline  Hugging Face `generate`, what a user would write without a server
"""
