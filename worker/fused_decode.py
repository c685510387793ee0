"""FusedDecode: all decoder layers of a model computing in float32 (float32 weights, packed
bfloat16 weights with a bfloat16 KV cache, or GGUF-quantized weights), for a step of one-token
sequences and prompt chunks, in one native call (`worker/kernels/decoder.c` says why).

One implementation for every architecture: a model describes its layers as `DecodeLayer`s
(`fused_decode_layers()`: which norms a layer has and where, its rotary tables, its attention
window) and its activation by its config's hidden_act. Used by LlamaForCausalLM (Llama,
Mistral, Qwen2, Qwen3) and Gemma3ForCausalLM when every linear layer is packed or quantized
(QuantLinear with its native kernel); a step's prompt chunks come too where the prefill
kernel takes them (16-token blocks, no LoRA rows in the step). Everything else takes the
Python path, which computes the same with the same kernels.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from worker.attention import AttentionMetadata
from worker.kernels import load_kernel
from worker.lora import LoRAWeights
from worker.packed_linear import PackedLinear
from worker.prefill_attention import PREFILL_BLOCK_SIZE, native_prefill_limits
from worker.quant_linear import QuantEmbedding, QuantLinear, StackedQuantLinear

_P = ctypes.c_void_p
_PROJ_KIND = {torch.float32: 0, torch.bfloat16: 1}  # else the GGML type number (decoder.c)


class _Projection(ctypes.Structure):
    pass


_Projection._fields_ = [("kind", ctypes.c_int), ("w", _P), ("row_bytes", ctypes.c_int64),
                        ("bias", _P), ("float_rows", ctypes.c_int), ("rows", ctypes.c_int),
                        ("next", ctypes.POINTER(_Projection))]


@dataclass
class DecodeLayer:
    """What a layer's step needs beside its projections: its norms as the float32 factors they
    multiply by (Gemma's 1 + w; None where the layer has no such norm), the rotary tables it
    rotates with, and the number of last tokens it attends to (0: all)."""

    input_norm: torch.Tensor
    mlp_norm: torch.Tensor
    rotary: object  # worker.models.llama.RotaryEmbedding: float32 cos, sin [positions, D]
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    window: int = 0


class _LayerWeights(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("input_norm", "mlp_norm", "attn_out_norm",
                                        "mlp_out_norm", "q_norm", "k_norm")] + [
        (name, _Projection) for name in ("qkv", "o", "gate_up", "down")] + [
        ("k_cache", _P), ("v_cache", _P), ("cos_table", _P), ("sin_table", _P),
        ("window", ctypes.c_int), ("lora", LoRAWeights * 4)]


class _ModelDims(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in ("hidden", "heads", "kv_heads", "head_dim",
                                                   "intermediate", "block_size", "act")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class _StepAttention(ctypes.Structure):
    _fields_ = [("decodes", ctypes.c_int), ("decode_rows", _P), ("decode_tables", _P),
                ("decode_seq_lens", _P), ("decode_max_blocks", ctypes.c_int),
                ("prefills", ctypes.c_int), ("prefill_tables", _P), ("prefill_seq_lens", _P),
                ("prefill_q_lens", _P), ("prefill_first_rows", _P),
                ("prefill_max_blocks", ctypes.c_int)]


_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}  # decoder.c's ACT_*


_lib = load_kernel("decoder")
if _lib is not None:
    _lib.loom_decode_layers.restype = ctypes.c_int
    _lib.loom_decode_layers.argtypes = [
        ctypes.POINTER(_LayerWeights), ctypes.c_int, ctypes.POINTER(_ModelDims), ctypes.c_int,
        _P, _P, ctypes.c_int, _P, _P, ctypes.POINTER(_StepAttention), _P, ctypes.c_int, _P,
        ctypes.POINTER(_Projection), _P]


class FusedDecode:
    def __init__(self, model) -> None:
        self.model = model
        cfg = model.config
        attn = model.layers[0].self_attn
        self.dims = _ModelDims(cfg.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                               cfg.intermediate_size, 0, _ACTIVATIONS[cfg.hidden_act],
                               model.norm.eps, attn.scale)
        self._layers = None
        self._embedding: _Projection | None = None  # a quantized table's rows (`embeds`)
        self._cache_ptr = None
        self._residual = torch.empty(0)  # (the call's scratch, kept across steps)
        # Whether the embedding table is one the call can look up (a quantized one, its
        # kernel built): read once, as a torch Module's attributes are slow to reach.
        table = getattr(model.embed_tokens, "table", None)
        self._looks_up = isinstance(model.embed_tokens, QuantEmbedding) \
            and table.kernel is not None
        # LoRA (worker/lora.py): the adapters' slots, and this step's slot of each row (int32
        # [T], -1: the base model's; None: no adapter rows).
        self.lora = None
        self.row_slots: torch.Tensor | None = None
        # Whether the prefill kernel takes this model's heads (its block size is checked per
        # call: the cache's).
        self._prefill_ok = native_prefill_limits(attn.head_dim, attn.num_heads,
                                                 attn.num_kv_heads)
        self._attention = _StepAttention()
        self._keep: tuple = ()  # (the step's index arrays, alive through the call)

    @classmethod
    def for_model(cls, model) -> "FusedDecode | None":
        """None where the native path does not apply (the Python path is used)."""
        if (_lib is None or model.compute_dtype != torch.float32
                or not hasattr(model, "fused_decode_layers")
                or model.config.hidden_act not in _ACTIVATIONS):
            return None
        packed_dtypes = set()
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(_native(m) for m in linears):
                return None
            packed_dtypes.update(m.dtype for m in linears if isinstance(m, PackedLinear))
        if len(packed_dtypes) > 1 or not packed_dtypes <= {torch.float32, torch.bfloat16}:
            return None
        return cls(model)

    def use_lora(self, slots) -> None:
        """Apply the LoRA adapters of `slots` (a LoRASlots) to the rows of `row_slots`."""
        self.lora = slots
        self._cache_ptr = None  # (the layers' structs point at its tensors)

    def applies(self, meta: AttentionMetadata, kv_cache: torch.Tensor | None = None) -> bool:
        """A step of decodes (one token each) and prompt chunks over `kv_cache`, on the CPU
        kernels the Python path runs them with (worker/attention.py): decodes through the
        decode kernel, chunks through the prefill kernel, which takes 16-token blocks and
        heads up to 256. Steps with prompt chunks and LoRA rows take the Python path."""
        if all(group.single_query for group in meta.groups):
            return len(meta.groups) == 1
        return (self._prefill_ok and self.row_slots is None and kv_cache is not None
                and kv_cache.device.type == "cpu" and kv_cache.shape[3] == PREFILL_BLOCK_SIZE
                and all(group.window is None for group in meta.groups))

    def embeds(self, input_ids: torch.Tensor) -> bool:
        """Whether the call can look up `input_ids` itself (a quantized embedding table, ids
        as the kernel reads them): one Python lookup less a step."""
        return (self._looks_up and input_ids.dtype == torch.int64 and input_ids.dim() == 1
                and input_ids.is_contiguous())

    def __call__(self, x: torch.Tensor | None, meta: AttentionMetadata, kv_cache: torch.Tensor,
                 final_norm: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x: the step's embeddings [T, hidden] (overwritten), or None with `input_ids` (where
        `embeds` them): the embedding rows are looked up in the call. Returns the model's final
        norm (`final_norm`: the float32 factors it multiplies by) of the last layer's output,
        [T, hidden]: the rows the output layer reads."""
        # (The cache's dtype is --kv-cache-dtype's, whatever the weights': the kernel reads and
        # writes a float32 or bfloat16 one.)
        if kv_cache.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"fused decode: a float32 or bfloat16 KV cache, not {kv_cache.dtype}")
        layers = self._layer_weights(kv_cache)
        attention = self._step_attention(meta, kv_cache)
        embedding, ids = None, None
        if x is None:
            embedding, ids = self._embedding, input_ids.data_ptr()
            x = torch.empty(len(input_ids), self.dims.hidden, dtype=torch.float32)
        tokens = x.shape[0]
        residual = self._scratch(tokens)
        rc = _lib.loom_decode_layers(
            layers, len(self.model.layers), ctypes.byref(self.dims),
            kv_cache.dtype == torch.bfloat16, x.data_ptr(),
            residual.data_ptr(), tokens, meta.positions.data_ptr(),
            meta.slot_mapping.data_ptr(), ctypes.byref(attention),
            *self._lora_rows(tokens), _pointer(final_norm), embedding, ids)
        self._keep = ()
        if rc == -3:
            raise IndexError(f"token ids must be in [0, {self.model.embed_tokens.num_embeddings})")
        if rc == -1:
            raise RuntimeError("the fused decode step failed: a projection has no kernel in "
                               "this build of decoder.c")
        if rc != 0:
            raise MemoryError(f"the fused decode step failed ({rc}): scratch memory could not "
                              f"be had")
        return x

    def _step_attention(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> _StepAttention:
        """The step's groups as decoder.c's StepAttention: the decode group's rows (NULL when
        they are the step's first rows, as in every decode-only step), tables and lengths, and
        the prompt chunks' as the prefill kernel reads them."""
        att = self._attention
        att.decodes = att.prefills = 0
        att.decode_rows = None
        keep = []
        for group in meta.groups:
            tables = group.block_tables
            if group.single_query:
                rows = group.valid_rows
                att.decodes = len(rows)
                if len(meta.groups) > 1 and not _first_rows(rows):
                    rows = rows.to(torch.int32)
                    keep.append(rows)
                    att.decode_rows = rows.data_ptr()
                att.decode_tables, att.decode_seq_lens = (tables.data_ptr(),
                                                          group.seq_lens.data_ptr())
                att.decode_max_blocks = tables.shape[1]
            else:
                att.prefills = tables.shape[0]
                att.prefill_tables, att.prefill_seq_lens = (tables.data_ptr(),
                                                            group.seq_lens.data_ptr())
                att.prefill_q_lens, att.prefill_first_rows = (group.q_lens.data_ptr(),
                                                              group.first_rows.data_ptr())
                att.prefill_max_blocks = tables.shape[1]
        self._keep = tuple(keep)
        return att

    def _scratch(self, tokens: int) -> torch.Tensor:
        """The residual stream's buffer, [tokens, hidden] at least (the call uses its first
        rows): grown, never freed, an allocation less a step."""
        if self._residual.shape[0] < tokens:
            self._residual = torch.empty(tokens, self.dims.hidden, dtype=torch.float32)
        return self._residual

    def _lora_rows(self, tokens: int) -> tuple[int | None, int]:
        """(the rows' slots, the widest rank) for the kernel; (None, 0): no adapter rows."""
        rows = self.row_slots
        if rows is None or self.lora is None:
            return None, 0
        if rows.dtype != torch.int32 or rows.shape != (tokens,) or not rows.is_contiguous():
            raise TypeError("fused decode: LoRA row slots must be int32 [T]")
        return rows.data_ptr(), self.lora.widest_rank

    def _layer_weights(self, kv_cache: torch.Tensor):
        if self._cache_ptr != kv_cache.data_ptr():
            specs = self.model.fused_decode_layers()
            self._tensors = specs  # (the norms' factors must outlive the pointers to them)
            self._layers = (_LayerWeights * len(self.model.layers))()
            for i, (layer, spec) in enumerate(zip(self.model.layers, specs)):
                attn, mlp = layer.self_attn, layer.mlp
                norms = [_pointer(getattr(spec, name)) for name in (
                    "input_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm", "q_norm",
                    "k_norm")]
                self._layers[i] = _LayerWeights(
                    *norms, _projection(attn.qkv_proj), _projection(attn.o_proj),
                    _projection(mlp.gate_up_proj), _projection(mlp.down_proj),
                    kv_cache[i, 0].data_ptr(), kv_cache[i, 1].data_ptr(),
                    spec.rotary.cos.data_ptr(), spec.rotary.sin.data_ptr(), spec.window,
                    (LoRAWeights * 4)(*self._lora_weights(i)))
            table = getattr(self.model.embed_tokens, "table", None)
            if isinstance(table, QuantLinear):
                self._embedding = _projection(table)
                self._embedding.rows = table.out_features
            self.dims.block_size = kv_cache.shape[3]
            self._cache_ptr = kv_cache.data_ptr()
        return self._layers


    def _lora_weights(self, layer: int) -> list[LoRAWeights]:
        """Layer `layer`'s qkv, o, gate_up and down adapters (a NULL: none)."""
        if self.lora is None:
            return [LoRAWeights()] * 4
        return [t.native for t in self.lora.layer_targets(layer)]


def _first_rows(rows: torch.Tensor) -> bool:
    """Whether the decode rows are the step's rows 0 .. n (the scheduler puts running
    requests first: in most mixed steps they are)."""
    n = len(rows)
    return n == 0 or (int(rows[0]) == 0 and int(rows[-1]) == n - 1)


def _pointer(norm: torch.Tensor | None) -> int | None:
    if norm is None:
        return None
    if norm.dtype != torch.float32 or not norm.is_contiguous():
        raise TypeError("fused decode: norm factors must be contiguous float32")
    return norm.data_ptr()


def _native(module) -> bool:
    """A projection decoder.c can run: packed, or quantized with the native kernel built."""
    if isinstance(module, QuantLinear):
        return module.kernel is not None
    if isinstance(module, StackedQuantLinear):
        return all(_native(part) for part in module.parts)
    return isinstance(module, PackedLinear)


def _projection(module) -> _Projection:
    if isinstance(module, StackedQuantLinear):
        # Each part's struct lives in the one before it (ctypes keeps the pointee alive).
        parts = [_projection(part) for part in module.parts]
        for i in range(len(parts) - 2, -1, -1):
            parts[i].rows = module.parts[i].out_features
            parts[i].next = ctypes.pointer(parts[i + 1])
        return parts[0]
    bias = module.bias.data_ptr() if module.bias is not None else None
    if isinstance(module, QuantLinear):
        return _Projection(module.kernel_kind, module.weight.data_ptr(), module.row_bytes,
                           bias, module.float_rows or 0)
    return _Projection(_PROJ_KIND[module.dtype], module.packed.data_ptr(), 0, bias, 0)
