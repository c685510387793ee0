"""The parts of a Hugging Face config.json that the Llama-family forward pass needs (and, for
a vision-language model, its vision encoder)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from pipelines.status import PipelineTask

# Architectures Loom runs, with what sets them apart (the defaults of their Hugging Face
# configs); worker/models/registry.py picks the implementation: the Llama family's, or Gemma 3's.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"attention_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    "Gemma3ForCausalLM": {"qk_norm": True, "tie_word_embeddings": True,
                          "hidden_act": "gelu_pytorch_tanh", "head_dim": 256,
                          "max_position_embeddings": 131072, "sliding_window": 4096},
    # SmolVLM / Idefics3: a SigLIP vision encoder and a Llama text model (the fields above are
    # the text model's; `vision` holds the rest).
    "Idefics3ForConditionalGeneration": {},
    # Qwen2-VL: a ViT with 2D rotary and a patch merger, and a Qwen2 text model whose rotary
    # takes 3-part positions (M-RoPE: `mrope_section`); `vision` holds the ViT's fields.
    "Qwen2VLForConditionalGeneration": {"attention_bias": True},
}


class UnsupportedModelError(ValueError):
    pass


@dataclass
class VisionConfig:
    """A SigLIP-style vision encoder and the connector into the text model (Idefics3's)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int  # of a tile, square
    patch_size: int
    hidden_act: str
    layer_norm_eps: float
    scale_factor: int  # pixel shuffle: scale_factor**2 patches per image token
    image_token_id: int

    @property
    def tokens_per_tile(self) -> int:
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor**2


@dataclass
class Qwen2VisionConfig:
    """Qwen2-VL's vision transformer (transformers' Qwen2VLVisionConfig, its defaults)."""

    embed_dim: int
    depth: int
    num_heads: int
    mlp_ratio: float
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int  # merge_size x merge_size patches per image token
    rope_theta: float  # of the 2D rotary over (row, column) patch positions
    image_token_id: int

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch, as the processor sends them (C x T x P x P)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    hidden_act: str
    sliding_window: int | None
    torch_dtype: str | None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    # Gemma 3 (None elsewhere): each layer's kind, "sliding_attention" (attends to the last
    # `sliding_window` positions, rotary base `rope_local_theta`) or "full_attention" (rotary
    # base `rope_theta` with `rope_scaling`); the attention scale query_pre_attn_scalar**-0.5;
    # tanh soft-capping of the final logits. (attn_logit_softcapping is read but, as in
    # transformers' Gemma 3, not applied.)
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    vision: VisionConfig | Qwen2VisionConfig | None = None  # vision-language models only
    # Multimodal rotary (Qwen2-VL's M-RoPE): the rotary's frequency pairs split in sections
    # turned by a token's temporal, height and width positions. None: one position per token.
    mrope_section: list[int] | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token across all layers, per byte of element size."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim


def check_tensor_parallel_size(config: ModelConfig, size: int) -> None:
    """A split gives each rank at least one key/value head (its share of the KV cache)."""
    kv = config.num_key_value_heads
    if not 1 <= size <= kv:
        raise ValueError(f"--tensor-parallel-size {size} must be between 1 and the "
                         f"model's {kv} key/value heads (each rank holds at least one)")


# Architectures whose every layer attends through `sliding_window` (Mistral's configs that
# set one); worker/models/llama.py honours it as Gemma 3 does for its sliding layers.
EVERY_LAYER_SLIDING = {"MistralForCausalLM"}


def resolve_max_model_len(config: ModelConfig, requested: int | None) -> int:
    limit = config.max_position_embeddings
    # The rest of the Llama family (a Qwen2 config asking for windows on some layers) attends
    # over the full context: stay inside the window. (Gemma 3's sliding layers, those
    # `layer_types` names, and Mistral's honour it.)
    if (config.sliding_window and config.layer_types is None
            and config.architecture not in EVERY_LAYER_SLIDING):
        limit = min(limit, config.sliding_window)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"--max-model-len {requested} exceeds the model's limit of {limit}")
    return requested


ENCODER_ARCHITECTURES = {"BertModel", "BertForMaskedLM", "BertForPreTraining"}


def detect_task(model_dir: str) -> PipelineTask:
    """EMBEDDINGS_GENERATION for a BERT-style encoder or a sentence-transformers checkpoint,
    PIXEL_GENERATION for a diffusers pipeline (model_index.json), else TEXT_GENERATION."""
    if os.path.isfile(os.path.join(model_dir, "model_index.json")):
        return PipelineTask.PIXEL_GENERATION
    path = os.path.join(model_dir, "config.json")
    raw = {}
    if os.path.isfile(path):
        with open(path) as f:
            raw = json.load(f)
    archs = set(raw.get("architectures") or [])
    if archs & ENCODER_ARCHITECTURES or raw.get("model_type") == "bert":
        return PipelineTask.EMBEDDINGS_GENERATION
    if os.path.isfile(os.path.join(model_dir, "modules.json")) and not archs & set(
            SUPPORTED_ARCHITECTURES):
        return PipelineTask.EMBEDDINGS_GENERATION
    return PipelineTask.TEXT_GENERATION


