"""The official `openai` SDK against `loom serve`, as its documentation uses it: nested
pydantic models in forced tool calls and in structured output (chat and Responses), tools
beside an output format, chained responses with default settings, input_items, streamed and
length-cut tool calls."""

import json

import openai
import pytest

from tests.client_models import MODEL, Address, Node, Person

ASK = [{"role": "user", "content": "Save Ann, who lives in Paris."}]


@pytest.fixture(scope="module")
def client(client_server):
    return openai.OpenAI(base_url=client_server.url + "/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "Person"}}])
def test_parse_forced_nested_tool(client, tool_choice):
    r = client.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=120, temperature=0,
                                      tools=[openai.pydantic_function_tool(Person)],
                                      tool_choice=tool_choice)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert all(isinstance(c.function.parsed_arguments, Person)
               for c in choice.message.tool_calls)


def test_recursive_tool_schema_is_accepted(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=60, temperature=0, tool_choice="required",
        tools=[openai.pydantic_function_tool(Node)])
    choice = r.choices[0]
    assert choice.finish_reason in ("tool_calls", "length") and not choice.message.content
    for call in choice.message.tool_calls or []:
        Node.model_validate_json(call.function.arguments)


def test_parse_nested_response_format(client):
    r = client.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=120,
                                      temperature=0, response_format=Person)
    assert isinstance(r.choices[0].message.parsed, Person)


def test_forced_tool_beside_response_format(client):
    r = client.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=120,
                                      temperature=0, response_format=Node,
                                      tools=[openai.pydantic_function_tool(Person)],
                                      tool_choice="required")
    calls = r.choices[0].message.tool_calls
    assert calls and all(isinstance(c.function.parsed_arguments, Person) for c in calls)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_tools_beside_response_format(client, seed):
    """Under auto the model either calls the tool or answers in the format; both are valid."""
    r = client.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=300,
                                      temperature=1.0, seed=seed, response_format=Address,
                                      tools=[openai.pydantic_function_tool(Person)])
    message = r.choices[0].message
    if message.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls" and not message.content
        assert all(isinstance(c.function.parsed_arguments, Person) for c in message.tool_calls)
    else:
        assert r.choices[0].finish_reason == "stop" and isinstance(message.parsed, Address)


def test_parallel_forced_calls_are_bounded_and_cut_calls_stay_calls(client):
    """The server runs with --max-parallel-tool-calls 3. Cut halfway, the same greedy output
    returns the calls completed before the cut as tool_calls, never as text."""
    kwargs = dict(model=MODEL, messages=ASK, temperature=0, tool_choice="required",
                  tools=[openai.pydantic_function_tool(Person)])
    full = client.chat.completions.create(max_tokens=300, **kwargs)
    calls = [c.function.arguments for c in full.choices[0].message.tool_calls]
    assert full.choices[0].finish_reason == "tool_calls" and 1 <= len(calls) <= 3
    cut = client.chat.completions.create(max_tokens=full.usage.completion_tokens // 2, **kwargs)
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    complete = [c.function.arguments for c in choice.message.tool_calls or []]
    assert len(complete) < len(calls) and complete == calls[:len(complete)]


def test_streamed_forced_tool_call(client):
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=120, temperature=0,
                  tools=[openai.pydantic_function_tool(Person)],
                  tool_choice={"type": "function", "function": {"name": "Person"}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    first, arguments, finish, deltas = None, "", None, 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            assert call.index == 0
            if first is None:  # id, type and name first, with empty arguments
                first = call
                assert call.id and call.type == "function" and call.function.name == "Person"
                assert call.function.arguments == ""
            else:
                assert call.id is None and call.function.name is None
            deltas += bool(call.function and call.function.arguments)
            arguments += call.function.arguments or "" if call.function else ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert finish == "tool_calls" and deltas > 1  # the arguments stream as they are written
    assert json.loads(arguments) == json.loads(whole[0].function.arguments)
    Person.model_validate_json(arguments)


def test_streamed_auto_tool_calls(client):
    """Under auto the Hermes parser streams each call's arguments once its name is written;
    the SDK's accumulated calls are the non-streamed ones (the same seed samples the same)."""
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=300, temperature=1.0,
                  response_format={"type": "json_schema", "json_schema": {
                      "name": "Address", "schema": Address.model_json_schema()}},
                  tools=[openai.pydantic_function_tool(Person)])
    seed, whole = next((seed, r.choices[0].message.tool_calls) for seed in range(8) for r in
                       [client.chat.completions.create(seed=seed, **kwargs)]
                       if r.choices[0].message.tool_calls)
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, seed=seed, **kwargs):
        for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if call.index not in calls:
                assert call.id and call.function.name == "Person"
                assert call.function.arguments == ""
                calls[call.index] = {"id": call.id, "pieces": []}
            elif call.function.arguments:
                calls[call.index]["pieces"].append(call.function.arguments)
    assert len(calls) == len(whole)
    for streamed, call in zip(calls.values(), whole):
        assert len(streamed["pieces"]) > 1
        assert json.loads("".join(streamed["pieces"])) == json.loads(call.function.arguments)


