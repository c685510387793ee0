"""Per request: how many proposed tokens were accepted, recently and in all, and how many to
propose next. The length follows transformers' assisted-generation schedule ("heuristic"): 2
more after a proposal accepted whole, 1 fewer after one that was not, within [1, the configured
number]. The recent acceptance rate is what a scheduler weighs against speculation's cost."""

from __future__ import annotations

from collections import deque


class AcceptanceHistory:
    def __init__(self, max_tokens: int, window: int = 8):
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        self.max_tokens = max_tokens
        self.next_length = max_tokens
        self.num_draft_tokens = 0  # all proposals of the request together
        self.num_accepted_tokens = 0
        # How often the i-th proposed token was accepted (vLLM's per-position metric).
        self.accepted_per_position = [0] * max_tokens
        self._recent: deque[tuple[int, int]] = deque(maxlen=window)  # (proposed, accepted)

    def record(self, proposed: int, accepted: int) -> None:
        """One verified proposal (an empty one, nothing to verify, changes nothing)."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"{accepted} accepted of {proposed} proposed")
        if proposed == 0:
            return
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for position in range(min(accepted, self.max_tokens)):
            self.accepted_per_position[position] += 1
        self._recent.append((proposed, accepted))
        if accepted == proposed:
            self.next_length = min(self.max_tokens, self.next_length + 2)
        else:
            self.next_length = max(1, self.next_length - 1)

    @property
    def recent_acceptance_rate(self) -> float | None:
        """Accepted / proposed over the last `window` proposals; None before any."""
        proposed = sum(p for p, _ in self._recent)
        return sum(a for _, a in self._recent) / proposed if proposed else None

    @property
    def recent_accepted(self) -> list[int]:
        """Accepted tokens of each of the last proposals, oldest first."""
        return [a for _, a in self._recent]
