"""Speculative decoding, the scheduler's part (issue 28): the proposers of draft tokens (n-gram
prompt lookup, suffix decoding), the per-request acceptance history that adapts how many
tokens to propose, and which requests propose in a step (speculation.py). The worker verifies
the proposals (worker/speculative/rejection.py keeps the output distribution exactly the
target model's).

Per step, for each request that speculates:

    draft = proposer.propose(request_id, context.all_tokens, max_tokens=history.next_length)
    # the worker verifies: the target's distributions at the draft's positions and one more
    tokens = rejection_sample(target_probs, draft, generator=..., greedy=...)
    history.record(len(draft), len(tokens) - 1)

`tokens` passed to propose() only grow (proposer.rollback(request_id, length) where they
shrink), and proposer.release(request_id) frees a request's state when it ends (the suffix
proposer then caches its output for other requests, unless `cache_output=False`).
"""
