"""The ceiling: ModelRunner's forward passes in a plain loop, one process, no server.

Whatever the server adds (HTTP, tokenization, ZeroMQ hops, scheduling, detokenization) shows
up as the gap between this and the load test at the same batch size and context length.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass

import torch

from bench import steps as st
from bench.clean_runs import CleanRuns
from bench.prompts import prompt_ids
from bench.stats import median

# Ceiling prompts use indexes far from the load test's, for tidiness only (no cache here).
PROMPT_INDEX_BASE = 1_000_000


@dataclass
class CeilingConfig:
    model_dir: str
    dtype: str
    prompt_len: int
    output_len: int
    batch_sizes: list[int]
    chunk_tokens: int = 512  # the server's default --max-num-batched-tokens
    block_size: int = 16
    prefill_repeats: int = 3


class Ceiling:
    """The model loaded once; its prefill and each batch size measured on demand, so that
    `bench.run` can measure batch B right before the server's level at concurrency B (the
    machine's speed drifts by 10% over minutes here; side by side, the ratio does not).

    `record` is the ceiling's part of the results, filled as measurements are made.
    """

    def __init__(self, cfg: CeilingConfig, log=print, clean: CleanRuns | None = None) -> None:
        self.cfg = cfg
        self.log = log
        self.clean = clean or CleanRuns()
        self.max_len = cfg.prompt_len + cfg.output_len
        torch.set_num_threads(os.cpu_count() or 1)
        self.loop = StepLoop(make_runner(cfg, self.max_len), cfg.block_size)
        self.prefills = 0
        self.record: dict = {"threads": torch.get_num_threads(), "prefill_one": None,
                             "one_token_forward_ms": None, "batches": {}}
        warm_up(self.loop, cfg, self.max_len)

    def measure_prefill_one(self) -> dict:
        cfg = self.cfg
        self.record["prefill_one"] = prefill = self.clean.run(
            "ceiling prefill", lambda: _measure_prefill_one(self.loop, cfg, self.max_len))
        self.log(f"ceiling: one {cfg.prompt_len}-token prefill {prefill['ms']:.1f} ms")
        return prefill

    def prefill_ms(self, ids: list[int]) -> float:
        """One prefill of exactly this prompt at batch 1 (bench.ttft_pairs pairs it with the
        server's TTFT for the same prompt)."""
        self.prefills += 1
        return _prefill_once(self.loop, self.cfg, self.max_len, ids, f"pair-{self.prefills}") * 1e3

    def measure_batch(self, batch: int) -> dict:
        cfg = self.cfg
        result = self._store_batch(self.clean.run(
            f"ceiling b={batch}", lambda: _measure_batch(self.loop, cfg, batch, self.max_len)))
        self.log(f"ceiling: batch {batch:>3}: decode {result['decode_tok_s']:8.1f} tok/s "
                 f"({result['decode_step_ms_p50']:.1f} ms/step), chunked prefill "
                 f"{result['prefill_tok_s']:8.1f} tok/s")
        return result

    def bracket_batch(self, batch: int) -> dict:
        """Batch `batch` measured again right after its load level: with the run right before
        it, the level is bracketed, and drift of the machine's speed over the level (10% in
        a minute here) cancels to first order. The batch's figures become the mean of both
        runs; each run stays in `runs`."""
        cfg = self.cfg
        before = self.record["batches"].get(str(batch))
        if before is None:
            return self.measure_batch(batch)
        if "runs" in before:  # bracketed already
            return before
        after = self.clean.run(
            f"ceiling b={batch} (after)",
            lambda: _measure_batch(self.loop, cfg, batch, self.max_len))
        result = self._store_batch(_mean_of_runs(before, after, cfg))
        self.log(f"ceiling: batch {batch:>3} again: prefill+decode "
                 f"{after['prefill_and_decode_tok_s']:.1f} tok/s (before the level: "
                 f"{before['prefill_and_decode_tok_s']:.1f}; mean of both: "
                 f"{result['prefill_and_decode_tok_s']:.1f})")
        return result

    def _store_batch(self, result: dict) -> dict:
        self.record["batches"][str(result["batch"])] = result
        if result["batch"] == 1:
            self.record["one_token_forward_ms"] = result["decode_step_ms_p50"]
        return result

    def unmeasured(self) -> list[int]:
        return [b for b in self.cfg.batch_sizes if str(b) not in self.record["batches"]]

    def close(self) -> None:
        self.loop = None
        gc.collect()


def run_ceiling(cfg: CeilingConfig, log=print, clean: CleanRuns | None = None) -> dict:
    """Everything at once: the prefill, then every batch size."""
    ceiling = Ceiling(cfg, log, clean)
    try:
        ceiling.measure_prefill_one()
        for batch in cfg.batch_sizes:
            ceiling.measure_batch(batch)
    finally:
        ceiling.close()
    return ceiling.record


def make_runner(cfg: CeilingConfig, max_len: int):
    # Imported here so `bench.run --skip-ceiling` never loads the worker package.
    from pipelines.checkpoint.model_config import load_model_config
    from pipelines.config import PipelineConfig
    from worker.device import DTYPES
    from worker.kv_cache import bytes_per_block
    from worker.model_runner import ModelRunner

    # Exactly the blocks the largest batch needs: the default sizing would take 40% of RAM.
    num_blocks = st.blocks_needed(max(cfg.batch_sizes), max_len, cfg.block_size)
    per_block = bytes_per_block(load_model_config(cfg.model_dir), DTYPES[cfg.dtype],
                                cfg.block_size)
    return ModelRunner(PipelineConfig.for_model(
        cfg.model_dir, dtype=cfg.dtype, kv_cache_page_size=cfg.block_size,
        max_length=max_len, max_batch_size=max(cfg.batch_sizes),
        kv_cache_memory=num_blocks * per_block,
    ))


class StepLoop:
    """Runs hand-built steps through the runner, timing each forward pass."""

    def __init__(self, runner, block_size: int) -> None:
        self.worker = st.WorkerSteps(runner)
        self.block_size = block_size
        self.step_id = 0

    def run(self, chunks) -> float:
        batch = st.build_step(self.step_id, chunks, self.block_size)
        self.step_id += 1
        started = time.perf_counter()
        sampled = self.worker.run(batch)
        elapsed = time.perf_counter() - started
        st.apply_step(chunks, batch, sampled)
        return elapsed

    def prefill(self, seqs, budget: int) -> list[float]:
        times = []
        while chunks := st.prefill_chunks(seqs, budget):
            times.append(self.run(chunks))
        return times

    def finish(self, seqs) -> None:
        self.worker.run(st.finish_step(self.step_id, seqs))
        self.step_id += 1


def _prompts(count: int, length: int, offset: int) -> list[list[int]]:
    return [prompt_ids(PROMPT_INDEX_BASE + offset + i, length) for i in range(count)]


def warm_up(loop: StepLoop, cfg: CeilingConfig, max_len: int) -> None:
    # First calls pay for allocator growth and kernel selection; keep them out of the numbers.
    # Sized to fit the KV cache, which holds exactly max(batch_sizes) sequences of max_len.
    count = min(2, max(cfg.batch_sizes))
    seqs = st.make_sequences(_prompts(count, min(cfg.prompt_len, 64), 0), max_len,
                             cfg.block_size, "warm")
    loop.prefill(seqs, cfg.chunk_tokens)
    for _ in range(min(4, cfg.output_len - 1)):
        loop.run(st.decode_chunks(seqs))
    loop.finish(seqs)


def _measure_prefill_one(loop: StepLoop, cfg: CeilingConfig, max_len: int) -> dict:
    """One P-token prompt at batch 1 (what TTFT at concurrency 1 is made of), median of a few."""
    times = [_prefill_once(loop, cfg, max_len, _prompts(1, cfg.prompt_len, 100 + r)[0], f"p1-{r}")
             for r in range(cfg.prefill_repeats)]
    ms = median(times) * 1e3
    return {"ms": ms, "tok_s": cfg.prompt_len / (ms / 1e3), "runs_ms": [t * 1e3 for t in times]}


def _prefill_once(loop: StepLoop, cfg: CeilingConfig, max_len: int, ids: list[int],
                  tag: str) -> float:
    """Seconds of forward passes to prefill one prompt at batch 1, in budget-sized chunks."""
    seqs = st.make_sequences([ids], max_len, cfg.block_size, tag)
    seconds = sum(loop.prefill(seqs, cfg.chunk_tokens))
    loop.finish(seqs)
    return seconds


def _measure_batch(loop: StepLoop, cfg: CeilingConfig, batch: int, max_len: int) -> dict:
    """B prompts prefilled together in budget-sized chunks (the first token comes out of the
    prefill), then N-1 decode steps of one token per sequence at contexts P+1 .. P+N-1: the
    steps a request of the load test goes through."""
    seqs = st.make_sequences(_prompts(batch, cfg.prompt_len, 1000 * batch), max_len,
                             cfg.block_size, f"b{batch}")
    prefill_times = loop.prefill(seqs, cfg.chunk_tokens)
    decode_times = [loop.run(st.decode_chunks(seqs)) for _ in range(cfg.output_len - 1)]
    loop.finish(seqs)
    return {"batch": batch, "prefill_steps": len(prefill_times),
            "decode_steps": len(decode_times), "decode_step_ms_p50": median(decode_times) * 1e3,
            **_batch_rates(batch, cfg, sum(prefill_times), sum(decode_times),
                           len(decode_times))}


def _batch_rates(batch: int, cfg: CeilingConfig, prefill_s: float, decode_s: float,
                 decode_steps: int) -> dict:
    return {
        "prefill_s": prefill_s,
        "prefill_tok_s": batch * cfg.prompt_len / prefill_s,
        "decode_s": decode_s,
        "decode_tok_s": batch * decode_steps / decode_s,
        "decode_step_ms_mean": decode_s / decode_steps * 1e3,
        # All N tokens over prefill + decode: what a server that batched perfectly but could
        # not hide prefill would reach in a closed loop at this concurrency.
        "prefill_and_decode_tok_s": batch * cfg.output_len / (prefill_s + decode_s),
    }


def _mean_of_runs(before: dict, after: dict, cfg: CeilingConfig) -> dict:
    runs = [before, after]
    return {
        **before,
        "decode_step_ms_p50": median([r["decode_step_ms_p50"] for r in runs]),
        **_batch_rates(before["batch"], cfg, (before["prefill_s"] + after["prefill_s"]) / 2,
                       (before["decode_s"] + after["decode_s"]) / 2, before["decode_steps"]),
        "runs": runs,
    }
