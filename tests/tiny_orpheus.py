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


def make_tiny_snac(config: dict = TINY_SNAC, name: str = "tiny-snac-v1") -> str:
    """A random SNAC of `config` as a from_pretrained directory, built once under
    ~/.cache/loom/`name`."""
    import snac
    import torch

    directory = Path(os.path.expanduser(f"~/.cache/loom/{name}"))
    if not (directory / "pytorch_model.bin").exists():
        directory.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        model = snac.SNAC(**config)
        (directory / "config.json").write_text(json.dumps(config))
        torch.save(model.state_dict(), directory / "pytorch_model.bin.tmp")
        os.replace(directory / "pytorch_model.bin.tmp", directory / "pytorch_model.bin")
    return str(directory)


def speech_chain(frames: int) -> list[int]:
    """The audio tokens the tiny model speaks: frame f's token at position p is code
    (97 * f + 13 * p) % 4096 of that position."""
    return [orpheus.AUDIO_TOKEN_OFFSET + 4096 * p + (97 * f + 13 * p + 5) % 4096
            for f in range(frames) for p in range(7)]


def make_tiny_orpheus(target: str, tokenizer_dir: str, frames: int = 12, snac_dir: str = "",
                      **shape) -> str:
    """Layers that add nothing (their output projections are zero), so the logits are a
    function of the last token alone: each chain token's successor gets a logit of 80, the
    rest at most about 25. `shape` overrides the Llama's config (bench/speech_tokens.py
    builds a bigger one); `snac_dir`: the decoder (default: the tiny SNAC)."""
    import torch

    from tests.helpers import make_tiny_checkpoint

    make_tiny_checkpoint(target, tokenizer_dir, vocab_size=orpheus.VOCAB_SIZE,
                         tie_word_embeddings=False, **shape)
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
    shutil.copytree(snac_dir or make_tiny_snac(), os.path.join(target, orpheus.SNAC_SUBDIRECTORY),
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


def write_orpheus_gguf(hf_dir: str, target_dir: str) -> str:
    """The tiny Orpheus as llama.cpp users hold one: a directory with its language model as a
    float32 GGUF file (llama.cpp's tensor names and q/k row order; SmolLM2's tokenizer from the
    default GGUF file, its vocabulary padded with <custom_token_N> to Orpheus's) and `snac/`."""
    import gguf
    from safetensors.numpy import load_file

    from pipelines.checkpoint.default_model import find_gguf

    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    source = gguf.GGUFReader(find_gguf())
    os.makedirs(target_dir, exist_ok=True)
    writer = gguf.GGUFWriter(os.path.join(target_dir, "orpheus-tiny-f32.gguf"), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])  # (transformers 5)
    tokens = source.fields["tokenizer.ggml.tokens"].contents()
    extra = orpheus.VOCAB_SIZE - len(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(source.fields["tokenizer.ggml.pre"].contents())
    writer.add_token_list(tokens + [f"<custom_token_{i}>" for i in range(extra)])
    # (Normal tokens: as 28k added tokens, transformers takes half a minute to load them.)
    writer.add_token_types(source.fields["tokenizer.ggml.token_type"].contents() + [1] * extra)
    writer.add_token_merges(source.fields["tokenizer.ggml.merges"].contents())
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(False)

    def permute(w: np.ndarray, n: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, w in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        w = w.astype(np.float32)
        if name == "lm_head.weight":
            writer.add_tensor("output.weight", w)
            continue
        parts = name.removeprefix("model.").removesuffix(".weight").split(".")
        if parts[0] == "layers":
            kind = ".".join(parts[2:])
            if kind == "self_attn.q_proj":
                w = permute(w, heads)
            elif kind == "self_attn.k_proj":
                w = permute(w, kv_heads)
            writer.add_tensor(f"blk.{parts[1]}.{names[kind]}.weight", w)
        else:
            writer.add_tensor(f"{names[parts[0]]}.weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shutil.copytree(os.path.join(hf_dir, orpheus.SNAC_SUBDIRECTORY),
                    os.path.join(target_dir, orpheus.SNAC_SUBDIRECTORY), dirs_exist_ok=True)
    return target_dir


def cached_orpheus_gguf(hf_dir: str, frames: int) -> str:
    """write_orpheus_gguf's directory for the tiny Orpheus of `frames` (seeded: the same
    file every time), written once under ~/.cache/loom (its tokenizer, minutes to read out of
    157k tokens on a busy machine, is then read from Loom's cache)."""
    directory = Path(os.path.expanduser(f"~/.cache/loom/tiny-orpheus-gguf-{frames}f-v1"))
    if not directory.exists():
        staging = write_orpheus_gguf(hf_dir, f"{directory}.{os.getpid()}.tmp")
        try:
            os.replace(staging, directory)
        except OSError:  # another run made it first
            shutil.rmtree(staging, ignore_errors=True)
    return str(directory)
