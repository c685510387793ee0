"""Images in chat completions, served by an Idefics3 (SmolVLM) model, against transformers.

A tiny random Idefics3 (SigLIP 64 px tiles of 16 px patches, pixel shuffle 2, a tiny Llama)
with the real SmolLM2 tokenizer plus SmolVLM's image tokens (tests/tiny_idefics3.py). Greedy
output through the HTTP server and the official openai client equals transformers' generate()
on the same weights and the same processor outputs, token for token: one image, two images, images in two turns, an
image request batched with a text-only one, with a 16-token step budget shorter than the
images (no chunk starts inside one); a follow-up turn finds its image's blocks in the prefix cache (loom's /metrics), and
the same follow-up with another image of the same size does not. In process, the
scheduler and the model runner: preemption, prefix-cache hits and aborts, and the worker's
image embeddings gone at the end. And every way an image part can be refused: a 400 naming it.
"""

import asyncio
import base64
import io
import os

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers
from PIL import Image

from api_server.protocol import RequestError
from api_server.reasoning_budget import close_thinking, continue_after_thinking
from api_server.tokenizer import TextTokenizer
from bench.server_metrics import parse_series
from pipelines import SamplingParams
from pipelines.config import KVCacheConfig, MediaLimits, PipelineConfig
from pipelines.request import TokenGeneratorRequest
from pipelines.status import GenerationStatus
from pipelines.vision_context import ImageMetadata, TextAndVisionContext
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler
from serialization.codec import msgpack_numpy_decoder, msgpack_numpy_encoder
from serialization.messages import RequestMessage
from worker.model_runner import ModelRunner
from worker.pipeline import run_step

MAX_TOKENS = 10
BLOCK = KVCacheConfig().kv_cache_page_size  # the server's KV block (default): hits are whole
def random_image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


IMAGES = {"wide": random_image(100, 80, 1), "tall": random_image(40, 120, 2),
          "square": random_image(70, 70, 3), "wide2": random_image(100, 80, 4),
          # Only for the prefix-cache test: the server must not have seen them before it.
          "photo": random_image(90, 60, 5), "photo2": random_image(90, 60, 6),
          "photo3": random_image(90, 60, 7)}
TEXT = "What is in this image?"


def image_part(name: str) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(IMAGES[name])}}


