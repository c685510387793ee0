"""LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors), as the
API process checks them and the worker reads them.

An adapter adds scale * B @ A to some of the base model's projections (q/k/v/o of attention,
gate/up/down of the MLP); `check_adapter` reads only its config and the safetensors header (no
tensor data, no torch) and refuses what the worker could not apply: other modules, shapes that
are not the base model's, a rank above --max-lora-rank, PEFT options Loom does not implement.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass

import msgspec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (also without `.model`)
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(\w+_proj)\.lora_([AB])(?:\.default)?\.weight$")
_MAX_HEADER = 64 << 20


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """The adapter a request runs with (vLLM's LoRARequest): its name and directory. Requests
    of two adapters, or of an adapter reloaded from another path, never share KV blocks."""
    name: str
    path: str

    @property
    def lora_int_id(self) -> int:
        """vLLM's integer id of the adapter (KV events' `lora_id`): from its name, so every
        replica serving an adapter of that name gives the same id (63 bits, never 0)."""
        digest = hashlib.sha256(self.name.encode("utf-8", "surrogatepass")).digest()
        return int.from_bytes(digest[:8], "big") >> 1 or 1


class AdapterError(ValueError):
    """An adapter that cannot be served; the message says why."""


@dataclass(frozen=True)
class AdapterInfo:
    rank: int  # the highest of its modules'
    modules: tuple[str, ...]  # the projections it changes


def parse_lora_paths(entries: tuple[str, ...] | list[str]) -> dict[str, str]:
    """NAME=PATH (or PATH, named after its directory) each -> {name: absolute path}."""
    adapters = {}
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.normpath(entry)), entry
        name, path = name.strip(), path.strip()
        if not name or not path:
            raise AdapterError(f"--lora-paths {entry!r}: not NAME=PATH")
        if name in adapters:
            raise AdapterError(f"--lora-paths: two adapters named {name!r}")
        adapters[name] = os.path.realpath(os.path.expanduser(path))
    return adapters


def inside(path: str, directories: list[str] | set[str]) -> bool:
    """Whether `path` (symlinks resolved) lies in one of `directories` (resolved)."""
    real = os.path.realpath(path)
    return any(os.path.commonpath([real, d]) == d for d in directories)


def base_shapes(config) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection an adapter may change, from the base model's ModelConfig."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * \
        config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
            "o_proj": (hidden, q), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def read_config(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise AdapterError(f"{path}: no such directory")
    if not os.path.isfile(file):
        raise AdapterError(f"{path}: no {CONFIG_FILE} (a PEFT LoRA adapter holds it)")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{file}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{file}: not a JSON object")
    return config


def scaling(config: dict, rank: int) -> float:
    """PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    alpha = float(config.get("lora_alpha", rank))
    return alpha / (rank ** 0.5 if config.get("use_rslora") else rank)


def _check_options(config: dict) -> None:
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"peft_type {kind}: only LORA adapters are served")
    unsupported = [name for name in ("use_dora", "fan_in_fan_out", "modules_to_save",
                                     "alpha_pattern", "rank_pattern", "layers_pattern")
                   if config.get(name)]
    if config.get("bias", "none") != "none":
        unsupported.append(f"bias={config['bias']}")
    if unsupported:
        raise AdapterError(f"adapter options not supported: {', '.join(unsupported)}")


def tensor_shapes(file: str) -> dict[str, list[int]]:
    """Name -> shape of every tensor of a safetensors file, from its header alone."""
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _MAX_HEADER:
                raise AdapterError(f"{file}: not a safetensors file (header of {size} bytes)")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise AdapterError(f"{file}: not a safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{file}: not a safetensors file")
    return {name: meta.get("shape") for name, meta in header.items()
            if name != "__metadata__" and isinstance(meta, dict)}


def parse_key(key: str) -> tuple[int, str, str] | None:
    """(layer, module, 'A' or 'B') of a PEFT LoRA weight's name; None for any other name."""
    match = _KEY.match(key)
    return None if match is None else (int(match[1]), match[2], match[3])


def check_adapter(path: str, base_config, max_rank: int) -> AdapterInfo:
    """What the adapter at `path` changes; AdapterError if it cannot be served over the base
    model `base_config` (a ModelConfig) with ranks up to `max_rank`."""
    config = read_config(path)
    _check_options(config)
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise AdapterError(f"{path}: no {WEIGHTS_FILE}")
    expected = base_shapes(base_config)
    pairs: dict[tuple[int, str], dict[str, list[int]]] = {}
    for key, shape in tensor_shapes(file).items():
        parsed = parse_key(key)
        if parsed is None:
            raise AdapterError(f"{WEIGHTS_FILE}: {key}: only LoRA weights of "
                               f"{', '.join(MODULES)} are served")
        layer, module, part = parsed
        if module not in expected:
            raise AdapterError(f"{key}: {module} is not one of {', '.join(MODULES)}")
        if not 0 <= layer < base_config.num_hidden_layers:
            raise AdapterError(f"{key}: the base model has {base_config.num_hidden_layers} "
                               f"layers")
        pairs.setdefault((layer, module), {})[part] = shape
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE}: holds no LoRA weights")
    rank = 0
    for (layer, module), parts in pairs.items():
        if set(parts) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {module}: lora_A and lora_B must both be given")
        out_features, in_features = expected[module]
        a, b = parts["A"], parts["B"]
        if (not isinstance(a, list) or not isinstance(b, list) or len(a) != 2 or len(b) != 2
                or a[1] != in_features or b[0] != out_features or a[0] != b[1]):
            raise AdapterError(
                f"layer {layer} {module}: lora_A {a} and lora_B {b} do not fit the base "
                f"model's [{out_features}, {in_features}] projection (an adapter of another "
                f"model?)")
        rank = max(rank, a[0])
    if rank > max_rank:
        raise AdapterError(f"rank {rank} is above the server's --max-lora-rank {max_rank}")
    return AdapterInfo(rank, tuple(sorted({m for _, m in pairs})))
