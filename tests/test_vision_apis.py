"""Images on /v1/responses (`input_image`) and /v1/messages (Anthropic `image` blocks).

The same tiny random Idefics3 as tests/test_vision.py, served once. Through the official
`openai` and `anthropic` clients, each API's conversation with an image gives the same greedy
text (and prompt token count) as chat completions with the same image, from data: URLs,
Anthropic's base64 and url sources, and allowed file:// URLs; a stored response's image is
seen again through previous_response_id. Every bad image is a 400 in the API's own error
shape naming the part in the API's own terms, and a text-only model refuses images on both.
"""

import asyncio
import base64
import gc
import io
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from api_server.image_budget import ImagePixelBudget
from api_server.protocol import RequestError
from bench.server_metrics import parse_series
from tests.test_vision import IMAGES, MAX_TOKENS, TEXT, data_url


def png_base64(name: str) -> str:
    buf = io.BytesIO()
    IMAGES[name].save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


REQUEST_PIXELS = 9_000_000  # the test server's --max-request-image-pixels (conftest's)


@pytest.fixture(scope="module")
def media_dir(vision_media_dir):
    allowed = vision_media_dir / "allowed"  # (what the server reads file:// URLs from)
    IMAGES["tall"].save(allowed / "tall.png")
    return allowed


@pytest.fixture(scope="module")
def server(vision_server, media_dir):
    return vision_server  # (shared with tests/test_vision.py)


@pytest.fixture(scope="module")
def openai_client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def anthropic_client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def chat_text(client, messages) -> tuple[str, int]:
    r = client.chat.completions.create(model="vlm", messages=messages, max_tokens=MAX_TOKENS,
                                       temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens


def chat_image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat_text_part(text: str) -> dict:
    return {"type": "text", "text": text}


# ---- /v1/responses ---------------------------------------------------------------------------

def responses_text(client, input_items, **kwargs) -> tuple[str, int, str]:
    r = client.responses.create(model="vlm", input=input_items, max_output_tokens=MAX_TOKENS,
                                temperature=0, **kwargs)
    return r.output_text, r.usage.input_tokens, r.id


def test_responses_input_image_equals_chat(openai_client):
    expected = chat_text(openai_client, [{"role": "user", "content": [
        chat_image(data_url(IMAGES["wide"])), chat_text_part(TEXT)]}])
    got = responses_text(openai_client, [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(IMAGES["wide"]), "detail": "high"},
        {"type": "input_text", "text": TEXT}]}])
    assert got[:2] == expected and expected[0]


def test_responses_two_images_and_a_file_url(openai_client, media_dir):
    file_url = (media_dir / "tall.png").as_uri()
    expected = chat_text(openai_client, [{"role": "user", "content": [
        chat_text_part("Compare "), chat_image(data_url(IMAGES["square"])),
        chat_text_part(" with "), chat_image(file_url)]}])
    got = responses_text(openai_client, [{"role": "user", "content": [
        {"type": "input_text", "text": "Compare "},
        {"type": "input_image", "image_url": data_url(IMAGES["square"]), "detail": "auto"},
        {"type": "input_text", "text": " with "},
        {"type": "input_image", "image_url": file_url}]}])
    assert got[:2] == expected


