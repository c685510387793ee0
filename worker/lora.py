"""LoRA adapters applied to the rows of their requests, in batches shared with the base model
(Punica's and vLLM's scheme, here in PyTorch).

The base projections run once for the whole step; a forward hook on each target projection
(qkv, o, gate_up, down) then adds scale * (x @ A) @ B of each row's adapter to that row only:
one product over every slot's columns, each row masked to its own slot's (base rows to
none). The adapters live in `max_num_loras` slots of stacked tensors, every rank padded to
--max-lora-rank (a fused projection's parts side by side: qkv's A is [in, 3R] and its B
[3R, q+k+v], block-diagonal), so an adapter loads by copying into a slot. Resident adapters are kept least recently used first; one not
resident is read from its directory when a step first needs it.

The one-call native decode step (worker/fused_decode.py, decoder.c) reads the same slot
tensors and adds the deltas itself, each row with its own slot (`row_slots`); the hooks serve
the Python path (prefill chunks, GPUs, models without the native step).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import numpy as np
import torch

from pipelines.lora import LoRARequest, base_shapes, parse_key, read_config, scaling

logger = logging.getLogger(__name__)

# Each hooked projection of a layer: its module path, and the PEFT modules fused in it.
TARGETS = (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
           ("self_attn.o_proj", ("o_proj",)),
           ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
           ("mlp.down_proj", ("down_proj",)))


class _Target:
    """One projection's adapter weights, all slots: A [slots, in, parts*R], B [slots,
    parts*R, out]."""

    def __init__(self, parts, shapes, slots, rank, dtype, device) -> None:
        self.parts = parts
        in_features = shapes[parts[0]][1]
        self.out_offsets = np.cumsum([0] + [shapes[p][0] for p in parts]).tolist()
        self.width = len(parts) * rank  # (per slot)
        self.A = torch.zeros(slots, in_features, self.width, dtype=dtype, device=device)
        self.B = torch.zeros(slots, self.width, self.out_offsets[-1], dtype=dtype,
                             device=device)
        # Every slot side by side, for the Python path's one masked product for all rows:
        # A's copy [in, slots * width]; B's rows already lie so.
        self.A_flat = torch.zeros(in_features, slots * self.width, dtype=dtype, device=device)
        self.B_flat = self.B.view(slots * self.width, -1)

    def sync_flat(self, slot: int) -> None:
        self.A_flat[:, slot * self.width:(slot + 1) * self.width] = self.A[slot]


class LoRASlots:
    def __init__(self, model: torch.nn.Module, config, max_num_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.max_num_loras, self.max_rank = max_num_loras, max_rank
        self.resident: OrderedDict[str, tuple[int, str]] = OrderedDict()  # name: (slot, path)
        self.groups: list[int] = []  # this step's slots
        # Several adapters in a step: each row's slot one-hot, widened to each target's
        # per-slot width (the columns of A_flat its row keeps).
        self.masks: dict[int, torch.Tensor] = {}
        # This step's slot of each row (int32 [T], -1: the base model's), for the native
        # decode step (worker/fused_decode.py), which reads the same tensors.
        self.row_slots: torch.Tensor | None = None
        shapes = base_shapes(config)
        self.targets: dict[tuple[int, str], _Target] = {}
        self._layers: list[list[_Target]] = []
        for i, layer in enumerate(model.layers):
            self._layers.append([])
            for path, parts in TARGETS:
                target = _Target(parts, shapes, max_num_loras, max_rank, dtype, device)
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
            if not self.groups:
                return None
            x = inputs[0]
            if not self.masks:  # one adapter, every row of the step
                slot = self.groups[0]
                return output.add_(x @ target.A[slot] @ target.B[slot])
            # (Three operations however many adapters: rows are masked to their slot's
            # columns, base rows to none; the products of other slots' columns are wasted,
            # cheaper than gathering and scattering each adapter's rows.)
            xa = (x @ target.A_flat).mul_(self.masks[target.width])
            return output.addmm_(xa, target.B_flat)
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
        self.groups, self.row_slots, self.masks = [], None, {}
        named = [i for i, a in enumerate(adapters) if a is not None]
        if not named:
            return False
        ends = np.cumsum(query_lens)
        starts = ends - query_lens
        by_slot: dict[int, int] = {}  # slot: its rows
        row_slots = np.full(int(ends[-1]), -1, np.int32)
        for i in named:
            slot = self.resident[adapters[i].name][0]
            by_slot[slot] = by_slot.get(slot, 0) + int(query_lens[i])
            row_slots[starts[i]:ends[i]] = slot
        device = next(iter(self.targets.values())).A.device
        self.row_slots = torch.from_numpy(row_slots).to(device)
        if len(by_slot) > 1 or sum(by_slot.values()) < len(row_slots):
            dtype = next(iter(self.targets.values())).A.dtype
            onehot = torch.zeros(len(row_slots), self.max_num_loras + 1, dtype=dtype)
            onehot[torch.arange(len(row_slots)), torch.from_numpy(row_slots).long()] = 1
            onehot = onehot[:, :-1].to(device)  # (the base's -1: the dropped last column)
            for width in {t.width for t in self.targets.values()}:
                self.masks[width] = onehot.repeat_interleave(width, dim=1)
        self.groups = list(by_slot)
        return True

    def clear_step(self) -> None:
        self.groups, self.row_slots, self.masks = [], None, {}

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
        targets = set(self.targets.values())
        for target in targets:
            target.A[slot].zero_()
            target.B[slot].zero_()
        with torch.no_grad():
            for (layer, module), ab in pairs.items():
                target = self.targets[(layer, module)]
                a, b = ab["A"], ab["B"]  # [r, in], [out, r]
                rank = a.shape[0]
                if rank > self.max_rank:
                    raise ValueError(f"LoRA adapter {adapter.name}: rank {rank} above "
                                     f"{self.max_rank}")
                p = target.parts.index(module)
                cols = slice(p * self.max_rank, p * self.max_rank + rank)
                out = slice(target.out_offsets[p], target.out_offsets[p + 1])
                target.A[slot][:, cols] = a.t().to(target.A.dtype)
                target.B[slot][cols, out] = (b.t() * scaling(config, rank)).to(target.B.dtype)
            for target in targets:
                target.sync_flat(slot)
        logger.info("LoRA adapter %s loaded from %s into slot %d in %.2fs", adapter.name,
                    adapter.path, slot, time.monotonic() - started)
