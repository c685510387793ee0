"""Structured output and tool calls through the official openai client: every output parses
and validates (jsonschema, an independent validator) against its schema."""

import json

import jsonschema
import openai
import pytest

from api_server.tool_calls import ToolCallParser

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                     "maxItems": 3},
        },
        "required": ["name", "age", "role", "tags"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 8},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "qty"], "additionalProperties": False}},
            "shipping": {"type": "object", "properties": {
                "method": {"enum": ["ground", "air"]},
                "express": {"type": "boolean"}},
                "required": ["method", "express"], "additionalProperties": False},
        },
        "required": ["id", "items", "shipping"],
        "additionalProperties": False,
    },
    "answer": {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 40},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["answer", "confidence"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(shared_server, smollm2_dir):
    srv = shared_server(smollm2_dir)
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(client, name, temperature):
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=temperature, seed=11, max_tokens=200,
        messages=[{"role": "user", "content": f"Produce a {name} as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_json_object_mode(client):
    # Sampled at temperature 1 a tiny model may still be inside the object at max_tokens
    # (a long run of digits): every choice that stops is an object, and most stop.
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=1.0, seed=5, max_tokens=150, n=6,
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        response_format={"type": "json_object"})
    stopped = [c for c in r.choices if c.finish_reason == "stop"]
    assert len(stopped) >= 3
    assert all(isinstance(json.loads(c.message.content), dict) for c in stopped)


def test_structured_completion_endpoint(client):
    r = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="A user record:", max_tokens=120, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": SCHEMAS["person"]}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS["person"])


def test_invalid_schema_is_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=5,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}})
    assert exc.value.body["param"] == "response_format.json_schema.schema"
    assert "wat" in exc.value.body["message"]


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "add"}}])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_tool_calls_are_valid(client, tool_choice, temperature):
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, tools=TOOLS,
                                       tool_choice=tool_choice, temperature=temperature,
                                       seed=2, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        if isinstance(tool_choice, dict):
            assert call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_streamed_tool_call_deltas(client):
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK,
                                            tools=TOOLS, tool_choice="required", temperature=0,
                                            max_tokens=80, stream=True)
    name, arguments, finish = None, "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            name = call.function.name or name
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and name in PARAMS
    jsonschema.validate(json.loads(arguments), PARAMS[name])


def test_tool_history_renders(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'},
    ]
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                       tools=TOOLS, temperature=0, max_tokens=30)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content


def test_tool_choice_errors(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function",
                                                    "function": {"name": "nope"}})
    assert exc.value.body["param"] == "tool_choice"


@pytest.mark.parametrize("pieces", [
    ["Sure. <tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}</tool_call>"],
    ["Sure. <tool", "_call>{\"name\": \"add\", ", "\"arguments\": {\"a\": 1, \"b\": 2}}</tool_",
     "call>"],
])
def test_hermes_parser_never_leaks_tags(pieces):
    parser = ToolCallParser()
    shown, calls = "", []
    for p in pieces:
        text, new = parser.push(p)
        shown += text
        calls += new
        assert "<" not in text
    text, new = parser.finish()
    shown += text
    calls += new
    assert shown == "Sure. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]


def test_hermes_parser_keeps_non_calls_and_parallel_calls():
    parser = ToolCallParser()
    text, calls = parser.push("a <b> c <tool_call>not json</tool_call> "
                              "<tool_call>{\"name\": \"x\", \"arguments\": {}}</tool_call>"
                              "<tool_call>{\"name\": \"y\", \"arguments\": {\"k\": 1}}</tool_call>")
    assert text.startswith("a <b> c <tool_call>not json</tool_call>")
    assert [c.name for c in calls] == ["x", "y"]


def test_grammar_tokenizer_built_from_tokenizer_json_equals_llguidance_hf(smollm2_dir):
    # The worker builds llguidance's tokenizer without transformers (start-up cost); it must be
    # the tokenizer llguidance.hf builds from the Hugging Face one, token for token.
    import llguidance.hf
    from transformers import AutoTokenizer

    from worker.structured_output import _llguidance_tokenizer

    ours = _llguidance_tokenizer(smollm2_dir)
    reference = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(smollm2_dir))
    assert ours.vocab_size == reference.vocab_size
    assert ours.eos_tokens == reference.eos_tokens
    assert all(ours.decode_bytes([i]) == reference.decode_bytes([i])
               and ours.is_special_token(i) == reference.is_special_token(i)
               for i in range(ours.vocab_size))


