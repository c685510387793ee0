"""Time the speculative proposers' `propose()` per decode step (worker/speculative/), on
SmolLM2's tokens of this checkout's own text: a 2,000-token request decoding 200 more tokens,
one propose() per token, with and without a suffix cache of other requests' outputs.

    python -m bench.spec_proposers
"""

from __future__ import annotations

import glob
import os
import time

import numpy as np

from scheduler.speculative.ngram import NgramProposer
from scheduler.speculative.suffix import SuffixProposer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def corpus_tokens() -> np.ndarray:
    from tokenizers import Tokenizer

    from pipelines.checkpoint.default_model import ensure_default_model

    tokenizer = Tokenizer.from_file(os.path.join(ensure_default_model(), "tokenizer.json"))
    files = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))
                   + glob.glob(os.path.join(ROOT, "*", "*.py")))
    text = "\n".join(open(f, encoding="utf-8").read() for f in files)
    return np.array(tokenizer.encode(text).ids, dtype=np.int64)


def time_steps(make_proposer, tokens: np.ndarray, start: int,
               repeats: int = 3) -> tuple[np.ndarray, float, float]:
    """Per-step times (µs) of propose() from `start` tokens to the end, each step's fastest of
    `repeats` runs (a shared machine's noise is all upward); the first call's time (ms:
    indexing the prompt) and the mean tokens proposed."""
    runs, firsts = [], []
    for _ in range(repeats):
        proposer = make_proposer()
        began = time.perf_counter()
        proposer.propose("r", tokens[:start])
        firsts.append((time.perf_counter() - began) * 1e3)
        times, proposed = [], 0
        for length in range(start + 1, len(tokens) + 1):
            began = time.perf_counter()
            proposed += len(proposer.propose("r", tokens[:length]))
            times.append(time.perf_counter() - began)
        runs.append(times)
    return np.min(runs, axis=0) * 1e6, min(firsts), proposed / len(runs[0])


def main() -> None:
    tokens = corpus_tokens()
    rng = np.random.default_rng(0)
    at = int(rng.integers(0, len(tokens) - 5_000))
    passage = tokens[at:at + 1_300]
    requests = {
        "text (no copy)": tokens[at + 2_000:at + 4_200],
        "copy-heavy": np.concatenate([passage, tokens[at + 3_000:at + 3_100], passage[:800]]),
    }
    outputs = [tokens[i:i + 400] for i in rng.integers(0, len(tokens) - 400, 2_000)]
    print(f"{len(tokens):,} corpus tokens; each request: 2,000 prompt tokens, 200 steps; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'request':16s} {'proposer':22s} {'first ms':>8s} {'p50 µs':>7s} {'p90 µs':>7s} "
          f"{'max µs':>7s} {'tokens/step':>11s}")
    for name, request in requests.items():
        request = request[:2_200]

        def with_outputs() -> SuffixProposer:
            proposer = SuffixProposer(16, max_cached_requests=len(outputs))
            for i, output in enumerate(outputs):
                proposer.add_request(f"o{i}", output[:1])
                proposer.propose(f"o{i}", output)
                proposer.release(f"o{i}")
            return proposer

        for label, make in (("ngram k=8", lambda: NgramProposer(8)),
                            ("suffix k=16", lambda: SuffixProposer(16)),
                            ("suffix k=16 +2k outputs", with_outputs)):
            times, first, proposed = time_steps(make, request, 2_000)
            print(f"{name:16s} {label:22s} {first:8.2f} {np.median(times):7.0f} "
                  f"{np.percentile(times, 90):7.0f} {times.max():7.0f} {proposed:11.1f}")


if __name__ == "__main__":
    main()
