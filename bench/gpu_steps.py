"""`python -m bench.gpu_steps MODEL_DIR --out F.json`: on a GPU, Loom's decode step against
the time to read the weights once, with and without CUDA graphs, and transformers' sequential
`generate()` on the same weights (part of bench/gpu_check.sh).

- bandwidth: a device-to-device copy of 2 GiB, bytes read + written over its median time;
  the weights' read time is their bytes over that bandwidth (the decode step's floor at
  batch 1, where reading the weights is nearly all the work);
- step: `ModelRunner.next_token` on decode-only steps (the worker's whole step: inputs,
  forward, the logits' copy to the host, sampling) at batch 1/16/64 over P-token contexts,
  the median of 30 steps, graphs on and then off (`--enforce-eager`'s path); and the graph's
  replay alone timed with CUDA events (the GPU's share of the step);
- transformers: `generate()` greedy, one request after another, N new tokens each: tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from bench.steps import (
    WorkerSteps,
    apply_step,
    build_step,
    decode_chunks,
    finish_step,
    make_sequences,
    prefill_chunks,
)
from pipelines.config import PipelineConfig
from worker.model_runner import ModelRunner

BLOCK = 16


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # (tied: once)


def decode_step_times(runner: ModelRunner, batch: int, prompt_len: int, steps: int,
                      tag: str) -> list[float]:
    """Seconds per `next_token` of `steps` decode steps of `batch` sequences."""
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(100, 40000, prompt_len).tolist() for _ in range(batch)]
    seqs = make_sequences(prompts, prompt_len + steps + 8, BLOCK, tag=tag)
    worker = WorkerSteps(runner)
    step_id = 0
    while chunks := prefill_chunks(seqs, 2048):
        step = build_step(step_id, chunks, BLOCK)
        apply_step(chunks, step, worker.run(step))
        step_id += 1
    times = []
    for _ in range(steps + 3):
        chunks = decode_chunks(seqs)
        step = build_step(step_id, chunks, BLOCK)
        started = time.perf_counter()
        sampled = worker.run(step)  # (ends with a copy to the host: synchronous)
        times.append(time.perf_counter() - started)
        apply_step(chunks, step, sampled)
        step_id += 1
    worker.run(finish_step(step_id, seqs))
    return times[3:]


def replay_time(runner: ModelRunner, batch: int) -> float | None:
    """Median seconds of the batch's graph replay alone (CUDA events)."""
    graphs = runner.graphs
    if graphs is None:
        return None
    size = next(s for s in graphs.sizes if s >= batch)
    times = []
    for i in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.graphs[size].replay()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def kernel_profile(runner: ModelRunner, prompt_len: int, top: int = 12) -> list[dict]:
    """Where a batch-1 decode step's GPU time goes: PyTorch's profiler over 5 eager steps
    (the kernels a graph replays are the same), the `top` kernels by GPU time per step."""
    from torch.profiler import ProfilerActivity, profile

    saved, runner.graphs = runner.graphs, None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode_step_times(runner, 1, prompt_len, 5, "prof")
    runner.graphs = saved
    rows = []
    for event in prof.key_averages():
        gpu_us = getattr(event, "self_device_time_total", 0) or 0
        if gpu_us > 0:
            rows.append({"kernel": event.key[:90], "calls": event.count,
                         "gpu_us_total": gpu_us})
    rows.sort(key=lambda r: -r["gpu_us_total"])
    return rows[:top]


def transformers_sequential(model_dir: str, device: torch.device, prompt_len: int,
                            new_tokens: int, requests: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    model.eval()
    rng = np.random.default_rng(7)

    def generate(n: int) -> None:
        ids = torch.tensor([rng.integers(100, 40000, prompt_len).tolist()], device=device)
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                       max_new_tokens=n, min_new_tokens=n, pad_token_id=2)

    with torch.inference_mode():
        generate(8)  # (warm-up)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(requests):
            generate(new_tokens)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
    model = None  # (freed before the next phase)
    torch.cuda.empty_cache()
    return {"requests": requests, "new_tokens": new_tokens, "seconds": elapsed,
            "tokens_per_s": requests * new_tokens / elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--out", required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hf-requests", type=int, default=3)
    p.add_argument("--hf-new-tokens", type=int, default=128)
    args = p.parse_args()
    device = torch.device("cuda")
    record: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    record["copy_bytes_per_s"] = bandwidth = copy_bandwidth(device)
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + written)", flush=True)
    runner = ModelRunner(PipelineConfig.for_model(
        args.model_dir, devices="cuda", dtype="bfloat16", kv_cache_page_size=BLOCK,
        max_length=2048, max_batch_size=max(args.batches), kv_cache_memory=4 << 30))
    record["weight_bytes"] = wb = weight_bytes(runner.model)
    record["weights_read_s"] = floor = wb / bandwidth
    print(f"weights {wb / 1e9:.2f} GB: read once in {floor * 1e3:.3f} ms", flush=True)
    rows = []
    graphs = runner.graphs
    for batch in args.batches:
        row = {"batch": batch}
        runner.graphs = graphs
        row["step_graphs_s"] = statistics.median(
            decode_step_times(runner, batch, args.prompt_len, args.steps, f"g{batch}"))
        row["replay_s"] = replay_time(runner, batch)
        runner.graphs = None
        row["step_eager_s"] = statistics.median(
            decode_step_times(runner, batch, args.prompt_len, args.steps, f"e{batch}"))
        rows.append(row)
        print(json.dumps(row), flush=True)
    runner.graphs = graphs
    record["steps"] = rows
    try:  # (prefill included: the table is for orientation, not a figure)
        record["kernels"] = kernel_profile(runner, args.prompt_len)
        for k in record["kernels"]:
            print(f"{k['gpu_us_total']:>10.0f} us {k['calls']:>6} calls  {k['kernel']}")
    except Exception as exc:  # (a profiler that does not work there costs nothing else)
        print(f"profiler: {exc!r}")
    del runner, graphs
    torch.cuda.empty_cache()
    record["transformers"] = hf = transformers_sequential(
        args.model_dir, device, args.prompt_len, args.hf_new_tokens, args.hf_requests)
    print(f"transformers sequential generate(): {hf['tokens_per_s']:.1f} tokens/s", flush=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"\n{'batch':>5} {'graphs ms':>10} {'replay ms':>10} {'eager ms':>9} "
          f"{'x weights':>10}")
    for row in rows:
        replay = row["replay_s"]
        print(f"{row['batch']:>5} {row['step_graphs_s'] * 1e3:>10.3f} "
              f"{replay * 1e3 if replay else float('nan'):>10.3f} "
              f"{row['step_eager_s'] * 1e3:>9.3f} {row['step_graphs_s'] / floor:>10.2f}")


if __name__ == "__main__":
    main()