def load_model_config(model_dir: str, any_architecture: bool = False) -> ModelConfig:
    """The config of a checkpoint directory, or of a GGUF file (from its header).
    `any_architecture`: one Loom does not know is read as a Llama-shaped decoder's (the
    standard Hugging Face fields), for a --custom-architectures model to serve."""
    if model_dir.lower().endswith(".gguf"):
        from pipelines.checkpoint.gguf_file import open_gguf

        return open_gguf(model_dir).config
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir} is not a model directory: no config.json")
    with open(path) as f:
        raw = json.load(f)
    return model_config_from_dict(raw, _generation_eos(model_dir), any_architecture)


def model_config_from_dict(raw: dict, generation_eos: list[int] | None = None,
                           any_architecture: bool = False) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else _architecture_from_model_type(raw.get("model_type", ""))
    if arch not in SUPPORTED_ARCHITECTURES and not (any_architecture and arch):
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise UnsupportedModelError(
            f"unsupported architecture {arch or raw.get('model_type')!r}; supported: {supported}"
        )
    if arch == "Gemma3ForCausalLM":
        return _gemma3_config(raw, generation_eos)
    if arch == "Idefics3ForConditionalGeneration":
        return _idefics3_config(raw, generation_eos)
    if arch == "Qwen2VLForConditionalGeneration":
        return _qwen2_vl_config(raw, generation_eos)
    traits = SUPPORTED_ARCHITECTURES.get(arch, {})
    heads = raw["num_attention_heads"]
    hidden = raw["hidden_size"]
    rope = raw.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_scaling = raw.get("rope_scaling")
    if rope.get("rope_type", "default") != "default":
        rope_scaling = rope
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
        rope_scaling = None
    sliding = raw.get("sliding_window")
    if arch.startswith("Qwen") and not raw.get("use_sliding_window", False):
        sliding = None
    eos = generation_eos if generation_eos else _as_list(raw.get("eos_token_id"))
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", traits.get("attention_bias", False))),
        qk_norm=traits.get("qk_norm", False),
        hidden_act=raw.get("hidden_act", "silu"),
        sliding_window=sliding,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        eos_token_ids=eos,
        bos_token_id=raw.get("bos_token_id"),
    )


def _gemma3_config(raw: dict, generation_eos: list[int] | None) -> ModelConfig:
    """Gemma3TextConfig's fields, with its defaults (transformers' configuration_gemma3.py)."""
    traits = SUPPORTED_ARCHITECTURES["Gemma3ForCausalLM"]
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma 3 with bidirectional attention (an embedding model) "
                                    "is not a causal LM")
    layers = raw.get("num_hidden_layers", 26)
    sliding = raw.get("sliding_window", traits["sliding_window"])
    layer_types = raw.get("layer_types")
    if layer_types is None:  # older configs: every `pattern`-th layer is global
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(layers)]
    layer_types = list(layer_types)
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown or len(layer_types) != layers:
        raise UnsupportedModelError(f"Gemma 3 layer_types {sorted(unknown) or layer_types} "
                                    f"do not describe its {layers} layers")
    if not sliding:
        layer_types = ["full_attention"] * layers
    # Rotary parameters: transformers >= 5 writes rope_parameters per layer kind; older
    # configs rope_theta, rope_local_base_freq and rope_scaling (for the global layers).
    rope = raw.get("rope_parameters") or {}
    full = dict(rope.get("full_attention") or {})
    local = dict(rope.get("sliding_attention") or {})
    if not full and raw.get("rope_scaling"):
        full.update(raw["rope_scaling"])
    full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise UnsupportedModelError("Gemma 3: rope scaling on the sliding layers is not "
                                    "supported")
    rope_scaling = full if full.get("rope_type", full.get("type", "default")) != "default" \
        else None
    heads = raw.get("num_attention_heads", 8)
    eos = generation_eos if generation_eos else _as_list(raw.get("eos_token_id", 1))
    return ModelConfig(
        architecture="Gemma3ForCausalLM",
        vocab_size=raw.get("vocab_size", 262_208),
        hidden_size=raw.get("hidden_size", 2304),
        intermediate_size=raw.get("intermediate_size", 9216),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or 4,
        head_dim=raw.get("head_dim") or traits["head_dim"],
        max_position_embeddings=raw.get("max_position_embeddings",
                                        traits["max_position_embeddings"]),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(full["rope_theta"]),
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        attention_bias=bool(raw.get("attention_bias", False)),
        qk_norm=True,
        hidden_act=raw.get("hidden_activation") or traits["hidden_act"],
        sliding_window=sliding or None,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        eos_token_ids=eos,
        bos_token_id=raw.get("bos_token_id", 2),
        layer_types=layer_types,
        rope_local_theta=float(local["rope_theta"]),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        attn_logit_softcapping=raw.get("attn_logit_softcapping"),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
    )


