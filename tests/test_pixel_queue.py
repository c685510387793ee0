"""Image requests scheduled as denoising steps (scheduler/pixel_queue.py) and run by the
worker's step handler (worker/process.py's answer_step, on FluxRunner): the arbiter the
scheduler process uses, its messages through the msgpack codec. Requests join between steps
and share calls, a cancelled one frees its slot at the next step, and the images are those
the same request makes alone."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("diffusers")

from api_server.pixel_tokenizer import PixelGenerationRequest, PixelGenerationTokenizer  # noqa: E402
from pipelines.config import PipelineConfig  # noqa: E402
from pipelines.status import GenerationStatus, PipelineTask  # noqa: E402
from scheduler.arbiter import Arbiter  # noqa: E402
from scheduler.block_manager import BlockManager  # noqa: E402
from serialization.codec import msgpack_numpy_decoder, msgpack_numpy_encoder  # noqa: E402
from serialization.messages import (  # noqa: E402
    PixelStep,
    ResponseBatch,
    ResultMessage,
    StepMessage,
    WorkerReady,
)

encode = msgpack_numpy_encoder()


@pytest.fixture(scope="module")
def flux():
    from tests.tiny_flux import cached_tiny_flux
    from worker.pixels.flux import FluxRunner

    d = cached_tiny_flux()
    return PixelGenerationTokenizer(d), FluxRunner(d)


def make_arbiter(max_batch_size: int = 8) -> Arbiter:
    ready = WorkerReady(num_blocks=0, block_size=0, max_model_len=0, eos_token_ids=[],
                        task=PipelineTask.PIXEL_GENERATION)
    return Arbiter.for_worker(PipelineConfig().replace(max_batch_size=max_batch_size,
                                                                  max_length=512), ready,
                              BlockManager(1, 1, False))


def run_one_step(arbiter: Arbiter, runner) -> tuple[PixelStep, ResponseBatch] | None:
    """A step from the arbiter to the worker and its result back, both on the wire."""
    from worker.process import SideModels, answer_step

    msg = arbiter.next_step()
    if msg is None:
        return None
    msg = msgpack_numpy_decoder(StepMessage)(encode(msg))
    result = answer_step(runner, SideModels(pixels=runner), msg, started=0.0)
    return msg, arbiter.after_step(msgpack_numpy_decoder(ResultMessage)(encode(result)))


def request(tok, seed: int, steps: int, **kw):
    return tok.new_context(PixelGenerationRequest(
        prompt="a red cat", height=32, width=32, num_inference_steps=steps, seed=seed,
        request_id=f"r{seed}", **kw))


def alone(tok, runner, seed, steps, **kw) -> np.ndarray:
    arbiter = make_arbiter()
    arbiter.add(request(tok, seed, steps, **kw))
    while (stepped := run_one_step(arbiter, runner)) is not None:
        done = [o for o in stepped[1].images if o.is_done]
    return done[0].images


def test_requests_join_between_steps_and_share_calls(flux):
    tok, runner = flux
    arbiter = make_arbiter()
    arbiter.add(request(tok, 1, 3))
    first, _ = run_one_step(arbiter, runner)
    assert first.request_ids == ["r1"] and [c.request_id for c in first.new] == ["r1"]
    arbiter.add(request(tok, 2, 2, negative_prompt="dog", true_cfg_scale=2.0))
    second, batch = run_one_step(arbiter, runner)
    # One call for both, at steps 1 and 0; only the new request's context travels.
    assert second.request_ids == ["r1", "r2"] and [c.request_id for c in second.new] == ["r2"]
    assert [(o.request_id, o.steps_executed) for o in batch.images] == [("r1", 2), ("r2", 1)]
    images = {}
    while (stepped := run_one_step(arbiter, runner)) is not None:
        images.update({o.request_id: o.images for o in stepped[1].images if o.is_done})
    assert set(images) == {"r1", "r2"} and not runner.requests and not arbiter.busy
    assert images["r1"].dtype == np.uint8 and images["r1"].shape == (1, 32, 32, 3)
    # uint8 pixels: batching moves floats by < 1e-4, so at most one level either way.
    for seed, steps, kw in ((1, 3, {}), (2, 2, {"negative_prompt": "dog", "true_cfg_scale": 2.0})):
        ref = alone(tok, runner, seed, steps, **kw)
        assert np.abs(images[f"r{seed}"].astype(int) - ref).max() <= 1


def test_cancelled_request_frees_its_slot_at_the_next_step(flux):
    tok, runner = flux
    arbiter = make_arbiter(max_batch_size=1)  # one running request at a time
    arbiter.add(request(tok, 3, 5))
    arbiter.add(request(tok, 4, 2))
    step, _ = run_one_step(arbiter, runner)
    assert step.request_ids == ["r3"]  # r4 waits for the slot
    arbiter.abort({"r3"})
    step, batch = run_one_step(arbiter, runner)
    assert step.released == ["r3"] and step.request_ids == ["r4"]
    assert "r3" not in runner.requests
    step, batch = run_one_step(arbiter, runner)
    assert batch.images[0].final_status is GenerationStatus.END_OF_SEQUENCE
    assert run_one_step(arbiter, runner) is None and not runner.requests


def test_failed_step_ends_its_requests_with_an_error(flux):
    tok, runner = flux
    arbiter = make_arbiter()
    bad = request(tok, 5, 2)
    bad.latent_image_ids = bad.latent_image_ids[:3]  # no longer the latents' patches
    arbiter.add(bad)
    _, batch = run_one_step(arbiter, runner)
    out = batch.images[0]
    assert out.final_status is GenerationStatus.ERROR and out.error
    arbiter.add(request(tok, 6, 1))
    step, batch = run_one_step(arbiter, runner)  # the worker forgets the failed one
    assert step.released == ["r5"] and batch.images[0].is_done and not runner.requests


def test_text_steps_go_on_between_denoising_steps(flux):
    """Images beside text (--image-model): while both wait, denoising steps get a quarter of
    the worker's time (fair_share.py's SHARES), so text decode steps run back to back between them (one
    queued ahead of the other) and a denoising step goes when its turn is due."""
    from scheduler.fair_share import SHARES
    from serialization.messages import StepResult
    from tests.test_scheduler import ctx

    tok, runner = flux
    ready = WorkerReady(num_blocks=64, block_size=4, max_model_len=256, eos_token_ids=[2])
    arbiter = Arbiter.for_worker(PipelineConfig().replace(
        max_length=256, image_model_path="flux"), ready, BlockManager(64, 4, False))
    arbiter.add(ctx(3, 200, rid="t"))
    arbiter.add(request(tok, 7, 50))
    from collections import deque

    from worker.process import SideModels, answer_step

    clock, kinds, busy, sent = 0.0, [], {"text": 0.0, "pixels": 0.0}, deque()
    for _ in range(60):
        while (msg := arbiter.next_step()) is not None:  # what the loop sends
            sent.append(msg)
        msg = sent.popleft()  # the worker runs the oldest
        if isinstance(msg, PixelStep):
            kind, took = "pixels", 0.06  # a denoising step: six text steps
            msg = msgpack_numpy_decoder(StepMessage)(encode(msg))
            result = answer_step(runner, SideModels(pixels=runner), msg, started=0.0)
        else:
            kind, took = "text", 0.01
            result = StepResult(step_id=msg.step_id,
                                sampled_token_ids=np.where(msg.sample, 7, -1).astype(np.int32))
        result.started_at, result.finished_at = clock, clock + took
        clock += took
        kinds.append(kind)
        busy[kind] += took
        arbiter.after_step(result)
    assert kinds.count("pixels") >= 3
    assert abs(busy["pixels"] / clock - SHARES["pixels"]) < 0.1
    # Between two denoising steps, text steps back to back.
    assert "pixels, pixels" not in ", ".join(kinds)
