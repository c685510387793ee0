"""Incremental detokenization and stop-string matching, per request.

Decoding one token at a time is wrong for byte-level BPE: a multi-byte character can span
tokens, and some tokens only form text together. So we decode a short window twice (with and
without the newest tokens) and emit only the difference, holding back while the window ends in
an incomplete character (U+FFFD) - the approach of TGI and vLLM.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens that seed the window, so the first generated word gets its leading space right.
_SEED_TOKENS = 5
# Tokens held back at most, waiting for a character to complete. A UTF-8 character is at most
# 4 bytes and every byte-level token carries at least one, so past this the bytes will never
# form one (a forced lone continuation byte, say) or the tokens decode to nothing (skipped
# special tokens): they are let go, and the window the decode runs over stays bounded, where
# it would otherwise grow with every token (quadratic time).
_MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list((prompt_ids or [])[-_SEED_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; returns the text they complete (possibly empty)."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            return self._advance(text, prefix_text, len(self.ids))
        if len(self.ids) - self.read_offset <= _MAX_HELD_TOKENS:
            return ""
        # Held too long. An incomplete character at the end lies within its last 4 tokens:
        # release what comes before it...
        for end in range(len(self.ids) - 1, max(self.read_offset, len(self.ids) - 4), -1):
            partial = self._decode(self.ids[self.prefix_offset : end])
            if len(partial) > len(prefix_text) and not partial.endswith("\ufffd"):
                return self._advance(partial, prefix_text, end)
        # ...else these bytes will never form a character: let them go as they are.
        if len(text) > len(prefix_text):
            return self._advance(text, prefix_text, len(self.ids))
        self.prefix_offset = self.read_offset = len(self.ids) - 1  # they decode to nothing
        return ""

    def _advance(self, text: str, prefix_text: str, end: int) -> str:
        """Emit `text` (the window decoded up to token `end`) past `prefix_text`."""
        self.prefix_offset = self.read_offset
        self.read_offset = end
        return text[len(prefix_text):]

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character stays replaced)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix_text):] if len(text) > len(prefix_text) else ""


class StopStringMatcher:
    """Cuts the output at the first stop string, and never releases text that could still
    turn out to be the start of one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the output

    def push(self, delta: str) -> str:
        """Returns the text that is safe to send now."""
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        self.pending += delta
        hits = [(i, s) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            at, self.matched = min(hits, key=lambda hit: hit[0])
            out, self.pending = self.pending[:at], ""
            return out
        hold = self._longest_partial_stop()
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

    def _longest_partial_stop(self) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of a stop string.

        Candidates start where the stop's first character occurs in the last len(stop) - 1
        characters; each is checked with one startswith (C speed), longest first."""
        best = 0
        pending = self.pending
        for stop in self.stops:
            start = max(len(pending) - len(stop) + 1, 0)
            i = pending.find(stop[0], start)
            while i != -1 and len(pending) - i > best:
                if stop.startswith(pending[i:]):
                    best = len(pending) - i
                    break
                i = pending.find(stop[0], i + 1)
        return best
