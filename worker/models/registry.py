"""Which model class runs a checkpoint: Gemma 3's own, Idefics3's (SmolVLM) or Qwen2-VL's (a
vision encoder on the Llama family's), or the Llama family's for the rest.

All are `PipelineModel`s (pipelines/pipeline.py: the runner drives them through it), built
with `(config, max_positions)`. For the loader they also offer `load_hf_weights(weights)`,
`compute_dtype`, `compute_in_float32()`, `use_fast_weight_layout()` and a `fused_decode`
attribute (None until the runner sets it; Gemma 3 never uses it).
"""

from __future__ import annotations

from pipelines.checkpoint.model_config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    UnsupportedModelError,
)


def model_class(config: ModelConfig) -> type:
    if config.architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported architecture {config.architecture!r}")
    if config.architecture == "Gemma3ForCausalLM":
        from worker.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    if config.architecture == "Idefics3ForConditionalGeneration":
        from worker.models.idefics3 import Idefics3ForConditionalGeneration

        return Idefics3ForConditionalGeneration
    if config.architecture == "Qwen2VLForConditionalGeneration":
        from worker.models.qwen2_vl import Qwen2VLForConditionalGeneration

        return Qwen2VLForConditionalGeneration
    from worker.models.llama import LlamaForCausalLM

    return LlamaForCausalLM
