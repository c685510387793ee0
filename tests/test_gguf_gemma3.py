"""`loom serve --model gemma-3-270m`: Google's Gemma 3 270M as a Q4_K_M GGUF file (assembled
from its four PyPI part packages), served in its own block formats through the HTTP API,
against transformers loading the same file (`gguf_file=`, which dequantizes it to float32).

The file is the pre-trained (base) model, google/gemma-3-270m, not the instruction-tuned one.

Agreement criterion: tests/test_gguf_serving.py's, with its bounds. Loom's decode steps
quantize the activations to 8 bits per block of 32 before the integer dot products (as
llama.cpp does), so its logits differ from the float32 oracle's; the test teacher-forces the
oracle on Loom's own output and requires, at every generated position:
- Loom's token is the oracle's greedy choice, or within TIE_NATS of its log probability
  (a near tie that quantization noise may break either way);
- the log probability Loom reports for its token is within LOGPROB_NATS of the oracle's;
and most tokens (>= 90%) are exactly the oracle's greedy choice. Two prompts are longer than
the model's 512-token sliding window (chunked prefill; one asks for a line only the global
layers still see), and one crosses the window while decoding.

Measured (x86-64 with AVX-512, 2 threads; 11 prompts x 24 tokens): alone 258/264 tokens the
oracle's choice, the others within 0.03 nats of it, logprobs within 0.16 nats (median 0.01,
99th percentile 0.12); batched 259/264, within 0.23 nats, logprobs within 0.23 nats (99th
percentile 0.14). Gemma's activations quantize worse than SmolLM2's (whose logprobs agree to a
few hundredths): the noise is the 8-bit activations' alone, spread over the layers. Served
with --dtype float32 (weights dequantized, no activation quantization) the same prompts agree
with the oracle to 0.001 nats, every token its choice.

Prompt token ids must equal transformers' GGUF tokenizer's exactly, chat prompts included
(the file has no chat template: Loom supplies Gemma 3's, pipelines/checkpoint/chat_templates.py). A base
model never ends a turn by itself (<end_of_turn> has a log probability near -30 after any
reply), so the test of <end_of_turn> ending a chat reply forces it with logit_bias once
min_tokens have been generated.
"""

import importlib.util

import httpx
import pytest

from pipelines.checkpoint.default_model import GEMMA3_NAME, GEMMA3_PARTS

_MISSING = [p for p, _ in GEMMA3_PARTS if importlib.util.find_spec(p) is None]
if _MISSING:
    pytest.skip(f"Gemma 3 270M's GGUF packages are not installed ({', '.join(_MISSING)}): "
                f"`make setup` installs them", allow_module_level=True)

import torch  # noqa: E402

from tests.gguf_oracle import (  # noqa: E402
    check_against_oracle,
    generate,
    oracle_choices,
)
from tests.helpers import start_server  # noqa: E402

TIE_NATS = 0.5
# 8-bit activations through every layer: deviations up to 0.34 nats were measured (2026-11-26,
# a Xeon with AVX-512; 0.2-0.3 on an EPYC), typically 0.1-0.2.
LOGPROB_NATS = 0.45
MAX_TOKENS = 24
WINDOW = 512
END_OF_TURN = 106
PROMPTS = [
    "The capital of France is",
    "Here is a Python function that reverses a string:\n",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Q: What is 12 times 12?\nA:",
    "List of planets in the solar system: Mercury,",
    "My favourite recipe for pancakes starts with",
    "Unicode test: café, naïve, 東京, emoji 🚀 and",
]
FISH = ["cod", "herring", "mackerel", "sardines", "tuna", "salmon", "plaice", "hake"]
# A fisherman's log, well past the sliding window; the question's answer lies in its first
# lines, more than 512 tokens back.
LOG = "".join(f"Day {d}: Tomas caught {7 + d * 13 % 40} {FISH[d * 5 % 8]} and sold them for "
              f"{3 + d * 7 % 20} coins at the {['harbour', 'village', 'town'][d % 3]} market.\n"
              for d in range(1, 41))
LONG_PROMPTS = [LOG + "Question: what did Tomas catch on day 2?\nAnswer: On day 2, Tomas caught",
                LOG[:LOG.index("Day 31:")] + "Day 31: Tomas caught"]
STORY = ("Once upon a time, in a small village by the sea, there lived an old fisherman named "
         "Tomas. Every morning he rowed his boat past the lighthouse and cast his nets. ")


@pytest.fixture(scope="module")
def gguf_path():
    from pipelines.checkpoint.default_model import gemma3_gguf

    return gemma3_gguf()


@pytest.fixture(scope="module")
def oracle(gemma3_oracle):
    return gemma3_oracle


