"""Shared by the GGUF serving tests: greedy completions with their token ids and logprobs from
the HTTP API, and the teacher-forced agreement check against transformers on the same file
(tests/test_gguf_serving.py's docstring states the criterion and why)."""

import asyncio
import os
import shutil
import tempfile
import weakref

import httpx
import torch


async def _complete(client, url, prompt_ids, max_tokens, timeout):
    r = await client.post(url + "/v1/completions", json={
        "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
        # a near tie broken the other way may lead to an end of text the oracle's branch
        # would not reach yet: every prompt is checked over all max_tokens positions
        "ignore_eos": True, "return_tokens_as_token_ids": True}, timeout=timeout)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    return ids, lp["token_logprobs"]


def generate(url, prompts_ids, concurrent, max_tokens, timeout=120.0):
    """[(generated ids, their logprobs)] per prompt, sent together or one after another."""
    async def go():
        async with httpx.AsyncClient() as client:
            calls = [_complete(client, url, p, max_tokens, timeout) for p in prompts_ids]
            if concurrent:
                return await asyncio.gather(*calls)
            return [await call for call in calls]

    return asyncio.run(go())


_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def oracle_logprobs(model, prompt_ids, generated):
    """The oracle's log probabilities at each generated position, fed Loom's tokens. Kept
    while the model lives: alone, batched and split across ranks, Loom mostly generates the
    same tokens."""
    seen = _SEEN.setdefault(model, {})
    key = (len(prompt_ids), tuple(prompt_ids + generated))
    if key not in seen:
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + generated])).logits
        seen[key] = logits[0, len(prompt_ids) - 1:-1].float().log_softmax(-1)
    return seen[key]


def check_against_oracle(oracle, prompt_ids, generated, logprobs, stats, tie_nats,
                         logprob_nats):
    """Every token the oracle's choice or within tie_nats of it, every reported logprob within
    logprob_nats of the oracle's; counts exact choices and the largest deviations in stats."""
    for j, token in enumerate(generated):
        best = float(oracle[j].max())
        mine = float(oracle[j, token])
        stats["gap"] = max(stats.get("gap", 0.0), best - mine)
        stats["logprob"] = max(stats.get("logprob", 0.0), abs(logprobs[j] - mine))
        assert mine >= best - tie_nats, (
            f"prompt of {len(prompt_ids)} tokens, position {j}: token {token} is "
            f"{best - mine:.3f} nats below the oracle's choice")
        assert abs(logprobs[j] - mine) <= logprob_nats, (
            f"prompt of {len(prompt_ids)} tokens, position {j}: logprob {logprobs[j]:.4f}, "
            f"oracle {mine:.4f}")
        stats["exact"] = stats.get("exact", 0) + int(token == int(oracle[j].argmax()))
        stats["total"] = stats.get("total", 0) + 1


def load_gguf_oracle(gguf_path: str):
    """(model, tokenizer): transformers loading `gguf_path` (`gguf_file=`, dequantized to
    float32), saved once as a float32 checkpoint beside Loom's models: reading a GGUF file
    through transformers takes ~30 s for SmolLM2 and ~90 s for Gemma 3 (tokenizer conversion,
    dequantization), loading the saved copy of the same tensors a few seconds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelines.checkpoint.default_model import cache_dir

    info = os.stat(gguf_path)
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    saved = os.path.join(cache_dir(), "oracles", f"{stem}-{info.st_size}-{info.st_mtime_ns}")
    if not os.path.isfile(os.path.join(saved, "config.json")):
        folder, name = os.path.split(gguf_path)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=torch.float32).eval()
        os.makedirs(os.path.dirname(saved), mode=0o700, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".saving-", dir=os.path.dirname(saved))
        # The GGUF "quantizer" only marks how the model was read: its tensors are float32,
        # and saved as a plain checkpoint they load to identical logits.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tok.save_pretrained(staging)
        try:
            os.rename(staging, saved)  # (another session may have saved it meanwhile)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
        return model, tok
    tok = AutoTokenizer.from_pretrained(saved)
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    return model, tok
