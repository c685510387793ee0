"""Constrained decoding with llguidance: a grammar (from a JSON schema) masks the logits of a
request's rows so every sampled token keeps the output valid.

- The llguidance tokenizer is built once per worker, straight from tokenizer.json (0.4 s),
  when the worker is first idle after start-up. It used to go through transformers'
  AutoTokenizer in a background thread: ~4 s of GIL-holding Python that slowed the first
  forward passes from 0.4 s to 2 s.
- Each distinct schema is compiled once; requests get a cheap deep copy of the compiled matcher.
- Masks of all constrained rows are computed in one call across Rust threads (GIL released).
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict

import numpy as np
import torch

from pipelines.cpu_placement import worker_threads
from pipelines.grammar import grammar_for_json_schema

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256


def _llguidance_tokenizer(model_dir: str):
    """llguidance's tokenizer from the checkpoint's tokenizer.json, as llguidance.hf builds it
    from a fast Hugging Face tokenizer (the same Rust tokenizer serialised), with the EOS token
    of tokenizer_config.json. Added tokens that only tokenizer_config.json lists need
    transformers to merge them in: then it goes through transformers."""
    import llguidance
    import tokenizers

    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        config = json.load(f)
    backend = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    extra = {int(i): t["content"] for i, t in config.get("added_tokens_decoder", {}).items()}
    if any(backend.token_to_id(content) != i for i, content in extra.items()):
        import llguidance.hf
        from transformers import AutoTokenizer

        return llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(model_dir))
    backend.no_padding()
    backend.no_truncation()
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    eos_id = backend.token_to_id(eos) if eos else None
    return llguidance.LLTokenizer(backend.to_str(), eos_token=eos_id)


class GrammarCompiler:
    """Compiles JSON schemas to matchers. Its llguidance tokenizer (0.4-0.5 s to build) is
    built by `load()`: the worker calls it once it is idle after start-up, so it is not on the
    way to a healthy /health; a structured request that comes first builds it itself."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.loaded = False
        self._tokenizer = None
        self._error: Exception | None = None
        self._templates: OrderedDict[str, object] = OrderedDict()
        self._executor = None

    def load(self) -> None:
        if self.loaded:
            return
        self.loaded = True
        try:
            import llguidance

            self._tokenizer = _llguidance_tokenizer(self.model_dir)
            # As many threads as the worker's torch threads: more would oversubscribe the cores.
            with worker_threads():
                self._executor = llguidance.LLExecutor(num_threads=torch.get_num_threads())
        except Exception as exc:  # reported on the first structured request
            self._error = exc
            logger.warning("structured output unavailable: %s", exc)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.vocab_size

    def matcher_for(self, json_schema: str):
        """A fresh matcher for `json_schema` (compiled once, then copied)."""
        self.load()
        if self._error is not None:
            raise RuntimeError(f"structured output unavailable: {self._error}")
        template = self._templates.get(json_schema)
        if template is None:
            import llguidance

            grammar = grammar_for_json_schema(json_schema)
            template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
            if template.is_error():
                raise ValueError(template.get_error())
            self._templates[json_schema] = template
            if len(self._templates) > _CACHE_SIZE:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(json_schema)
        return template.deep_copy()

    def compute_masks(self, matchers: list) -> np.ndarray:
        """The tokens each matcher allows next, bool [len(matchers), vocab].

        Computed after the forward pass, not beside it: on a 2-core machine a mask thread
        running during the forward steals a core from torch's threads, and the forward's
        parallel regions then stall at every barrier (measured: 9x slower steps)."""
        import llguidance.torch as llt

        bitmask = llt.allocate_token_bitmask(len(matchers), self.vocab_size)
        llt.fill_next_token_bitmask_par(self._executor,
                                        [(m, i) for i, m in enumerate(matchers)], bitmask)
        # Little-endian int32 words: unpacking their bytes bit by bit gives token order.
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        return allowed[:, : self.vocab_size].astype(bool)

    @staticmethod
    def apply_masks(logits: torch.Tensor, rows: list[int], allowed: np.ndarray) -> None:
        """Rows of `logits` [B, V] keep only the tokens their grammar allows."""
        vocab = logits.shape[1]
        keep = np.zeros((len(rows), vocab), dtype=bool)
        n = min(vocab, allowed.shape[1])
        keep[:, :n] = allowed[:, :n]
        index = torch.tensor(rows)
        logits[index] = logits[index].masked_fill(torch.from_numpy(~keep), float("-inf"))
