"""Speculative decoding, the worker's part (issue 28): verifying the scheduler's proposals
(scheduler/speculative/) in one forward, by the rejection rule that keeps the output
distribution exactly the target model's (rejection.py; ModelRunner._verify)."""