def chat(names: list[str], text: str = TEXT) -> list[dict]:
    return [{"role": "user", "content": [*(image_part(n) for n in names),
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def vlm_dir(idefics3_dir):
    return idefics3_dir


class Oracle:
    """transformers' greedy tokens and prompt for a conversation. A conversation is a tuple
    of turns (role, parts), a part ("image", name) or ("text", text): hashable, so each is
    generated once per module."""

    def __init__(self, vlm_dir: str) -> None:
        self.processor = transformers.AutoProcessor.from_pretrained(vlm_dir)
        self.model = transformers.Idefics3ForConditionalGeneration.from_pretrained(
            vlm_dir, dtype=torch.float32).eval()
        self.cache: dict = {}

    def __call__(self, names: tuple[str, ...], text: str = TEXT) -> tuple[list[int], int]:
        """(tokens, prompt length) for one user turn: the images, then the text."""
        tokens, prompt = self.chat(user(*names, text))
        return tokens, len(prompt)

    def chat(self, *turns) -> tuple[list[int], list[int]]:
        """(greedy tokens, prompt token ids) for the whole conversation."""
        if turns not in self.cache:
            messages = [{"role": role, "content": [
                {"type": "image"} if kind == "image" else {"type": "text", "text": value}
                for kind, value in parts]} for role, parts in turns]
            names = [value for _, parts in turns for kind, value in parts if kind == "image"]
            prompt = self.processor.apply_chat_template(messages, add_generation_prompt=True)
            images = [[IMAGES[n].convert("RGB") for n in names]] if names else None
            inputs = self.processor(text=[prompt], images=images, add_special_tokens=False,
                                    return_tensors="pt")
            with torch.no_grad():
                out = self.model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False,
                                          pad_token_id=2)
            ids = inputs["input_ids"][0].tolist()
            self.cache[turns] = (out[0, len(ids):].tolist(), ids)
        return self.cache[turns]


def user(*parts: str) -> tuple:
    """A user turn: each part an image name (a key of IMAGES) or else text."""
    return ("user", tuple(("image", p) if p in IMAGES else ("text", p) for p in parts))


def assistant(text: str) -> tuple:
    return ("assistant", (("text", text),))


def messages_of(*turns) -> list[dict]:
    """The conversation as the openai client sends it: images as data: URLs."""
    return [{"role": role, "content": [image_part(value) if kind == "image" else
                                       {"type": "text", "text": value} for kind, value in parts]}
            for role, parts in turns]


@pytest.fixture(scope="module")
def oracle(vlm_dir):
    return Oracle(vlm_dir)


# ---- through the HTTP server ---------------------------------------------------------------

@pytest.fixture(scope="module")
def media_dir(vision_media_dir):
    root = vision_media_dir
    allowed = root / "allowed"
    IMAGES["wide"].save(allowed / "wide.png")
    IMAGES["tall"].save(root / "outside.png")
    os.symlink(root / "outside.png", allowed / "link.png")
    return root


@pytest.fixture(scope="module")
def server(vision_server, media_dir):
    return vision_server  # (shared with tests/test_vision_apis.py)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def served_tokens(client, messages) -> tuple[list[int], int]:
    r = client.chat.completions.create(
        model="vlm", messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
        extra_body={"return_tokens_as_token_ids": True})
    ids = [int(t.token.removeprefix("token_id:")) for t in r.choices[0].logprobs.content]
    return ids, r.usage.prompt_tokens


def test_one_image(client, oracle):
    assert served_tokens(client, chat(["wide"])) == oracle(("wide",))


def test_different_images_do_not_share_cached_blocks(client, oracle):
    # Same text, another image of the same size: the same token ids throughout, but other
    # prefix-cache keys for the image tokens. Then the first image again: its cached blocks
    # may be reused, and the output is the same.
    assert oracle(("wide2",))[0] != oracle(("wide",))[0]
    assert served_tokens(client, chat(["wide2"])) == oracle(("wide2",))
    assert served_tokens(client, chat(["wide"])) == oracle(("wide",))


def test_two_images_in_one_message(client, oracle):
    assert served_tokens(client, chat(["square", "tall"], "Compare them.")) == \
        oracle(("square", "tall"), "Compare them.")


def served_chat(client, messages) -> tuple[list[int], int, str]:
    """Greedy tokens, prompt length and text of the reply."""
    r = client.chat.completions.create(
        model="vlm", messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
        extra_body={"return_tokens_as_token_ids": True})
    ids = [int(t.token.removeprefix("token_id:")) for t in r.choices[0].logprobs.content]
    return ids, r.usage.prompt_tokens, r.choices[0].message.content


def test_images_in_two_turns(client, oracle):
    turns = (user("wide", TEXT), assistant("A wide picture of noise."),
             user("tall", "And this one, is it the same?"))
    tokens, prompt = oracle.chat(*turns)
    assert served_chat(client, messages_of(*turns))[:2] == (tokens, len(prompt))


def prefix_cache_hits(server) -> float:
    series = parse_series(httpx.get(server.url + "/metrics").text)
    return sum(series["loom:prefix_cache_hits_total"].values())


def whole_blocks(num_tokens: int) -> int:
    return num_tokens // BLOCK * BLOCK


def test_follow_up_hits_the_prefix_cache_only_with_the_same_image(server, client, oracle):
    # Text before the image, so that the image starts inside the second block: the hits
    # with another image must stop at the first block, not at the image's start. Text after
    # it, so that the block the image ends in is all first-turn tokens: a hit ending inside
    # an image is cut back to the image's start, and the tokens after the first prompt (the
    # answer as generated, then as the template renders it) need not match.
    first = user("Here is a photo I took on holiday, in the hills above the lake:", "photo",
                 "What is in it? Tell me about the shapes and the colours in it.")
    tokens, first_prompt = oracle.chat(first)
    image = oracle.processor.tokenizer.convert_tokens_to_ids("<image>")
    image_start = first_prompt.index(image)  # the image's first vision token
    image_end = len(first_prompt) - first_prompt[::-1].index(image)  # one past its last
    assert BLOCK < image_start < 2 * BLOCK and image_end <= whole_blocks(len(first_prompt))
    served, n, answer = served_chat(client, messages_of(first))
    assert (served, n) == (tokens, len(first_prompt))

    def follow_up(image: str) -> tuple:
        parts = tuple(("image", image) if kind == "image" else (kind, v) for kind, v in first[1])
        return (("user", parts), assistant(answer), user("Which colour is there most of?"))

    # The same image: every whole block of the first prompt, image and all, is found.
    same = follow_up("photo")
    tokens, prompt = oracle.chat(*same)
    assert prompt[:len(first_prompt)] == first_prompt
    before = prefix_cache_hits(server)
    assert served_chat(client, messages_of(*same))[:2] == (tokens, len(prompt))
    assert prefix_cache_hits(server) - before >= whole_blocks(len(first_prompt))

    # Another image of the same size (the same token ids): only the whole blocks before it.
    other = follow_up("photo2")
    tokens, prompt = oracle.chat(*other)
    assert tokens != oracle.chat(*same)[0]
    before = prefix_cache_hits(server)
    assert served_chat(client, messages_of(*other))[:2] == (tokens, len(prompt))
    assert prefix_cache_hits(server) - before == whole_blocks(image_start) == BLOCK


def test_a_follow_up_hit_may_end_inside_the_image(server, client, oracle):
    # The first prompt ends a few tokens after its image, so the image's last block also holds
    # tokens the follow-up changes: the hit ends inside the image. The image is sent again with
    # the follow-up's first step and only the rows after the hit are merged.
    image = oracle.processor.tokenizer.convert_tokens_to_ids("<image>")
    for lead in ("A photo:", "Look at this photo, please:", "Here it is:", "Photo:"):
        first = user(lead, "photo3")
        tokens, first_prompt = oracle.chat(first)
        image_start = first_prompt.index(image)
        image_end = len(first_prompt) - first_prompt[::-1].index(image)
        if image_start < whole_blocks(len(first_prompt)) < image_end:
            break
    else:
        pytest.fail("no lead text puts the first prompt's end inside the image's last block")
    served, n, answer = served_chat(client, messages_of(first))
    assert (served, n) == (tokens, len(first_prompt))
    follow = (first, assistant(answer), user("Which colour is there most of?"))
    tokens, prompt = oracle.chat(*follow)
    before = prefix_cache_hits(server)
    assert served_chat(client, messages_of(*follow))[:2] == (tokens, len(prompt))
    assert prefix_cache_hits(server) - before >= whole_blocks(len(first_prompt))


def test_batched_with_a_text_only_request(server, oracle):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    async def one(messages):
        r = await client.chat.completions.create(
            model="vlm", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            logprobs=True, extra_body={"return_tokens_as_token_ids": True})
        return [int(t.token.removeprefix("token_id:")) for t in r.choices[0].logprobs.content]

    async def both():
        text_only = [{"role": "user", "content": "Describe a cat."}]
        return await asyncio.gather(one(chat(["square"])), one(text_only), one(chat(["wide"])))

    image_a, text, image_b = asyncio.run(both())
    assert image_a == oracle(("square",))[0]
    assert text == oracle((), "Describe a cat.")[0]
    assert image_b == oracle(("wide",))[0]


def test_file_url_inside_the_allowed_directory(client, oracle, media_dir):
    url = (media_dir / "allowed" / "wide.png").as_uri()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": TEXT}]}]
    assert served_tokens(client, messages) == oracle(("wide",))


def test_models_lists_input_modalities(client):
    assert client.models.list().data[0].model_extra["input_modalities"] == ["text", "image"]


def truncated_png() -> str:
    buf = io.BytesIO()
    IMAGES["wide"].save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()[:300]).decode()


def bad(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize("parts,param,code", [
    ([bad("data:image/png;base64,!!not-base64!!")], "messages[0].content[0]", "invalid_image"),
    ([{"type": "text", "text": "x"}, bad("data:image/png;base64," +
                                         base64.b64encode(b"not an image").decode())],
     "messages[0].content[1]", "invalid_image"),
    ([bad(truncated_png())], "messages[0].content[0]", "invalid_image"),
    ([bad("https://example.com/cat.png")], "messages[0].content[0]", "unsupported_image_url"),
    ([image_part("wide"), image_part("tall"), image_part("square")], "messages[0].content[2]",
     "limit_exceeded"),
    ([{"type": "input_audio", "input_audio": {}}], "messages[0].content[0]", None),
])
def test_bad_image_parts_are_400s_naming_the_part(client, parts, param, code):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="vlm", max_tokens=1,
                                       messages=[{"role": "user", "content": parts}])
    assert exc.value.body["param"] == param
    if code:
        assert exc.value.body["code"] == code


@pytest.mark.parametrize("name", ["../outside.png", "link.png", "missing.png"])
def test_file_urls_outside_the_allowed_directory_are_refused(client, media_dir, name):
    path = os.path.join(media_dir, "allowed", name)
    url = "file://" + path  # (not normalised: ".." must be resolved by the server)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="vlm", max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "text", "text": "x"}, bad(url)]}])
    assert exc.value.body["param"] == "messages[0].content[1]"


def test_a_text_only_model_refuses_image_parts(tiny_server):
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "text", "text": "x"}, image_part("wide")]}])
    assert exc.value.body["param"] == "messages[0].content[1]"
    assert client.models.list().data[0].model_extra["input_modalities"] == ["text"]


