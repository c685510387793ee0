"""Tool calls as each model family writes them: Hermes `<tool_call>`, Llama 3 JSON, Mistral
`[TOOL_CALLS]`. Streamed in any pieces they give what the whole text gives; text that looks
like a call but does not parse comes back as content, unchanged; a call that fails its tool's
schema is returned and counted. The server part runs a tiny model whose output a grammar makes
look like a Llama 3 call, parsed by `--tool-call-parser llama3_json`, through the openai client.
"""

import json
import re
import time

import httpx
import jsonschema
import openai
import pytest

from api_server.chat_turn import ChatDelta
from api_server.output_blocks import BlockTracker
from api_server.tool_calls import ForcedCallCollector
from api_server.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    render_calls,
    resolve_tool_call_parser,
)
from api_server.tool_validation import ToolCallChecker

PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}


def run_parser(name, pieces, streamed=None):
    """(content, calls) of the output in these pieces; checks how the calls streamed: each
    streamed call's pieces add up to its arguments, or it was dropped (not returned). The
    names of the calls that streamed go into `streamed`."""
    parser = PARSERS[name]()
    content, calls, args, dropped = "", [], {}, []
    for piece in [*pieces, None]:
        text, found = parser.push(piece) if piece is not None else parser.finish()
        content += text
        calls += found
        for p in parser.progress():
            args[p.call.id] = args.get(p.call.id, "") + p.arguments
        dropped += parser.dropped()
    assert not {c.id for c in dropped} & {c.id for c in calls}
    assert set(args) <= {c.id for c in calls + dropped}
    assert all(args[c.id] == c.arguments for c in calls if c.id in args)
    if streamed is not None:
        streamed += [c.name for c in calls if c.id in args]
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def splits(text):
    """The text whole, char by char, and in pieces of 3 and 7."""
    return [[text], list(text), [text[i:i + 3] for i in range(0, len(text), 3)],
            [text[i:i + 7] for i in range(0, len(text), 7)]]


CASES = [
    # (parser, model output, expected content, expected calls)
    ("hermes", 'Let me check. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
     "Let me check. ", [("f", {"a": 1})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>'
               '{"name": "g", "arguments": {"b": [1, 2]}}</tool_call>', "\n",
     [("f", {}), ("g", {"b": [1, 2]})]),
    ("hermes", "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}", "", [("f", {"a": 1})]),
    ("llama3_json", '{"name": "f", "parameters": {"city": "Paris"}}', "",
     [("f", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", '
                    '"parameters": {"x": 1}}', "", [("f", {}), ("g", {"x": 1})]),
    ("llama3_json", "The answer is {not a call}.", "The answer is {not a call}.", []),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", '
                '"arguments": {}}]', "Sure.", [("f", {"a": 1}), ("g", {})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": "x"}[TOOL_CALLS]g[CALL_ID]abc123def[ARGS]{}', "",
     [("f", {"a": "x"}), ("g", {})]),
]

MALFORMED = [
    ("hermes", "<tool_call>{not json</tool_call> and more"),
    ("hermes", '<tool_call>{"name": "f", "arguments": "not an object"}</tool_call>'),
    ("hermes", "<tool_call>{\"name\": \"f\", \"argu"),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1'),
    ("llama3_json", '{"city": "Paris"}'),
    ("llama3_json", '{"name": "f", "parameters": [1, 2]}'),
    ("mistral", "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": 1}"),
    ("mistral", "[TOOL_CALLS]f[ARGS]not json"),
    ("mistral", "[TOOL_CALLS] and then prose"),
]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parsers_stream_as_they_parse_whole(name, text, content, calls):
    for pieces in splits(text):
        streamed = []
        assert run_parser(name, pieces, streamed) == (content, calls), pieces
        # Calls written as JSON objects stream their arguments; Mistral's [ARGS] ones whole.
        assert streamed == ([] if "[ARGS]" in text else [c[0] for c in calls])


@pytest.mark.parametrize("name,text", MALFORMED)
def test_malformed_calls_come_back_as_content(name, text):
    for pieces in splits(text):
        assert run_parser(name, pieces) == (text, []), pieces


def test_content_streams_before_a_call_completes():
    parser = HermesParser()
    assert parser.push("Hello <tool") == ("Hello ", [])
    parser = MistralParser()
    assert parser.push("Hello [TOOL") == ("Hello ", [])
    parser = Llama3JsonParser()
    assert parser.push("Hello") == ("Hello", [])


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_rendered_history_parses_back(name):
    history = [{"id": "1", "type": "function",
                "function": {"name": "f", "arguments": '{"a": 1, "b": "é"}'}},
               {"id": "2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    assert run_parser(name, [render_calls(name, history)]) == \
        ("", [("f", {"a": 1, "b": "é"}), ("g", {})])


@pytest.mark.parametrize("template,parser", [
    ("{{ '<tool_call>' }}", "hermes"), ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"), ("{{ messages }}", "hermes"), (None, "hermes")])
def test_auto_reads_the_chat_template(template, parser):
    assert resolve_tool_call_parser("auto", template) == parser
    assert resolve_tool_call_parser("mistral", template) == "mistral"


def test_schema_check_counts_failures_and_is_bounded():
    class Counter:
        value = 0

        def inc(self):
            self.value += 1

    from api_server.tool_calls import ToolCall

    counter = Counter()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}},
        "required": ["s"]}}}]
    checker = ToolCallChecker(tools, counter)
    assert checker.check(ToolCall("f", '{"s": "aaa"}'))
    assert not checker.check(ToolCall("f", '{"t": 1}'))
    assert not checker.check(ToolCall("nope", "{}"))
    started = time.perf_counter()
    assert not checker.check(ToolCall("f", json.dumps({"s": "a" * 5000 + "b"})))
    assert time.perf_counter() - started < 2.0  # Python's re would backtrack for ages
    assert counter.value == 3


@pytest.mark.parametrize("size", [1, 3, 7])
def test_forced_calls_stream_their_arguments_and_a_cut_call_is_dropped(size):
    text = ('[{"name": "a\\"b", "arguments": {"s": "}]\\"{", "l": [1, {"k": 2}]}}, '
            '{"name": "noop", "arguments": {}}, {"name": "a", "arguments": {"s": "cut')
    collector, calls, pieces = ForcedCallCollector(), [], {}
    for i in range(0, len(text), size):
        calls += collector.push(text[i:i + size])[1]
        for piece in collector.progress():
            pieces[piece.call.id] = pieces.get(piece.call.id, "") + piece.arguments
    assert collector.finish() == ("", [])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ('a"b', {"s": '}]"{', "l": [1, {"k": 2}]}), ("noop", {})]
    assert [pieces[c.id] for c in calls] == [c.arguments for c in calls]
    assert list(pieces.values())[-1] == '{"s": "cut'  # streamed, then cut: not a call