def test_responses_image_kept_for_previous_response_id(openai_client):
    first_input = [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(IMAGES["wide"])},
        {"type": "input_text", "text": TEXT}]}]
    answer, _, response_id = responses_text(openai_client, first_input, store=True)
    followup = responses_text(openai_client, "And the colours?",
                              previous_response_id=response_id)
    expected = chat_text(openai_client, [
        {"role": "user", "content": [chat_image(data_url(IMAGES["wide"])),
                                     chat_text_part(TEXT)]},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And the colours?"}])
    assert followup[:2] == expected


# ---- /v1/messages ----------------------------------------------------------------------------

def messages_text(client, content) -> tuple[str, int]:
    r = client.messages.create(model="vlm", max_tokens=MAX_TOKENS,
                               messages=[{"role": "user", "content": content}],
                               extra_body={"temperature": 0})  # (no such argument here)
    return "".join(b.text for b in r.content if b.type == "text"), r.usage.input_tokens


def base64_block(name: str) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": png_base64(name)}}


def test_messages_base64_image_equals_chat(openai_client, anthropic_client):
    expected = chat_text(openai_client, [{"role": "user", "content": [
        chat_image(data_url(IMAGES["wide"])), chat_text_part(TEXT)]}])
    got = messages_text(anthropic_client, [base64_block("wide"), {"type": "text", "text": TEXT}])
    assert got == expected and expected[0]


def test_messages_url_sources_and_count_tokens(openai_client, anthropic_client, media_dir):
    file_url = (media_dir / "tall.png").as_uri()
    expected = chat_text(openai_client, [{"role": "user", "content": [
        chat_image(data_url(IMAGES["square"])), chat_image(file_url),
        chat_text_part("Compare them.")]}])
    content = [{"type": "image", "source": {"type": "url", "url": data_url(IMAGES["square"])}},
               {"type": "image", "source": {"type": "url", "url": file_url}},
               {"type": "text", "text": "Compare them."}]
    assert messages_text(anthropic_client, content) == expected
    count = anthropic_client.messages.count_tokens(
        model="vlm", messages=[{"role": "user", "content": content}])
    assert count.input_tokens == expected[1]


# ---- refusals --------------------------------------------------------------------------------

NOT_BASE64 = "!!not-base64!!"
NOT_AN_IMAGE = base64.b64encode(b"not an image").decode()

# (the image part's payload, the code chat gives it; None: refused before the tokenizer)
BAD_IMAGES = [
    ("data:image/png;base64," + NOT_BASE64, "invalid_image"),
    ("data:image/png;base64," + NOT_AN_IMAGE, "invalid_image"),
    ("https://example.com/cat.png", "unsupported_image_url"),
    ("file:///etc/passwd", "forbidden_path"),
    ("file:///etc/passwd%00.png", "invalid_image_url"),  # was a 500 (os.path on a NUL)
]


@pytest.mark.parametrize("url,code", BAD_IMAGES)
def test_responses_bad_image_is_a_400_naming_the_part(openai_client, url, code):
    with pytest.raises(openai.BadRequestError) as exc:
        openai_client.responses.create(model="vlm", max_output_tokens=1, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "x"},
                                         {"type": "input_image", "image_url": url}]}])
    assert exc.value.body["param"] == "input[0].content[1]"
    assert exc.value.body["code"] == code


@pytest.mark.parametrize("part,param", [
    ({"type": "input_image", "file_id": "file-123"}, "input[0].content[0]"),
    ({"type": "input_image"}, "input[0].content[0]"),
])
def test_responses_malformed_input_image(openai_client, part, param):
    with pytest.raises(openai.BadRequestError) as exc:
        openai_client.responses.create(model="vlm", max_output_tokens=1,
                                       input=[{"role": "user", "content": [part]}])
    assert exc.value.body["param"] == param


def test_responses_too_many_images_names_the_first_over_the_limit(openai_client):
    image = {"type": "input_image", "image_url": data_url(IMAGES["square"])}
    with pytest.raises(openai.BadRequestError) as exc:
        openai_client.responses.create(model="vlm", max_output_tokens=1, input=[
            {"role": "user", "content": [image, image]},
            {"role": "user", "content": [{"type": "input_text", "text": "x"}, image]}])
    assert exc.value.body["param"] == "input[1].content[1]"
    assert exc.value.body["code"] == "limit_exceeded"


def anthropic_error(client, content) -> str:
    """The message of the 400 /v1/messages answers, checked to be in Anthropic's shape."""
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model="vlm", max_tokens=1,
                               messages=[{"role": "user", "content": content}])
    body = exc.value.body
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


@pytest.mark.parametrize("url,code", BAD_IMAGES)
def test_messages_bad_image_is_a_400_naming_the_block(anthropic_client, url, code):
    media_type, _, data = url.removeprefix("data:").partition(";base64,")
    source = {"type": "base64", "media_type": media_type, "data": data} if data else \
        {"type": "url", "url": url}
    message = anthropic_error(anthropic_client, [{"type": "text", "text": "x"},
                                                 {"type": "image", "source": source}])
    assert message.startswith("messages[0].content[1]: ")


