"""The official `anthropic` SDK against `loom serve`: nested pydantic schemas as forced tools
(`tool`, `any`), a forced tool beside an output format, streamed tool_use input, and a forced
call cut by max_tokens (complete calls stay tool_use blocks, stop_reason max_tokens)."""

import json

import anthropic
import pytest

from tests.client_models import MODEL, Address, Node, Person

ASK = [{"role": "user", "content": "Save Ann, who lives in Paris."}]
SAVE = {"name": "save_person", "description": "Save a person.",
        "input_schema": Person.model_json_schema()}
GREEDY = {"temperature": 0}  # this client version has no temperature argument
TREE = {"name": "tree", "input_schema": Node.model_json_schema()}


@pytest.fixture(scope="module")
def client(client_server):
    return anthropic.Anthropic(base_url=client_server.url, api_key="x", max_retries=0)


@pytest.mark.parametrize("tool_choice", [{"type": "tool", "name": "save_person"},
                                         {"type": "any"}])
def test_forced_nested_tool(client, tool_choice):
    m = client.messages.create(model=MODEL, max_tokens=120, messages=ASK, tools=[SAVE, TREE],
                               tool_choice=tool_choice, extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and [b.type for b in m.content] == ["tool_use"] * len(uses)
    for b in uses:
        (Person if b.name == "save_person" else Node).model_validate(b.input)


def test_forced_tool_beside_output_format(client):
    m = client.messages.create(
        model=MODEL, max_tokens=120, messages=ASK, tools=[SAVE], extra_body=GREEDY,
        tool_choice={"type": "tool", "name": "save_person"},
        output_config={"format": {"type": "json_schema", "schema": Node.model_json_schema()}})
    assert m.stop_reason == "tool_use"
    Person.model_validate(m.content[0].input)


def test_auto_tool_beside_output_format(client):
    """Under auto the model either calls the tool or answers in the format."""
    m = client.messages.create(
        model=MODEL, max_tokens=300, messages=ASK, tools=[SAVE],
        extra_body={"temperature": 1.0},
        output_config={"format": {"type": "json_schema", "schema": {
            **Address.model_json_schema(), "additionalProperties": False}}})
    uses = [b for b in m.content if b.type == "tool_use"]
    if uses:
        assert m.stop_reason == "tool_use" and all(Person.model_validate(b.input) for b in uses)
    else:
        assert m.stop_reason == "end_turn"
        Address.model_validate_json("".join(b.text for b in m.content if b.type == "text"))


def test_streamed_tool_use_and_cut_call(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=[SAVE], extra_body=GREEDY,
                  tool_choice={"type": "any"})
    with client.messages.stream(max_tokens=300, **kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and 1 <= len(uses) <= 3
    assert all(Person.model_validate(b.input) for b in uses)
    # Each tool_use block starts with an empty input; its JSON streams in pieces.
    starts = [e for e in events if e.type == "content_block_start"]
    assert [(e.content_block.type, e.content_block.input) for e in starts] == \
        [("tool_use", {})] * len(uses)
    pieces: dict[int, list[str]] = {}
    for e in events:
        if e.type == "content_block_delta":
            assert e.delta.type == "input_json_delta"
            pieces.setdefault(e.index, []).append(e.delta.partial_json)
    assert all(len(p) > 1 for p in pieces.values())
    assert [json.loads("".join(pieces[i])) for i in sorted(pieces)] == [b.input for b in uses]
    cut = client.messages.create(max_tokens=final.usage.output_tokens // 2, **kwargs)
    assert cut.stop_reason == "max_tokens"
    assert [(b.type, b.input) for b in cut.content] == \
        [("tool_use", b.input) for b in uses[:len(cut.content)]]
    assert len(cut.content) < len(uses)