def _idefics3_config(raw: dict, generation_eos: list[int] | None) -> ModelConfig:
    """Idefics3Config: its text_config is a Llama's (transformers' default rms_norm_eps 1e-5
    there), its vision_config a SigLIP encoder's (Idefics3VisionConfig's defaults)."""
    text = dict(raw.get("text_config") or {})
    if text.get("model_type", "llama") != "llama":
        raise UnsupportedModelError(f"Idefics3 with a {text['model_type']!r} text model")
    text.setdefault("rms_norm_eps", 1e-5)
    text["architectures"] = ["LlamaForCausalLM"]
    text["tie_word_embeddings"] = raw.get("tie_word_embeddings", False)
    config = model_config_from_dict(text, generation_eos)
    v = raw.get("vision_config") or {}
    config.architecture = "Idefics3ForConditionalGeneration"
    config.torch_dtype = raw.get("torch_dtype") or raw.get("dtype") or config.torch_dtype
    config.vision = VisionConfig(
        hidden_size=v.get("hidden_size", 1152),
        intermediate_size=v.get("intermediate_size", 3072),
        num_hidden_layers=v.get("num_hidden_layers", 12),
        num_attention_heads=v.get("num_attention_heads", 16),
        num_channels=v.get("num_channels", 3),
        image_size=v.get("image_size", 224),
        patch_size=v.get("patch_size", 32),
        hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"),
        layer_norm_eps=v.get("layer_norm_eps", 1e-6),
        scale_factor=raw.get("scale_factor", 2),
        image_token_id=raw.get("image_token_id", 128257),
    )
    return config


def _qwen2_vl_config(raw: dict, generation_eos: list[int] | None) -> ModelConfig:
    """Qwen2VLConfig: the text model's fields nested in text_config (transformers >= 5) or at
    the top level (the Hub's checkpoints), its M-RoPE sections in rope_parameters or in
    rope_scaling ({"type": "mrope", "mrope_section": ...}); the vision fields in
    vision_config."""
    text = dict(raw.get("text_config") or raw)
    text.pop("vision_config", None)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = rope.pop("mrope_section", None)
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
        raise UnsupportedModelError(f"Qwen2-VL with rope scaling {rope!r}")
    rope_theta = rope.get("rope_theta", text.get("rope_theta", 1_000_000.0))
    text.update(architectures=["Qwen2ForCausalLM"], rope_parameters={"rope_theta": rope_theta},
                rope_scaling=None, rms_norm_eps=text.get("rms_norm_eps", 1e-5),
                tie_word_embeddings=raw.get("tie_word_embeddings",
                                            text.get("tie_word_embeddings", False)))
    config = model_config_from_dict(text, generation_eos)
    if section is None or sum(section) != config.head_dim // 2:
        raise UnsupportedModelError(f"Qwen2-VL's mrope_section {section} must split the "
                                    f"rotary's {config.head_dim // 2} frequencies")
    v = raw.get("vision_config") or {}
    v_rope = v.get("rope_parameters") or {}
    config.architecture = "Qwen2VLForConditionalGeneration"
    config.torch_dtype = raw.get("torch_dtype") or raw.get("dtype") or config.torch_dtype
    config.mrope_section = list(section)
    config.vision = Qwen2VisionConfig(
        embed_dim=v.get("embed_dim", 1280),
        depth=v.get("depth", 32),
        num_heads=v.get("num_heads", 16),
        mlp_ratio=v.get("mlp_ratio", 4),
        hidden_act=v.get("hidden_act", "quick_gelu"),
        in_channels=v.get("in_channels", 3),
        patch_size=v.get("patch_size", 14),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        rope_theta=float(v_rope.get("rope_theta", 10000.0)),
        image_token_id=raw.get("image_token_id", 151655),
    )
    if v.get("hidden_size", config.hidden_size) != config.hidden_size:
        raise UnsupportedModelError("Qwen2-VL's vision_config.hidden_size must be the text "
                                    "model's hidden_size")
    return config


def _architecture_from_model_type(model_type: str) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "gemma3_text": "Gemma3ForCausalLM",
        "idefics3": "Idefics3ForConditionalGeneration",
        "qwen2_vl": "Qwen2VLForConditionalGeneration",
    }.get(model_type, "")


def _generation_eos(model_dir: str) -> list[int]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return _as_list(json.load(f).get("eos_token_id"))


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
