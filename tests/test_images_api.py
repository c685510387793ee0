"""POST /v1/images/generations on a real server serving a tiny random FLUX directory
(tests/tiny_flux.py) beside a tiny text model, in one worker (`--image-model`): the official
openai client's images.generate gets PNGs equal to diffusers' FluxPipeline on the same latents
and schedule (to one 8-bit level: PNG is lossless, batching moves floats by < 1e-4),
concurrent requests share steps and still get their own images, text generated while images
are denoised is the text generated alone, and hostile requests get 400s."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("diffusers")

MAX_IMAGE_SIZE = 512


@pytest.fixture(scope="module")
def server(features_server):
    return features_server  # (its --max-image-size is MAX_IMAGE_SIZE)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


@pytest.fixture(scope="module")
def expected(flux_dir):
    """The image diffusers' FluxPipeline makes for a request, as uint8 [n, H, W, 3]."""
    import torch
    from diffusers import FluxPipeline

    from api_server.pixel_tokenizer import PixelGenerationRequest, PixelGenerationTokenizer
    from worker.pixels.flux import to_uint8

    pipe = FluxPipeline.from_pretrained(flux_dir)
    pipe.set_progress_bar_config(disable=True)
    tok = PixelGenerationTokenizer(flux_dir)

    def run(prompt, size, n, seed, steps):
        height, width = size
        ctx = tok.new_context(PixelGenerationRequest(
            prompt=prompt, height=height, width=width, num_images_per_prompt=n, seed=seed,
            num_inference_steps=steps))
        return to_uint8(pipe(prompt=prompt, height=height, width=width, num_images_per_prompt=n,
                             num_inference_steps=steps, latents=torch.from_numpy(ctx.latents),
                             output_type="np").images)
    return run


@pytest.fixture(scope="module")
def expected_previews(flux_dir):
    """The previews a request gets, from diffusers' FluxPipeline: the clean image each
    previewed step predicted (x0 = x_t - sigma_t * v, v recovered from the pipeline's latents
    before and after the step), decoded as the pipeline decodes its last latents."""
    import torch
    from diffusers import FluxPipeline

    from api_server.pixel_tokenizer import PixelGenerationRequest, PixelGenerationTokenizer
    from worker.pixels.flux import to_uint8

    pipe = FluxPipeline.from_pretrained(flux_dir)
    pipe.set_progress_bar_config(disable=True)
    tok = PixelGenerationTokenizer(flux_dir)

    def run(prompt, size, seed, steps, after_steps):
        height, width = size
        ctx = tok.new_context(PixelGenerationRequest(
            prompt=prompt, height=height, width=width, seed=seed, num_inference_steps=steps))
        latents = [torch.from_numpy(ctx.latents)]

        def keep(pipe, i, t, kwargs):
            latents.append(kwargs["latents"].clone())
            return kwargs

        pipe(prompt=prompt, height=height, width=width, num_inference_steps=steps,
             latents=latents[0], output_type="latent", callback_on_step_end=keep)
        sigmas = torch.from_numpy(ctx.sigmas)
        previews = []
        for done in after_steps:
            before, after = latents[done - 1], latents[done]
            velocity = (after - before) / (sigmas[done] - sigmas[done - 1])
            x0 = pipe._unpack_latents(before - sigmas[done - 1] * velocity, height, width,
                                      pipe.vae_scale_factor)
            x0 = x0 / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
            with torch.no_grad():
                image = pipe.vae.decode(x0, return_dict=False)[0]
            previews.append(to_uint8(pipe.image_processor.postprocess(image, "np"))[0])
        return previews
    return run


