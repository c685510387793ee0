"""Which model class runs a checkpoint: Gemma 3's own, Idefics3's (SmolVLM) or Qwen2-VL's (a
vision encoder on the Llama family's), or the Llama family's for the rest; a
--custom-architectures class (pipelines/custom_architectures.py) before any of them.

All are `PipelineModel`s (pipelines/pipeline.py: the runner drives them through it), built
as `cls(pipeline_config, session)` (a tensor-parallel rank's with `shard=`, where the class
`supports_tensor_parallel`). For the loader they also offer `load_hf_weights(weights)`,
`compute_dtype`, `compute_in_float32()`, `use_fast_weight_layout()` and a `fused_decode`
attribute (None until the runner sets it; Gemma 3 never uses it).
"""

from __future__ import annotations

from pipelines.checkpoint.model_config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    UnsupportedModelError,
)
from pipelines.custom_architectures import find_architecture


def model_class(config: ModelConfig, custom: list = ()) -> type:
    """`custom`: the --custom-architectures' SupportedArchitectures, which come first (MAX's
    rule)."""
    arch = find_architecture(list(custom), config.architecture)
    if arch is not None:
        return arch.pipeline_model
    if config.architecture not in SUPPORTED_ARCHITECTURES:
        served = ", ".join(a.name for a in custom if a.name)
        raise UnsupportedModelError(f"unsupported architecture {config.architecture!r}"
                                    + (f" (--custom-architectures serve {served})"
                                       if custom else ""))
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
