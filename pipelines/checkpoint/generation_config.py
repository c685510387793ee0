"""A checkpoint's recommended sampling: the values of its generation_config.json that a request
leaving them out gets, as vLLM's `--generation-config auto` applies them (and for an Orpheus
directory, canopylabs' values where its file says nothing)."""

from __future__ import annotations

import json
import os

# The SamplingParamsDefaults a generation_config.json may set (vLLM reads the same ones).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(model_path: str) -> dict[str, float]:
    """The sampling values `model_path` (a checkpoint directory, or a GGUF file: that of the
    directory holding it) recommends."""
    from pipelines import orpheus

    values: dict[str, float] = {}
    if orpheus.snac_directory(model_path):
        values.update(orpheus.SAMPLING_DEFAULTS)
    if not os.path.isdir(model_path):
        model_path = os.path.dirname(model_path)
    try:
        with open(os.path.join(model_path, "generation_config.json")) as f:
            config = json.load(f)
    except FileNotFoundError:
        return values
    except (OSError, ValueError) as exc:
        raise ValueError(f"{model_path}/generation_config.json: {exc}") from None
    values.update({name: config[name] for name in SAMPLING_FIELDS
                   if isinstance(config.get(name), (int, float))
                   and not isinstance(config.get(name), bool)})
    return values