# ---- in process: scheduler + model runner ----------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(vlm_dir):
    return TextTokenizer(vlm_dir, 1024, [2], MediaLimits())


@pytest.fixture(scope="module")
def runner(vlm_dir):
    return ModelRunner(PipelineConfig.for_model(vlm_dir, kv_cache_page_size=4, max_length=512,
                                                kv_cache_memory=8 << 20))


def new_context(tokenizer, messages, request_id):
    return asyncio.run(tokenizer.new_context(TokenGeneratorRequest(
        id=request_id, index=0, model_name="vlm", messages=messages,
        sampling_params=SamplingParams(max_new_tokens=MAX_TOKENS))))


def test_context_crosses_the_wire(tokenizer):
    ctx = new_context(tokenizer, chat(["wide", "tall"]), "wire")
    assert isinstance(ctx, TextAndVisionContext) and len(ctx.images) == 2
    assert ctx.images[0].pixel_values.shape == (5, 3, 64, 64)  # 2 x 2 tiles + the whole
    assert ctx.images[1].pixel_values.shape == (3, 3, 64, 64)  # 2 x 1 tiles + the whole
    back = msgpack_numpy_decoder(RequestMessage)(msgpack_numpy_encoder()(ctx))
    assert isinstance(back, TextAndVisionContext)
    for a, b in zip(ctx.images, back.images):
        assert (a.start_idx, a.end_idx, a.image_hash) == (b.start_idx, b.end_idx, b.image_hash)
        assert np.array_equal(a.pixel_values, b.pixel_values)
    assert ctx.needs_vision_encoding and ctx.image_idx == 0
    mid = (ctx.images[0].start_idx + ctx.images[0].end_idx) // 2
    assert ctx.compute_image_aligned_idx(mid) == ctx.images[0].start_idx
    ctx.set_token_indices(start_idx=ctx.images[0].end_idx)
    assert ctx.image_idx == 1 and ctx.next_images == ctx.images[1:]


