"""A choice's output as ordered blocks: reasoning, text, one block per tool call.

The Responses API (output items) and Anthropic's Messages (content blocks) both lay an answer
out this way, streamed as open / delta / close events; `BlockTracker` turns the shared
pipeline's deltas into those events once, and each API only names them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from api_server.chat_turn import ChatDelta
from api_server.tool_calls import ToolCall


@dataclass
class Block:
    kind: str  # "reasoning", "text" or "call"
    index: int
    parts: list[str] = field(default_factory=list)
    call: ToolCall | None = None
    dropped: bool = False  # a call streamed that turned out not to be one (or was cut)

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass
class BlockEvent:
    type: str  # "open", "delta" or "close"
    block: Block
    delta: str = ""


class BlockTracker:
    """A call's block opens with its first argument piece and closes when the call is
    complete; its deltas add up to the call's arguments. A streamed call that is dropped (or
    still open at the end: the length limit cut it) closes as `dropped`: not part of the
    answer."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.current: Block | None = None  # the reasoning or text block still growing
        self.calls: dict[str, Block] = {}  # call id -> the block of a call being streamed

    @property
    def answer(self) -> list[Block]:
        return [b for b in self.blocks if not b.dropped]

    def feed(self, d: ChatDelta) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        # Text after a streamed call (or the text of a dropped one) follows the call's block.
        text_first = not self.calls
        if text_first:
            events += self._texts(d)
        for piece in d.call_deltas:
            events += self._piece(piece.call, piece.arguments)
        for call in d.calls:
            block = self.calls.pop(call.id, None)
            if block is None:  # returned whole
                events += self._piece(call, call.arguments)
                block = self.calls.pop(call.id)
            block.call = call
            events.append(BlockEvent("close", block))
        for call in d.dropped_calls:
            events += self._drop(call.id)
        if not text_first:
            events += self._texts(d)
        if d.finish_reason:
            events += self._close()
            for call_id in list(self.calls):
                events += self._drop(call_id)
        return events

    def _texts(self, d: ChatDelta) -> list[BlockEvent]:
        events = []
        if d.reasoning:
            events += self._text("reasoning", d.reasoning)
        if d.content:
            events += self._text("text", d.content)
        return events

    def _piece(self, call: ToolCall, arguments: str) -> list[BlockEvent]:
        events = []
        block = self.calls.get(call.id)
        if block is None:
            events += self._close()
            block = self.calls[call.id] = self._new("call")
            block.call = call
            events.append(BlockEvent("open", block))
        block.parts.append(arguments)
        events.append(BlockEvent("delta", block, arguments))
        return events

    def _drop(self, call_id: str) -> list[BlockEvent]:
        block = self.calls.pop(call_id, None)
        if block is None:
            return []
        block.dropped = True
        return [BlockEvent("close", block)]

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
