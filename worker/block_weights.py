"""Loading a Llama-family model whose projections stay in GGUF block formats.

Two sources: a GGUF file's tensors as they are (`pipelines/checkpoint/gguf_file.py`), and a Hugging Face
checkpoint quantized at load time (`--quantization int8`: Q8_0, below). Either way every
projection becomes a QuantLinear, the fused q/k/v and gate/up ones holding their parts' rows
one after another (the rows of a block format are independent, so concatenating them is
exact); a fused projection whose parts the file stores in different formats (llama.cpp's
*_K_M mixes) becomes a StackedQuantLinear. The token table stays quantized too (a lookup
dequantizes only its rows) and a tied output layer reads the same bytes. Norms and biases are
float32. A projection the file stores as plain floats (F32/F16/BF16) is widened to float32 and
left to the packed float32 kernel like any dense checkpoint.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pipelines.checkpoint.gguf_file import GGUFTensor, dequantize
from worker.quant_linear import QuantEmbedding, QuantLinear, StackedQuantLinear
from worker.weights import materialize_on_cpu

# The fused projections of a layer and the Hugging Face weights each holds, in row order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def load_block_weights(model: nn.Module, tensors: dict[str, GGUFTensor]) -> None:
    """Fill `model` (a LlamaForCausalLM built on the meta device) from `tensors`, by Hugging
    Face name; every tensor must be used (a stray one means a mapping Loom got wrong)."""
    used: set[str] = set()

    def take(name: str) -> GGUFTensor:
        if name not in tensors:
            raise ValueError(f"the weights lack {name}")
        used.add(name)
        return tensors[name]

    for i, layer in enumerate(model.layers):
        for fused, names in _FUSED.items():
            src = [f"model.layers.{i}.{name}" for name in names]
            parts = [take(f"{name}.weight") for name in src]
            biases = [take(f"{name}.bias") for name in src if f"{name}.bias" in tensors]
            bias = torch.cat([dequantize(b) for b in biases]) if biases else None
            parent_name, attr = fused.split(".")
            setattr(getattr(layer, parent_name), attr, block_linear(parts, bias))
    table = take("model.embed_tokens.weight")
    head = tensors.get("lm_head.weight")
    if head is not None:
        used.add("lm_head.weight")
    model.embed_tokens, model.lm_head = embedding_and_head(table, head)
    materialize_on_cpu(model)  # the norms (and q/k norms) left on the meta device
    own = dict(model.named_parameters())
    for name, tensor in tensors.items():
        if name in used:
            continue
        target = name.removeprefix("model.")
        if target not in own:
            raise ValueError(f"the weights hold {name}, which this model has no place for")
        with torch.no_grad():
            own[target].copy_(dequantize(tensor).reshape(own[target].shape))
        used.add(name)
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"weights not loaded: {missing[:5]}")


def block_linear(parts: list[GGUFTensor], bias: torch.Tensor | None) -> nn.Module:
    """One projection from the weights stacked in it, kept in their block formats."""
    in_features = parts[0].shape[1]
    out_features = sum(p.shape[0] for p in parts)
    if not all(p.is_quantized for p in parts):
        linear = nn.Linear(in_features, out_features, bias=bias is not None)
        with torch.no_grad():
            linear.weight.copy_(torch.cat([dequantize(p) for p in parts]))
            if bias is not None:
                linear.bias.copy_(bias)
        return linear
    if len({p.qtype for p in parts}) == 1:
        raw = parts[0].data if len(parts) == 1 else np.concatenate([p.data for p in parts])
        return QuantLinear(parts[0].qtype, raw, (out_features, in_features), bias)
    layers, start = [], 0
    for p in parts:
        rows = p.shape[0]
        part_bias = None if bias is None else bias[start:start + rows]
        layers.append(QuantLinear(p.qtype, p.data, p.shape, part_bias))
        start += rows
    return StackedQuantLinear(layers)


def embedding_and_head(table: GGUFTensor,
                       head: GGUFTensor | None) -> tuple[nn.Module, nn.Module]:
    """The token embedding, and the output layer (`head`, or the table itself when tied)."""
    if table.is_quantized:
        # float_rows=None: the output layer's rows are the sampled ones, one per sequence,
        # and a sequence's logits must not depend on how many others share its step.
        table_linear = QuantLinear(table.qtype, table.data, table.shape, float_rows=None)
        embedding = QuantEmbedding(table_linear)
    else:
        weight = dequantize(table)
        embedding = nn.Embedding(*weight.shape, _weight=weight)
    if head is None:
        if table.is_quantized:  # one module, two uses: the bytes (maybe interleaved) once
            return embedding, table_linear
        head_linear = nn.Linear(table.shape[1], table.shape[0], bias=False)
        head_linear.weight = embedding.weight
        return embedding, head_linear
    return embedding, block_linear([head], None)


def quantize_weights(weights: dict[str, torch.Tensor], qtype: str = "Q8_0"
                     ) -> dict[str, GGUFTensor]:
    """A Hugging Face state dict with its projection and embedding matrices quantized to
    `qtype` blocks (`--quantization int8`: Q8_0, 32 weights per float16 scale, finer than one
    scale per output channel at the same 8.5 bits per weight, and run by the same kernels as
    a GGUF file); everything else stays float32."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    out = {}
    for name, tensor in weights.items():
        values = tensor.detach().float()
        if values.dim() == 2 and values.shape[1] % block == 0 and _is_matrix_weight(name):
            raw = gguf.quants.quantize(values.numpy(), kind)
            out[name] = GGUFTensor(qtype, tuple(values.shape), raw)
        else:
            out[name] = GGUFTensor("F32", tuple(values.shape), values.numpy())
    return out


def _is_matrix_weight(name: str) -> bool:
    return name.endswith("_proj.weight") or name in ("model.embed_tokens.weight",
                                                     "lm_head.weight")
