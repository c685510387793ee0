"""POST /v1/responses through the official openai client (`responses.create`,
`responses.stream`), checked against chat completions on the same conversation: the same greedy
text, the same token counts, tool round trips, json_schema output that validates, stored
responses, and every error a 400 in OpenAI's shape naming the parameter."""

import json

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import UNTIED_KEY

CONTEXT = 512  # (conftest.untied_server's)
AUTH = {"authorization": f"Bearer {UNTIED_KEY}"}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                         "properties": {"city": {"type": "string", "maxLength": 12}}}}]
CHAT_TOOLS = [{"type": "function", "function": {k: TOOLS[0][k] for k in
                                                ("name", "description", "parameters")}}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


@pytest.fixture(scope="module")
def server(untied_server):
    # Untied embeddings: greedy text that varies (a tied tiny model repeats its last token).
    yield untied_server  # (shared with tests/test_anthropic_api.py)
    assert "Traceback" not in untied_server.log()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=UNTIED_KEY, max_retries=0)


def chat(client, messages, **kw):
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, **kw)


def test_text_equals_chat_completions(client):
    r = client.responses.create(model="tiny", instructions="Be brief.", input="Hello there",
                                max_output_tokens=12, temperature=0)
    c = chat(client, [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Hello there"}], max_tokens=12)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == c.choices[0].message.content and r.output_text.strip()
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens) == \
        (c.usage.prompt_tokens, c.usage.completion_tokens) == (c.usage.prompt_tokens, 12)


def test_stream_equals_non_stream(client):
    kw = dict(model="tiny", input=[{"role": "user", "content": "Tell me a story"}],
              max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output[0].content[0].text == text
    assert final.usage.output_tokens == whole.usage.output_tokens == 10


def test_json_schema_output_validates(client):
    fmt = {"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}}
    with client.responses.stream(model="tiny", input="A thing as JSON", text=fmt,
                                 max_output_tokens=80, temperature=0) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), SCHEMA)
    assert deltas == final.output_text
    plain = client.responses.create(model="tiny", input="A thing as JSON", text=fmt,
                                    max_output_tokens=80, temperature=0)
    assert plain.output_text == final.output_text


def test_forced_tool_call_round_trip(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    with client.responses.stream(model="tiny", input=ask, tools=TOOLS, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=60,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), TOOLS[0]["parameters"])
    streamed = "".join(e.delta for e in events
                       if e.type == "response.function_call_arguments.delta")
    assert streamed == call.arguments
    assert any(e.type == "response.function_call_arguments.done" for e in events)
    named = client.responses.create(model="tiny", input=ask, tools=TOOLS, temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=60)
    assert named.output[0].arguments == call.arguments
    # The tool's result goes back; the answer is text, as chat completions gives it.
    result = '{"temperature": 21}'
    answer = client.responses.create(
        model="tiny", tools=TOOLS, temperature=0, max_output_tokens=12,
        input=ask + [call.model_dump(exclude_none=True),
                     {"type": "function_call_output", "call_id": call.call_id,
                      "output": result}])
    c = chat(client, ask + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result}],
        tools=CHAT_TOOLS, max_tokens=12)
    assert answer.output_text == c.choices[0].message.content
    assert answer.usage.input_tokens == c.usage.prompt_tokens


def test_no_max_output_tokens_gets_the_rest_of_the_context(client):
    r = client.responses.create(model="tiny", input="Hi", temperature=0)
    assert r.status == "completed" or \
        r.usage.input_tokens + r.usage.output_tokens == CONTEXT


def test_stored_responses_continue(client, server):
    first = client.responses.create(model="tiny", input="Hello", max_output_tokens=6,
                                    temperature=0, store=True)
    got = client.responses.retrieve(first.id)
    assert got.output_text == first.output_text
    second = client.responses.create(model="tiny", input="And then?", max_output_tokens=6,
                                     temperature=0, previous_response_id=first.id)
    c = chat(client, [{"role": "user", "content": "Hello"},
                      {"role": "assistant", "content": first.output_text},
                      {"role": "user", "content": "And then?"}], max_tokens=6)
    assert second.output_text == c.choices[0].message.content
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=2,
                                       store=False)  # (the default: stored)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="tiny", input="x", previous_response_id=unstored.id)
    assert exc.value.body["param"] == "previous_response_id"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def nested(depth):
    value = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}}
    return value


BAD = [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 42}, "input"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x",
                                        "schema": {"type": "wat"}}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x",
                                        "schema": nested(100)}}}, "text.format.schema"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "reasoning": {"effort": "enormous"}}, "reasoning.effort"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": [{"role": "user", "content": "x"}] * 4097}, "input"),
    ({"input": "x", "tools": TOOLS * 129}, "tools"),
    ({"input": "word " * 200_000}, "input"),
    ({"input": [{"type": "function_call", "call_id": "1", "name": "f",
                 "arguments": "[" * 500 + "]" * 500}]}, "input[0].arguments"),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_requests_are_400s_naming_the_parameter(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_context_overflow_names_both_numbers(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="tiny", input="Hello", max_output_tokens=100_000)
    body = exc.value.body
    assert body["param"] == "max_output_tokens" and body["code"] == "context_length_exceeded"
    assert "100000" in body["message"] and str(CONTEXT) in body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-5", input="Hello")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 600}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}],
                              "max_tokens": 600}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}],
                              "max_completion_tokens": 600}, "max_completion_tokens"),
    ("/v1/responses", {"input": "Hello", "max_output_tokens": 600}, "max_output_tokens"),
])
def test_every_route_refuses_what_the_context_cannot_hold(server, path, body, param):
    r = httpx.post(server.url + path, json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, "context_length_exceeded")
    assert f"{param}=600" in error["message"] and str(CONTEXT) in error["message"]
