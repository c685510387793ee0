"""A choice's output as ordered blocks: reasoning, text, one block per tool call.

The Responses API (output items) and Anthropic's Messages (content blocks) both lay an answer
out this way, streamed as open / delta / close events; `BlockTracker` turns the shared
pipeline's deltas into those events once, and each API only names them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from api_server.chat_pipeline import ChatDelta
from api_server.tool_calls import ToolCall


@dataclass
class Block:
    kind: str  # "reasoning", "text" or "call"
    index: int
    parts: list[str] = field(default_factory=list)
    call: ToolCall | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass
class BlockEvent:
    type: str  # "open", "delta" or "close"
    block: Block
    delta: str = ""


class BlockTracker:
    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.current: Block | None = None  # the reasoning or text block still growing

    def feed(self, d: ChatDelta) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if d.reasoning:
            events += self._text("reasoning", d.reasoning)
        if d.content:
            events += self._text("text", d.content)
        for call in d.calls:
            events += self._close()
            block = self._new("call")
            block.call = call
            block.parts.append(call.arguments)
            events += [BlockEvent("open", block), BlockEvent("delta", block, call.arguments),
                       BlockEvent("close", block)]
        if d.finish_reason:
            events += self._close()
        return events

    def _text(self, kind: str, text: str) -> list[BlockEvent]:
        events = []
        if self.current is None or self.current.kind != kind:
            events += self._close()
            self.current = self._new(kind)
            events.append(BlockEvent("open", self.current))
        self.current.parts.append(text)
        events.append(BlockEvent("delta", self.current, text))
        return events

    def _new(self, kind: str) -> Block:
        block = Block(kind, len(self.blocks))
        self.blocks.append(block)
        return block

    def _close(self) -> list[BlockEvent]:
        if self.current is None:
            return []
        block, self.current = self.current, None
        return [BlockEvent("close", block)]
