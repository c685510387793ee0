"""Anthropic's Messages API through the official anthropic client (create, stream,
count_tokens), checked against chat completions on the same conversation: the same greedy
text and token counts, tool round trips, structured output, stop sequences, `x-api-key`, and
every error in Anthropic's shape."""

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from api_server.anthropic_route import AnthropicRoute, _MessageBuilder
from api_server.engine_client import GenerationFailed
from api_server.responses_protocol import ResponsesRequest
from api_server.responses_route import ResponsesRoute, _ResponseBuilder
from tests.conftest import UNTIED_KEY

KEY = UNTIED_KEY
CONTEXT = 512  # (conftest.untied_server's)
GREEDY = {"temperature": 0}  # this client version has no temperature argument
TOOLS = [{"name": "get_weather", "description": "Weather in a city",
          "input_schema": {"type": "object", "required": ["city"], "additionalProperties": False,
                           "properties": {"city": {"type": "string", "maxLength": 12}}}}]
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": TOOLS[0]["input_schema"]}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(untied_server):
    yield untied_server  # (shared with tests/test_responses_api.py)
    assert "Traceback" not in untied_server.log()


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def chat(oai, messages, **kw):
    return oai.chat.completions.create(model="tiny", messages=messages, temperature=0, **kw)


def test_text_equals_chat_completions(client, oai):
    m = client.messages.create(model="tiny", max_tokens=12, system="Be brief.",
                               messages=[{"role": "user", "content": "Hello there"}],
                               extra_body=GREEDY)
    c = chat(oai, [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "Hello there"}], max_tokens=12)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == c.choices[0].message.content and m.content[0].text.strip()
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert (m.usage.input_tokens, m.usage.output_tokens) == (c.usage.prompt_tokens, 12)
    counted = client.messages.count_tokens(model="tiny", system="Be brief.",
                                           messages=[{"role": "user", "content": "Hello there"}])
    assert counted.input_tokens == m.usage.input_tokens


def test_stream_equals_non_stream(client):
    kw = dict(model="tiny", max_tokens=10, messages=[{"role": "user", "content": "A story"}],
              extra_body=GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.usage.output_tokens == whole.usage.output_tokens == 10
    events = [e.type for e in client.messages.create(**kw, stream=True)]
    assert events[:2] == ["message_start", "content_block_start"]
    assert set(events[2:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences(client):
    kw = dict(model="tiny", max_tokens=12, messages=[{"role": "user", "content": "Go"}],
              extra_body=GREEDY)
    text = client.messages.create(**kw).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    m = client.messages.create(**kw, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.index(stop)]
    with client.messages.stream(**kw, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_forced_tool_use_round_trip(client, oai):
    kw = dict(model="tiny", max_tokens=60, messages=ASK, tools=TOOLS, extra_body=GREEDY)
    m = client.messages.create(**kw, tool_choice={"type": "any",
                                                  "disable_parallel_tool_use": True})
    (use,) = m.content
    assert use.type == "tool_use" and use.name == "get_weather" and m.stop_reason == "tool_use"
    jsonschema.validate(use.input, TOOLS[0]["input_schema"])
    with client.messages.stream(**kw, tool_choice={"type": "tool", "name": "get_weather"}) as s:
        events = list(s)
        streamed = s.get_final_message()
    assert streamed.content[0].input == use.input and streamed.stop_reason == "tool_use"
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta"
               for e in events)
    # The tool's result goes back; the answer is text, as chat completions gives it.
    result = '{"temperature": 21}'
    conversation = ASK + [
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": result}]}]
    answer = client.messages.create(model="tiny", max_tokens=12, messages=conversation,
                                    tools=TOOLS, extra_body=GREEDY)
    c = chat(oai, ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": use.id, "type": "function",
            "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": result}],
        tools=CHAT_TOOLS, max_tokens=12)
    assert answer.content[0].text == c.choices[0].message.content
    assert answer.usage.input_tokens == c.usage.prompt_tokens == client.messages.count_tokens(
        model="tiny", messages=conversation, tools=TOOLS).input_tokens


def test_structured_output_validates(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["name"],
              "properties": {"name": {"type": "string", "maxLength": 10}}}
    m = client.messages.create(model="tiny", max_tokens=60, messages=ASK, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema",
                                                         "schema": schema}})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_the_api_key_is_taken_either_way(server):
    body = {"model": "tiny", "max_tokens": 2, "messages": ASK}
    for headers in ({"x-api-key": KEY}, {"authorization": f"Bearer {KEY}"}):
        assert httpx.post(server.url + "/v1/messages", json=body, headers=headers,
                          timeout=30).status_code == 200
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert r.status_code == 401
    assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                   "message": "missing or invalid API key"}}
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) \
            .messages.create(model="tiny", max_tokens=2, messages=ASK)