def chunk_starts_inside_an_image(step, contexts) -> list[str]:
    """The requests whose chunk of this step starts strictly inside one of their images."""
    by_id = {ctx.request_id: ctx for ctx in contexts}
    starts = step.batch.seq_lens - step.batch.query_lens
    return [rid for rid, start in zip(step.batch.request_ids, starts.tolist())
            if isinstance(by_id[rid], TextAndVisionContext)
            and any(img.start_idx < start < img.end_idx for img in by_id[rid].images)]


def run_in_process(runner, contexts, budget, num_blocks=None, abort_after=None, steps_seen=None):
    blocks = BlockManager(num_blocks or runner.num_blocks, 4, True)
    sched = Scheduler(PipelineConfig().replace(max_batch_size=8, max_batch_input_tokens=budget,
                                      max_length=runner.max_model_len), blocks)
    for ctx in contexts:
        sched.add_request(ctx)
    steps = 0
    while sched.has_work:
        step = sched.schedule()
        assert chunk_starts_inside_an_image(step, contexts) == []  # as MAX requires
        if steps_seen is not None:
            steps_seen.append((step.batch.request_ids, step.batch.query_lens.tolist(),
                               step.batch.seq_lens.tolist()))
        sched.update(step, run_step(runner, step))
        steps += 1
        if steps == abort_after:
            sched.abort(contexts[0].request_id)
    assert blocks.num_free_blocks == blocks.num_blocks
    return sched


