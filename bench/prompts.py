"""Benchmark prompts: random token ids from a seed, one distinct prompt per request.

Distinct prompts matter: identical ones would hit the server's prefix cache and skip prefill,
which would flatter TTFT. Ids come from a range that is ordinary text in any tokenizer with at
least 30k entries, clear of the special tokens most vocabularies put first.

In-process measurements (ceiling, baseline, kernels) use the fixed SEED: the same prompts
every run. A served load takes a fresh seed per run (`run_seed`): a server kept up between
runs, as a peer often is, would otherwise answer the second run's prompts from its prefix
cache (vLLM's is on by default: 64% of a repeated c=16 run's prompt tokens were hits, and its
tokens/s rose 1.45x). Both servers of one run get the same prompts.
"""

from __future__ import annotations

import secrets

import numpy as np

SEED = 1234
LOW_ID = 1000
HIGH_ID = 30000


def prompt_ids(index: int, length: int, seed: int = SEED) -> list[int]:
    """Prompt number `index`: the same ids every run, different from every other index."""
    rng = np.random.default_rng([seed, index])
    return rng.integers(LOW_ID, HIGH_ID, size=length).tolist()


def run_seed() -> int:
    """A seed for one run's served prompts (recorded in its results, to repeat it)."""
    return secrets.randbits(32)


class PromptSource:
    """Hands out prompts with increasing indexes, so no two requests share one."""

    def __init__(self, length: int, first_index: int = 0, seed: int = SEED) -> None:
        self.length = length
        self.next_index = first_index
        self.seed = seed

    def next(self) -> list[int]:
        ids = prompt_ids(self.next_index, self.length, self.seed)
        self.next_index += 1
        return ids
