"""Reasoning output: the `<think>...</think>` convention of DeepSeek-R1, Qwen3 and their kin.

A reasoning model writes its thinking between the tags, then the answer. `ThinkParser` splits a
text stream into the two, holding back only what could still be a partial tag. Templates that
open the thinking in the generation prompt (DeepSeek-R1, Qwen3-Thinking) leave the output
starting inside it; others let the model write `<think>` itself, which counts only at the start.

`--reasoning-parser auto` turns this on when the chat template mentions the tags.
"""

from __future__ import annotations

from api_server.protocol import RequestError

OPEN, CLOSE = "<think>", "</think>"
# What ends the thinking when a budget runs out: the tag as the models write it, then the blank
# line before the answer (Qwen3's and DeepSeek-R1's layout).
FORCED_CLOSE = "\n" + CLOSE + "\n\n"
REASONING_PARSERS = ("auto", "think", "none")

# Responses' `reasoning.effort` and chat's `reasoning_effort` as a share of the output budget
# (OpenRouter's mapping for models that take a token budget); "none"/"minimal" end it at once.
EFFORT_SHARE = {"none": 0.0, "minimal": 0.0, "low": 0.2, "medium": 0.5, "high": 0.8,
                "xhigh": None}


def resolve_reasoning_parser(flag: str, chat_template) -> str | None:
    """'think' or None: the flag, or for `auto` whether the template uses the tags."""
    if flag not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {flag!r}; choose from {REASONING_PARSERS}")
    if flag == "auto":
        templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
        uses = any(isinstance(t, str) and CLOSE in t for t in templates)
        return "think" if uses else None
    return None if flag == "none" else flag


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt (its last few tokens, decoded) leaves the output inside a thought."""
    return prompt_tail.rstrip().endswith(OPEN)


def effort_budget(effort: str | None, param: str) -> float | None:
    """An effort level as a share of the output budget (None: no limit)."""
    if effort is None:
        return None
    if effort not in EFFORT_SHARE:
        raise RequestError(f"unknown reasoning effort {effort!r}; expected one of "
                           f"{', '.join(EFFORT_SHARE)}", param=param)
    return EFFORT_SHARE[effort]


class ThinkParser:
    """Splits streamed output into (reasoning, content)."""

    def __init__(self, in_reasoning: bool) -> None:
        # "start": may still open with <think>; "think": inside; "answer": past the thought.
        self.state = "think" if in_reasoning else "start"
        self.buffer = ""
        self.strip_next = in_reasoning  # whitespace right after a tag is layout, not text

    @property
    def in_reasoning(self) -> bool:
        return self.state == "think"

    def push(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning, content = [], []
        while self.buffer:
            if self.state == "start":
                head = self.buffer.lstrip()
                if head.startswith(OPEN):
                    self.buffer = head[len(OPEN):]
                    self.state, self.strip_next = "think", True
                    continue
                if OPEN.startswith(head):  # still could be the tag
                    break
                self.state = "answer"
            elif self.state == "think":
                if self.strip_next:
                    self.buffer = self.buffer.lstrip()
                    if not self.buffer:
                        break
                    self.strip_next = False
                end = self.buffer.find(CLOSE)
                if end < 0:
                    keep = partial_suffix(self.buffer, CLOSE)
                    reasoning.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                reasoning.append(self.buffer[:end])
                self.buffer = self.buffer[end + len(CLOSE):]
                self.state, self.strip_next = "answer", True
            else:
                if self.strip_next:
                    self.buffer = self.buffer.lstrip()
                    if not self.buffer:
                        break
                    self.strip_next = False
                content.append(self.buffer)
                self.buffer = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """End of output: what was held back is what it looked like."""
        rest, self.buffer = self.buffer, ""
        if self.state == "think":
            return rest, ""
        return "", rest


class NoReasoning:
    """Models that do not think: everything is content."""

    in_reasoning = False

    def push(self, text: str) -> tuple[str, str]:
        return "", text

    def finish(self) -> tuple[str, str]:
        return "", ""


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
