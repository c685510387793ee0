"""A speculative verify step against a one-token decode step, in process, part by part.

    .venv/bin/python -m bench.verify_step [--model FILE.gguf] [--proposals 5] [--steps 30]

The model (default: the default SmolLM2 Q4_1 GGUF file) is loaded as `loom serve` loads it,
one 256-token prompt prefilled, then one-token decode steps and verify steps (the last token
and `--proposals` proposed ones, fed as one-token rows through the fused native step, as the
server runs them) alternate through the worker's own pipeline (bench/steps.py). The proposals
are always wrong, so each verify step keeps one token and the context grows as in decoding.
Each step is timed in the calling thread's CPU time (one thread), with its parts: the layer
stack (the one native call, each part of a layer from a LOOM_DECODE_PROFILE build of
decoder.c), the output layer, sampling or verification, and the rest (Python). Medians over
the steps; the machine is shared: compare the two kinds, measured together.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np
import torch

from bench import steps as st
from bench.decode_breakdown import PARTS, _Timed, default_gguf, load_runner, profiled_decoder
from bench.prompts import prompt_ids
from bench.stats import median

CONTEXT = 256


def measure(model_path: str, proposals: int, steps: int) -> dict:
    from worker import fused_decode, model_runner
    from worker.decode_attention import set_kernel_threads

    torch.set_num_threads(1)
    set_kernel_threads(1)
    clock = time.thread_time
    runner = load_runner(model_path, CONTEXT, 2 * steps + 16)
    model = runner.model
    parts: dict[str, float] = {}
    model.fused_decode = _Timed(model.fused_decode, "layers", parts, clock)
    model.lm_head.forward = _Timed(model.lm_head.forward, "lm_head", parts, clock)
    model_runner.sample_isolated = _Timed(model_runner.sample_isolated, "sampling", parts,
                                          clock)
    model_runner.verify_proposals = _Timed(model_runner.verify_proposals, "sampling", parts,
                                           clock)
    profiled = profiled_decoder()
    fused_decode._lib = profiled
    worker = st.WorkerSteps(runner)
    seqs = st.make_sequences([prompt_ids(7, CONTEXT)], CONTEXT + 2 * steps + 32, 16, "vs")
    seq = seqs[0]
    step_id = 0

    def run(chunks, drafts: int) -> float:
        nonlocal step_id
        seq.tokens.extend([13] * drafts)  # (proposals: fed, then taken off again)
        batch = st.build_step(step_id, chunks, 16)
        del seq.tokens[len(seq.tokens) - drafts:]
        if drafts:
            batch.num_draft_tokens = np.array([drafts], np.int32)
        step_id += 1
        start = clock()
        sampled = worker.run(batch)
        elapsed = clock() - start
        seq.computed += chunks[0][1] - drafts
        seq.tokens.append(int(sampled[0]))
        seq.generated.append(int(sampled[0]))
        return elapsed

    while chunks := st.prefill_chunks(seqs, 512):
        batch = st.build_step(step_id, chunks, 16)
        step_id += 1
        st.apply_step(chunks, batch, worker.run(batch))
    kinds = {"one-token": 0, "verify": proposals}
    for _ in range(4):  # (warm: both kinds' first calls)
        for drafts in kinds.values():
            run([(seq, 1 + drafts)], drafts)
    profiled.loom_decode_profile((ctypes.c_double * len(PARTS))())  # (zeroed)
    totals: dict[str, list[float]] = {k: [] for k in kinds}
    each: dict[str, dict[str, list[float]]] = {k: {} for k in kinds}
    layer_parts = {k: [0.0] * len(PARTS) for k in kinds}
    for i in range(steps):
        for kind in (list(kinds) if i % 2 == 0 else list(kinds)[::-1]):
            parts.clear()
            totals[kind].append(run([(seq, 1 + kinds[kind])], kinds[kind]))
            for name, seconds in parts.items():
                each[kind].setdefault(name, []).append(seconds)
            buf = (ctypes.c_double * len(PARTS))()
            profiled.loom_decode_profile(buf)
            layer_parts[kind] = [a + b for a, b in zip(layer_parts[kind], buf)]
    out = {}
    for kind in kinds:
        step_ms = median(totals[kind]) * 1e3
        ms = {name: median(v) * 1e3 for name, v in each[kind].items()}
        ms["rest (Python, runner, pipeline)"] = step_ms - sum(ms.values())
        out[kind] = {"step_ms": step_ms, "parts_ms": ms,
                     "layer_parts_ms": {name: s / steps * 1e3
                                        for name, s in zip(PARTS, layer_parts[kind])}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2 Q4_1)")
    parser.add_argument("--proposals", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    result = measure(args.model or default_gguf(), args.proposals, args.steps)
    for kind, r in result.items():
        print(f"{kind}: step {r['step_ms']:.2f} ms")
        for name, ms in list(r["parts_ms"].items()) + [
                (f"  layers: {n}", ms) for n, ms in r["layer_parts_ms"].items()]:
            print(f"  {name:<36} {ms:7.3f} ms")
    ratio = result["verify"]["step_ms"] / result["one-token"]["step_ms"]
    print(f"verify / one-token step: {ratio:.2f}x")


if __name__ == "__main__":
    main()