@pytest.fixture(scope="module")
def prompts_ids(oracle):
    tok = oracle.tokenizer
    ids = [tok(p)["input_ids"] for p in PROMPTS + LONG_PROMPTS]
    # One prompt just short of the window, so decoding crosses it.
    story = tok(STORY * 30)["input_ids"]
    ids.append(story[:WINDOW - MAX_TOKENS // 2])
    assert sum(len(p) > WINDOW for p in ids) >= 2
    return ids


@pytest.fixture(scope="module")
def server(gguf_path):
    # By its alias, as users name it (the path resolves to the same assembled file).
    srv = start_server(GEMMA3_NAME, "--max-model-len", "2048", "--kv-cache-memory", "256MiB",
                       threads=2, timeout=300)
    yield srv
    assert srv.stop() == 0


@pytest.mark.parametrize("concurrent", [False, True], ids=["alone", "batched"])
def test_greedy_output_agrees_with_transformers_on_the_gguf(server, oracle, prompts_ids,
                                                             concurrent):
    results = generate(server.url, prompts_ids, concurrent, MAX_TOKENS, timeout=300)
    stats = {"exact": 0, "total": 0, "gap": 0.0, "logprob": 0.0}
    for prompt_ids, (generated, logprobs) in zip(prompts_ids, results):
        assert len(generated) == MAX_TOKENS
        check_against_oracle(oracle_choices(oracle, prompt_ids, generated), prompt_ids,
                             generated, logprobs, stats, TIE_NATS, LOGPROB_NATS)
    print(f"\n{'batched' if concurrent else 'alone'}: {stats['exact']}/{stats['total']} exact, "
          f"largest gap to the oracle's choice {stats['gap']:.3f} nats, largest logprob "
          f"difference {stats['logprob']:.3f} nats")
    assert stats["exact"] >= 0.9 * stats["total"], stats


def test_config_and_weights_are_transformers(gguf_path, oracle):
    """The header read as transformers reads it (and llama.cpp: every 6th layer global, local
    rotary base 10,000), and every tensor, dequantized, equal to the oracle's parameter."""
    from pipelines.checkpoint.gguf_file import GGUFTensor, dequantize, open_gguf

    model = oracle.model
    gguf = open_gguf(gguf_path)
    config, hf = gguf.config, model.config
    assert config.architecture == "Gemma3ForCausalLM"
    assert config.layer_types == hf.layer_types
    assert config.sliding_window == hf.sliding_window == WINDOW
    assert config.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"]
    assert config.rope_local_theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
    assert config.query_pre_attn_scalar == hf.query_pre_attn_scalar
    assert (config.head_dim, config.num_key_value_heads) == (hf.head_dim, hf.num_key_value_heads)
    assert config.hidden_act == hf.hidden_activation and config.rms_norm_eps == hf.rms_norm_eps
    assert config.final_logit_softcapping == hf.final_logit_softcapping
    assert config.eos_token_ids == [1, END_OF_TURN]  # <eos>, <end_of_turn>
    assert gguf.chat_template is None  # (Loom supplies Gemma 3's)
    state = model.state_dict()
    assert set(gguf.tensors) == set(state) - {"lm_head.weight"}  # tied
    for name, tensor in gguf.tensors.items():
        if name == "model.embed_tokens.weight":  # every 97th row of the 262,144
            rows = slice(0, None, 97)
            tensor = GGUFTensor(tensor.qtype, (len(tensor.data[rows]), tensor.shape[1]),
                                tensor.data[rows])
            expected = state[name][rows]
        else:
            expected = state[name]
        assert torch.equal(dequantize(tensor), expected), name
    assert gguf.tensors["model.layers.0.self_attn.q_proj.weight"].qtype == "Q5_0"


def test_tokenizer_matches_transformers(server, oracle):
    tok = oracle.tokenizer
    texts = PROMPTS + [
        "  leading spaces\tand tabs\n\nnew lines   ",
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
        "def reverse(s: str) -> str:\n    return s[::-1]  # slicing\n",
        "1234567890 + 0.000314159 = ?; 2**64 = 18446744073709551616",
        "Ünïcödé façade — “quotes” … ½ ¾ ™ ©; Привет, мир! Γειά σου; مرحبا; नमस्ते",
        "日本語のテキストと中文文本，混合 English words. 한국어도 있어요 🙂👍🏽",
        "URL: https://example.com/a?b=c&d=e#f <html><body>x</body></html>",
        "<bos><eos><pad> <unused0> [multimodal]",
    ]
    for text in texts:
        r = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tok(text)["input_ids"], text


def test_chat_uses_gemma3s_template(server, oracle):
    tok = oracle.tokenizer
    conversations = [
        ([{"role": "system", "content": "Be brief."},
          {"role": "user", "content": "What is the capital of France?"}],
         "<bos><start_of_turn>user\nBe brief.\n\nWhat is the capital of France?<end_of_turn>\n"
         "<start_of_turn>model\n"),
        ([{"role": "user", "content": "  Hi!  "}, {"role": "assistant", "content": "Hello."},
          {"role": "user", "content": "What is 2 + 2?"}],
         "<bos><start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
         "<start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n"),
    ]
    for messages, text in conversations:
        r = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tok(text, add_special_tokens=False)["input_ids"], text
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": conversations[0][0], "max_tokens": 8, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tok(conversations[0][1],
                                                         add_special_tokens=False)["input_ids"])
    models = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert models[0]["id"] == GEMMA3_NAME


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_end_of_turn_ends_a_chat_reply(server, skip_special_tokens):
    # <end_of_turn> made certain (logit_bias) once it may end the reply (min_tokens): it stops
    # generation there, as <eos> would, and is not part of the text.
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": messages, "max_tokens": 32, "temperature": 0, "min_tokens": 5,
        "logit_bias": {str(END_OF_TURN): 100}, "skip_special_tokens": skip_special_tokens},
        timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == 5 + 1  # (the stop token counted)
    content = choice["message"]["content"]
    assert content.strip() and "<end_of_turn>" not in content and "<eos>" not in content
