"""Qwen2-VL served against transformers: a tiny random Qwen2VLForConditionalGeneration (a 2-block
ViT of 14 px patches merged 2 x 2, a 2-layer Qwen2 text model with M-RoPE sections 2/3/3) and
the SmolLM2 tokenizer with Qwen2-VL's vision tokens added (no Qwen2 tokenizer is on this
machine), images resized to 4-16 merged patches by the real Qwen2-VL image processor.

Greedy output through the HTTP server and the openai client equals transformers' generate()
token for token: one image, two images, and image requests batched with a text-only one, with
a 16-token step budget shorter than the images (each fed whole, never from its middle); in process, preemption and prefix-cache hits too.
The prompt's M-RoPE positions equal transformers' get_rope_index.
"""

import asyncio

import numpy as np
import openai
import pytest
import torch
import transformers

from api_server.qwen2_vl_processor import (
    image_only_processor_class,
    image_runs,
    load_processor,
    mrope_positions,
)
from api_server.tokenizer import TextTokenizer
from pipelines.config import MediaLimits, PipelineConfig
from pipelines.vision_context import TextAndVisionContext
from serialization.codec import msgpack_numpy_decoder, msgpack_numpy_encoder
from serialization.messages import RequestMessage, StepImage
from tests.helpers import start_server
from tests.test_vision import (
    IMAGES,
    MAX_TOKENS,
    TEXT,
    chat,
    check_an_image_fault_fails_alone,
    new_context,
    run_in_process,
)
from worker.model_runner import ModelRunner

SHARPEN = 6.0
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL-Instruct's chat template, images only.
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_qwen2_vl(target: str, tokenizer_dir: str) -> str:
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens(VISION_TOKENS, special_tokens=True)
    tok.chat_template = QWEN2_VL_TEMPLATE
    ids = tok.convert_tokens_to_ids(VISION_TOKENS)
    # 4 to 16 merged patches (28 px squares) per image: 4-16 image tokens.
    images = transformers.Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4,
                                                   max_pixels=28 * 28 * 16)
    processor = image_only_processor_class()(images, tok, chat_template=QWEN2_VL_TEMPLATE)
    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2,
                         # Low rotary bases: with 8 frequency pairs per head, the usual
                         # bases leave the height and width sections too slow to matter.
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                          "rope_theta": 10.0}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           rope_parameters={"rope_type": "axial", "rope_theta": 100.0}),
        vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2],
        video_token_id=ids[3])
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).to(torch.float32)
    # transformers initialises biases to zero: make them matter (small: larger ones swamp
    # the images, and every prompt gives the same few tokens).
    # And sharpen both models' attention (scores of a random init are near zero: every query
    # would average over the context, whatever the rotary says of the keys' positions).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(SHARPEN)
            if name.endswith("attn.qkv.weight"):  # the ViT's: q and k are its first 2/3
                p[: 2 * p.shape[0] // 3].mul_(SHARPEN)
    model.save_pretrained(target)
    processor.save_pretrained(target)
    tok.save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def vlm_dir(smollm2_dir, tmp_path_factory):
    return make_tiny_qwen2_vl(str(tmp_path_factory.mktemp("tiny-qwen2-vl")), smollm2_dir)


@pytest.fixture(scope="module")
def hf(vlm_dir):
    tok = transformers.AutoTokenizer.from_pretrained(vlm_dir)
    processor = load_processor(vlm_dir, tok)
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        vlm_dir, dtype=torch.float32).eval()
    return processor, model


def hf_inputs(processor, names: tuple[str, ...], text: str):
    messages = [{"role": "user", "content": [*({"type": "image"} for _ in names),
                                             {"type": "text", "text": text}]}]
    prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=False)
    images = [IMAGES[n].convert("RGB") for n in names] or None
    return processor(text=[prompt], images=images, add_special_tokens=False,
                     return_tensors="pt")


@pytest.fixture(scope="module")
def oracle(hf):
    """transformers' greedy tokens (and prompt length) for (image names, text)."""
    processor, model = hf
    cache = {}

    def expected(names: tuple[str, ...], text: str = TEXT) -> tuple[list[int], int]:
        if (names, text) not in cache:
            inputs = hf_inputs(processor, names, text)
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False,
                                     pad_token_id=2)
            n = inputs["input_ids"].shape[1]
            cache[(names, text)] = (out[0, n:].tolist(), n)
        return cache[(names, text)]

    return expected


def test_mrope_positions_equal_transformers_get_rope_index(hf):
    processor, model = hf
    inputs = hf_inputs(processor, ("wide", "tall"), TEXT)
    expected, delta = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"],
        attention_mask=inputs["attention_mask"])
    ids = inputs["input_ids"][0].numpy()
    ours = mrope_positions(len(ids), image_runs(ids, processor.image_token_id),
                           inputs["image_grid_thw"].numpy(), 2)
    assert np.array_equal(ours, expected[:, 0].numpy())
    assert int(ours.max()) + 1 - len(ids) == int(delta) < 0


# ---- through the HTTP server ---------------------------------------------------------------

