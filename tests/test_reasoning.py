"""Reasoning models: `<think>...</think>` split from the answer on every API
(`reasoning_content` on chat, reasoning items on Responses, thinking blocks on Messages), and
a reasoning budget that ends the thought and moves on to the answer.

The model is a tiny random one with a real tokenizer that knows `<think>` and `</think>` and a
chat template that opens the thought in the generation prompt (as DeepSeek-R1's and
Qwen3-Thinking's do). Random weights never close a thought on their own, so the budget is what
makes the output deterministic: the oracle is Hugging Face `transformers` greedy decoding on the
same weights, continued after the same forced `</think>`.
"""

import json
import os

import anthropic
import httpx
import jsonschema
import openai
import pytest

from api_server.reasoning import FORCED_CLOSE, ThinkParser, resolve_reasoning_parser
from tests.helpers import hf_greedy, make_tiny_checkpoint, start_server

THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "Why is the sky blue?"}]
TOOL_CALL_TOKEN = 49154


# ---- the parser ------------------------------------------------------------------------------
@pytest.mark.parametrize("in_reasoning,text,expected", [
    (True, "Rayleigh scattering.</think>\n\nBecause of air.", ("Rayleigh scattering.",
                                                               "Because of air.")),
    (False, "<think>\nHmm.</think>\n\nBlue.", ("Hmm.", "Blue.")),
    (False, "  <think>Hmm.</think>Blue.", ("Hmm.", "Blue.")),
    (False, "Blue. <think>no</think>", ("", "Blue. <think>no</think>")),
    (False, "\n\nBlue.", ("", "\n\nBlue.")),
    (True, "Still thinking about </thi", ("Still thinking about </thi", "")),
    (False, "<thin", ("", "<thin")),
])
def test_think_parser_streams_as_it_parses_whole(in_reasoning, text, expected):
    for size in (len(text), 1, 2, 5):
        parser = ThinkParser(in_reasoning)
        reasoning, content = "", ""
        for i in range(0, len(text), size):
            r, c = parser.push(text[i:i + size])
            reasoning, content = reasoning + r, content + c
        r, c = parser.finish()
        assert (reasoning + r, content + c) == expected, size


def test_the_parser_is_on_when_the_template_thinks():
    assert resolve_reasoning_parser("auto", THINK_TEMPLATE) == "think"
    assert resolve_reasoning_parser("auto", "{{ messages }}") is None
    assert resolve_reasoning_parser("none", THINK_TEMPLATE) is None
    assert resolve_reasoning_parser("think", "{{ messages }}") == "think"


# ---- through the server ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(smollm2_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    target = str(tmp_path_factory.mktemp("tiny-thinker"))
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    tok.chat_template = THINK_TEMPLATE
    make_tiny_checkpoint(target, smollm2_dir, vocab_size=len(tok), tie_word_embeddings=False,
                         seed=3)
    for name in os.listdir(target):  # SmolLM2's tokenizer files: replaced by the new ones
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            os.remove(os.path.join(target, name))
    tok.save_pretrained(target)
    assert tok.convert_tokens_to_ids("<tool_call>") == TOOL_CALL_TOKEN
    return target


