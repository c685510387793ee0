"""A tiny random FLUX pipeline in diffusers format, built from configs (no weights ship here).

One double and one single transformer block, a three-level VAE (4x downsampling), tiny CLIP and
T5 encoders and word-level tokenizers made locally; saved with FluxPipeline.save_pretrained, so
the directory has model_index.json like a real FLUX checkpoint.
"""

from __future__ import annotations

import os

WORDS = ("a red cat on blue mat the sky over green hills with sun dog tree house water "
         "bird flower mountain city night star bright dark small big").split()


def _word_tokenizer(max_length: int, bos: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # CLIP-like: <s> ... </s>; T5-like: ... </s>
    single = ("<s> $A </s>" if bos else "$A </s>")
    tok.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[("<s>", 2), ("</s>", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>", model_max_length=max_length)


def cached_tiny_flux(guidance_embeds: bool = False) -> str:
    """The tiny FLUX saved in Loom's model cache, built once per builder source and library
    versions (building costs seconds per test module otherwise)."""
    import hashlib
    import shutil

    import diffusers
    import torch
    import transformers

    from pipelines.checkpoint.default_model import cache_dir

    with open(__file__, "rb") as f:
        key = hashlib.sha256(f.read())
    key.update(f"{guidance_embeds}:{diffusers.__version__}:{torch.__version__}:"
               f"{transformers.__version__}".encode())
    path = os.path.join(cache_dir(), "test-models", f"tiny-flux-{key.hexdigest()[:16]}")
    if not os.path.exists(os.path.join(path, "model_index.json")):
        staging = f"{path}.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        make_tiny_flux(staging, guidance_embeds)
        try:
            os.rename(staging, path)
        except OSError:  # another session saved it first
            shutil.rmtree(staging, ignore_errors=True)
    return path


def make_tiny_flux(out_dir: str, guidance_embeds: bool = False, seed: int = 0,
                   **transformer_shape) -> str:
    """`transformer_shape`: FluxTransformer2DModel settings replacing the tiny ones (bench/
    images.py builds a FLUX-shaped model of a chosen step time); the VAE's latent channels
    follow its in_channels."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    if os.path.exists(os.path.join(out_dir, "model_index.json")):
        return out_dir
    torch.manual_seed(seed)
    vocab = 4 + len(WORDS)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=77, projection_dim=32,
        bos_token_id=2, eos_token_id=3, pad_token_id=0))
    t5 = T5EncoderModel(T5Config(
        vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=3))
    shape = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                 attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                 pooled_projection_dim=32, guidance_embeds=guidance_embeds,
                 axes_dims_rope=(4, 4, 8))
    shape.update(transformer_shape)
    transformer = FluxTransformer2DModel(**shape)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=shape["in_channels"] // 4, block_out_channels=(16, 32, 32),
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        layers_per_block=1, norm_num_groups=8, sample_size=32, scaling_factor=0.3611,
        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
        max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip,
                        tokenizer=_word_tokenizer(77, bos=True), text_encoder_2=t5,
                        tokenizer_2=_word_tokenizer(512, bos=False), transformer=transformer)
    pipe.save_pretrained(out_dir)
    return out_dir