@pytest.mark.parametrize("size", [1, 4, 9])
def test_hermes_calls_stream_their_arguments_once_named(size):
    """Auto mode: a call's arguments stream from when its name is complete and its object has
    begun; the pieces add up to the call's arguments exactly. A call that then does not parse
    is dropped (its pieces stop) and comes back as content; one written otherwise (arguments
    as a JSON string) is returned whole."""
    bad = '<tool_call>{"name": "b", "arguments": {"x": tru}}</tool_call>'
    text = ('Hi <tool_call>\n{"name": "a\\"b", "arguments": {"s": "}<\\"{", "l": [1]}}\n'
            '</tool_call>' + bad + ' ok<tool_call>{"name": "c", "arguments": "{}"}</tool_call>'
            '<tool_call>{"name":"d","parameters":{"k": {}}}</tool_call>'
            '<tool_call>{"name": "e", "arguments": {"cut')
    parser, content, calls, pieces, dropped = HermesParser(), "", [], {}, []
    for i in range(0, len(text), size):
        shown, found = parser.push(text[i:i + size])
        content, calls = content + shown, calls + found
        for piece in parser.progress():
            assert piece.call.id not in {c.id for c in calls}  # a call's pieces come first
            pieces[piece.call.id] = pieces.get(piece.call.id, "") + piece.arguments
        dropped += parser.dropped()
    shown, found = parser.finish()
    content, calls, dropped = content + shown, calls + found, dropped + parser.dropped()
    assert content == "Hi " + bad + ' ok<tool_call>{"name": "e", "arguments": {"cut'
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ('a"b', {"s": '}<"{', "l": [1]}), ("c", {}), ("d", {"k": {}})]
    assert [pieces.get(c.id) for c in calls] == [calls[0].arguments, None, calls[2].arguments]
    assert [(c.name, pieces[c.id]) for c in dropped] == [("b", '{"x": tru}'), ("e", '{"cut')]
    assert set(pieces) == {c.id for c in calls + dropped if c.name != "c"}


