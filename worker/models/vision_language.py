"""What the vision-language models (Idefics3, Qwen2-VL) share: a Llama-family text model whose
prompts hold images.

An image is encoded in the step that feeds its first token (the scheduler sends its pixels
then, `StepImage`) and its embeddings are kept in a `VisionEmbeddingCache` until the step that
feeds its last token, so chunked prefill may cut an image anywhere. Each step, the cached rows
of the tokens it feeds replace those tokens' embeddings before the decoder layers. A subclass
brings its encoder: `image_embeddings(images)` (one [tokens, hidden] tensor per image) and
`check_image(image)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pipelines.pipeline import ModelOutputs, PagedModelInputs
from serialization.messages import StepImage
from worker.models.llama import LlamaForCausalLM
from worker.sampler import describe
from worker.vision_cache import VisionEmbeddingCache

# Vision encoders' activations, by their config's hidden_act.
VISION_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def layer_norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` with its weights in x's dtype: a bfloat16 model may compute in float32."""
    return F.layer_norm(x, norm.normalized_shape, norm.weight.to(x.dtype),
                        norm.bias.to(x.dtype), norm.eps)


@dataclass
class VisionModelInputs(PagedModelInputs):
    """A step's inputs with what the image merge needs: the sequences and the images sent."""

    request_ids: list[str] = field(default_factory=list)
    images: list[StepImage] = field(default_factory=list)


class VisionLanguageModel(LlamaForCausalLM):
    supports_tensor_parallel = False  # (the vision encoders do not all-reduce)
    # The runner passes the step (its images, its new requests) to prepare_initial_token_inputs.
    reads_step = True

    def __init__(self, pipeline_config, session) -> None:
        super().__init__(pipeline_config, session)
        self.image_cache = VisionEmbeddingCache()

    # ---- what a model brings ---------------------------------------------------------------
    def image_embeddings(self, images: list[StepImage]) -> list[torch.Tensor]:
        raise NotImplementedError

    def check_image(self, image: StepImage) -> None:
        raise NotImplementedError

    def decode(self, hidden: torch.Tensor, m: PagedModelInputs) -> torch.Tensor:
        """The decoder over the step's embeddings (images merged in): the wanted logits."""
        return self.forward_embeddings(hidden, m.attention, m.kv_cache, m.logits_rows)

    # ---- PipelineModel ---------------------------------------------------------------------
    def prepare_initial_token_inputs(self, context_batch, kv_cache_inputs=None,
                                     return_n_logits=1, step=None):
        """`step`: the StepBatch the contexts run in, whose images are encoded now."""
        base = super().prepare_initial_token_inputs(context_batch, kv_cache_inputs,
                                                    return_n_logits)
        return VisionModelInputs(**vars(base),
                                 request_ids=[ctx.request_id for ctx in context_batch],
                                 images=step.images if step is not None else [])

    def execute(self, model_inputs):
        m = model_inputs
        merge = None
        failed: dict[str, str] = {}
        if isinstance(m, VisionModelInputs):  # (multi-step decode inputs carry no images)
            failed = self.encode_images(m.images, m.request_ids)
            merge = self.image_cache.gather(m.request_ids, m.query_lens, m.seq_lens)
        hidden = self.embed_tokens(m.input_ids).to(self.compute_dtype)
        if merge is not None:
            rows, embeddings = merge
            hidden[rows] = embeddings.to(hidden.dtype)
        logits = self.decode(hidden, m)
        if isinstance(m, VisionModelInputs):
            self.image_cache.drop_done(m.request_ids, m.seq_lens)
        return ModelOutputs(next_token_logits=logits[: m.num_sampled], logits=logits,
                            failed_requests=failed)

    def release(self, request_id: str) -> None:
        self.image_cache.release(request_id)

    # ---- images ----------------------------------------------------------------------------
    def encode_images(self, images: list[StepImage], request_ids: list[str]) -> dict[str, str]:
        """Encode the step's new images into the cache, all at once; should that raise,
        request by request. Returns the requests whose images fail, with why: they fail
        alone, and this step their image tokens keep their token embeddings (nothing is
        cached for them), so the others' rows are computed as if they were not there."""
        if not images:
            return {}
        in_step = set(request_ids)
        for img in images:
            if img.request_id not in in_step:
                raise ValueError(f"an image of request {img.request_id}, which is not in the "
                                 f"step")
        try:
            self._encode(images)
            return {}
        except Exception:
            pass
        by_request: dict[str, list[StepImage]] = {}
        for img in images:
            by_request.setdefault(img.request_id, []).append(img)
        failed = {}
        for request_id, own in by_request.items():
            try:
                self._encode(own)
            except Exception as exc:
                failed[request_id] = f"image encoding: {describe(exc)}"
                self.image_cache.release(request_id)  # (what the batch left of it)
        return failed

    def _encode(self, images: list[StepImage]) -> None:
        for img in images:
            if not 0 <= img.start_idx < img.end_idx or len(img.token_mask) != (
                    img.end_idx - img.start_idx):
                raise ValueError(f"request {img.request_id}: an image's token run and mask "
                                 f"disagree")
            self.check_image(img)
        for img, rows in zip(images, self.image_embeddings(images), strict=True):
            self.image_cache.put(img.request_id, img.image_index, img.start_idx,
                                 np.asarray(img.token_mask, dtype=bool), rows)
