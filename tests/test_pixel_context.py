"""PixelContext and PixelGenerationTokenizer.new_context against diffusers' FluxPipeline: the
same token ids, schedule, packing and image ids on the same inputs (tests/tiny_flux.py)."""

from __future__ import annotations

import numpy as np
import pytest

from api_server.pixel_tokenizer import PixelGenerationRequest, PixelGenerationTokenizer
from api_server.protocol import RequestError
from pipelines import GenerationStatus, PixelContext
from serialization.codec import msgpack_numpy_decoder, msgpack_numpy_encoder
from serialization.messages import RequestMessage

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def flux_dir() -> str:
    from tests.tiny_flux import cached_tiny_flux

    return cached_tiny_flux()


@pytest.fixture(scope="module")
def flux_pipe(flux_dir):
    from diffusers import FluxPipeline

    return FluxPipeline.from_pretrained(flux_dir)


@pytest.fixture(scope="module")
def pixel_tokenizer(flux_dir) -> PixelGenerationTokenizer:
    return PixelGenerationTokenizer(flux_dir)


def test_documented_defaults():
    ctx = PixelContext(tokens=np.array([1, 2], dtype=np.int64))
    assert (ctx.height, ctx.width, ctx.num_inference_steps, ctx.guidance_scale) == \
        (1024, 1024, 50, 3.5)
    assert (ctx.true_cfg_scale, ctx.num_warmup_steps, ctx.num_images_per_prompt) == (1.0, 0, 1)
    assert ctx.mask is ctx.tokens_2 is ctx.negative_tokens is ctx.negative_tokens_2 is None
    assert ctx.guidance is None and ctx.extra_params == {} and ctx.model_name == ""
    assert ctx.status is GenerationStatus.ACTIVE and not ctx.is_done and ctx.request_id


def test_steps_update_and_reset():
    ctx = PixelContext(tokens=np.array([1], dtype=np.int64), num_inference_steps=2)
    assert ctx.compute_num_available_steps(max_seq_len=4096) == 2
    ctx.update(np.ones(3, dtype=np.float32))
    assert ctx.compute_num_available_steps(4096) == 1 and not ctx.is_done
    ctx.update(np.full(3, 2, dtype=np.float32))
    assert ctx.is_done and ctx.status is GenerationStatus.END_OF_SEQUENCE
    out = ctx.to_generation_output()
    assert (out.request_id, out.steps_executed, out.is_done) == (ctx.request_id, 2, True)
    ctx.reset()
    assert ctx.step == 0 and not ctx.is_done


def test_tokens_match_flux_pipeline(pixel_tokenizer, flux_pipe):
    req = PixelGenerationRequest(prompt="a red cat on the mat", negative_prompt="dog",
                                 height=32, width=32, num_inference_steps=4, seed=3)
    ctx = pixel_tokenizer.new_context(req)
    for text, ids, ids_2 in ((req.prompt, ctx.tokens, ctx.tokens_2),
                             (req.negative_prompt, ctx.negative_tokens, ctx.negative_tokens_2)):
        clip = flux_pipe.tokenizer(text, padding="max_length", max_length=77, truncation=True)
        t5 = flux_pipe.tokenizer_2(text, padding="max_length", max_length=512, truncation=True)
        assert ids.tolist() == clip["input_ids"] and ids_2.tolist() == t5["input_ids"]


@pytest.mark.parametrize("steps,size", [(1, (32, 32)), (4, (32, 48)), (28, (64, 64))])
def test_schedule_matches_flow_match_scheduler(pixel_tokenizer, flux_pipe, steps, size):
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    height, width = size
    ctx = pixel_tokenizer.new_context(PixelGenerationRequest(
        prompt="sun", height=height, width=width, num_inference_steps=steps, seed=0))
    sched, cfg = flux_pipe.scheduler, flux_pipe.scheduler.config
    mu = calculate_shift(ctx.latents.shape[1], cfg.base_image_seq_len, cfg.max_image_seq_len,
                         cfg.base_shift, cfg.max_shift)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    np.testing.assert_array_equal(ctx.timesteps, sched.timesteps.numpy())
    np.testing.assert_array_equal(ctx.sigmas, sched.sigmas.numpy())
    assert ctx.timesteps.dtype == ctx.sigmas.dtype == np.float32