def test_in_process_chunked_preempted_and_prefix_cached(tokenizer, runner, oracle):
    # The last two: the first's blocks, image included, are cached and reused for the same
    # image, not for another of the same size (the same token ids).
    cases = [(("wide",), TEXT), (("tall", "square"), TEXT), ((), "Describe a cat."),
             (("wide",), TEXT), (("wide2",), TEXT)]
    contexts = [new_context(tokenizer, chat(list(names), text) if names else
                            [{"role": "user", "content": text}], f"r{i}")
                for i, (names, text) in enumerate(cases)]
    # 5-token steps, shorter than every image (each is fed whole, over the budget); 24 blocks
    # of 4 tokens can't hold all four: preemption.
    sched = run_in_process(runner, contexts, budget=5, num_blocks=24)
    for ctx, (names, text) in zip(contexts, cases):
        assert ctx.generated_tokens.tolist() == oracle(names, text)[0], names
    assert sched.num_preemptions > 0 and sched.blocks.prefix_hits > 0
    assert len(runner.model.image_cache) == 0  # every image's embeddings dropped


def test_aborted_request_leaves_no_embeddings(tokenizer, runner):
    # Aborted in the middle of its prefill, its first image fed; the next step tells the worker.
    contexts = [new_context(tokenizer, chat(["wide", "tall"]), "gone"),
                new_context(tokenizer, [{"role": "user", "content": "Describe a cat."}], "cat")]
    run_in_process(runner, contexts, budget=8, abort_after=2)
    assert contexts[0].images[0].end_idx <= contexts[0].start_idx < contexts[0].prompt_length
    assert len(runner.model.image_cache) == 0


def test_an_image_that_fails_to_encode_fails_its_request_alone(tokenizer, runner, oracle,
                                                                monkeypatch):
    check_an_image_fault_fails_alone(tokenizer, runner, oracle, monkeypatch)


def check_an_image_fault_fails_alone(tokenizer, runner, oracle, monkeypatch):
    """Issue 26: one request's image raising in the encoder ends that request with an error;
    the others encoded in the same step (and a text-only one) finish as transformers does.
    (Qwen2-VL's module runs it too.)"""
    cases = [(("wide",), TEXT), ((), "Describe a cat."), (("square",), TEXT)]
    honest = [new_context(tokenizer, chat(list(names), text) if names else
                          [{"role": "user", "content": text}], f"ok{i}")
              for i, (names, text) in enumerate(cases)]
    culprit = new_context(tokenizer, chat(["tall", "wide"]), "culprit")
    encode = runner.model.image_embeddings
    batches = []

    def faulty(images):
        batches.append({img.request_id for img in images})
        if any(img.request_id == "culprit" for img in images):
            raise RuntimeError("injected encoder fault")
        return encode(images)

    monkeypatch.setattr(runner.model, "image_embeddings", faulty)
    contexts = [honest[0], culprit, *honest[1:]]
    run_in_process(runner, contexts, budget=4096)

    assert batches[0] == {"ok0", "culprit", "ok2"}  # one step encoded them all, and raised
    assert culprit.status is GenerationStatus.ERROR
    for ctx, (names, text) in zip(honest, cases):
        assert ctx.generated_tokens.tolist() == oracle(names, text)[0], names
    assert len(runner.model.image_cache) == 0
    assert "culprit" not in runner.requests and runner.failing == set()  # released


