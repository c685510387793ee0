"""Reading a GGUF file as llama.cpp and Ollama users hold it: its hyper-parameters as a
ModelConfig, and its tensors under Hugging Face names, still in their block formats.

Nothing is dequantized or copied here: tensors are views of the memory-mapped file (but for
Gemma 3's norm vectors, which llama.cpp stores as 1 + w and Loom takes as w, as Hugging Face
checkpoints hold them). Every problem a file can have (truncated, another architecture, a
block type Loom has no kernel for, a header that contradicts itself) is one `GGUFError` with a
one-line message naming the file, never an exception from the parser underneath.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np

from pipelines.checkpoint.gguf_header import (
    ArrayValue,
    GGUFHeader,
    HeaderError,
    TensorInfo,
    read_header,
)
from pipelines.checkpoint.model_config import ModelConfig

# GGUF's architecture names, and the Hugging Face architecture Loom runs each as. (llama.cpp's
# converter writes Mistral and SmolLM checkpoints as "llama"; "gemma3" is Gemma 3's text model.)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM"}
# Tensor types Loom can hold: plain floats, and the block formats worker/quant_linear.py runs.
SUPPORTED_TYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K",
                   "Q6_K"}

# Hugging Face parameter names, from GGUF's per-layer tensor names.
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3 norms the sub-layers' outputs too: its ffn_norm is the MLP's input norm, and the
# attention's output norm is post_attention_norm (llama.cpp's tensor names for Gemma 2 and 3).
_GEMMA3_LAYER_TENSORS = {**_LAYER_TENSORS,
                         "post_attention_norm.weight": "post_attention_layernorm.weight",
                         "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                         "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_LAYER_TENSORS_BY_ARCH = {"gemma3": _GEMMA3_LAYER_TENSORS}
_MODEL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                  "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
# What llama.cpp hard-codes for Gemma 3 rather than writing it to the header
# (src/llama-model.cpp, LLM_ARCH_GEMMA3), as transformers' GGUF loader also assumes it: every
# 6th layer attends globally, the sliding ones with rotary base 10,000.
_GEMMA3_GLOBAL_EVERY = 6
_GEMMA3_LOCAL_ROPE_THETA = 10_000.0
# Tokens that end a turn besides the file's EOS (Gemma's instruction-tuned models end their
# replies with <end_of_turn>; Hugging Face's generation config lists both).
_END_OF_TURN = {"gemma3": "<end_of_turn>"}


class GGUFError(ValueError):
    """A GGUF file Loom cannot serve; the message is one line naming the file and the problem."""


@dataclass
class GGUFTensor:
    """One tensor as the file stores it. `shape` is PyTorch's order ([out, in] for a weight);
    `data` is a read-only view of the file: [rows, row bytes] uint8 for a block format, the
    values for F32/F16/BF16 (BF16 as uint16)."""

    qtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def is_quantized(self) -> bool:
        return self.qtype not in ("F32", "F16", "BF16")


@dataclass
class GGUFModel:
    path: str
    architecture: str  # GGUF's name (llama, qwen2, ...)
    config: ModelConfig
    tensors: dict[str, GGUFTensor]  # by Hugging Face parameter name
    chat_template: str | None


def open_gguf(path: str) -> GGUFModel:
    """The file's config and tensors; GGUFError for anything Loom cannot serve as it is."""
    name = os.path.basename(path)
    header = _read(path)
    fields = _Fields(header, name)
    arch = fields.string("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{name}: unsupported architecture {arch!r}; loom serves GGUF files of "
                        f"{', '.join(ARCHITECTURES)}")
    if arch in _END_OF_TURN:  # again, with the vocabulary's strings (~0.1 s for 262k tokens)
        header = _read(path, frozenset({"tokenizer.ggml.tokens"}))
        fields = _Fields(header, name)
    config = _config(fields, arch, header)
    tensors = _tensors(header, name, config, arch)
    template = fields.string("tokenizer.chat_template", required=False)
    return GGUFModel(path, arch, config, tensors, template)


def dequantize(tensor: GGUFTensor):
    """float32 torch tensor of `shape` (for small tensors, the fallback path and tests)."""
    import gguf
    import torch

    if tensor.qtype == "BF16":
        values = (tensor.data.astype(np.uint32) << 16).view(np.float32)
    else:
        values = gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType[tensor.qtype])
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(tensor.shape))


# -- reading ------------------------------------------------------------------------------------


def _read(path: str, read_arrays: frozenset[str] = frozenset()) -> GGUFHeader:
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such file")
    try:
        return read_header(path, read_arrays)
    except HeaderError as exc:
        raise GGUFError(f"{name}: {exc}") from None
    except OSError as exc:
        raise GGUFError(f"{name}: cannot be read ({exc.strerror or exc})") from None


