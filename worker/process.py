"""The worker process: owns the model and KV cache, runs each StepBatch it receives."""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import zmq

from pipelines.config import PipelineConfig
from pipelines.progress import Progress
from pipelines.status import PipelineTask
from processes.cpu_placement import CpuPlacement, short_time_slice, worker_threads
from processes.lifecycle import (
    die_with_parent,
    freeze_startup_heap,
    ignore_interrupts,
    setup_logging,
)
from processes.sockets import MAX_MESSAGE_BYTES, Endpoints, decode_or_drop, make_socket
from serialization.codec import msgpack_numpy_decoder, msgpack_numpy_encoder
from serialization.messages import (
    AudioResult,
    AudioStep,
    EmbedResult,
    EmbedStep,
    PixelResult,
    PixelStep,
    Shutdown,
    StepBatch,
    StepMessage,
    StepResult,
    WorkerFailed,
    WorkerReady,
)

logger = logging.getLogger("loom.worker")

STARTUP_PREFAULT_SECONDS = 0.3  # of KV cache page faults before the worker reports ready
IDLE_MS = 20  # without a step for this long, the worker counts as idle


@dataclass
class SideModels:
    """What runs the steps that are not the main model's: a voice (speech steps) beside a text
    model, and a FLUX pipeline (pixel steps) beside one or alone."""

    speech: Any = None
    pixels: Any = None


def run_worker(cfg: PipelineConfig, endpoints: Endpoints, num_threads: int, log_level: str,
               placement: CpuPlacement | None = None, rank: int = 0) -> None:
    """Entry point of a worker process (spawned by `loom serve`): rank `rank` of
    `cfg.device_config.tensor_parallel_size` workers holding one model
    (worker/tensor_parallel.py). Every rank runs every step; rank 0 alone answers the
    scheduler."""
    _enter_worker_process(num_threads, log_level, placement)
    zctx, steps, results = _connect(endpoints, rank)
    try:
        _join_ranks(cfg, endpoints, rank)
        runner = _load_runner(cfg, rank)
        side = SideModels(speech=_load_speech(cfg, rank), pixels=_load_pixels(cfg, rank, runner))
    except Exception as exc:
        _exit_failed(results, exc, rank, cfg.device_config.tensor_parallel_size)
    if rank == 0:
        from worker.kernels import startup_summary

        logger.log(*startup_summary())  # (one line: which kernels run, or why PyTorch's does)
    faulting = _warm_up(runner)
    if cfg.device_config.tensor_parallel_size > 1:
        from worker.tensor_parallel import barrier

        barrier()  # every rank loaded: ready to run steps together
    if rank == 0:
        ready = _ready_message(runner, cfg.model_config.task, side.speech)
        results.send(msgpack_numpy_encoder()(ready))
    _serve_steps(steps, results if rank == 0 else None,
                 _generator(runner, cfg.model_config.task), side,
                 _deferred_start_up(runner, faulting))
    zctx.destroy(linger=0)


def _enter_worker_process(num_threads: int, log_level: str,
                          placement: CpuPlacement | None) -> None:
    """The process's signals, logging, cores and threads, before anything loads a model."""
    die_with_parent()
    ignore_interrupts()
    setup_logging(log_level)
    if placement is not None:
        placement.enter_worker()  # before torch loads OpenMP
    import torch

    torch.set_num_threads(num_threads)
    from worker.decode_attention import set_kernel_threads

    set_kernel_threads(num_threads)


def _connect(endpoints: Endpoints, rank: int):
    """This rank's sockets: its steps in, the results out."""
    with worker_threads(), short_time_slice():  # ZeroMQ starts its I/O thread with the first socket
        zctx = zmq.Context()
        steps = make_socket(zctx, zmq.PULL, endpoints.steps_of_rank(rank), bind=False,
                            max_message_bytes=MAX_MESSAGE_BYTES["steps"])
        results = make_socket(zctx, zmq.PUSH, endpoints.results, bind=False)
    return zctx, steps, results


def _exit_failed(results, exc: Exception, rank: int, size: int) -> None:
    """A model that failed to load is reported to the user as one line by `loom serve`."""
    logger.debug("model load failed", exc_info=True)
    where = f" (worker rank {rank})" if size > 1 else ""
    results.send(msgpack_numpy_encoder()(
        WorkerFailed(message=f"{type(exc).__name__}: {exc}{where}")))
    time.sleep(0.5)  # let the message leave before the process exits
    sys.exit(1)


def _join_ranks(cfg: PipelineConfig, endpoints: Endpoints, rank: int) -> None:
    """A split model's ranks join their process group, each on its own device."""
    size = cfg.device_config.tensor_parallel_size
    if size == 1:
        return
    from worker.device import rank_device
    from worker.tensor_parallel import init_process_group

    init_process_group(rank, size, endpoints.rendezvous_file, rank_device(cfg.devices, rank))
    logger.info("worker rank %d of %d is pid %d", rank, size, os.getpid())


