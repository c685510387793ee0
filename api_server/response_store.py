"""Responses created with `store: true`, kept in memory for `previous_response_id` and
GET /v1/responses/{id}.

Bounded in count and in bytes, oldest dropped first: a server restart, or enough newer
responses, forgets a response (a later `previous_response_id` naming it is then a 400).

Each response is kept as its JSON bytes and decoded when read, so the bound is the memory it
takes: kept as Python objects, JSON of nested empty lists takes ~24x its size (4 responses
with 8 MiB of `[]` in `tools` took 770 MB against a 64 MiB bound).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from api_server.image_inputs import ImagePart

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 64 << 20

_encode = msgspec.json.Encoder().encode


@dataclass
class StoredResponse:
    body_json: bytes  # the response object, as returned
    messages_json: bytes  # the conversation through this response, as chat messages
    input_items_json: bytes = b"[]"  # the request's input items, for GET .../input_items

    @property
    def size(self) -> int:
        return len(self.body_json) + len(self.messages_json) + len(self.input_items_json)

    @property
    def body(self) -> dict:
        return msgspec.json.decode(self.body_json)

    @property
    def messages(self) -> list[dict]:
        return decode_messages(self.messages_json)

    @property
    def input_items(self) -> list[dict]:
        return msgspec.json.decode(self.input_items_json)


class ResponseStore:
    def __init__(self, max_responses: int = MAX_STORED_RESPONSES,
                 max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def put(self, body: dict, messages: list[dict], input_items: list[dict] | None = None) -> None:
        # The echoed request (tools, instructions) can be most of it: all of it is counted.
        item = StoredResponse(_encode(body), encode_messages(messages),
                              _encode(input_items or []))
        if item.size > self.max_bytes:
            return  # larger than the whole store: not kept
        self.delete(body["id"])
        self.items[body["id"]] = item
        self.bytes += item.size
        while len(self.items) > self.max_responses or self.bytes > self.max_bytes:
            _, dropped = self.items.popitem(last=False)
            self.bytes -= dropped.size

    def get(self, response_id: str) -> StoredResponse | None:
        return self.items.get(response_id)

    def delete(self, response_id: str) -> bool:
        item = self.items.pop(response_id, None)
        if item is None:
            return False
        self.bytes -= item.size
        return True


def encode_messages(messages: list[dict]) -> bytes:
    """Chat messages as JSON. Their images (`ImagePart`s, which no JSON body can put in a
    conversation) are kept beside them by position, and put back in place when decoded."""
    plain, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(p, ImagePart) for p in content):
            images += [[i, j, p.param, p.url] for j, p in enumerate(content)
                       if isinstance(p, ImagePart)]
            message = {**message, "content": [None if isinstance(p, ImagePart) else p
                                              for p in content]}
        plain.append(message)
    return _encode({"messages": plain, "images": images})


def decode_messages(data: bytes) -> list[dict]:
    stored = msgspec.json.decode(data)
    messages = stored["messages"]
    for i, j, param, url in stored["images"]:
        messages[i]["content"][j] = ImagePart(param, url)
    return messages