def pixels(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def test_openai_client_generates_the_pipeline_images(client, expected):
    result = client.images.generate(model="tiny-flux", prompt="a red cat", n=2, size="48x32",
                                    response_format="b64_json",
                                    extra_body={"seed": 5, "num_inference_steps": 3})
    assert len(result.data) == 2 and result.size == "48x32" and result.output_format == "png"
    got = np.stack([pixels(d.b64_json) for d in result.data])
    assert got.shape == (2, 32, 48, 3)  # (size is WIDTHxHEIGHT)
    assert np.abs(got.astype(int) - expected("a red cat", (32, 48), 2, 5, 3)).max() <= 1
    assert result.usage.input_tokens == 4  # "a", "red", "cat" and T5's </s>


def test_concurrent_requests_get_their_own_images(client, expected):
    def generate(seed):
        r = client.images.generate(model="tiny-flux", prompt="green hills", size="32x32",
                                   extra_body={"seed": seed, "num_inference_steps": 4})
        return pixels(r.data[0].b64_json)

    with ThreadPoolExecutor(4) as pool:
        images = list(pool.map(generate, range(4)))
    for seed, image in enumerate(images):
        ref = expected("green hills", (32, 32), 1, seed, 4)[0]
        assert np.abs(image.astype(int) - ref).max() <= 1


@pytest.mark.parametrize("body,param", [
    ({"size": "1000x1000"}, "size"), ({"size": "0x16"}, "size"),
    ({"size": "99999x99999"}, "size"), ({"size": "16x16x"}, "size"),
    ({"size": f"{MAX_IMAGE_SIZE + 16}x16"}, "size"),
    ({"n": 5}, "n"), ({"n": 0}, "n"), ({"num_inference_steps": 101}, "steps"),
    ({"response_format": "jpg"}, "response_format"),
    ({"response_format": "url", "stream": True}, "response_format"), ({"output_format": "gif"}, "output_format"),
    ({"prompt": "sun " * 600}, "prompt"), ({"seed": -1}, "seed"),
    ({"stream": True, "partial_images": 4}, "partial_images"),
    ({"partial_images": 1}, "partial_images"),
])
def test_hostile_requests_get_400s(server, body, param):
    import httpx

    r = httpx.post(server.url + "/v1/images/generations",
                   json={"prompt": "sun", "size": "32x32", **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    # ...and the server goes on serving.
    assert httpx.get(server.url + "/health").status_code == 200


def test_sizes_over_the_models_largest_are_named(server):
    import httpx

    r = httpx.post(server.url + "/v1/images/generations",
                   json={"prompt": "sun", "size": f"16x{MAX_IMAGE_SIZE + 16}"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "image_too_large"
    assert str(MAX_IMAGE_SIZE) in r.json()["error"]["message"]


def test_the_image_model_is_listed_and_documented(server):
    import httpx

    cards = httpx.get(server.url + "/v1/models").json()["data"]
    assert [(c["id"], c.get("task")) for c in cards][:2] == [("tiny", None), ("tiny-flux",
                                                                            "image")]
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    assert "text/event-stream" in \
        paths["/v1/images/generations"]["post"]["responses"]["200"]["content"]
    assert "image/webp" in paths["/v1/images/{image_id}/content"]["get"]["responses"]["200"][
        "content"]


def test_text_while_images_are_denoised_is_the_text_alone(server, client):
    """Text and image requests share the worker: greedy text generated while four image
    requests take their steps is the text generated alone."""
    import httpx

    def complete() -> list[str]:
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": ["The sky over", "A small dog"], "max_tokens": 24,
            "temperature": 0})
        assert r.status_code == 200, r.text
        return [c["text"] for c in r.json()["choices"]]

    alone = complete()

    def generate(seed):
        return client.images.generate(model="tiny-flux", prompt="green hills", size="64x64",
                                      extra_body={"seed": seed, "num_inference_steps": 8})

    with ThreadPoolExecutor(6) as pool:
        images = [pool.submit(generate, seed) for seed in range(4)]
        texts = [pool.submit(complete) for _ in range(2)]
        assert [t.result() for t in texts] == [alone, alone]
        assert all(len(i.result().data) == 1 for i in images)


def test_a_pixel_model_directory_is_served_for_images():
    """`loom serve --model DIR` with model_index.json serves images alone: the text routes
    point to the Images API."""
    import types

    from api_server.cli import resolve_task
    from api_server.protocol import RequestError
    from api_server.serving_context import ServingContext
    from pipelines.status import PipelineTask
    from tests.tiny_flux import cached_tiny_flux

    assert resolve_task(None, cached_tiny_flux()) is PipelineTask.PIXEL_GENERATION
    serving = types.SimpleNamespace(task=PipelineTask.PIXEL_GENERATION, model_name="tiny-flux")
    with pytest.raises(RequestError, match="/v1/images/generations"):
        ServingContext.check_generates(serving)


def test_openai_client_streams_partial_images_then_the_image(client, expected,
                                                              expected_previews):
    stream = client.images.generate(model="tiny-flux", prompt="a red cat", size="32x32",
                                    stream=True, partial_images=2,
                                    extra_body={"seed": 9, "num_inference_steps": 6})
    events = list(stream)
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + \
        ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    final = pixels(events[-1].b64_json)
    assert np.abs(final.astype(int) - expected("a red cat", (32, 32), 1, 9, 6)[0]).max() <= 1
    assert events[-1].usage.input_tokens == 4
    # Previews (after steps 2 and 4 of 6) are the clean images those steps predicted.
    previews = expected_previews("a red cat", (32, 32), 9, 6, after_steps=(2, 4))
    for event, preview in zip(events[:2], previews):
        assert np.abs(pixels(event.b64_json).astype(int) - preview).max() <= 2
    assert np.abs(pixels(events[0].b64_json).astype(int) - final).max() > 1


def test_metrics_count_images_and_steps(server, client):
    import httpx

    def value(text, name):
        line = next(ln for ln in text.splitlines() if ln.startswith(name))
        return float(line.rsplit(" ", 1)[1])

    before = httpx.get(server.url + "/metrics").text
    client.images.generate(model="tiny-flux", prompt="sun", size="16x16", n=2,
                           extra_body={"num_inference_steps": 3})
    after = httpx.get(server.url + "/metrics").text
    assert value(after, "loom:generated_images_total") - \
        value(before, "loom:generated_images_total") == 2
    assert value(after, "loom:denoising_steps_total") - \
        value(before, "loom:denoising_steps_total") == 3
    assert value(after, "loom:image_time_to_first_step_seconds_count") >= 1


def test_url_results_are_fetched_later(server, client, expected):
    import httpx

    result = client.images.generate(model="tiny-flux", prompt="a red cat", size="32x32",
                                    response_format="url", output_format="webp",
                                    output_compression=100,
                                    extra_body={"seed": 5, "num_inference_steps": 3})
    url = result.data[0].url
    assert url.startswith(server.url + "/v1/images/img_") and url.endswith("/content")
    r = httpx.get(url)
    assert r.status_code == 200 and r.headers["content-type"] == "image/webp"
    got = pixels(base64.b64encode(r.content).decode())
    assert got.shape == (32, 32, 3)
    missing = httpx.get(server.url + "/v1/images/img_nope/content")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "image_not_found"


def test_image_store_is_bounded_in_number_and_lifetime():
    from api_server.image_store import ImageStore

    store = ImageStore(max_images=2, ttl_seconds=3600)
    ids = [store.put(bytes([i]), "image/png") for i in range(3)]
    assert store.get(ids[0]) is None and store.get(ids[2]) == (b"\x02", "image/png")
    assert len(store) == 2
    expiring = ImageStore(ttl_seconds=0)
    assert expiring.get(expiring.put(b"x", "image/png")) is None and len(expiring) == 0


def test_image_requests_beyond_the_queue_bound_get_429():
    """Every image request in flight counts against --max-queued-requests."""
    import asyncio
    import types

    from api_server.images_route import ImagesRoute
    from pipelines.config import PipelineConfig

    limits = PipelineConfig().server_config.admission
    engine = types.SimpleNamespace(pixel_streams={str(i): None
                                                  for i in range(limits.max_queued_requests)})
    state = types.SimpleNamespace(limits=limits, check_available=lambda: None)
    route = ImagesRoute(engine, state, types.SimpleNamespace(max_image_size=64), "tiny-flux")

    class Body:
        async def body(self):
            return b'{"prompt": "sun", "size": "32x32"}'

    response = asyncio.run(route.create(Body()))
    assert response.status_code == 429 and response.headers["retry-after"] == "1"


def test_a_client_that_leaves_a_stream_frees_its_slot(server):
    """100 steps at 512x512 take the tiny model about 30 s here (a step ~0.3 s); the request
    stops running within a few steps of its client leaving (the scheduler's running count
    drops to 0)."""
    import time

    import httpx

    def running() -> float:
        text = httpx.get(server.url + "/metrics").text
        return float(next(ln for ln in text.splitlines()
                          if ln.startswith("loom:num_requests_running")).rsplit(" ", 1)[1])

    with httpx.stream("POST", server.url + "/v1/images/generations", timeout=60,
                      json={"prompt": "sun", "size": "512x512", "stream": True,
                            "num_inference_steps": 100}) as r:
        assert r.status_code == 200
        deadline = time.monotonic() + 10
        while running() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running() == 1
    left = time.monotonic()
    while running() and time.monotonic() - left < 8:
        time.sleep(0.1)
    assert running() == 0
