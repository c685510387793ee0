"""Speculative decoding: proposers of draft tokens (n-gram prompt lookup, suffix decoding),
the per-request acceptance history that adapts how many tokens to propose, and the rejection
rule that keeps the output distribution exactly the target model's (issue 28)."""