def _load_speech(cfg: PipelineConfig, rank: int):
    """The voice beside a text model (rank 0's alone), when asked for and installed."""
    if cfg.model_config.task is not PipelineTask.TEXT_GENERATION or rank != 0:
        return None
    from pipelines import orpheus

    if orpheus.snac_directory(cfg.model_config.model_path):  # it writes speech tokens
        from worker.device import rank_device
        from worker.speech.snac_decoder import SnacDecoder

        return SnacDecoder.for_checkpoint(cfg.model_config.model_path,
                                          cfg.model_config.served_model_name,
                                          device=rank_device(cfg.devices, rank))
    if not cfg.speech_config.enable_speech:
        return None
    from worker.speech_runner import SpeechRunner

    if not SpeechRunner.available():
        return None
    with worker_threads():  # onnxruntime's thread pool
        return SpeechRunner(noise=cfg.speech_config.speech_noise)


def _load_pixels(cfg: PipelineConfig, rank: int, runner):
    """The FLUX pipeline: the worker's model, or one beside a text model (rank 0's alone)."""
    if cfg.model_config.task is PipelineTask.PIXEL_GENERATION:
        return runner
    path = cfg.pixel_config.image_model_path
    if path is None or rank != 0:
        return None
    from worker.device import rank_device, resolve_dtype
    from worker.pixels.flux import FluxRunner

    device = rank_device(cfg.devices, rank)
    return FluxRunner(path, device, resolve_dtype(None, device))


def _warm_up(runner):
    """The first KV cache page faults (the blocks the first requests get; at most
    STARTUP_PREFAULT_SECONDS of them), then the start-up heap frozen. Returns the faults left
    for idle moments."""
    from worker.kv_cache import KVCachePrefault  # (torch: imported in the worker only)

    cache = getattr(runner, "kv_cache", None)  # (a GPU's is allocated zeroed: nothing to fault)
    prefault = KVCachePrefault(cache) if cache is not None and cache.device.type == "cpu" \
        else None
    faulting = _faulting_in(prefault)
    deadline = time.monotonic() + STARTUP_PREFAULT_SECONDS
    for fault in faulting:
        fault()
        if time.monotonic() >= deadline:
            break
    freeze_startup_heap()
    return faulting


def _serve_steps(steps, results, generator, side: SideModels, idle_tasks) -> None:
    """Run each step received until Shutdown, answering on `results` (rank 0's; other ranks
    run the text steps with it and answer nothing). Idle for a while, the worker does what
    start-up left for later, a short call at a time, until a step comes. (Not at once: a
    request arriving in a burst's gaps would wait for it.)"""
    decode = msgpack_numpy_decoder(StepMessage, copy=False)
    encode = msgpack_numpy_encoder()
    idle_task = next(idle_tasks, None)
    while True:
        if idle_task is not None and not steps.poll(IDLE_MS):
            while idle_task is not None and not steps.poll(0):
                idle_task()
                idle_task = next(idle_tasks, None)
        frame = steps.recv(copy=False)
        started = time.monotonic()
        msg = decode_or_drop(decode, frame.buffer, "steps")
        if msg is None:
            continue
        if isinstance(msg, Shutdown):
            return
        if results is not None:
            results.send(encode(answer_step(generator, side, msg, started)))
        elif isinstance(msg, StepBatch):  # (speech and pixels run on rank 0 alone)
            answer_step(generator, side, msg, started)


def answer_step(runner, side: SideModels | None, msg, started: float):
    """The result of one step. A step that raises (a bad step the runner refuses included) is
    answered with an error result for its requests, and the worker goes on to the next."""
    try:
        result = STEP_HANDLERS[type(msg)](runner, side or SideModels(), msg)
    except Exception as exc:
        logger.error("step %d failed:\n%s", msg.step_id, traceback.format_exc())
        result = _failed(msg, f"{type(exc).__name__}: {exc}")
    result.started_at, result.finished_at = started, time.monotonic()
    return result


def _deferred_start_up(runner, prefault):
    """Start-up work that need not delay /health, as short calls: the structured-output
    tokenizer (0.4-0.5 s, once), then faulting in the KV cache's fresh blocks (`prefault`:
    what start-up left of `_faulting_in`)."""
    grammars = getattr(runner, "grammars", None)
    if grammars is not None:
        yield grammars.load
    if prefault is not None:
        yield from prefault


def _faulting_in(prefault):
    """The KV cache's page faults as short calls, lowest blocks first, under one progress
    report from the first to the last (seconds for gigabytes, spread over idle moments)."""
    if prefault is None or prefault.done:
        return
    with Progress("faulting in the KV cache", total=prefault.num_blocks,
                  unit="blocks") as progress:
        while not prefault.done:
            yield prefault.step
            progress.done = prefault.next_block


