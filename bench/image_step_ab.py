"""`python -m bench.image_step_ab TREE_A TREE_B`: one batched FLUX denoising step of two
checkouts of Loom, A/B, on bench.images' random FLUX-shaped model.

This machine's speed moves 10-20% from one minute to the next, so two runs one after the other
compare the minutes, not the code. Here both checkouts live at once, each in its own process
importing its own tree (PYTHONPATH: a child that imported the editable install would run
this tree's code on both sides), and take turns: one step each per turn, medians over the
turns. Make the other tree with `git worktree add /tmp/base <commit>`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CHILD = "bench.image_step_ab"


def child(threads: int, batch: int) -> None:
    """Set up a runner with `batch` requests; then one step per line read, its seconds out."""
    import torch

    torch.set_num_threads(threads)
    from api_server.pixel_tokenizer import PixelGenerationRequest, PixelGenerationTokenizer
    from bench.images import PROMPTS, flux_shaped_model
    from worker.decode_attention import set_kernel_threads
    from worker.pixels.flux import FluxRunner

    set_kernel_threads(threads)
    model = flux_shaped_model()
    tok, runner = PixelGenerationTokenizer(model), FluxRunner(model)
    ids = []
    for i in range(batch):
        ctx = tok.new_context(PixelGenerationRequest(
            prompt=PROMPTS[i % len(PROMPTS)], height=128, width=128, num_inference_steps=100,
            seed=i, request_id=f"r{i}"))
        runner.add(ctx)
        ids.append(ctx.request_id)
    runner.step(ids)  # (warm)
    import worker

    print("ready", os.path.dirname(os.path.dirname(worker.__file__)), flush=True)
    for _ in sys.stdin:
        started = time.perf_counter()
        runner.step(ids)
        print(time.perf_counter() - started, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.image_step_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trees", nargs=2, help="two checkouts of Loom (directories)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=4, help="requests in each step")
    p.add_argument("--turns", type=int, default=25)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.threads, args.batch)
    procs = []
    for tree in args.trees:
        tree = os.path.abspath(tree)
        proc = subprocess.Popen(
            [sys.executable, "-m", CHILD, "--child", tree, tree, "--threads", str(args.threads),
             "--batch", str(args.batch)], cwd=tree, env={**os.environ, "PYTHONPATH": tree},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = proc.stdout.readline().split()
        if ready[:1] != ["ready"] or os.path.realpath(ready[1]) != os.path.realpath(tree):
            sys.exit(f"{tree}: its process did not start on its own tree ({ready})")
        procs.append(proc)
    times: list[list[float]] = [[], []]
    for _ in range(args.turns):
        for proc, spent in zip(procs, times):
            proc.stdin.write("step\n")
            proc.stdin.flush()
            spent.append(float(proc.stdout.readline()))
    for proc in procs:
        proc.stdin.close()
        proc.wait()
    medians = [statistics.median(t) for t in times]
    for tree, spent, median in zip(args.trees, times, medians):
        print(f"{tree}: median {1000 * median:.1f} ms, min {1000 * min(spent):.1f} ms")
    print(f"A / B: {medians[0] / medians[1]:.3f}")


if __name__ == "__main__":
    main()