@pytest.mark.parametrize("source,param", [
    (None, "messages[0].content[0].source"),
    ({"type": "file", "file_id": "f"}, "messages[0].content[0].source"),
    ({"type": "base64", "media_type": "text/plain", "data": NOT_AN_IMAGE},
     "messages[0].content[0].source.media_type"),
    ({"type": "base64", "media_type": "image/png"}, "messages[0].content[0].source.data"),
    ({"type": "url"}, "messages[0].content[0].source.url"),
])
def test_messages_malformed_image_block(anthropic_client, source, param):
    block = {"type": "image"} if source is None else {"type": "image", "source": source}
    assert anthropic_error(anthropic_client, [block]).startswith(param + ": ")


def test_messages_too_many_images(anthropic_client):
    message = anthropic_error(anthropic_client, [base64_block("square")] * 3)
    assert message.startswith("messages[0].content[2]: ") and "limit-mm-per-prompt" in message


def test_a_text_only_model_refuses_images_on_both_apis(tiny_server):
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="tiny", max_output_tokens=1, input=[
            {"role": "user", "content": [
                {"type": "input_text", "text": "x"},
                {"type": "input_image", "image_url": data_url(IMAGES["wide"])}]}])
    assert exc.value.body["param"] == "input[0].content[1]"
    assert "text only" in exc.value.body["message"]
    claude = anthropic.Anthropic(base_url=tiny_server.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(model="tiny", max_tokens=1, messages=[
            {"role": "user", "content": [base64_block("wide")]}])
    message = exc.value.body["error"]["message"]
    assert message.startswith("messages[0].content[0]: ") and "text only" in message


# ---- admission: images counted before they are decoded, and decoded once (#26) ----------------

def large_image_url(side: int, seed: int) -> str:
    """A side x side PNG that unpacks to 3 bytes a pixel but compresses well (bands of
    colour): the kind of small body that costs a server a lot to decode."""
    rows = np.random.RandomState(seed).randint(0, 256, (side // 64, 1, 3), dtype=np.uint8)
    pixels = np.repeat(np.repeat(rows, 64, axis=0), side, axis=1)
    return chat_image(data_url(Image.fromarray(pixels)))["image_url"]["url"]


def metric(server, name: str) -> float:
    return sum(parse_series(httpx.get(server.url + "/metrics").text).get(name, {}).values())


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_n_choices_decode_their_images_once(server, openai_client):
    # The probe of #26: n=8 choices of 2048 px images decoded each image once per choice
    # (the API process grew by gigabytes). Now once per request, the choices sharing the
    # pixel arrays, and an honest request beside it is served as usual.
    images = [large_image_url(2048, 1), large_image_url(2048, 2)]
    messages = [{"role": "user", "content": [chat_image(u) for u in images]
                 + [chat_text_part(TEXT)]}]
    honest = [{"role": "user", "content": [chat_image(data_url(IMAGES["wide"])),
                                           chat_text_part(TEXT)]}]
    expected = chat_text(openai_client, honest)
    one = openai_client.chat.completions.create(model="vlm", messages=messages,
                                                max_tokens=MAX_TOKENS, temperature=0)
    decoded, rss = metric(server, "loom:images_decoded_total"), rss_mib(server.proc.pid)
    with ThreadPoolExecutor(2) as pool:
        many = pool.submit(openai_client.chat.completions.create, model="vlm",
                           messages=messages, max_tokens=MAX_TOKENS, temperature=0, n=8)
        beside = pool.submit(chat_text, openai_client, honest)
        assert beside.result() == expected
        many = many.result()
    assert metric(server, "loom:images_decoded_total") - decoded == 2 + 1  # (+ the honest one)
    assert [c.message.content for c in many.choices] == [one.choices[0].message.content] * 8
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    grown = rss_mib(server.proc.pid) - rss
    print(f"API process RSS {rss:.0f} MiB, +{grown:.0f} MiB after n=8 x 2 images of 2048 px")
    assert grown < 400
    # Every array is freed with its request: nothing stays counted in flight.
    deadline = time.monotonic() + 10
    while metric(server, "loom:image_pixels_in_flight") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, "loom:image_pixels_in_flight") == 0


def test_choices_sent_after_the_first_has_finished_still_see_the_images(openai_client):
    # The other choices send their images by reference to the first's; with one token each,
    # the first has finished (and the scheduler let its images go) before they arrive: they
    # are sent again whole, and every choice still sees the image.
    messages = [{"role": "user", "content": [chat_image(data_url(IMAGES["tall"])),
                                             chat_text_part(TEXT)]}]
    one = openai_client.chat.completions.create(model="vlm", messages=messages, max_tokens=1,
                                                temperature=0)
    many = openai_client.chat.completions.create(model="vlm", messages=messages, max_tokens=1,
                                                 temperature=0, n=4)
    assert [c.message.content for c in many.choices] == [one.choices[0].message.content] * 4
    assert many.usage.prompt_tokens == one.usage.prompt_tokens


def test_images_over_the_request_pixel_budget_are_refused_before_decoding(server,
                                                                          openai_client):
    # Two 2,200 px squares: each within --max-image-pixels, together over the request's
    # --max-request-image-pixels (9M): a 400 naming the image that crossed it, none decoded.
    decoded = metric(server, "loom:images_decoded_total")
    with pytest.raises(openai.BadRequestError) as exc:
        openai_client.chat.completions.create(model="vlm", max_tokens=1, messages=[
            {"role": "user", "content": [chat_image(large_image_url(2200, 3)),
                                         chat_image(large_image_url(2200, 4))]}])
    assert exc.value.body["param"] == "messages[0].content[1]"
    assert exc.value.body["code"] == "limit_exceeded"
    assert "--max-request-image-pixels" in exc.value.body["message"]
    assert metric(server, "loom:images_decoded_total") == decoded


def test_count_tokens_concurrency_is_bounded(server, anthropic_client):
    # count_tokens decodes images like a generation request: at most a few at once, the
    # rest refused with 429 (and nothing decoded for them); the answers stay right.
    content = [{"type": "image", "source": {"type": "url", "url": large_image_url(2048, s)}}
               for s in (5, 6)] + [{"type": "text", "text": "Compare them."}]
    expected = anthropic_client.messages.count_tokens(
        model="vlm", messages=[{"role": "user", "content": content}]).input_tokens
    body = {"model": "vlm", "messages": [{"role": "user", "content": content}]}
    decoded = metric(server, "loom:images_decoded_total")

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*[client.post("/v1/messages/count_tokens", json=body)
                                          for _ in range(24)])

    replies = asyncio.run(burst())
    codes = [r.status_code for r in replies]
    assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) >= 4, codes
    assert all(r.json()["input_tokens"] == expected for r in replies if r.status_code == 200)
    assert all(r.headers.get("retry-after") for r in replies if r.status_code == 429)
    assert metric(server, "loom:images_decoded_total") - decoded == 2 * codes.count(200)


def test_the_pixel_budget_is_held_until_the_arrays_are_freed():
    budget = ImagePixelBudget(1000)
    first = budget.reserve(800, "messages[0].content[0]")
    with pytest.raises(RequestError) as exc:  # the server is busy: retry later
        budget.reserve(300, "messages[0].content[0]")
    assert exc.value.status == 429
    with pytest.raises(RequestError) as exc:  # could never fit
        budget.reserve(1001, "messages[0].content[1]")
    assert exc.value.status == 400 and exc.value.param == "messages[0].content[1]"
    # Decoded: the reservation becomes the pixel arrays' size (values / 3 channels), until
    # the last array is freed.
    arrays = [np.zeros((2, 3, 10, 10), np.float32), np.zeros((1, 3, 10, 10), np.float32)]
    first.hold(arrays)
    assert budget.in_flight == 300
    shared = arrays[0]
    del arrays
    gc.collect()
    assert budget.in_flight == 200
    del shared
    gc.collect()
    assert budget.in_flight == 0
