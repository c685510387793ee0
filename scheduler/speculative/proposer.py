"""The proposer a configuration asks for: one object for all running requests, each of its
kinds with the same calls (add_request, propose, rollback, release)."""

from __future__ import annotations

import numpy as np

from pipelines.config import SpeculativeConfig
from scheduler.speculative.ngram import NgramProposer
from scheduler.speculative.suffix import SuffixProposer


class DraftModelSlots:
    """--speculative-method draft: the worker's draft model proposes, in the step that
    verifies (worker/speculative/draft_model.py). The scheduler only makes room: `propose`
    gives placeholders, which the worker replaces (StepResult.draft_token_ids)."""

    def __init__(self, num_speculative_tokens: int):
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, request_id: str, tokens: np.ndarray,
                max_tokens: int | None = None) -> np.ndarray:
        n = self.num_speculative_tokens if max_tokens is None else max_tokens
        return np.zeros(max(n, 0), dtype=np.int32)

    def add_request(self, request_id: str, prompt: np.ndarray) -> None:
        pass

    def rollback(self, request_id: str, length: int) -> None:
        pass

    def release(self, request_id: str, cache_output: bool = True) -> None:
        pass


def make_proposer(config: SpeculativeConfig
                  ) -> NgramProposer | SuffixProposer | DraftModelSlots | None:
    """None where speculation is off."""
    method = config.speculative_method
    if method == "none":
        return None
    if method == "ngram":
        return NgramProposer(config.num_draft_tokens, config.prompt_lookup_max,
                             config.prompt_lookup_min)
    if method == "suffix":
        return SuffixProposer(config.num_draft_tokens, config.suffix_decoding_max_tree_depth,
                              config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor,
                              config.suffix_decoding_min_token_prob)
    if method == "draft":
        return DraftModelSlots(config.num_draft_tokens)
    raise NotImplementedError(f"speculative method {method}: no proposer yet")
