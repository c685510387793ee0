"""The proposer a configuration asks for: one object for all running requests, each of its
kinds with the same calls (add_request, propose, rollback, release)."""

from __future__ import annotations

from pipelines.config import SpeculativeConfig
from scheduler.speculative.ngram import NgramProposer
from scheduler.speculative.suffix import SuffixProposer


def make_proposer(config: SpeculativeConfig) -> NgramProposer | SuffixProposer | None:
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
    raise NotImplementedError(f"speculative method {method}: no proposer yet")
