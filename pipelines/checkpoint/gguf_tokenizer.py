"""The tokenizer of a GGUF file, as a Hugging Face tokenizer directory the API process (and the
worker's grammar compiler) load like any checkpoint's.

The file's tokenizer.ggml.* metadata is turned into a fast tokenizer by transformers' own GGUF
loader (`from_pretrained(dir, gguf_file=...)`), so the ids are the ones users of that loader
get; its chat template comes along. A file without a template gets its model family's own
where Loom knows it (`pipelines/checkpoint/chat_templates.py`: Gemma 3's), else none (completions only).
Building it reads the whole vocabulary (seconds), so it is done once per file and kept in
Loom's cache, keyed by the file's path, size and modification time (and the fallback
templates): a replaced file gets a new directory.

A tokenizer directory holds a chat template, which is code, so the cache is used only where
nobody else could have written it (pipelines/checkpoint/cache_dirs.py): a cache directory
others can write into is passed over with a warning for a private one (the tokenizer is read
again at each start, seconds), and a cached tokenizer with a file others could have changed is
rebuilt.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile

from pipelines.checkpoint.cache_dirs import (
    UnsafeCacheError,
    cache_root,
    contents_problem,
    drop_others_write,
    private_dir,
)
from pipelines.checkpoint.chat_templates import FALLBACK_TEMPLATES, fallback_template
from pipelines.checkpoint.gguf_file import GGUFError
from pipelines.checkpoint.gguf_header import HeaderError, read_header


def is_gguf(path: str) -> bool:
    return path.lower().endswith(".gguf")


def gguf_tokenizer_dir(gguf_path: str) -> str:
    """The cached tokenizer directory for `gguf_path`, made first if needed."""
    target = _cached_dir(gguf_path)
    try:
        private_dir(os.path.dirname(target))
    except UnsafeCacheError as exc:
        print(f"loom: warning: {exc}; reading the tokenizer into a private directory",
              file=sys.stderr, flush=True)
        return _build_privately(gguf_path)
    except OSError:  # cannot be created (a read-only file system)
        return _build_privately(gguf_path)
    if not _is_built(target):
        try:
            _build(gguf_path, target)
        except OSError:  # a read-only cache (a container's)
            return _build_privately(gguf_path)
    return target


def _is_built(target: str) -> bool:
    """Whether `target` holds a tokenizer that only this user (or root) could have written."""
    if not os.path.isfile(os.path.join(target, "tokenizer_config.json")):
        return False
    try:
        return contents_problem(target) is None
    except OSError:  # (unreadable: not one this process can use either)
        return False


def _build_privately(gguf_path: str) -> str:
    private = os.path.join(tempfile.mkdtemp(prefix="loom-gguf-tokenizer-"), "tok")
    _build(gguf_path, private)
    return private


def _cached_dir(gguf_path: str) -> str:
    real = os.path.realpath(gguf_path)
    # Keyed by the metadata the tokenizer is read from (the bytes before the first tensor),
    # not the file's path and time: every fresh install of a package that ships the file
    # rewrites the same bytes somewhere else, and would otherwise read its tokenizer again.
    header = read_header(real)
    metadata_end = min((t.offset for t in header.tensors), default=len(header.data))
    digest = hashlib.sha256(header.data[:metadata_end])
    for arch, template in sorted(FALLBACK_TEMPLATES.items()):  # a changed one: rebuilt
        digest.update(f"\0{arch}\0{template}".encode())
    key = digest.hexdigest()
    stem = os.path.splitext(os.path.basename(real))[0]
    return os.path.join(cache_root(), "gguf-tokenizers", f"{stem}-{key[:16]}")


def _build(gguf_path: str, target: str) -> None:
    from transformers import AutoTokenizer

    folder, name = os.path.split(os.path.realpath(gguf_path))
    print(f"loom: reading the tokenizer of {name} (once)", file=sys.stderr, flush=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # transformers fails in many ways on a tokenizer it cannot read
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise GGUFError(f"{name}: its tokenizer cannot be read ({type(exc).__name__}: "
                        f"{first})") from None
    if not tokenizer.chat_template:
        template = fallback_template(_architecture(gguf_path))
        if template is not None:
            tokenizer.chat_template = template
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".building-", dir=os.path.dirname(target))
    try:
        tokenizer.save_pretrained(staging)
        drop_others_write(staging)  # (a umask of 002 would make the next start rebuild it)
        if os.path.exists(target):
            shutil.rmtree(target)
        os.replace(staging, target)  # atomic: a half-written directory is never used
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _architecture(gguf_path: str) -> str | None:
    try:
        arch = read_header(gguf_path).fields.get("general.architecture")
    except (HeaderError, OSError):
        return None
    return arch if isinstance(arch, str) else None
