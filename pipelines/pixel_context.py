"""PixelContext: one image generation request, model-ready, as max.pipelines.core lays it out.

Only numbers travel: the prompt and negative prompt are consumed by the tokenizer
(PixelGenerationTokenizer.new_context, in the API process), which also computes the
flow-matching schedule and draws the initial noise. The worker runs the text encoders once and
then one denoising step at a time, so requests at different steps share a transformer call;
`update` stores each step's latents and counts the step.

TokenBuffer in MAX is a numpy array of token ids; here it is one (int64).
"""

from __future__ import annotations

import uuid

import msgspec
import numpy as np

from pipelines.status import GenerationStatus


def _new_request_id() -> str:
    return uuid.uuid4().hex


def _empty_f32() -> np.ndarray:
    return np.zeros(0, dtype=np.float32)


class GenerationOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """Where a pixel request stands after a step; `images` (uint8, [n, height, width, 3]) is set
    on the last one."""

    request_id: str
    final_status: GenerationStatus = GenerationStatus.ACTIVE
    steps_executed: int = 0
    images: np.ndarray | None = None
    error: str | None = None  # set when final_status is ERROR: what went wrong, for the client

    @property
    def is_done(self) -> bool:
        return self.final_status.is_done


class PixelContext(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True, eq=False):
    # eq=False: one request's mutable state, like TextContext.

    tokens: np.ndarray  # primary (CLIP-like) encoder's ids
    request_id: str = msgspec.field(default_factory=_new_request_id)
    model_name: str = ""
    mask: np.ndarray | None = None  # bool: the text encoder's attention mask
    tokens_2: np.ndarray | None = None  # secondary (T5-like) encoder's ids; None for one encoder
    negative_tokens: np.ndarray | None = None
    negative_tokens_2: np.ndarray | None = None
    # Model-specific numeric parameters (e.g. cfg_normalization values).
    extra_params: dict[str, np.ndarray] = msgspec.field(default_factory=dict)
    timesteps: np.ndarray = msgspec.field(default_factory=_empty_f32)  # [steps], float32
    sigmas: np.ndarray = msgspec.field(default_factory=_empty_f32)  # [steps + 1], ends at 0
    latents: np.ndarray = msgspec.field(default_factory=_empty_f32)  # packed: [n, seq, 4*C]
    latent_image_ids: np.ndarray = msgspec.field(default_factory=_empty_f32)  # [seq, 3]
    height: int = 1024
    width: int = 1024
    num_inference_steps: int = 50
    guidance_scale: float = 3.5
    guidance: np.ndarray | None = None  # float32 [1]: set for guidance-distilled models
    true_cfg_scale: float = 1.0
    num_warmup_steps: int = 0
    num_images_per_prompt: int = 1
    status: GenerationStatus = GenerationStatus.ACTIVE
    _step: int = 0  # denoising steps done

    @property
    def is_done(self) -> bool:
        """Whether the request has completed generation."""
        return self.status.is_done

    @property
    def step(self) -> int:
        """Denoising steps done: the index of the next timestep."""
        return self._step

    @property
    def do_true_cfg(self) -> bool:
        """Real classifier-free guidance: a second, negative-prompt pass each step (diffusers'
        FluxPipeline's condition)."""
        return self.true_cfg_scale > 1.0 and self.negative_tokens is not None

    def compute_num_available_steps(self, max_seq_len: int) -> int:
        """The denoising steps still to run (all of them at first): what the scheduler
        schedules, as a text context's available tokens."""
        return self.num_inference_steps - self._step

    def update(self, latents: np.ndarray) -> None:
        """Store one step's latents; the request ends after its last step."""
        self.latents = latents
        self._step += 1
        if self._step >= self.num_inference_steps:
            self.status = GenerationStatus.END_OF_SEQUENCE

    def reset(self) -> None:
        """Back to step 0 (the caller restores the initial latents if it kept them)."""
        self._step = 0
        self.status = GenerationStatus.ACTIVE

    def to_generation_output(self) -> GenerationOutput:
        return GenerationOutput(request_id=self.request_id, final_status=self.status,
                                steps_executed=self._step)
