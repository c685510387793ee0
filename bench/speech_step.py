"""`python -m bench.speech_step`: what four speech rows cost a text row's decode step, in process.

The bench's Orpheus-shaped model (bench/speech_tokens.py builds it) in a runner as the worker
holds it; five sequences prefilled, then decode steps alternating between the text sequence
alone (greedy) and beside four sequences sampled as Orpheus samples (0.6 / 0.8 / 1.3): the
batch a text client shares with four speech requests, without the server around it. Each
step's CPU time on one thread (other processes' use of the cores does not inflate it), and
inside it the output layer, the logits processing (penalties) and the sampling; medians.
Run it in two checkouts in turn to compare them.
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.speech_step", description=__doc__)
    p.add_argument("--model-dir", default=os.path.expanduser("~/.cache/loom/bench-orpheus-14l-16f"))
    p.add_argument("--steps", type=int, default=25, help="steps of each kind")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    from bench import steps as st
    from bench.prompts import prompt_ids
    from bench.speech_tokens import SAMPLING
    from pipelines.config import PipelineConfig
    from pipelines.sampling_params import SamplingParams
    from worker import model_runner
    from worker.decode_attention import set_kernel_threads
    from worker.model_runner import ModelRunner

    set_kernel_threads(1)
    runner = ModelRunner(PipelineConfig.for_model(
        args.model_dir, dtype="float32", kv_cache_page_size=16, max_length=1024,
        max_batch_size=8, kv_cache_memory=256 << 20))
    parts: dict[str, float] = {}

    def timed(fn, name):
        def call(*a, **k):
            started = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                parts[name] = parts.get(name, 0.0) + time.thread_time() - started
        return call

    model_runner.sample_isolated = timed(model_runner.sample_isolated, "sampling")
    model_runner.process_logits = timed(model_runner.process_logits, "penalties")
    runner.model.lm_head.forward = timed(runner.model.lm_head.forward, "lm_head")
    worker = st.WorkerSteps(runner)
    seqs = st.make_sequences([prompt_ids(31, 64)] + [prompt_ids(50 + i, 64) for i in range(4)],
                             64 + 2 * args.steps + 16, 16, "speech-step")
    sampled = SamplingParams(top_k=0, ignore_eos=True, **SAMPLING)
    step_id = 0

    def run(chunks) -> float:
        nonlocal step_id
        batch = st.build_step(step_id, chunks, 16)
        step_id += 1
        for new in batch.new_requests:
            if new.request_id != seqs[0].request_id:
                new.sampling_params = sampled
        parts.clear()
        started = time.thread_time()
        tokens = worker.run(batch)
        elapsed = time.thread_time() - started
        st.apply_step(chunks, batch, tokens)
        return elapsed

    while chunks := st.prefill_chunks(seqs, 512):
        run(chunks)
    times: dict[str, dict[str, list[float]]] = {"alone": {}, "beside 4 sampled": {}}
    for i in range(args.steps + 3):
        for kind, batch in (("alone", seqs[:1]), ("beside 4 sampled", seqs)):
            step = run(st.decode_chunks(batch))
            if i >= 3:  # (warm)
                for name, seconds in {"step": step, **parts}.items():
                    times[kind].setdefault(name, []).append(seconds * 1e3)
    from bench.stats import median

    for kind, by_part in times.items():
        print(f"{kind:17s} " + "  ".join(f"{name} {median(v):.2f} ms"
                                         for name, v in by_part.items()))
    print(f"step ratio {median(times['beside 4 sampled']['step']) / median(times['alone']['step']):.2f}")


if __name__ == "__main__":
    main()
