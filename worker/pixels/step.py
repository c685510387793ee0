"""The worker's answer to a PixelStep: one batched denoising step (flux.py), and the images of
the requests that took their last step."""

from __future__ import annotations

from pipelines.pixel_context import GenerationOutput
from pipelines.status import GenerationStatus
from serialization.messages import PixelResult, PixelStep
from worker.pixels.flux import FluxRunner, to_uint8


def preview_steps(ctx) -> set[int]:
    """The steps after which a request asking for `partial_images` previews gets one: spread
    evenly, before the last step. A preview is the clean image that step predicted (x0), not
    its noisy latents."""
    wanted = ctx.extra_params.get("partial_images")
    k = int(wanted.reshape(-1)[0]) if wanted is not None and wanted.size else 0
    total = ctx.num_inference_steps
    return {round(i * total / (k + 1)) for i in range(1, k + 1)} - {0, total}


def run_pixel_step(runner: FluxRunner, msg: PixelStep) -> PixelResult:
    for rid in msg.released:
        runner.release(rid)
    for ctx in msg.new:
        runner.add(ctx)
    runner.step(msg.request_ids)
    outputs = []
    for rid in msg.request_ids:
        done, total = runner.steps_done(rid), runner.requests[rid].ctx.num_inference_steps
        out = GenerationOutput(request_id=rid, steps_executed=done)
        if done >= total:
            out.images = to_uint8(runner.decode(rid))
            out.final_status = GenerationStatus.END_OF_SEQUENCE
            runner.release(rid)
        elif done in preview_steps(runner.requests[rid].ctx):
            out.images = to_uint8(runner.decode(rid, predicted=True))
        outputs.append(out)
    return PixelResult(step_id=msg.step_id, outputs=outputs)