def test_request_images_work_like_image_parts(tokenizer):
    """MAX's `TokenGeneratorRequest.images` (encoded bytes) fill the messages' bare image
    parts in order, the rest following the last user message: the same context as
    image_url parts; a text-only prompt with images is refused, naming `images`."""
    def png(name):
        buf = io.BytesIO()
        IMAGES[name].save(buf, format="PNG")
        return buf.getvalue()

    def request(messages, images):
        return asyncio.run(tokenizer.new_context(TokenGeneratorRequest(
            id="images", index=0, model_name="vlm", messages=messages, images=images,
            sampling_params=SamplingParams(max_new_tokens=MAX_TOKENS))))

    want = new_context(tokenizer, chat(["wide", "tall"]), "parts")
    placed = request([{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                   {"type": "text", "text": TEXT}]}],
                     [png("wide"), png("tall")])
    assert placed.tokens.tolist() == want.tokens.tolist()
    for a, b in zip(placed.images, want.images):
        assert np.array_equal(a.pixel_values, b.pixel_values)
    appended = request([{"role": "user", "content": TEXT}], [png("wide")])
    assert len(appended.images) == 1
    with pytest.raises(RequestError) as exc:
        asyncio.run(tokenizer.new_context(TokenGeneratorRequest(
            id="x", index=0, model_name="vlm", prompt="hi", images=[png("wide")])))
    assert exc.value.param == "images"


def test_closing_a_thought_keeps_the_images(tokenizer):
    """A reasoning budget closes the thought in the prompt, or continues after it: the new
    context is still a vision context with the same images (before, a plain TextContext
    without them: the model answered about an image it never saw)."""
    ctx = new_context(tokenizer, chat(["wide", "tall"]), "think")
    closed = close_thinking(tokenizer, ctx, max_model_len=1024)
    after, tag_len = continue_after_thinking(tokenizer, ctx, [11, 12, 13])
    for new in (closed, after):
        assert isinstance(new, TextAndVisionContext)
        assert len(new.images) == 2 and all(a is b for a, b in zip(new.images, ctx.images))
        assert new.vision_token_ids == ctx.vision_token_ids
        assert new.extra_model_args is ctx.extra_model_args
    assert closed.prompt_tokens[:ctx.prompt_length].tolist() == ctx.prompt_tokens.tolist()
    assert after.prompt_tokens[ctx.prompt_length:].tolist() == [11, 12, 13]
    assert after.end_idx == ctx.prompt_length + 3 + tag_len  # the tag, jumped ahead
    assert after.next_tokens.tolist() == after.all_tokens.tolist()  # all still to be fed


def test_an_image_straddling_the_budget_is_fed_whole_and_exact(tokenizer, runner, oracle):
    """Issue 27: no prefill chunk starts inside an image (MAX's TextAndVisionContext forbids
    it). A budget that would cut the image ends the chunk before at the image's start, and the
    image, longer than the budget, is fed whole in the next step; the greedy output equals
    transformers' (the unsplit prompt)."""
    ctx = new_context(tokenizer, chat(["wide"]), "straddle")
    img = ctx.images[0]
    budget = img.start_idx + 3  # the first chunk would end 3 tokens into the image
    assert img.end_idx - img.start_idx > budget
    steps = []
    run_in_process(runner, [ctx], budget=budget, steps_seen=steps)
    assert ctx.generated_tokens.tolist() == oracle(("wide",), TEXT)[0]
    assert (steps[0][1], steps[0][2]) == ([img.start_idx], [img.start_idx])  # ends early
    assert (steps[1][1], steps[1][2]) == ([img.end_idx - img.start_idx], [img.end_idx])


