"""`python -m bench.mixed_step`: where the time of a step that mixes decodes and a prompt chunk
goes (the step a loaded server runs most: at c=16 nearly every step carries ~16 decodes and a
piece of a new prompt), timed per call in process: the packed GEMMs by shape, decode
attention, prompt attention, and the rest (norms, rotary, activation, sampling, the runner's
Python). Beside it the same decodes alone (a decode-only step is one call into the fused
native step, worker/fused_decode.py: its parts are all "rest" here) and the chunk alone.

The model is the bench ceiling's (the float32 checkpoint converted from the default GGUF
file, `--dtype` as bench.run's). Timing wraps each call, so the figures include a few
microseconds of wrapper per call (~400 calls a step).

    python -m bench.mixed_step --batch 16 --context 256 --chunk 32
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

import bench.steps as st
import worker.attention as attention
import worker.packed_linear as packed_linear
from bench.ceiling import CeilingConfig, StepLoop, make_runner, warm_up
from bench.prompts import prompt_ids
from pipelines.checkpoint.default_model import ensure_default_model

PROMPT_BASE = 2_000_000  # (far from the load test's and the ceiling's prompt indexes)


class CallTimes:
    """Seconds spent in each wrapped call, by label, since the last `take`."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()

    def wrap(self, owner, name: str, label) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            result = inner(*args, **kwargs)
            key = label(*args) if callable(label) else label
            self.seconds[key] += time.perf_counter() - started
            return result

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        seconds, self.seconds = dict(self.seconds), collections.Counter()
        return seconds


def report(title: str, steps: list[float], seconds: dict[str, float]) -> None:
    n = len(steps)
    print(f"{title}: median {statistics.median(steps) * 1e3:.1f} ms a step ({n} steps)")
    for key, total in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"    {key:28s} {total / n * 1e3:7.2f} ms")
    print(f"    {'rest':28s} {(sum(steps) - sum(seconds.values())) / n * 1e3:7.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16, help="decoding sequences")
    parser.add_argument("--context", type=int, default=256, help="their prompt length")
    parser.add_argument("--chunk", type=int, default=32, help="prompt tokens beside them")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    max_len = args.context + args.steps + 64
    cfg = CeilingConfig(model_dir=ensure_default_model(), dtype=args.dtype,
                        prompt_len=args.context, output_len=args.steps,
                        batch_sizes=[args.batch + 2])
    loop = StepLoop(make_runner(cfg, max_len), cfg.block_size)
    warm_up(loop, cfg, max_len)
    times = CallTimes()
    times.wrap(packed_linear.PackedLinear, "forward",
               lambda layer, x: f"GEMM {layer.in_features}x{layer.out_features}")
    times.wrap(attention, "paged_decode_attention", "decode attention")
    times.wrap(attention, "paged_prefill_attention", "prompt attention")

    prompts = [prompt_ids(PROMPT_BASE + i, args.context) for i in range(args.batch)]
    decoding = st.make_sequences(prompts, max_len, cfg.block_size, "decoding")
    loop.prefill(decoding, 512)
    for _ in range(2):
        loop.run(st.decode_chunks(decoding))
    times.take()

    def prompt_steps(with_decodes: bool, offset: int) -> list[float]:
        """args.steps steps, each with the next chunk of a new prompt (a fresh one when the
        last is fed whole), beside the decodes or alone."""
        steps, fresh = [], None
        while len(steps) < args.steps:
            if fresh is None or not st.prefill_chunks(fresh, args.chunk):
                if fresh is not None:
                    loop.finish(fresh)
                # (its own blocks, after the decoding sequences')
                fresh = [st.Sequence(f"fresh-{offset}-{len(steps)}",
                                     prompt_ids(PROMPT_BASE + offset + len(steps), args.context),
                                     first_block=args.batch * -(-max_len // cfg.block_size))]
            chunks = st.prefill_chunks(fresh, args.chunk)
            steps.append(loop.run(st.decode_chunks(decoding) + chunks if with_decodes
                                  else chunks))
        loop.finish(fresh)
        return steps

    report(f"{args.batch} decodes", [loop.run(st.decode_chunks(decoding))
                                     for _ in range(args.steps)], times.take())
    report(f"{args.batch} decodes + a {args.chunk}-token chunk", prompt_steps(True, 10_000),
           times.take())
    report(f"a {args.chunk}-token chunk alone", prompt_steps(False, 20_000), times.take())


if __name__ == "__main__":
    main()
