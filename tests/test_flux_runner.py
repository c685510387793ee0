"""FluxRunner's batched denoising against diffusers' own FluxPipeline on a tiny random FLUX
(tests/tiny_flux.py): the same latents and schedule give the same images, for a request alone
and for requests that start at different steps and share transformer calls, with real CFG (a
negative prompt) and with a guidance-distilled model, at two sizes.

Tolerance: float32 on CPU; batching changes only the order of float additions inside matmuls,
so images agree to 1e-4 (of the [0, 1] range), far below one 8-bit level (0.004)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("diffusers")

from api_server.pixel_tokenizer import PixelGenerationRequest, PixelGenerationTokenizer  # noqa: E402

ATOL = 1e-4


@pytest.fixture(scope="module", params=[False, True], ids=["cfg", "guidance-embeds"])
def flux(request):
    """(directory, tokenizer, runner, diffusers pipeline) of one tiny FLUX."""
    import torch
    from diffusers import FluxPipeline

    from tests.tiny_flux import cached_tiny_flux
    from worker.pixels.flux import FluxRunner

    torch.manual_seed(0)
    d = cached_tiny_flux(guidance_embeds=request.param)
    pipe = FluxPipeline.from_pretrained(d, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return d, PixelGenerationTokenizer(d), FluxRunner(d), pipe


def oracle(pipe, req: PixelGenerationRequest, ctx) -> np.ndarray:
    import torch

    return pipe(prompt=req.prompt, negative_prompt=req.negative_prompt,
                true_cfg_scale=req.true_cfg_scale, guidance_scale=req.guidance_scale,
                height=req.height, width=req.width, num_inference_steps=req.num_inference_steps,
                num_images_per_prompt=req.num_images_per_prompt,
                latents=torch.from_numpy(ctx.latents.copy()), output_type="np").images


def run_alone(runner, ctx) -> np.ndarray:
    runner.add(ctx)
    for _ in range(ctx.num_inference_steps):
        runner.step([ctx.request_id])
    images = runner.decode(ctx.request_id)
    runner.release(ctx.request_id)
    return images


def test_one_request_matches_flux_pipeline(flux):
    _, tok, runner, pipe = flux
    req = PixelGenerationRequest(prompt="a red cat on the mat", height=32, width=32,
                                 num_inference_steps=4, guidance_scale=4.0, seed=1)
    ctx = tok.new_context(req)
    ours = run_alone(runner, ctx)
    assert ours.shape == (1, 32, 32, 3)
    np.testing.assert_allclose(ours, oracle(pipe, req, ctx), atol=ATOL, rtol=0)


def test_requests_started_at_different_steps_share_calls(flux):
    _, tok, runner, pipe = flux
    reqs = [
        PixelGenerationRequest(prompt="a red cat", height=32, width=32, num_inference_steps=5,
                               seed=1),
        PixelGenerationRequest(prompt="green hills under the sky", negative_prompt="dark city",
                               true_cfg_scale=2.5, height=32, width=32, num_inference_steps=3,
                               guidance_scale=2.0, seed=2, num_images_per_prompt=2),
        PixelGenerationRequest(prompt="a dog", height=48, width=32, num_inference_steps=4,
                               seed=3),
        PixelGenerationRequest(prompt="blue water", height=32, width=32, num_inference_steps=2,
                               guidance_scale=5.0, seed=4),
    ]
    ctxs = [tok.new_context(r) for r in reqs]
    # Request i joins before step i; every step runs all the requests still going.
    running, images = [], {}
    for i in range(12):
        if i < len(ctxs):
            runner.add(ctxs[i])
            running.append(ctxs[i])
        if not running:
            break
        runner.step([c.request_id for c in running])
        for c in list(running):
            if runner.steps_done(c.request_id) == c.num_inference_steps:
                images[c.request_id] = runner.decode(c.request_id)
                runner.release(c.request_id)
                running.remove(c)
    assert len(images) == 4 and not runner.requests
    for req, ctx in zip(reqs, ctxs):
        np.testing.assert_allclose(images[ctx.request_id], oracle(pipe, req, ctx), atol=ATOL,
                                   rtol=0, err_msg=req.prompt)
