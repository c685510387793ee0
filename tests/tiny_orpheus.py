"""A tiny Orpheus-shaped checkpoint for the speech-token tests: a Llama with Orpheus's
vocabulary whose greedy (and recommended-sampling) answer to any prompt ending in
<start_of_speech> is a known chain of audio tokens, then <end_of_speech>; and a tiny random
SNAC from a config beside it in `snac/` (cached under ~/.cache/loom)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from pipelines import orpheus

# snac_24khz's shape (rates, strides, codebooks) with narrow channels; no noise blocks, so a
# decode is deterministic and chunks can equal the whole.
TINY_SNAC = dict(sampling_rate=24000, encoder_dim=4, encoder_rates=[2, 4, 8, 8],
                 decoder_dim=32, decoder_rates=[8, 8, 4, 2], attn_window_size=None,
                 codebook_size=4096, codebook_dim=8, vq_strides=[4, 2, 1], noise=False,
                 depthwise=True)


def make_tiny_snac() -> str:
    """The tiny SNAC as a from_pretrained directory, built once under ~/.cache/loom."""
    import snac
    import torch

    directory = Path(os.path.expanduser("~/.cache/loom/tiny-snac-v1"))
    if not (directory / "pytorch_model.bin").exists():
        directory.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        model = snac.SNAC(**TINY_SNAC)
        (directory / "config.json").write_text(json.dumps(TINY_SNAC))
        torch.save(model.state_dict(), directory / "pytorch_model.bin.tmp")
        os.replace(directory / "pytorch_model.bin.tmp", directory / "pytorch_model.bin")
    return str(directory)


def speech_chain(frames: int) -> list[int]:
    """The audio tokens the tiny model speaks: frame f's token at position p is code
    (97 * f + 13 * p) % 4096 of that position."""
    return [orpheus.AUDIO_TOKEN_OFFSET + 4096 * p + (97 * f + 13 * p + 5) % 4096
            for f in range(frames) for p in range(7)]


def make_tiny_orpheus(target: str, tokenizer_dir: str, frames: int = 12) -> str:
    """Layers that add nothing (their output projections are zero), so the logits are a
    function of the last token alone: each chain token's successor gets a logit of 80, the
    rest at most about 25."""
    import torch

    from tests.helpers import make_tiny_checkpoint

    make_tiny_checkpoint(target, tokenizer_dir, vocab_size=orpheus.VOCAB_SIZE,
                         tie_word_embeddings=False)
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(target)
    chain = [orpheus.START_OF_SPEECH, *speech_chain(frames), orpheus.END_OF_SPEECH]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        embed = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.zero_()
        for token, successor in zip(chain, chain[1:]):
            head[successor] = 10 * embed[token] / embed[token].norm()
    model.save_pretrained(target, safe_serialization=True)
    shutil.copytree(make_tiny_snac(), os.path.join(target, orpheus.SNAC_SUBDIRECTORY),
                    dirs_exist_ok=True)
    return target


def snac_decode(tokens: list[int]) -> np.ndarray:
    """`snac`'s own decoder over the whole sequence (whole frames), float samples."""
    import snac
    import torch

    from worker.speech.snac_decoder import tokens_to_codes

    frames = len(tokens) // 7
    codes = tokens_to_codes(np.asarray(tokens[: frames * 7])[None], orpheus.AUDIO_TOKEN_OFFSET)
    model = snac.SNAC.from_pretrained(make_tiny_snac())
    with torch.inference_mode():
        return model.decode([torch.from_numpy(c) for c in codes])[0, 0].numpy()
