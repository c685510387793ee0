"""Responses created with `store: true`, kept in memory for `previous_response_id` and
GET /v1/responses/{id}.

Bounded in count and in size, oldest dropped first: a server restart, or enough newer
responses, forgets a response (a later `previous_response_id` naming it is then a 400).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

MAX_STORED_RESPONSES = 1024
MAX_STORED_CHARS = 64 << 20


@dataclass
class StoredResponse:
    body: dict  # the response object, as returned
    messages: list[dict]  # the conversation through this response, as chat messages
    size: int
    input_items: list[dict] = field(default_factory=list)  # GET .../input_items


class ResponseStore:
    def __init__(self, max_responses: int = MAX_STORED_RESPONSES,
                 max_chars: int = MAX_STORED_CHARS) -> None:
        self.max_responses = max_responses
        self.max_chars = max_chars
        self.items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.chars = 0

    def put(self, body: dict, messages: list[dict], input_items: list[dict] | None = None) -> None:
        # The echoed request (tools, instructions) can be most of it: count all of it.
        input_items = input_items or []
        size = len(msgspec.json.encode(body)) + len(msgspec.json.encode(messages)) + \
            len(msgspec.json.encode(input_items))
        if size > self.max_chars:
            return  # larger than the whole store: not kept
        self.delete(body["id"])
        self.items[body["id"]] = StoredResponse(body, messages, size, input_items)
        self.chars += size
        while len(self.items) > self.max_responses or self.chars > self.max_chars:
            _, dropped = self.items.popitem(last=False)
            self.chars -= dropped.size

    def get(self, response_id: str) -> StoredResponse | None:
        return self.items.get(response_id)

    def delete(self, response_id: str) -> bool:
        item = self.items.pop(response_id, None)
        if item is None:
            return False
        self.chars -= item.size
        return True