def test_latents_packed_as_flux_packs(pixel_tokenizer, flux_pipe):
    import torch

    req = PixelGenerationRequest(prompt="sun", height=32, width=48, num_inference_steps=2,
                                 seed=7, num_images_per_prompt=2)
    ctx = pixel_tokenizer.new_context(req)
    lh, lw = 2 * (32 // 8), 2 * (48 // 8)  # tiny VAE: 4x, patches: 2x
    noise = np.random.default_rng(7).standard_normal((2, 4, lh, lw), dtype=np.float32)
    packed = flux_pipe._pack_latents(torch.from_numpy(noise), 2, 4, lh, lw)
    np.testing.assert_array_equal(ctx.latents, packed.numpy())
    ids = flux_pipe._prepare_latent_image_ids(2, lh // 2, lw // 2, "cpu", torch.float32)
    np.testing.assert_array_equal(ctx.latent_image_ids, ids.numpy())
    # The seed decides the noise; no seed draws fresh noise.
    again = pixel_tokenizer.new_context(req)
    np.testing.assert_array_equal(again.latents, ctx.latents)
    fresh = pixel_tokenizer.new_context(PixelGenerationRequest(prompt="sun", height=32,
                                                               width=48))
    assert not np.array_equal(fresh.latents[:1], ctx.latents[:1])


def test_guidance_for_guidance_distilled_models():
    from tests.tiny_flux import cached_tiny_flux

    tok = PixelGenerationTokenizer(cached_tiny_flux(guidance_embeds=True))
    ctx = tok.new_context(PixelGenerationRequest(prompt="sun", height=16, width=16,
                                                 guidance_scale=4.5))
    assert ctx.guidance.tolist() == [4.5] and ctx.guidance.dtype == np.float32


def test_context_travels_on_the_request_codec(pixel_tokenizer):
    ctx = pixel_tokenizer.new_context(PixelGenerationRequest(
        prompt="a cat", negative_prompt="dog", height=32, width=32, num_inference_steps=3,
        seed=1, true_cfg_scale=2.0))
    ctx.extra_params["cfg_normalization"] = np.array([0.5], dtype=np.float32)
    back = msgpack_numpy_decoder(RequestMessage)(msgpack_numpy_encoder()(ctx))
    assert isinstance(back, PixelContext) and back.request_id == ctx.request_id
    for name in ("tokens", "tokens_2", "negative_tokens", "negative_tokens_2", "timesteps",
                 "sigmas", "latents", "latent_image_ids"):
        np.testing.assert_array_equal(getattr(back, name), getattr(ctx, name))
    assert back.extra_params["cfg_normalization"].tolist() == [0.5]
    assert (back.true_cfg_scale, back.do_true_cfg, back.height) == (2.0, True, 32)


@pytest.mark.parametrize("field,value,param", [
    ("height", 1000, "size"), ("width", 0, "size"), ("width", 1 << 20, "size"),
    ("num_inference_steps", 0, "steps"), ("num_inference_steps", 101, "steps"),
    ("num_images_per_prompt", 5, "n"), ("num_images_per_prompt", 0, "n")])
def test_hostile_requests_refused(pixel_tokenizer, field, value, param):
    req = PixelGenerationRequest(prompt="sun", height=32, width=32)
    setattr(req, field, value)
    with pytest.raises(RequestError) as err:
        pixel_tokenizer.new_context(req)
    assert err.value.param == param and err.value.status == 400


def test_prompt_over_t5_length_refused(pixel_tokenizer):
    with pytest.raises(RequestError) as err:
        pixel_tokenizer.new_context(PixelGenerationRequest(prompt="sun " * 600, height=32,
                                                           width=32))
    assert err.value.param == "prompt"