def test_streamed_calls_as_blocks_one_open_at_a_time():
    """What /v1/responses and /v1/messages stream: a call's block opens with its first piece,
    its deltas are its arguments, blocks never overlap (Anthropic's events need that), and a
    dropped call's block closes but is not part of the answer, its text shown after it."""
    bad = '<tool_call>{"name": "b", "arguments": {"x": tru}}</tool_call>'
    text = 'Hi <tool_call>{"name": "a", "arguments": {"s": [1, 2]}}</tool_call>' + bad + " ok"
    parser, tracker, events = HermesParser(), BlockTracker(), []
    for i in range(0, len(text) + 1, 2):
        end = i + 2 > len(text)
        content, calls = parser.push(text[i:i + 2])
        if end:
            rest, more = parser.finish()
            content, calls = content + rest, calls + more
        events += tracker.feed(ChatDelta(0, content=content, calls=calls,
                                         call_deltas=parser.progress(),
                                         dropped_calls=parser.dropped(),
                                         finish_reason="stop" if end else None))
    open_blocks = []
    for e in events:
        if e.type == "open":
            assert not open_blocks
            open_blocks.append(e.block)
        else:
            assert open_blocks == [e.block]
            if e.type == "close":
                open_blocks.pop()
    assert [(b.kind, b.dropped) for b in tracker.blocks] == \
        [("text", False), ("call", False), ("call", True), ("text", False)]
    call = tracker.blocks[1]
    assert sum(e.block is call and e.type == "delta" for e in events) > 1
    assert call.text == call.call.arguments == '{"s": [1, 2]}'
    assert [b.text for b in tracker.answer] == ["Hi ", call.text, bad + " ok"]


# ---- through the server ------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"]}}}]


def llama_call_format(args_schema):
    """A grammar that makes the model write a Llama 3 style call of get_weather."""
    return {"type": "json_schema", "json_schema": {"name": "call", "schema": {
        "type": "object", "properties": {"name": {"const": "get_weather"},
                                         "parameters": args_schema},
        "required": ["name", "parameters"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(features_server):
    yield features_server
    assert "Traceback" not in features_server.log()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def answer_first(args_schema) -> dict:
    """A format for a Llama 3 style call of get_weather written parameters first."""
    return {"type": "json_schema", "json_schema": {"name": "call", "schema": {
        "type": "object", "properties": {"parameters": args_schema,
                                         "name": {"const": "get_weather"}},
        "required": ["parameters", "name"], "additionalProperties": False}}}


def prefer_answer(server) -> dict[str, int]:
    """A response format beside tools lets the model either call a tool (`{"name": ...`) or
    answer in the format; this logit_bias steers the tiny model into an answer that starts
    `{"parameters": ...` (a call to the Llama 3 parser all the same)."""
    def tokens(text):
        return httpx.post(server.url + "/tokenize", json={
            "model": "tiny", "prompt": text, "add_special_tokens": False}).json()["tokens"]
    return {str(i): 100 for i in set(tokens('{"parameters')) - set(tokens('{"name'))}


def failures(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    match = re.search(r"^loom:tool_call_schema_failures_total\{[^}]*\} (\S+)$", text, re.M)
    return float(match.group(1))


def test_llama3_calls_are_parsed_in_auto_mode(client, server):
    args = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"], "additionalProperties": False}
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
              tools=TOOLS, temperature=0, max_tokens=60, response_format=llama_call_format(args),
              parallel_tool_calls=False)  # one call, either as the format's answer or a call
    before = failures(server)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    streamed, finish = "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            streamed += c.function.arguments or ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert finish == "tool_calls" and streamed == call.function.arguments
    assert failures(server) == before


def test_a_call_failing_its_schema_is_returned_and_counted(client, server):
    bad = {"type": "object", "properties": {"city": {"type": "integer"}}, "required": ["city"],
           "additionalProperties": False}
    before = failures(server)
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
        temperature=0, max_tokens=60, response_format=answer_first(bad),
        logit_bias=prefer_answer(server), parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(json.loads(call.function.arguments)["city"], int)
    assert failures(server) == before + 1


def test_json_that_is_not_a_call_is_content(client, server):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
        temperature=0, max_tokens=60, response_format=answer_first({"type": "integer"}),
        logit_bias=prefer_answer(server), parallel_tool_calls=False)
    choice = r.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason == "stop"
    assert json.loads(choice.message.content)["name"] == "get_weather"
