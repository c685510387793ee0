"""Shared by the GGUF serving tests: greedy completions with their token ids and logprobs from
the HTTP API, and the teacher-forced agreement check against transformers on the same file
(tests/test_gguf_serving.py's docstring states the criterion and why)."""

import asyncio
import hashlib
import os
import shutil
import tempfile

import httpx
import torch

from tests.oracle_cache import cached_oracle


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


def oracle_choices(oracle: "GGUFOracle", prompt_ids, generated) -> list[list]:
    """[the oracle's best log probability, its token, the log probability of Loom's token] at
    each generated position, the oracle fed Loom's tokens. Cached beside the saved oracle by
    the tokens (alone, batched and split across ranks, Loom mostly generates the same ones):
    a 270M model's forward over a thousand tokens takes seconds."""
    def compute():
        with torch.no_grad():
            logits = oracle.model(torch.tensor([prompt_ids + generated])).logits
        logprobs = logits[0, len(prompt_ids) - 1:-1].float().log_softmax(-1)
        best, best_ids = logprobs.max(-1)
        mine = logprobs.gather(1, torch.tensor(generated)[:, None])[:, 0]
        return [[float(b), int(i), float(m)] for b, i, m in zip(best, best_ids, mine)]

    return cached_oracle("teacher-forced", oracle.saved, [prompt_ids, generated], compute)


def check_against_oracle(choices, prompt_ids, generated, logprobs, stats, tie_nats,
                         logprob_nats):
    """Every token the oracle's choice or within tie_nats of it, every reported logprob within
    logprob_nats of the oracle's; counts exact choices and the largest deviations in stats.
    `choices`: oracle_choices' answer for these tokens."""
    for j, (token, (best, best_id, mine)) in enumerate(zip(generated, choices, strict=True)):
        stats["gap"] = max(stats.get("gap", 0.0), best - mine)
        stats["logprob"] = max(stats.get("logprob", 0.0), abs(logprobs[j] - mine))
        assert mine >= best - tie_nats, (
            f"prompt of {len(prompt_ids)} tokens, position {j}: token {token} is "
            f"{best - mine:.3f} nats below the oracle's choice")
        assert abs(logprobs[j] - mine) <= logprob_nats, (
            f"prompt of {len(prompt_ids)} tokens, position {j}: logprob {logprobs[j]:.4f}, "
            f"oracle {mine:.4f}")
        stats["exact"] = stats.get("exact", 0) + int(token == best_id)
        stats["total"] = stats.get("total", 0) + 1


class GGUFOracle:
    """transformers loading a GGUF file (`gguf_file=`, dequantized to float32), saved once as
    a float32 checkpoint beside Loom's models: reading a GGUF file through transformers takes
    ~30 s for SmolLM2 and ~90 s for Gemma 3 (tokenizer conversion, dequantization), loading
    the saved copy of the same tensors a few seconds. The tokenizer is loaded at once, the
    model only when a test needs it (oracle_choices' cache answers most)."""

    def __init__(self, gguf_path: str) -> None:
        from transformers import AutoTokenizer

        from pipelines.checkpoint.default_model import cache_dir

        # Keyed by the file's content, not its time: reinstalling the package that ships it
        # (every fresh environment) rewrites the same bytes with a new time.
        with open(gguf_path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
        stem = os.path.splitext(os.path.basename(gguf_path))[0]
        self.saved = os.path.join(cache_dir(), "oracles", f"{stem}-{digest}")
        self._model = None
        if not os.path.isfile(os.path.join(self.saved, "config.json")):
            self._save(gguf_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.saved)

    @property
    def model(self):
        if self._model is None:
            from transformers import AutoModelForCausalLM

            self._model = AutoModelForCausalLM.from_pretrained(
                self.saved, dtype=torch.float32).eval()
        return self._model

    def _save(self, gguf_path: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder, name = os.path.split(gguf_path)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=torch.float32).eval()
        os.makedirs(os.path.dirname(self.saved), mode=0o700, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".saving-", dir=os.path.dirname(self.saved))
        # The GGUF "quantizer" only marks how the model was read: its tensors are float32,
        # and saved as a plain checkpoint they load to identical logits.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tok.save_pretrained(staging)
        self._model = model
        try:
            os.rename(staging, self.saved)  # (another session may have saved it meanwhile)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
