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


@pytest.mark.parametrize("native", [True, False], ids=["native-ops", "torch-ops"])
@pytest.mark.parametrize("guidance_embeds", [False, True])
def test_flux_forward_matches_the_transformers_own_forward(guidance_embeds, native, monkeypatch):
    """FluxForward against FluxTransformer2DModel.forward on a random model with two blocks of
    each kind (the runner's tiny FLUX has one of each: its single block is the last one, whose
    text rows FluxForward skips), two samples at different timesteps and guidances; with the
    element-wise ops, the attention and the linears native (worker/kernels/flux_ops.c,
    flux_attention.c, packed_linear.c) and in PyTorch."""
    import torch
    from diffusers import FluxTransformer2DModel

    from worker.pixels import flux_attention, flux_linear, flux_ops
    from worker.pixels.flux_forward import FluxForward, rope_table

    if native and (flux_ops._lib is None or flux_attention._lib is None
                   or flux_linear.KERNEL is None):
        pytest.skip("the native kernels could not be built here (or no AVX-512)")
    if not native:
        monkeypatch.setattr(flux_ops, "_lib", None)
        monkeypatch.setattr(flux_attention, "_lib", None)
        monkeypatch.setattr(flux_linear, "KERNEL", None)

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=guidance_embeds, axes_dims_rope=(4, 4, 8)).eval()
    latents, embeds, pooled = torch.randn(2, 24, 16), torch.randn(2, 40, 32), torch.randn(2, 32)
    timestep = torch.tensor([0.9, 0.25])
    guidance = torch.tensor([3.5, 1.0]) if guidance_embeds else None
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(6.0),
                                         indexing="ij"), -1).reshape(-1, 3)
    with torch.inference_mode():
        expected = model(hidden_states=latents, timestep=timestep, guidance=guidance,
                         pooled_projections=pooled, encoder_hidden_states=embeds,
                         txt_ids=torch.zeros(40, 3), img_ids=img_ids, return_dict=False)[0]
        ours = FluxForward(model)(latents, timestep, guidance, pooled, embeds,
                                  rope_table(model, img_ids))
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 5, 7, 1, 16), (2, 50, 77, 3, 64), (2, 256, 768, 2, 64),
                                   (1, 13, 40, 2, 128), (1, 100, 100, 1, 48)],
                         ids=lambda s: "B{}-Sq{}-S{}-H{}-d{}".format(*s))
def test_native_attention_equals_scaled_dot_product_attention(shape):
    """flux_attention against PyTorch's SDPA in float64 on slices of one projection (strided
    rows, as FluxForward passes them): query blocks and key counts that fill no tile, several
    heads, head_dim 16 to 128, and a sample whose scores span tens (its softmax rows nearly
    one-hot). Its float32 error is no larger than PyTorch's own float32 kernel's."""
    import torch
    import torch.nn.functional as F

    from worker.pixels import flux_attention

    if flux_attention._lib is None:
        pytest.skip("the native kernel could not be built here (or no AVX-512)")
    batch, rows, keys, heads, head_dim = shape
    torch.manual_seed(0)
    qkv = torch.randn(batch, keys, 3, heads, head_dim)
    qkv[0, :, 0] *= 8
    q, k, v = qkv[:, keys - rows:, 0], qkv[:, :, 1], qkv[:, :, 2]

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2)).transpose(1, 2).flatten(2)

    exact = sdpa(q.double(), k.double(), v.double())
    ours = flux_attention.attend(q, k, v)
    assert ours.shape == exact.shape and ours.dtype == torch.float32
    torch_error = (sdpa(q, k, v).double() - exact).abs().max().item()
    assert (ours.double() - exact).abs().max().item() <= 1.5 * torch_error + 1e-6
