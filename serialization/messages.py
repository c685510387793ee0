"""Every message that crosses a process boundary, in one place.

Channels (all ZMQ PUSH/PULL, one direction each):
  API -> scheduler    requests:  TextContext (TextAndVisionContext), EmbeddingsContext, TTSContext,
                                 PixelContext
  API -> scheduler    cancel:    CancelRequest
  scheduler -> API    responses: ResponseBatch | SchedulerReady | SchedulerFailed
  scheduler -> worker steps:     StepBatch | Shutdown
  worker -> scheduler results:   StepResult | WorkerReady | WorkerFailed

Timestamps are `time.monotonic()` values: CLOCK_MONOTONIC is one clock for the whole host,
so intervals between processes on one machine can be computed.
"""

from __future__ import annotations

from typing import Union

import msgspec
import numpy as np

from pipelines.context import TextContext
from pipelines.embeddings import EmbeddingsContext
from pipelines.lora import LoRARequest
from pipelines.pixel_context import GenerationOutput, PixelContext
from pipelines.response import TextGenerationOutput
from pipelines.sampling_params import SamplingParams
from pipelines.speech_context import TTSContext
from pipelines.status import PipelineTask
from pipelines.vision_context import TextAndVisionContext


class CancelRequest(msgspec.Struct, tag=True):
    request_ids: list[str]


class SchedulerStats(msgspec.Struct, array_like=True):
    """The scheduler's gauges and running totals, attached to every ResponseBatch."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    # Per step since the previous stats: tokens fed, and the scheduler + IPC gap the worker
    # waited through (from the previous result reaching the scheduler to the step starting).
    iteration_tokens: list[int] = []
    step_overheads: list[float] = []
    # The worker's own time for each step since the previous stats (the forward pass and
    # sampling), steps with a prompt chunk and steps of decodes only apart.
    prefill_forward_times: list[float] = []
    decode_forward_times: list[float] = []
    # LoRA adapters of the running and the waiting requests (vLLM's lora_requests_info).
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []
    # Malformed frames the scheduler dropped since it started, per channel it reads
    # (requests, cancel, results).
    malformed_frames_total: dict[str, int] = {}
    # Speculative decoding since the start: proposals verified, their tokens, those accepted,
    # and how often the i-th proposed token was (vLLM's spec_decode counters).
    spec_num_drafts_total: int = 0
    spec_num_draft_tokens_total: int = 0
    spec_num_accepted_tokens_total: int = 0
    spec_accepted_per_position: list[int] = []


class EmbeddingOutput(msgspec.Struct, array_like=True):
    request_id: str
    embedding: np.ndarray  # float32 [dim]
    error: str | None = None


class AudioChunk(msgspec.Struct, array_like=True, omit_defaults=True):
    """One synthesized segment of a speech request (int16 mono PCM)."""

    request_id: str
    audio: np.ndarray  # int16 [samples]
    index: int
    is_last: bool
    synthesis_seconds: float = 0.0
    error: str | None = None


class ResponseBatch(msgspec.Struct, tag=True):
    """One step's worth of outputs for every request that produced something."""

    outputs: list[TextGenerationOutput]
    stats: SchedulerStats | None = None
    embeddings: list[EmbeddingOutput] = []
    audio: list[AudioChunk] = []
    images: list[GenerationOutput] = []  # pixel requests' progress; images on the last step


class SchedulerReady(msgspec.Struct, tag=True):
    num_blocks: int
    block_size: int
    max_model_len: int
    task: PipelineTask = PipelineTask.TEXT_GENERATION
    voices: list[str] = []
    sample_rate: int = 0
    # SPEECH_TOKEN_GENERATION: the text model writes speech tokens (Orpheus), a decoder
    # streams them; AUDIO_GENERATION: a voice (Piper) beside the text model.
    speech_task: PipelineTask = PipelineTask.AUDIO_GENERATION


class SchedulerFailed(msgspec.Struct, tag=True):
    message: str


class NewRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """Sent once, the first step a request is scheduled; the worker keeps it until finished."""

    request_id: str
    sampling_params: SamplingParams
    # EOS ids that count as stops (empty with ignore_eos): masked until min_new_tokens.
    eos_token_ids: list[int] = []
    # Top-N log probabilities per sampled token; 0: none.
    logprobs: int = 0
    # Log probabilities of the prompt tokens too (OpenAI's `echo` with `logprobs`).
    echo_logprobs: bool = False
    prompt_len: int = 0
    # The context's tokens when first scheduled: the prompt, then any given past it (a
    # continuation's forced tokens, `jump_ahead`), as vLLM V1's NewRequestData sends them.
    prompt_token_ids: np.ndarray | None = None
    # Constrained decoding: outputs must match this JSON schema.
    json_schema: str | None = None
    # A multimodal-rotary model's (Qwen2-VL's M-RoPE) positions of the prompt's first tokens,
    # int32 [3, n <= prompt_len] (temporal, height, width): image tokens take their place in
    # the image's grid. Later tokens continue from max + 1. None: a token's index.
    rope_positions: np.ndarray | None = None
    # The context's max_length (prompt and output); 0: the model's.
    max_length: int = 0
    # The LoRA adapter its rows run with (None: the base model).
    lora: LoRARequest | None = None


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log probabilities of a run of tokens: the token's own and the top-N alternatives."""

    token_logprobs: np.ndarray  # float32 [n]
    top_token_ids: np.ndarray  # int32 [n, N]
    top_logprobs: np.ndarray  # float32 [n, N]


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Prompt-token log probabilities resolved in one step, for sequence `seq` of the step,
    starting at prompt position `start` (position 0 never has one)."""

    seq: int
    start: int
    logprobs: TokenLogprobs


class StepImage(msgspec.Struct, array_like=True):
    """An image whose first token a step feeds: the worker encodes it then, and keeps its
    embeddings until the step that feeds its last token (worker/vision_cache.py). Sent again
    if the request is preempted and its prompt recomputed."""

    request_id: str
    image_index: int  # of the request's images
    start_idx: int  # the image's token run [start_idx, end_idx) in the request's sequence
    end_idx: int
    token_mask: np.ndarray  # bool [end_idx - start_idx]: the run's tokens that take a row
    pixel_values: np.ndarray  # the model's layout (Idefics3: float32 [tiles, C, H, W];
    #                           Qwen2-VL: float32 [patches, C x T x P x P])
    grid_thw: np.ndarray | None = None  # Qwen2-VL: int64 [3], the image's patch grid


class StepBatch(msgspec.Struct, tag=True):
    """One forward pass: prefill chunks and decodes together, in one flat token array.

    Sequence i feeds `query_lens[i]` tokens (a slice of `input_ids`) at positions
    `seq_lens[i] - query_lens[i] .. seq_lens[i] - 1`; its KV lives in the blocks of
    `block_tables[i]` (padded with -1). The worker samples a token for sequence i only
    when `sample[i]` (a partial prefill chunk has nothing to sample yet).
    """

    step_id: int
    request_ids: list[str]
    input_ids: np.ndarray  # int32 [num_tokens]
    query_lens: np.ndarray  # int32 [num_seqs]
    seq_lens: np.ndarray  # int32 [num_seqs]
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks]
    sample: np.ndarray  # bool [num_seqs]
    new_requests: list[NewRequest] = []
    finished_request_ids: list[str] = []
    images: list[StepImage] = []
    # Speculative decoding: the last `num_draft_tokens[i]` tokens sequence i feeds are
    # proposals to verify (int32 [num_seqs]; None: none this step). Their KV is written; the
    # worker samples at each of them and the one before, and keeps the accepted run.
    num_draft_tokens: np.ndarray | None = None


class EmbedStep(msgspec.Struct, tag=True):
    """Inputs to embed in one padded forward: `input_ids` holds them back to back."""

    step_id: int
    request_ids: list[str]
    input_ids: np.ndarray  # int32 [sum(lengths)]
    lengths: np.ndarray  # int32 [n]


class EmbedResult(msgspec.Struct, tag=True):
    step_id: int
    embeddings: np.ndarray  # float32 [n, dim]
    started_at: float = 0.0
    finished_at: float = 0.0
    error: str | None = None


class AudioStep(msgspec.Struct, tag=True):
    """Decode the next chunk of each of these speech requests (the scheduler's contexts, as
    they are now: the worker's AudioGenerator reads their speech tokens and indices)."""

    step_id: int
    contexts: list[TTSContext]
    num_tokens: int = 0  # speech tokens per chunk (Piper decodes a sentence: 0)


class AudioResult(msgspec.Struct, tag=True):
    step_id: int
    # Per context of the step, in order: its audio (int16 PCM) and its decoded_index after.
    audio: list[np.ndarray]
    decoded_index: list[int] = []
    started_at: float = 0.0
    finished_at: float = 0.0
    error: str | None = None


class PixelStep(msgspec.Struct, tag=True):
    """One denoising step for each request in `request_ids` (each at its own step), in one
    transformer call where their sizes match. `new` requests are added first (their text
    encoders run then); `released` ones (cancelled) are forgotten."""

    step_id: int
    request_ids: list[str]
    new: list[PixelContext] = []
    released: list[str] = []


class PixelResult(msgspec.Struct, tag=True):
    step_id: int
    outputs: list[GenerationOutput]  # per request of the step, in order
    started_at: float = 0.0
    finished_at: float = 0.0
    error: str | None = None


class Shutdown(msgspec.Struct, tag=True):
    pass


class SequenceFailure(msgspec.Struct, array_like=True):
    """Sequence `seq` of a step failed alone (its sampling state, grammar, sampling or log
    probabilities raised): that request ends with `error`, the others of the step go on."""

    seq: int
    error: str


class StepResult(msgspec.Struct, tag=True, omit_defaults=True):
    step_id: int
    sampled_token_ids: np.ndarray  # int32 [num_seqs], -1 where nothing was sampled
    # For the sequences that asked: log probabilities of the sampled tokens (rows of the
    # sequences in `logprob_seqs` order), and of prompt tokens (echo).
    logprob_seqs: list[int] = []
    sampled_logprobs: TokenLogprobs | None = None
    prompt_logprobs: list[PromptLogprobs] = []
    started_at: float = 0.0  # worker received the step
    finished_at: float = 0.0  # worker sent the result
    error: str | None = None  # the whole step failed
    failed: list[SequenceFailure] = []
    # With proposals (StepBatch.num_draft_tokens): how many of sequence i's were accepted
    # (int32 [num_seqs]). Its new tokens are those proposals, then sampled_token_ids[i];
    # with log probabilities, sequence i is in `logprob_seqs` once per new token.
    num_accepted: np.ndarray | None = None
    # With a draft model (--speculative-method draft): the proposals it made in place of the
    # scheduler's placeholders, int32, the num_draft_tokens of each proposing sequence back
    # to back in sequence order.
    draft_token_ids: np.ndarray | None = None


class WorkerReady(msgspec.Struct, tag=True):
    num_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: list[int]
    task: PipelineTask = PipelineTask.TEXT_GENERATION
    # The step's token budget for the worker's device (`batch_input_tokens_on`; 0: none).
    max_batch_input_tokens: int = 0
    voices: list[str] = []  # speech voices the worker serves (empty: no speech)
    sample_rate: int = 0
    speech_task: PipelineTask = PipelineTask.AUDIO_GENERATION  # (as SchedulerReady's)


class WorkerFailed(msgspec.Struct, tag=True):
    message: str


RequestMessage = Union[TextContext, TextAndVisionContext, EmbeddingsContext, TTSContext,
                       PixelContext]
ResponseMessage = Union[ResponseBatch, SchedulerReady, SchedulerFailed]
StepMessage = Union[StepBatch, EmbedStep, AudioStep, PixelStep, Shutdown]
ResultMessage = Union[StepResult, EmbedResult, AudioResult, PixelResult, WorkerReady,
                      WorkerFailed]
