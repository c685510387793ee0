"""The baseline a user would write without a server: Hugging Face `generate`, greedy.

Two shapes: requests one after another (what a simple script serving requests does), and one
static batch padded on the left (the best `generate` offers without continuous batching).
`min_new_tokens=N` forces exactly N new tokens, like `ignore_eos` in the load test.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass

import torch

from bench.clean_runs import CleanRuns
from bench.prompts import prompt_ids

PROMPT_INDEX_BASE = 2_000_000


@dataclass
class BaselineConfig:
    model_dir: str
    dtype: str
    prompt_len: int
    output_len: int
    sequential_requests: int = 3
    batch_size: int = 16


def run_baseline(cfg: BaselineConfig, log=print, clean: CleanRuns | None = None) -> dict:
    clean = clean or CleanRuns()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generate() warns about flags we set on purpose
    torch.set_num_threads(os.cpu_count() or 1)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
    tokenizer.padding_side = "left"  # decoder-only models continue from the right edge
    model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=getattr(torch, cfg.dtype))
    model.eval()
    try:
        _generate(model, tokenizer, [prompt_ids(PROMPT_INDEX_BASE, 16)], 4)  # warm-up
        sequential = clean.run("baseline sequential", lambda m=model: _sequential(m, tokenizer, cfg))
        log(f"baseline: sequential {sequential['tok_s']:.1f} tok/s")
        batched = clean.run("baseline batch", lambda m=model: _batched(m, tokenizer, cfg))
        log(f"baseline: static batch of {cfg.batch_size} {batched['tok_s']:.1f} tok/s")
    finally:
        del model
        gc.collect()
    return {"sequential": sequential, "static_batch": batched}


def _generate(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    """Seconds for one generate() call and the number of new tokens it produced."""
    batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    pad_id = tokenizer.pad_token_id
    if pad_id is None:  # Llama-style tokenizers have none; padding is masked out anyway
        pad_id = tokenizer.eos_token_id
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **batch, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - started
    return elapsed, (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]


def _sequential(model, tokenizer, cfg: BaselineConfig) -> dict:
    times, tokens = [], 0
    for i in range(cfg.sequential_requests):
        elapsed, n = _generate(model, tokenizer, [prompt_ids(PROMPT_INDEX_BASE + 1 + i,
                                                             cfg.prompt_len)], cfg.output_len)
        times.append(elapsed)
        tokens += n
    return {"requests": cfg.sequential_requests, "tokens": tokens, "seconds": sum(times),
            "tok_s": tokens / sum(times), "per_request_s": times}


def _batched(model, tokenizer, cfg: BaselineConfig) -> dict:
    prompts = [prompt_ids(PROMPT_INDEX_BASE + 100 + i, cfg.prompt_len)
               for i in range(cfg.batch_size)]
    elapsed, tokens = _generate(model, tokenizer, prompts, cfg.output_len)
    return {"batch_size": cfg.batch_size, "tokens": tokens, "seconds": elapsed,
            "tok_s": tokens / elapsed}
