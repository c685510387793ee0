"""Reading a GGUF file as llama.cpp and Ollama users hold it: its hyper-parameters as a
ModelConfig, and its tensors under Hugging Face names, still in their block formats.

Nothing is dequantized or copied here: tensors are views of the memory-mapped file. Every
problem a file can have (truncated, another architecture, a block type Loom has no kernel for,
a header that contradicts itself) is one `GGUFError` with a one-line message naming the file,
never an exception from the parser underneath.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from worker.gguf_header import ArrayValue, GGUFHeader, HeaderError, TensorInfo, read_header
from worker.model_config import ModelConfig

# GGUF's architecture names, and the Hugging Face architecture Loom runs each as. (llama.cpp's
# converter writes Mistral and SmolLM checkpoints as "llama".)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
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
_MODEL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                  "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


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


def _read(path: str) -> GGUFHeader:
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such file")
    try:
        return read_header(path)
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
    return ModelConfig(
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


def _tensors(header: GGUFHeader, name: str, config: ModelConfig,
             arch: str) -> dict[str, GGUFTensor]:
    out = {}
    for t in header.tensors:
        hf_name = _hf_name(t.name, config.num_hidden_layers)
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
    return out


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


def _hf_name(gguf_name: str, num_layers: int) -> str | None:
    if gguf_name in _MODEL_TENSORS:
        return _MODEL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        layer = int(parts[1])
        suffix = _LAYER_TENSORS.get(parts[2])
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