def _load_runner(cfg: PipelineConfig, rank: int):
    model = cfg.model_config
    if model.task is PipelineTask.EMBEDDINGS_GENERATION:
        from worker.embedding_runner import EmbeddingRunner

        return EmbeddingRunner(cfg)  # (on the CPU)
    if model.task is PipelineTask.PIXEL_GENERATION:
        from worker.device import rank_device, resolve_dtype
        from worker.pixels.flux import FluxRunner

        device = rank_device(cfg.devices, rank)
        return FluxRunner(model.model_path, device, resolve_dtype(model.dtype, device))
    from worker.model_runner import ModelRunner

    return ModelRunner(cfg, rank)


def _generator(runner, task: PipelineTask):
    """What runs the steps: for text, MAX's TextGenerationPipeline over the runner, fed the
    scheduler's steps."""
    if task in (PipelineTask.EMBEDDINGS_GENERATION, PipelineTask.PIXEL_GENERATION):
        return runner
    from worker.pipeline import ScheduledSteps, TextGenerationPipeline

    return TextGenerationPipeline(runner, ScheduledSteps(runner.max_model_len))


def _ready_message(runner, task: PipelineTask, speech) -> WorkerReady:
    if task is PipelineTask.EMBEDDINGS_GENERATION:
        return WorkerReady(num_blocks=0, block_size=0, max_model_len=runner.max_model_len,
                           eos_token_ids=[], task=PipelineTask.EMBEDDINGS_GENERATION)
    if task is PipelineTask.PIXEL_GENERATION:
        return WorkerReady(num_blocks=0, block_size=0, max_model_len=0, eos_token_ids=[],
                           task=task)
    ready = WorkerReady(num_blocks=runner.num_blocks, block_size=runner.block_size,
                        max_model_len=runner.max_model_len, eos_token_ids=runner.eos_token_ids,
                        max_batch_input_tokens=runner.max_batch_input_tokens)
    if speech is not None:
        ready.voices, ready.sample_rate = [speech.voice_id], speech.sample_rate
        ready.speech_task = speech.speech_task
    return ready


def _text_step(pipeline, side: SideModels, msg: StepBatch) -> StepResult:
    """The step's contexts run through `TextGenerationPipeline.next_token` (each updated
    with its token); the packed result is what goes back to the scheduler."""
    steps, runner = pipeline.steps, pipeline.runner
    for request_id in msg.finished_request_ids:
        ctx = steps.contexts.get(request_id)
        if ctx is not None:
            pipeline.release(ctx)
    # (Checked before the step's tokens are written into the contexts: a corrupted step is
    # refused whole and leaves every running request as it was.)
    runner.check(msg)
    pipeline.next_token(steps.receive(msg))
    return pipeline.last_result


def _embed_step(runner, side: SideModels, msg: EmbedStep) -> EmbedResult:
    """The step's inputs as contexts through `EmbeddingsGenerator.encode`, packed back."""
    import numpy as np

    from pipelines.context import TextContext

    inputs = np.split(msg.input_ids, np.cumsum(msg.lengths)[:-1])
    batch = {rid: TextContext(tokens=ids, request_id=rid, max_length=len(ids))
             for rid, ids in zip(msg.request_ids, inputs)}
    if len(batch) != len(inputs):
        raise ValueError(f"step {msg.step_id}: request ids repeat or miss inputs")
    responses = runner.encode(batch)
    return EmbedResult(step_id=msg.step_id,
                       embeddings=np.stack([responses[rid].embeddings for rid in batch]))


def _audio_step(runner, side: SideModels, msg: AudioStep) -> AudioResult:
    if side.speech is None:
        raise RuntimeError("this worker serves no voice")
    from worker.speech_runner import run_audio_step

    return run_audio_step(side.speech, msg)


def _pixel_step(runner, side: SideModels, msg: PixelStep) -> PixelResult:
    if side.pixels is None:
        raise RuntimeError("this worker serves no image model")
    from worker.pixels.step import run_pixel_step

    return run_pixel_step(side.pixels, msg)


# Each step type the scheduler sends, and what runs it: (runner, side models, step) -> result.
STEP_HANDLERS = {StepBatch: _text_step, EmbedStep: _embed_step, AudioStep: _audio_step,
                 PixelStep: _pixel_step}


def _failed(msg, error: str):
    import numpy as np

    if isinstance(msg, EmbedStep):
        return EmbedResult(step_id=msg.step_id, embeddings=np.zeros((0, 0), np.float32),
                           error=error)
    if isinstance(msg, AudioStep):
        return AudioResult(step_id=msg.step_id, audio=[], error=error)
    if isinstance(msg, PixelStep):
        return PixelResult(step_id=msg.step_id, outputs=[], error=error)
    return StepResult(step_id=msg.step_id,
                      sampled_token_ids=np.full(len(msg.request_ids), -1, dtype=np.int32),
                      error=error)