def test_grammar_tokenizer_is_left_out_of_start_up(smollm2_dir):
    # Built when the worker is first idle (or by the first structured request), not before
    # /health: a matcher asked for first still constrains with the right tokenizer.
    import json

    from worker.process import _deferred_start_up
    from worker.structured_output import GrammarCompiler

    first = GrammarCompiler(smollm2_dir)
    assert not first.loaded
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                         "required": ["a"]})
    matcher = first.matcher_for(schema)
    assert first.loaded and first.vocab_size >= 49152
    allowed = first.compute_masks([matcher])[0]
    assert 0 < allowed.sum() < first.vocab_size  # constrained, not everything or nothing

    class Runner:  # what _deferred_start_up looks at
        grammars = GrammarCompiler(smollm2_dir)

    tasks = list(_deferred_start_up(Runner, prefault=None))
    assert tasks == [Runner.grammars.load] and not Runner.grammars.loaded
    tasks[0]()
    assert Runner.grammars.loaded and Runner.grammars.vocab_size == first.vocab_size


def _grammar(smollm2_dir):
    from worker.structured_output import GrammarCompiler

    compiler = GrammarCompiler(smollm2_dir)
    schema = json.dumps(SCHEMAS["answer"])
    start = compiler.matcher_for(schema)
    start.consume_tokens(start.compute_ff_tokens())  # {"answer": (then a quote, spaced or not)
    allowed = compiler.compute_masks([start])[0].astype(bool)
    return compiler, start, allowed


def test_constrained_draws_follow_the_masked_distribution(smollm2_dir):
    # Rows draw before any mask and are masked only when rejected: the tokens they end with
    # must still be distributed as the masked distribution, p restricted to what the grammar
    # allows and renormalised, and never a token the grammar rejects.
    import numpy as np
    import torch

    from pipelines import SamplingParams
    from worker.sampler import RequestSamplingState, sample_isolated

    compiler, start, allowed = _grammar(smollm2_dir)
    ok = np.flatnonzero(allowed)
    bad = np.flatnonzero(~allowed)
    assert len(ok) >= 2 and len(bad) > 1000
    # Half of the mass on rejected tokens, the rest 3:1 on two allowed ones.
    probs = torch.zeros(compiler.vocab_size)
    probs[bad[:2]] = 0.25
    probs[ok[:2]] = torch.tensor([0.375, 0.125])
    logits = probs.log().repeat(8, 1)
    counts = torch.zeros(2)
    for trial in range(60):
        states = [RequestSamplingState.create(SamplingParams(top_k=0, temperature=1.0,
                                                             seed=trial * 8 + i))
                  for i in range(8)]
        for st in states:
            st.matcher = start.deep_copy()
        failed = {}
        tokens = compiler.sample(logits.clone(), states, list(range(8)), sample_isolated,
                                 failed).tolist()
        assert failed == {}
        assert set(tokens) <= set(ok[:2].tolist())
        counts += torch.tensor([tokens.count(int(ok[0])), tokens.count(int(ok[1]))])
        # Each matcher consumed its token (accepted at once or after its mask): it has moved on.
        after = compiler.compute_masks([st.matcher for st in states]).astype(bool)
        assert not any((row == allowed).all() for row in after)
    assert abs(counts[0] / counts.sum() - 0.75) < 0.06


def test_greedy_constrained_rows_take_the_best_allowed_token(smollm2_dir):
    import torch

    from pipelines import SamplingParams
    from worker.sampler import RequestSamplingState, sample_isolated

    compiler, start, allowed = _grammar(smollm2_dir)
    torch.manual_seed(0)
    logits = torch.randn(6, compiler.vocab_size)
    states = [RequestSamplingState.create(SamplingParams(temperature=0.0)) for _ in range(6)]
    for st in states:
        st.matcher = start.deep_copy()
    logits[:3, torch.from_numpy(allowed)] += 10.0  # rows 0-2: the unmasked argmax passes
    failed = {}
    tokens = compiler.sample(logits.clone(), states, list(range(6)), sample_isolated,
                             failed).tolist()
    assert failed == {}
    masked = logits.masked_fill(~torch.from_numpy(allowed), float("-inf"))
    assert tokens == masked.argmax(dim=-1).tolist()