@pytest.fixture(scope="module")
def server(model_dir):
    srv = start_server(model_dir, "--served-model-name", "thinker", "--max-model-len", "256")
    yield srv
    assert srv.stop() == 0
    assert "Traceback" not in srv.log()


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def oracle(server, model_dir):
    """Hugging Face's greedy thought of BUDGET tokens, then its answer after the forced tag."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir).float().eval()
    prompt = httpx.post(server.url + "/tokenize", json={"messages": ASK}).json()["tokens"]
    thought = hf_greedy(model, tok, prompt, BUDGET)
    close = tok.encode(FORCED_CLOSE, add_special_tokens=False)
    answer = hf_greedy(model, tok, prompt + thought + close, MAX_TOKENS - BUDGET - len(close))
    return tok.decode(thought).lstrip(), tok.decode(answer).lstrip()


BUDGET, MAX_TOKENS = 5, 16


def test_a_thought_without_end_is_all_reasoning(oai):
    r = oai.chat.completions.create(model="thinker", messages=ASK, max_tokens=8, temperature=0)
    message = r.choices[0].message
    assert message.reasoning_content and not message.content
    assert r.choices[0].finish_reason == "length"


def test_the_budget_ends_the_thought_as_the_oracle_does(oai, oracle):
    r = oai.chat.completions.create(model="thinker", messages=ASK, max_tokens=MAX_TOKENS,
                                    temperature=0, extra_body={"max_reasoning_tokens": BUDGET})
    message = r.choices[0].message
    assert all(oracle) and (message.reasoning_content, message.content) == oracle
    assert r.usage.completion_tokens == MAX_TOKENS
    reasoning, content = "", ""
    for chunk in oai.chat.completions.create(
            model="thinker", messages=ASK, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"max_reasoning_tokens": BUDGET}):
        delta = chunk.choices[0].delta
        if getattr(delta, "reasoning_content", None):
            assert not delta.content  # its own deltas
            reasoning += delta.reasoning_content
        content += delta.content or ""
    assert (reasoning, content) == oracle


def test_responses_return_reasoning_items(oai, oracle):
    kw = dict(model="thinker", input=ASK, max_output_tokens=MAX_TOKENS, temperature=0,
              extra_body={"reasoning": {"max_tokens": BUDGET}})
    r = oai.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert (r.output[0].content[0].text, r.output_text) == oracle
    assert r.usage.output_tokens_details.reasoning_tokens == BUDGET
    events = list(oai.responses.create(**kw, stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, text) == oracle
    effort = oai.responses.create(model="thinker", input=ASK, max_output_tokens=25,
                                  temperature=0, reasoning={"effort": "low"})
    assert effort.usage.output_tokens_details.reasoning_tokens == 5  # 20% of 25


def test_messages_return_thinking_blocks(server, oracle):
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    kw = dict(model="thinker", max_tokens=MAX_TOKENS, messages=ASK,
              thinking={"type": "enabled", "budget_tokens": BUDGET},
              extra_body={"temperature": 0})
    m = client.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert (m.content[0].thinking, m.content[1].text) == oracle
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert (final.content[0].thinking, final.content[1].text) == oracle


def test_no_thinking_asked_for(server, oai):
    chat = oai.chat.completions.create(
        model="thinker", messages=ASK, max_tokens=8, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert chat.choices[0].message.content and not chat.choices[0].message.reasoning_content
    answer = chat.choices[0].message.content
    effort = oai.chat.completions.create(model="thinker", messages=ASK, max_tokens=8,
                                         temperature=0, reasoning_effort="none")
    assert effort.choices[0].message.content == answer
    r = oai.responses.create(model="thinker", input=ASK, max_output_tokens=8, temperature=0,
                             reasoning={"effort": "none"})
    assert [o.type for o in r.output] == ["message"] and r.output_text == answer
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    m = client.messages.create(model="thinker", max_tokens=8, messages=ASK,
                               thinking={"type": "disabled"}, extra_body={"temperature": 0})
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == answer


def test_json_schema_answers_without_thinking(oai):
    schema = {"type": "object", "required": ["color"], "additionalProperties": False,
              "properties": {"color": {"enum": ["blue", "red"]}}}
    r = oai.chat.completions.create(
        model="thinker", messages=ASK, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    message = r.choices[0].message
    jsonschema.validate(json.loads(message.content), schema)
    assert not message.reasoning_content


def test_malformed_tool_call_text_is_content(oai):
    # Forced to write <tool_call> over and over: never a call, all of it comes back.
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    kw = dict(model="thinker", messages=ASK, tools=tools, max_tokens=6, temperature=0,
              logit_bias={str(TOOL_CALL_TOKEN): 100}, extra_body={"max_reasoning_tokens": 0})
    r = oai.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.message.content == "<tool_call>" * 6 and not choice.message.tool_calls
    assert choice.finish_reason == "length"
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       oai.chat.completions.create(**kw, stream=True) if c.choices)
    assert streamed == choice.message.content