@pytest.fixture(scope="module")
def server(vlm_dir):
    srv = start_server(vlm_dir, "--served-model-name", "qwen2-vl",
                       "--max-num-batched-tokens", "16", "--limit-mm-per-prompt", "2")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def served_tokens(client, messages) -> tuple[list[int], int]:
    r = client.chat.completions.create(
        model="qwen2-vl", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    ids = [int(t.token.removeprefix("token_id:")) for t in r.choices[0].logprobs.content]
    return ids, r.usage.prompt_tokens


def test_one_image(client, oracle):
    assert oracle(("wide",))[0] != oracle(("wide2",))[0]  # the output depends on the pixels
    assert served_tokens(client, chat(["wide"])) == oracle(("wide",))


def test_two_images(client, oracle):
    assert served_tokens(client, chat(["square", "tall"], "Compare them.")) == \
        oracle(("square", "tall"), "Compare them.")


def test_batched_with_a_text_only_request(server, oracle):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    async def one(messages):
        r = await client.chat.completions.create(
            model="qwen2-vl", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            logprobs=True, extra_body={"return_tokens_as_token_ids": True})
        return [int(t.token.removeprefix("token_id:")) for t in r.choices[0].logprobs.content]

    async def all_three():
        text_only = [{"role": "user", "content": "Describe a cat."}]
        return await asyncio.gather(one(chat(["square", "wide"])), one(text_only),
                                    one(chat(["tall"])))

    images_a, text, image_b = asyncio.run(all_three())
    assert images_a == oracle(("square", "wide"))[0]
    assert text == oracle((), "Describe a cat.")[0]
    assert image_b == oracle(("tall",))[0]


# ---- in process: scheduler + model runner ----------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(vlm_dir):
    return TextTokenizer(vlm_dir, 1024, [2], MediaLimits())


@pytest.fixture(scope="module")
def runner(vlm_dir):
    return ModelRunner(PipelineConfig.for_model(vlm_dir, kv_cache_page_size=4, max_length=512,
                                                kv_cache_memory=8 << 20))


def test_context_carries_grids_and_positions(tokenizer):
    ctx = new_context(tokenizer, chat(["wide", "tall"]), "wire")
    assert isinstance(ctx, TextAndVisionContext) and len(ctx.images) == 2
    grids = ctx.extra_model_args["image_grid_thw"]
    positions = ctx.extra_model_args["rope_positions"]
    assert positions.shape == (3, ctx.prompt_length)
    for img, (t, h, w) in zip(ctx.images, grids.tolist()):
        assert img.pixel_values.shape == (t * h * w, 3 * 2 * 14 * 14)
        assert img.end_idx - img.start_idx == t * h * w // 4
    back = msgpack_numpy_decoder(RequestMessage)(msgpack_numpy_encoder()(ctx))
    assert np.array_equal(back.extra_model_args["rope_positions"], positions)
    assert np.array_equal(back.extra_model_args["image_grid_thw"], grids)


def test_in_process_chunked_preempted_and_prefix_cached(tokenizer, runner, oracle):
    cases = [(("wide",), TEXT), (("tall", "square"), TEXT), ((), "Describe a cat."),
             (("wide",), TEXT), (("wide2",), TEXT)]
    contexts = [new_context(tokenizer, chat(list(names), text) if names else
                            [{"role": "user", "content": text}], f"r{i}")
                for i, (names, text) in enumerate(cases)]
    # 5-token steps, shorter than every image (fed whole, over the budget); 24 blocks of 4
    # tokens can't hold them all: preemption.
    sched = run_in_process(runner, contexts, budget=5, num_blocks=24)
    for ctx, (names, text) in zip(contexts, cases):
        assert ctx.generated_tokens.tolist() == oracle(names, text)[0], names
    assert sched.num_preemptions > 0 and sched.blocks.prefix_hits > 0
    assert len(runner.model.image_cache) == 0
    # Positions are dropped when the worker hears a request finished (with the next step).
    assert len(runner.model.mrope.requests) <= 1


def test_an_image_that_fails_to_encode_fails_its_request_alone(tokenizer, runner, oracle,
                                                                monkeypatch):
    check_an_image_fault_fails_alone(tokenizer, runner, oracle, monkeypatch)


def test_image_embeddings_equal_transformers(hf, runner):
    """The ViT, its 2D rotary and the merger, against transformers' get_image_features (the
    greedy tests can't see every small error of an image's embeddings)."""
    processor, model = hf
    inputs = hf_inputs(processor, ("wide", "tall"), TEXT)
    with torch.no_grad():
        expected = model.model.get_image_features(inputs["pixel_values"],
                                                  inputs["image_grid_thw"]).pooler_output
    pixels = inputs["pixel_values"].numpy()
    images, offset = [], 0
    for i, grid in enumerate(inputs["image_grid_thw"].numpy()):
        patches = int(np.prod(grid))
        tokens = np.ones(patches // 4, dtype=bool)
        images.append(StepImage("r", i, 0, len(tokens), tokens, pixels[offset:offset + patches],
                                grid))
        offset += patches
    with torch.inference_mode():
        ours = runner.model.image_embeddings(images)
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_images_in_two_turns(client, hf):
    # An image in each of two user turns, an assistant reply between: M-RoPE positions run
    # on across both images and the text after each.
    processor, model = hf
    reply = "It is noise."
    turns = [("wide", "What is this?"), ("tall", "And this one?")]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": t}]}
                for _, t in turns]
    messages.insert(1, {"role": "assistant", "content": [{"type": "text", "text": reply}]})
    prompt = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=False)
    inputs = processor(text=[prompt], images=[IMAGES[n].convert("RGB") for n, _ in turns],
                       add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False,
                             pad_token_id=2)
    n = inputs["input_ids"].shape[1]
    served = chat([turns[0][0]], turns[0][1])
    served.append({"role": "assistant", "content": reply})
    served += chat([turns[1][0]], turns[1][1])
    assert served_tokens(client, served) == (out[0, n:].tolist(), n)