def deep(depth):
    value = {}
    for _ in range(depth):
        value = {"a": value}
    return value


BAD = [
    ({"messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 5}, 400, "messages"),
    ({"max_tokens": 0, "messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, 400, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400,
     "messages[0].role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document"}]}]}, 400,
     "messages[0].content[0].type"),
    ({"max_tokens": 5, "messages": ASK, "temperature": 1.5}, 400, "temperature"),
    ({"max_tokens": 5, "messages": ASK, "top_k": -1}, 400, "top_k"),
    ({"max_tokens": 5, "messages": ASK, "stop_sequences": ["x"] * 17}, 400, "stop_sequences"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305"}]}, 400,
     "tools[0].type"),
    ({"max_tokens": 5, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "magic"}}, 400,
     "tool_choice.type"),
    ({"max_tokens": 5, "messages": ASK, "tools": TOOLS,
      "tool_choice": {"type": "tool", "name": "nope"}}, 400, "tool_choice"),
    ({"max_tokens": 5, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 9}},
     400, "thinking.budget_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": deep(100)}]}]}, 400,
     "messages[0].content[0].input"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}] * 4097}, 400,
     "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}] * 1025}]}, 400, "messages[0].content"),
    ({"max_tokens": 5, "messages": ASK, "tools": TOOLS * 129}, 400, "tools"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "word " * 300_000}]}, 400,
     "messages"),
    ({"max_tokens": 5000, "messages": ASK}, 400, "max_tokens"),
    ({"max_tokens": 5, "messages": ASK, "model": "claude-opus-4"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_errors_have_anthropics_shape(server, body, status, param):
    body = {"model": "tiny", **body}
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY},
                   timeout=60)
    assert r.status_code == status, r.text
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == ("not_found_error" if status == 404 else
                                      "invalid_request_error")
    assert error["error"]["message"].startswith(param) or param in error["error"]["message"]


def test_context_overflow_names_both_numbers(client):
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="tiny", max_tokens=5000, messages=ASK)
    message = exc.value.body["error"]["message"]
    assert "5000" in message and str(CONTEXT) in message
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="tiny", messages=[
            {"role": "user", "content": "word " * 300_000}])


def test_transport_errors_have_anthropics_shape(server):
    headers = {"x-api-key": KEY, "content-type": "application/json"}
    for raw in (b"{not json", b"x" * (3 << 20)):
        r = httpx.post(server.url + "/v1/messages", content=raw, headers=headers, timeout=30)
        assert r.json()["type"] == "error", r.text
        assert r.status_code == (400 if len(raw) < 100 else 413)
    assert httpx.get(server.url + "/v1/messages", headers=headers).json()["type"] == "error"


class FailingRun:
    """A run whose engine fails after one delta, as when a worker dies mid-stream."""

    request_id = "abc"
    prompt_tokens = 3

    def deltas(self):
        from api_server.chat_turn import ChatDelta

        async def gen():
            yield ChatDelta(0, content="Hi", prompt_tokens=3, completion_tokens=1)
            raise GenerationFailed("the engine stopped: worker died")

        return gen()


def events_of(body) -> list[tuple[str, dict]]:
    import asyncio

    async def collect():
        return [chunk async for chunk in body]

    out = []
    for chunk in asyncio.run(collect()):
        name, data = chunk.decode().strip().split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_errors_mid_stream_are_events_in_each_apis_shape():
    run = FailingRun()
    events = events_of(AnthropicRoute._events(None, run, _MessageBuilder("tiny", run)))
    assert [name for name, _ in events][-1] == "error"
    assert events[-1][1] == {"type": "error", "error": {
        "type": "api_error", "message": "the engine stopped: worker died"}}
    req = ResponsesRequest(input="x")
    events = events_of(ResponsesRoute._events(None, run, _ResponseBuilder("tiny", req, run),
                                              []))
    assert [name for name, _ in events][-2:] == ["error", "response.failed"]
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
