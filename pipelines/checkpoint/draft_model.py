"""The draft model of speculative decoding (--speculative-method draft), checked before any
process starts: its proposals are token ids the served model verifies, so both must read and
write text with the same tokenizer, and its positions must reach the served context length."""

from __future__ import annotations

import os

from pipelines.checkpoint.gguf_tokenizer import gguf_tokenizer_dir, is_gguf


class DraftModelError(ValueError):
    pass


def check_draft_model(path: str, tokenizer_dir: str, max_length: int) -> None:
    """Raises DraftModelError naming what keeps `path` from drafting for the model whose
    tokenizer is in `tokenizer_dir`, served up to `max_length` tokens."""
    from pipelines.checkpoint.model_config import load_model_config, resolve_max_model_len

    if not is_gguf(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise DraftModelError("not a checkpoint directory (config.json) or a GGUF file")
    try:
        config = load_model_config(path)
        if config.vision is not None:
            raise DraftModelError("a vision-language model; a draft is a text model")
        resolve_max_model_len(config, max_length)
        own_tokenizer = gguf_tokenizer_dir(path) if is_gguf(path) else path
    except DraftModelError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        raise DraftModelError(str(exc)) from None
    if own_tokenizer == tokenizer_dir:
        return
    theirs, ours = tokenizer_vocab(own_tokenizer), tokenizer_vocab(tokenizer_dir)
    if theirs != ours:
        differ = sum(ours.get(token) != i for token, i in theirs.items())
        raise DraftModelError(
            f"its tokenizer differs from the served model's ({len(theirs)} tokens against "
            f"{len(ours)}, {differ} of its tokens missing or with other ids): a draft "
            f"proposes token ids, so it must share the served model's tokenizer")


def tokenizer_vocab(directory: str) -> dict[str, int]:
    """Token -> id of a tokenizer directory (its tokenizer.json when it has one: fast)."""
    path = os.path.join(directory, "tokenizer.json")
    try:
        if os.path.isfile(path):
            from tokenizers import Tokenizer

            return Tokenizer.from_file(path).get_vocab(with_added_tokens=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory).get_vocab()
    except Exception as exc:  # (a tokenizer library's own errors: name the directory)
        raise DraftModelError(f"the tokenizer of {directory} could not be read: {exc}") \
            from None
