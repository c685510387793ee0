"""LoRA adapters applied to the rows of their requests, in batches shared with the base model
(Punica's and vLLM's scheme).

The base projections run once for the whole step; a forward hook on each target projection
(qkv, o, gate_up, down) then adds scale * (x @ A) @ B of each row's adapter to that row only:
the rows of each adapter gathered, multiplied by its A and B, and added back (Punica's SGMV),
base rows untouched. The adapters live in `max_num_loras` slots of stacked tensors, every
rank padded to --max-lora-rank (a fused projection's parts side by side: qkv's A is [in, 3R]
and its B [3R, q+k+v], block-diagonal), so an adapter loads by copying into a slot. Resident
adapters are kept least recently used first; one not resident is read from its directory
when a step first needs it.

Beside quantized base weights the slots hold bfloat16 (`adapter_dtype`): every decode step
reads every adapter it runs, and at rank 16 on all seven projections float32 adapters are a
third of a 4-bit base's bytes; their bfloat16 rounding is far below the base's own. Beside
float weights they keep the weights' dtype (the float oracle's exactness). The hooks multiply
by a widening of the stored values to the compute dtype, made as the adapter loads (torch's
bfloat16 products are slow on CPUs without bfloat16 instructions, and widening in each step
cost more than the products).

The one-call native decode step (worker/fused_decode.py, decoder.c) reads the same slot
tensors and adds the deltas itself, each row with its own slot (`row_slots`). On CPUs the
hooks of the Python path (prefill chunks) call the same kernel (worker/kernels/lora.c), one
call per projection for every adapter of the step: PyTorch's gathers, small products and
scatter per adapter cost a third of a prefill step at c=16 over four adapters. Elsewhere
(GPUs, no compiler) they gather each adapter's rows in PyTorch.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections import OrderedDict

import numpy as np
import torch

from pipelines.lora import LoRARequest, base_shapes, parse_key, read_config, scaling
from worker.kernels import load_kernel

logger = logging.getLogger(__name__)

# Each hooked projection of a layer: its module path, and the PEFT modules fused in it.
TARGETS = (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
           ("self_attn.o_proj", ("o_proj",)),
           ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
           ("mlp.down_proj", ("down_proj",)))


class LoRAWeights(ctypes.Structure):
    """One projection's slots as worker/kernels/lora.c reads them."""
    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("rank", ctypes.c_int),
                ("parts", ctypes.c_int), ("dtype", ctypes.c_int),
                ("out_start", ctypes.c_int * 4)]


_LORA_DTYPE = {torch.float32: 0, torch.bfloat16: 1}  # lora.c's LORA_*


