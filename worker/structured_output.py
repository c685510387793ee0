"""Constrained decoding with llguidance: a grammar (from a JSON schema) masks the logits of a
request's rows so every sampled token keeps the output valid.

- The llguidance tokenizer is built once per worker, straight from tokenizer.json (0.4 s),
  when the worker is first idle after start-up. It used to go through transformers'
  AutoTokenizer in a background thread: ~4 s of GIL-holding Python that slowed the first
  forward passes from 0.4 s to 2 s.
- Each distinct schema is compiled once; requests get a cheap deep copy of the compiled matcher.
- A row draws first and is masked only when the grammar rejects its token (see `sample`);
  the masks needed are computed in one call across Rust threads (GIL released).
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict

import numpy as np
import torch

from pipelines.grammar import grammar_for_json_schema
from processes.cpu_placement import worker_threads
from worker.sampler import describe

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
            import llguidance.numpy  # noqa: F401 (here, not on the first constrained step)

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
        """The tokens each matcher allows next, uint8 0/1 [len(matchers), vocab].

        Computed after the forward pass, not beside it: when torch's threads hold every core, a
        mask thread running during the forward steals one of them, and the forward's parallel
        regions then stall at every barrier (several times slower steps).
        (llguidance.numpy, not llguidance.torch: importing the latter imports
        torch._dynamo, a 1.8 s stall of the first constrained step.)"""
        import llguidance.numpy as lln

        bitmask = lln.allocate_token_bitmask(len(matchers), self.vocab_size)
        lln.fill_next_token_bitmask_par(self._executor,
                                        [(m, i) for i, m in enumerate(matchers)], bitmask)
        # Little-endian int32 words: unpacking their bytes bit by bit gives token order.
        return np.unpackbits(bitmask.view(np.uint8), axis=1, count=self.vocab_size,
                             bitorder="little")

    def masks_along(self, matcher, drafts: list[int]) -> tuple[int, np.ndarray]:
        """Speculative decoding: how many of the proposals `drafts` the grammar allows in a
        row (n: those after are cut before verification), and the tokens it allows after
        each of the first 0..n, [n + 1, vocab] (a verification's rows' masks). The matcher
        is left where it was."""
        n = matcher.validate_tokens(drafts)
        masks = []
        for j in range(n + 1):
            masks.append(self.compute_masks([matcher])[0])
            if j < n and not matcher.consume_token(drafts[j]):
                raise ValueError(f"the grammar refused proposal {j} it had validated")
        matcher.rollback(n)
        return n, np.stack(masks)

    @staticmethod
    def consume(matcher, tokens: list[int]) -> None:
        """A verification's new tokens, each allowed by its row's mask."""
        failed: dict[int, str] = {}
        for token in tokens:
            GrammarCompiler._consume(matcher, token, 0, failed)
            if failed:
                raise ValueError(failed[0].removeprefix("structured output: "))

    @staticmethod
    def apply_masks(logits: torch.Tensor, rows: list[int], allowed: np.ndarray) -> None:
        """Rows of `logits` [B, V] keep only the tokens their grammar allows (in place)."""
        n = min(logits.shape[1], allowed.shape[1])
        forbidden = torch.from_numpy(allowed[:, :n]) == 0
        for j, row in enumerate(rows):
            logits[row, :n].masked_fill_(forbidden[j], float("-inf"))
            logits[row, n:] = float("-inf")  # ids past the grammar's vocabulary (padding)

    def sample(self, logits: torch.Tensor, states: list, constrained: list[int], draw,
               failed: dict[int, str]) -> torch.Tensor:
        """`draw(logits, states)` (-> tokens, {row: error}) for every row, the `constrained`
        rows kept to their grammar, each of whose matchers then consumes its token. A row
        whose grammar or draw fails is added to `failed` (row -> error) and the others go on.

        A row that samples from the whole distribution (greedy, or temperature alone) draws
        first and is masked only if the grammar rejects its token, then draws again: a token
        the grammar accepts at once is a draw from the masked distribution (rejection
        sampling), and for greedy rows the argmax is the masked argmax. Most tokens of a JSON
        output pass, so most rows skip the mask (0.1 ms per row per step). Rows with top-k,
        top-p or min-p are masked first, since those filters must see the masked logits.
        The check is llguidance's token validation, which also admits a non-canonical
        tokenization of text the grammar forces (its mask admits only the canonical one)."""
        masked_first = [j for j in constrained if _filters_the_distribution(states[j].params)]
        if masked_first:
            self._mask(logits, masked_first, states, failed)
        tokens, errors = draw(logits, states)
        failed.update(errors)
        drawn = tokens.tolist()
        rejected = []
        for j in constrained:
            if j in masked_first or j in failed:
                continue
            try:
                if states[j].matcher.try_consume_tokens([drawn[j]]) != 1:
                    rejected.append(j)
            except Exception as exc:
                failed[j] = f"structured output: {describe(exc)}"
        if rejected:
            self._mask(logits, rejected, states, failed)
            rejected = [j for j in rejected if j not in failed]
            again, errors = draw(logits[rejected], [states[j] for j in rejected])
            tokens[rejected] = again
            failed.update((rejected[k], error) for k, error in errors.items())
            drawn = tokens.tolist()
        for j in masked_first + rejected:
            if j not in failed:
                self._consume(states[j].matcher, drawn[j], j, failed)
        return tokens

    @staticmethod
    def _consume(matcher, token: int, row: int, failed: dict[int, str]) -> None:
        """The matcher takes the token its mask allowed. Should it refuse it (the mask left
        nothing, or the grammar broke), the output is no longer held to the schema: the
        request ends with an error, never silently unconstrained."""
        try:
            if matcher.consume_token(token):
                return
            if matcher.is_error():
                failed[row] = f"structured output: the grammar failed: {matcher.get_error()}"
            else:  # (a stopped grammar: its request ends with this step)
                logger.warning("grammar rejected token %d: %s", token, matcher.get_error())
        except Exception as exc:
            failed[row] = f"structured output: {describe(exc)}"

    def _mask(self, logits: torch.Tensor, rows: list[int], states: list,
              failed: dict[int, str]) -> None:
        """Masks the rows by their grammars: all at once, or, if that raises, one at a time
        so that only the rows whose grammar fails are added to `failed`."""
        try:
            allowed = self.compute_masks([states[j].matcher for j in rows])
        except Exception:
            for j in rows:
                try:
                    self.apply_masks(logits, [j], self.compute_masks([states[j].matcher]))
                except Exception as exc:
                    failed[j] = f"structured output: {describe(exc)}"
            return
        self.apply_masks(logits, rows, allowed)
        for j in rows:
            if states[j].matcher.is_error():
                failed[j] = f"structured output: the grammar failed: " \
                            f"{states[j].matcher.get_error()}"


def _filters_the_distribution(params) -> bool:
    return not params.is_greedy and (params.top_k > 1 or params.top_p < 1.0
                                     or params.min_p > 0.0)