def test_responses_parse_nested_format_and_forced_tool(client):
    r = client.responses.parse(model=MODEL, input="Who is Ann?", text_format=Person,
                               max_output_tokens=120, temperature=0)
    assert isinstance(r.output_parsed, Person)
    tool = {"type": "function", "name": "save_person", "strict": True,
            "parameters": openai.pydantic_function_tool(Person)["function"]["parameters"]}
    r = client.responses.parse(model=MODEL, input="Save Ann.", text_format=Node, tools=[tool],
                               tool_choice="required", max_output_tokens=120, temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and all(Person.model_validate_json(c.arguments) for c in calls)


@pytest.mark.parametrize("seed", [0, 1])
def test_responses_auto_tools_beside_text_format(client, seed):
    tool = {"type": "function", "name": "save_person", "strict": True,
            "parameters": openai.pydantic_function_tool(Person)["function"]["parameters"]}
    r = client.responses.parse(model=MODEL, input="Save Ann.", text_format=Address,
                               tools=[tool], max_output_tokens=300, temperature=1.0,
                               extra_body={"seed": seed})
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed"
    if calls:
        assert all(Person.model_validate_json(c.arguments) for c in calls)
    else:
        assert isinstance(r.output_parsed, Address)


def test_responses_chain_with_default_store_and_input_items(client):
    first = client.responses.create(model=MODEL, input="Hello", max_output_tokens=5,
                                    temperature=0)
    assert first.store is True
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, max_output_tokens=5, temperature=0,
        input=[{"role": "user", "content": "one"}, {"role": "user", "content": "two"},
               {"role": "user", "content": "three"}])
    assert second.previous_response_id == first.id
    items = client.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["three", "two", "one"]  # newest first
    page = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["one", "two"] and page.has_more
    rest = client.responses.input_items.list(second.id, order="asc", after=page.last_id)
    assert [i.content[0].text for i in rest.data] == ["three"] and not rest.has_more
    # The SDK's auto-pagination follows the cursors to the end.
    assert [i.id for i in client.responses.input_items.list(second.id, limit=1)] == \
        [i.id for i in items.data]
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.input_items.list(second.id, limit=101)
    assert exc.value.body["param"] == "limit"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


def test_responses_stream_and_cut_tool_call(client):
    tool = {"type": "function", "name": "save_person",
            "parameters": Person.model_json_schema()}
    with client.responses.stream(model=MODEL, input="Save Ann.", tools=[tool],
                                 tool_choice="required", max_output_tokens=300,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    calls = [i for i in final.output if i.type == "function_call"]
    assert calls and all(Person.model_validate_json(c.arguments) for c in calls)
    # Each call's arguments stream in pieces that add up to them, then a done event.
    deltas: dict[str, list[str]] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            deltas.setdefault(e.item_id, []).append(e.delta)
    done = {e.item_id: e.arguments for e in events
            if e.type == "response.function_call_arguments.done"}
    assert list(deltas) == list(done) == [c.id for c in calls]
    assert all(len(deltas[c.id]) > 1 and "".join(deltas[c.id]) == done[c.id] == c.arguments
               for c in calls)
    cut = client.responses.create(model=MODEL, input="Save Ann.", tools=[tool],
                                  tool_choice="required", temperature=0,
                                  max_output_tokens=final.usage.output_tokens // 2)
    assert cut.status == "incomplete"
    assert {i.type for i in cut.output} <= {"function_call"} and len(cut.output) < len(calls)
    assert [json.loads(i.arguments) for i in cut.output] == \
        [json.loads(c.arguments) for c in calls[:len(cut.output)]]