class _Fields:
    """Typed access to the key-value metadata, with errors that name the key."""

    def __init__(self, header: GGUFHeader, name: str) -> None:
        self.fields = header.fields
        self.name = name

    def _value(self, key: str, required: bool):
        value = self.fields.get(key)
        if value is None and required:
            raise GGUFError(f"{self.name}: the header lacks {key}")
        return value

    def string(self, key: str, required: bool = True) -> str | None:
        value = self._value(key, required)
        if value is not None and not isinstance(value, str):
            raise GGUFError(f"{self.name}: {key} is not a string")
        return value

    def number(self, key: str, required: bool = True, default=None):
        value = self._value(key, required)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GGUFError(f"{self.name}: {key} is not a number")
        return value

    def positive_int(self, key: str, required: bool = True, default=None) -> int | None:
        value = self.number(key, required, default)
        if value is not None and (int(value) != value or value <= 0):
            raise GGUFError(f"{self.name}: {key} must be a positive integer, not {value}")
        return None if value is None else int(value)

    def token_count(self) -> int:
        tokens = self.fields.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, ArrayValue):
            raise GGUFError(f"{self.name}: the header lacks tokenizer.ggml.tokens")
        return tokens.length


def _config(fields: _Fields, arch: str, header: GGUFHeader) -> ModelConfig:
    hidden = fields.positive_int(f"{arch}.embedding_length")
    heads = fields.positive_int(f"{arch}.attention.head_count")
    head_dim = fields.positive_int(f"{arch}.attention.key_length", required=False,
                                   default=hidden // heads)
    eos = fields.number("tokenizer.ggml.eos_token_id", required=False)
    bos = fields.number("tokenizer.ggml.bos_token_id", required=False)
    names = {t.name for t in header.tensors}
    rope_scaling = None
    scaling_type = fields.string(f"{arch}.rope.scaling.type", required=False)
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type,
                        "factor": fields.number(f"{arch}.rope.scaling.factor")}
    config = ModelConfig(
        architecture=ARCHITECTURES[arch],
        vocab_size=fields.token_count(),
        hidden_size=hidden,
        intermediate_size=fields.positive_int(f"{arch}.feed_forward_length"),
        num_hidden_layers=fields.positive_int(f"{arch}.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=fields.positive_int(f"{arch}.attention.head_count_kv",
                                                required=False, default=heads),
        head_dim=head_dim,
        max_position_embeddings=fields.positive_int(f"{arch}.context_length"),
        rms_norm_eps=float(fields.number(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(fields.number(f"{arch}.rope.freq_base", required=False,
                                       default=10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        hidden_act="silu",
        sliding_window=None,
        torch_dtype=None,
        eos_token_ids=[] if eos is None else [int(eos)],
        bos_token_id=None if bos is None else int(bos),
    )
    end_of_turn = _token_id(header, _END_OF_TURN.get(arch))
    if end_of_turn is not None and end_of_turn not in config.eos_token_ids:
        config.eos_token_ids.append(end_of_turn)
    if arch == "gemma3":
        config = _gemma3_config(fields, config)
    return config


def _gemma3_config(fields: _Fields, config: ModelConfig) -> ModelConfig:
    """The Gemma 3 fields (pipelines/checkpoint/model_config.py) of a gemma3 file, as llama.cpp reads them:
    the header holds the sliding window (none: every layer global) and, optionally, the final
    logits' soft-capping; the rest is llama.cpp's (and transformers' GGUF loader's) fixed
    values."""
    layers = config.num_hidden_layers
    sliding = fields.positive_int("gemma3.attention.sliding_window", required=False)
    layer_types = ["sliding_attention" if sliding and (i + 1) % _GEMMA3_GLOBAL_EVERY
                   else "full_attention" for i in range(layers)]
    # The attention scale: head_dim**-0.5, but (hidden/heads)**-0.5 for the 27B model, told
    # apart by its 62 layers (llama.cpp's f_attention_scale; its Hugging Face config's
    # query_pre_attn_scalar is 168, not its head_dim of 128). transformers' GGUF loader
    # leaves Gemma3TextConfig's default of 256: the same number for the 270M, 1B, 4B and 12B.
    scalar = config.hidden_size // config.num_attention_heads if layers == 62 else config.head_dim
    softcap = fields.number("gemma3.final_logit_softcapping", required=False)
    return dataclasses.replace(  # (q/k norms: Gemma 3 has them; a file lacking them is broken)
        config, hidden_act="gelu_pytorch_tanh", qk_norm=True, sliding_window=sliding,
        layer_types=layer_types,
        rope_local_theta=_GEMMA3_LOCAL_ROPE_THETA, query_pre_attn_scalar=float(scalar),
        final_logit_softcapping=float(softcap) if softcap else None)


def _token_id(header: GGUFHeader, text: str | None) -> int | None:
    """The id of the token spelled `text`, where the vocabulary's strings were read."""
    tokens = header.fields.get("tokenizer.ggml.tokens")
    if text is None or not isinstance(tokens, ArrayValue) or tokens.values is None:
        return None
    try:
        return tokens.values.index(text)
    except ValueError:
        return None


def _tensors(header: GGUFHeader, name: str, config: ModelConfig,
             arch: str) -> dict[str, GGUFTensor]:
    out = {}
    layer_tensors = _LAYER_TENSORS_BY_ARCH.get(arch, _LAYER_TENSORS)
    for t in header.tensors:
        hf_name = _hf_name(t.name, config.num_hidden_layers, layer_tensors)
        if hf_name is None:
            continue  # (e.g. rope_freqs: Loom computes its own tables)
        if t.qtype not in SUPPORTED_TYPES:
            raise GGUFError(f"{name}: tensor {t.name} is of type {t.qtype}, which loom cannot "
                            f"run; supported: {', '.join(sorted(SUPPORTED_TYPES))}")
        shape = tuple(reversed(t.dims))
        out[hf_name] = GGUFTensor(t.qtype, shape, _tensor_data(header, t, shape))
    _check_shapes(out, config, name)
    if arch == "llama":  # llama.cpp's converter interleaved the rotary halves of q and k rows
        for i in range(config.num_hidden_layers):
            for proj, n in (("q", config.num_attention_heads), ("k", config.num_key_value_heads)):
                key = f"model.layers.{i}.self_attn.{proj}_proj.weight"
                out[key] = _unpermute_rows(out[key], n)
    if arch == "gemma3":  # llama.cpp's converter stored Gemma's norm weights w as 1 + w
        for key, tensor in out.items():
            if key.endswith("norm.weight"):
                out[key] = _minus_one(tensor, name, key)
    return out


def _minus_one(tensor: GGUFTensor, name: str, key: str) -> GGUFTensor:
    """tensor - 1 in float32 (what transformers' GGUF loader does to every Gemma norm)."""
    if tensor.is_quantized:
        raise GGUFError(f"{name}: {key} is stored as {tensor.qtype}; loom reads norms of "
                        f"F32, F16 or BF16")
    values = tensor.data
    if tensor.qtype == "BF16":
        values = (values.astype(np.uint32) << 16).view(np.float32)
    return GGUFTensor("F32", tensor.shape, values.astype(np.float32) - np.float32(1))


def _tensor_data(header: GGUFHeader, t: TensorInfo, shape: tuple[int, ...]) -> np.ndarray:
    """[rows, row bytes] uint8 for a block format; the values, shaped, for a float type."""
    raw = header.tensor_bytes(t)
    if t.qtype in _FLOAT_VIEWS:
        return raw.view(_FLOAT_VIEWS[t.qtype]).reshape(shape)
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return raw.reshape(rows, -1)


_FLOAT_VIEWS = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def _hf_name(gguf_name: str, num_layers: int,
             layer_tensors: dict[str, str] = _LAYER_TENSORS) -> str | None:
    if gguf_name in _MODEL_TENSORS:
        return _MODEL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        layer = int(parts[1])
        suffix = layer_tensors.get(parts[2])
        if suffix is not None and layer < num_layers:
            return f"model.layers.{layer}.{suffix}"
    return None


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
             "mlp.gate_proj.weight": (config.intermediate_size, h),
             "mlp.up_proj.weight": (config.intermediate_size, h),
             "mlp.down_proj.weight": (h, config.intermediate_size)}
    if config.attention_bias:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                      "self_attn.v_proj.bias": (kv,)})
    if config.qk_norm:
        layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    if config.layer_types is not None:  # Gemma 3
        layer.update({"pre_feedforward_layernorm.weight": (h,),
                      "post_feedforward_layernorm.weight": (h,)})
    for i in range(config.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


def _check_shapes(tensors: dict[str, GGUFTensor], config: ModelConfig, name: str) -> None:
    for key, shape in _expected_shapes(config).items():
        tensor = tensors.get(key)
        if tensor is None:
            raise GGUFError(f"{name}: the file lacks the tensor for {key}")
        if tensor.shape != shape:
            raise GGUFError(f"{name}: {key} is {list(tensor.shape)}, but the header's "
                            f"hyper-parameters make it {list(shape)}")


def _unpermute_rows(tensor: GGUFTensor, heads: int) -> GGUFTensor:
    """Undo llama.cpp's q/k permutation. It reorders whole rows, so quantized blocks (which lie
    within a row) move intact and the tensor stays in its format."""
    rows = tensor.shape[0]
    permuted = np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(-1)
    data = np.empty_like(tensor.data)
    data[permuted] = tensor.data
    return GGUFTensor(tensor.qtype, tensor.shape, data)