def test_a_prefix_hit_ending_inside_an_image_is_cut_back_to_it():
    """A follow-up with the same image but other text after it finds the blocks up to the one
    the image's last token shares with the new text: that hit ends inside the image, so it is
    cut back to the block holding the image's first token, and the image is sent again and
    fed whole (over the budget) rather than from the middle."""
    from serialization.messages import StepResult

    def ctx(request_id, after):
        pixels = np.ones((1, 3, 64, 64), np.float32)
        tokens = np.array([1, 2, 3, 4, 5, 9, 9, 9, 9, 9, 9, after, 5, 6, 7])  # image [5, 11)
        return TextAndVisionContext(request_id=request_id, max_length=20, tokens=tokens,
                                    vision_token_ids=[9], images=[
                                        ImageMetadata(start_idx=5, end_idx=11,
                                                      pixel_values=pixels)])

    blocks = BlockManager(32, 4, True)
    sched = Scheduler(PipelineConfig().replace(max_length=8192, max_batch_input_tokens=16), blocks)
    sched.add_request(ctx("a", 4))
    step = sched.schedule()  # a's whole prompt: blocks [0, 4), [4, 8), [8, 12) cached
    sched.update(step, StepResult(step_id=step.batch.step_id,
                                  sampled_token_ids=np.full(1, 0, np.int32)))
    sched.abort("a")
    sched = Scheduler(PipelineConfig().replace(max_length=8192, max_batch_input_tokens=3), blocks)
    sched.add_request(ctx("b", 8))  # its block [8, 12) differs: the hit is [0, 8)
    chunks = []
    while sched.has_work and len(chunks) < 4:
        step = sched.schedule()
        start = int(step.batch.seq_lens[0] - step.batch.query_lens[0])
        chunks.append((start, int(step.batch.seq_lens[0]),
                       [i.start_idx for i in step.batch.images]))
        sched.update(step, StepResult(step_id=step.batch.step_id,
                                      sampled_token_ids=np.full(1, 0, np.int32)))
    # The hit cut back to [0, 4); [4, 7) would end inside the image: [4, 5); then the image.
    assert chunks[:3] == [(4, 5, []), (5, 11, [5]), (11, 14, [])]


def test_a_cut_back_hit_is_cut_again_if_it_lands_in_an_earlier_image():
    """Cut back to the block holding the last image's start, the hit may end inside the image
    before it (found by the n=8 choices of test_vision_apis): cut back to that one's too."""
    from serialization.messages import StepResult

    def ctx(request_id, after):
        pixels = np.ones((1, 3, 64, 64), np.float32)
        tokens = np.array([1, 9, 9, 9, 9, 9, 2, 9, 9, 9, 9, after, 5, 6])  # [1, 6), [7, 11)
        return TextAndVisionContext(request_id=request_id, max_length=20, tokens=tokens,
                                    vision_token_ids=[9], images=[
                                        ImageMetadata(start_idx=1, end_idx=6, pixel_values=pixels),
                                        ImageMetadata(start_idx=7, end_idx=11,
                                                      pixel_values=pixels)])

    blocks = BlockManager(32, 4, True)
    sched = Scheduler(PipelineConfig().replace(max_length=8192, max_batch_input_tokens=16), blocks)
    sched.add_request(ctx("a", 4))
    step = sched.schedule()
    sched.update(step, StepResult(step_id=step.batch.step_id,
                                  sampled_token_ids=np.full(1, 0, np.int32)))
    sched.abort("a")
    sched.add_request(ctx("b", 8))  # hit [0, 8) ends in image 2; [0, 4) would in image 1
    step = sched.schedule()
    assert (int(step.batch.seq_lens[0] - step.batch.query_lens[0]), int(step.batch.seq_lens[0])) \
        == (0, 14)
    assert [i.start_idx for i in step.batch.images] == [1, 7]