def _native_kernel(device: torch.device, compute_dtype: torch.dtype):
    """lora.c's library where the Python path computes in float32 on the CPU, else None."""
    if device.type != "cpu" or compute_dtype != torch.float32:
        return None
    lib = load_kernel("lora")
    if lib is not None:
        lib.loom_lora_add.restype = ctypes.c_int
        lib.loom_lora_add.argtypes = [
            ctypes.POINTER(LoRAWeights), ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    return lib


class _Target:
    """One projection's adapter weights, all slots: A [slots, in, parts*R], B [slots,
    parts*R, out], and the same widened to the model's compute dtype for the hooks (the same
    tensors where the dtypes agree)."""

    def __init__(self, parts, shapes, slots, rank, dtype, compute_dtype, device) -> None:
        self.parts = parts
        in_features = shapes[parts[0]][1]
        self.out_offsets = np.cumsum([0] + [shapes[p][0] for p in parts]).tolist()
        self.width = len(parts) * rank  # (per slot)
        self.A = torch.zeros(slots, in_features, self.width, dtype=dtype, device=device)
        self.B = torch.zeros(slots, self.width, self.out_offsets[-1], dtype=dtype,
                             device=device)
        self.A_compute, self.B_compute = (self.A, self.B) if dtype == compute_dtype else (
            self.A.to(compute_dtype), self.B.to(compute_dtype))
        # (The slots are filled in place: these pointers hold for the server's life.)
        self.native = LoRAWeights(self.A.data_ptr(), self.B.data_ptr(), self.width, len(parts),
                                  _LORA_DTYPE.get(dtype, -1),
                                  (ctypes.c_int * 4)(*self.out_offsets))

    def zeros(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot's a and b in float32, zeros (store's arguments, to be filled)."""
        return torch.zeros(self.A.shape[1:]), torch.zeros(self.B.shape[1:])

    def store(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slot `slot` holds a [in, parts*R] and b [parts*R, out] (rounded to the slots'
        dtype; the widened copy holds the rounded values, so both paths compute with the
        same adapter)."""
        self.A[slot], self.B[slot] = a, b
        if self.A_compute is not self.A:
            self.A_compute[slot], self.B_compute[slot] = self.A[slot], self.B[slot]


def _native_shapes(x: torch.Tensor, output: torch.Tensor, row_slots: torch.Tensor) -> bool:
    """Whether lora.c can take a hook's call: float32 rows of x and output, one per row of
    row_slots, each row's elements contiguous."""
    return (x.dim() == 2 and output.dim() == 2 and x.dtype == output.dtype == torch.float32
            and x.shape[0] == output.shape[0] == row_slots.shape[0]
            and x.stride(1) == 1 and output.stride(1) == 1)


def adapter_dtype(weights_dtype: torch.dtype, quantized: bool) -> torch.dtype:
    """The dtype the slots hold beside base weights of `weights_dtype` (module doc)."""
    return torch.bfloat16 if quantized else weights_dtype


class LoRASlots:
    def __init__(self, model: torch.nn.Module, config, max_num_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.max_num_loras, self.max_rank = max_num_loras, max_rank
        self.resident: OrderedDict[str, tuple[int, str]] = OrderedDict()  # name: (slot, path)
        # This step's slot of each row (int32 [T], -1: the base model's), for the native
        # kernels (the decode step's and the hooks'), which read the same tensors.
        self.row_slots: torch.Tensor | None = None
        # This step's slots, each with its rows (None: every row of the step): the hooks'
        # PyTorch path, made on its first use in a step.
        self._groups: list[tuple[int, torch.Tensor | None]] | None = None
        self._native = _native_kernel(device, model.compute_dtype) if dtype in _LORA_DTYPE \
            else None
        shapes = base_shapes(config)
        self.targets: dict[tuple[int, str], _Target] = {}
        self._layers: list[list[_Target]] = []
        for i, layer in enumerate(model.layers):
            self._layers.append([])
            for path, parts in TARGETS:
                target = _Target(parts, shapes, max_num_loras, max_rank, dtype,
                                 model.compute_dtype, device)
                for part in parts:
                    self.targets[(i, part)] = target
                self._layers[-1].append(target)
                layer.get_submodule(path).register_forward_hook(self._hook(target))
        self.widest_rank = 3 * max_rank  # (qkv's)

    def layer_targets(self, layer: int) -> list[_Target]:
        """Layer `layer`'s qkv, o, gate_up and down adapter weights."""
        return self._layers[layer]

    def _hook(self, target: _Target):
        def add_deltas(module, inputs, output):
            x = inputs[0]
            if self.row_slots is None:  # (a step of the base model alone)
                return output
            if self._native is not None and _native_shapes(x, output, self.row_slots):
                rc = self._native.loom_lora_add(
                    ctypes.byref(target.native), self.row_slots.data_ptr(), x.shape[0],
                    x.data_ptr(), x.stride(0), output.data_ptr(), output.stride(0),
                    output.shape[1], x.shape[1])
                if rc != 0:
                    raise MemoryError("LoRA deltas: scratch memory could not be had")
                return output
            for slot, rows in self._step_groups():
                a, b = target.A_compute[slot], target.B_compute[slot]
                if rows is None:  # (one adapter, every row of the step)
                    output.addmm_(x @ a, b)
                else:
                    output.index_add_(0, rows, (x.index_select(0, rows) @ a) @ b)
            return output
        return add_deltas

    # ---- per step ---------------------------------------------------------------------------
    def load_for_step(self, adapters: set[LoRARequest]) -> dict[LoRARequest, str]:
        """Make the step's adapters resident (at most max_num_loras: the scheduler's bound);
        returns those that failed to load, with why."""
        failed = {}
        keep = {a.name for a in adapters}
        for adapter in adapters:
            try:
                self._make_resident(adapter, keep)
            except Exception as exc:  # (its requests fail; the others run)
                logger.error("LoRA adapter %s failed to load: %s", adapter.name, exc)
                self.resident.pop(adapter.name, None)
                failed[adapter] = f"LoRA adapter {adapter.name} failed to load: {exc}"
        return failed

    def set_step(self, adapters: list[LoRARequest | None], query_lens: np.ndarray) -> bool:
        """Point the hooks at this step's rows: sequence i feeds query_lens[i] rows and runs
        `adapters[i]` (None: the base model; each resident). Returns whether any row has an
        adapter."""
        self.clear_step()
        named = [i for i, a in enumerate(adapters) if a is not None]
        if not named:
            return False
        ends = np.cumsum(query_lens)
        starts = ends - query_lens
        row_slots = np.full(int(ends[-1]), -1, np.int32)
        for i in named:
            row_slots[starts[i]:ends[i]] = self.resident[adapters[i].name][0]
        device = next(iter(self.targets.values())).A.device
        self.row_slots = torch.from_numpy(row_slots).to(device)
        return True

    def _step_groups(self) -> list[tuple[int, torch.Tensor | None]]:
        if self._groups is None:
            row_slots = self.row_slots.cpu().numpy()
            device = self.row_slots.device
            slots = np.unique(row_slots[row_slots >= 0])
            if len(slots) == 1 and row_slots[0] >= 0 and (row_slots == row_slots[0]).all():
                self._groups = [(int(slots[0]), None)]
            else:
                self._groups = [(int(slot), torch.from_numpy(
                    np.flatnonzero(row_slots == slot)).to(device)) for slot in slots]
        return self._groups

    def clear_step(self) -> None:
        self._groups, self.row_slots = None, None

    # ---- residency --------------------------------------------------------------------------
    def _make_resident(self, adapter: LoRARequest, keep: set[str]) -> None:
        held = self.resident.get(adapter.name)
        if held is not None and held[1] == adapter.path:
            self.resident.move_to_end(adapter.name)
            return
        if held is not None:  # (unloaded and loaded again from elsewhere)
            slot = self.resident.pop(adapter.name)[0]
        elif len(self.resident) < self.max_num_loras:
            used = {s for s, _ in self.resident.values()}
            slot = next(s for s in range(self.max_num_loras) if s not in used)
        else:  # the least recently used adapter this step does not run
            victim = next(name for name in self.resident if name not in keep)
            slot = self.resident.pop(victim)[0]
            logger.info("LoRA adapter %s unloaded (slot %d) for %s", victim, slot, adapter.name)
        self._load(adapter, slot)
        self.resident[adapter.name] = (slot, adapter.path)

    def _load(self, adapter: LoRARequest, slot: int) -> None:
        from safetensors.torch import load_file

        started = time.monotonic()
        config = read_config(adapter.path)
        weights = load_file(f"{adapter.path}/adapter_model.safetensors")
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, value in weights.items():
            parsed = parse_key(key)
            if parsed is None:
                raise ValueError(f"LoRA adapter {adapter.name}: unexpected weight {key}")
            layer, module, part = parsed
            pairs.setdefault((layer, module), {})[part] = value
        staged: dict[_Target, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad():
            for (layer, module), ab in pairs.items():
                target = self.targets[(layer, module)]
                a, b = ab["A"], ab["B"]  # [r, in], [out, r]
                rank = a.shape[0]
                if rank > self.max_rank:
                    raise ValueError(f"LoRA adapter {adapter.name}: rank {rank} above "
                                     f"{self.max_rank}")
                if target not in staged:
                    staged[target] = target.zeros()
                p = target.parts.index(module)
                cols = slice(p * self.max_rank, p * self.max_rank + rank)
                out = slice(target.out_offsets[p], target.out_offsets[p + 1])
                staged[target][0][:, cols] = a.t().float()
                staged[target][1][cols, out] = b.t().float() * scaling(config, rank)
            for target in set(self.targets.values()):
                target.store(slot, *(staged.get(target) or target.zeros()))
        logger.info("LoRA adapter %s loaded from %s into slot %d in %.2fs", adapter.name,
                    adapter.path, slot, time.monotonic() - started)
