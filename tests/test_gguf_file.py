"""worker/gguf_file.py against the default model's GGUF file (whose converted checkpoint
transformers made from the same file) and against small hostile files written with gguf's own
writer: every problem is one GGUFError line, never another exception."""

import os

import gguf
import numpy as np
import pytest
import torch

from worker.gguf_file import GGUFError, dequantize, open_gguf

H, HEADS, KV_HEADS, FF, VOCAB = 32, 2, 1, 64, 8


def write_gguf(path, arch="llama", ff_in_header=FF, extra_tensor=None) -> str:
    """A one-layer model in float32 (with optionally one more, raw tensor)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(128)
    writer.add_embedding_length(H)
    writer.add_block_count(1)
    writer.add_feed_forward_length(ff_in_header)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_eos_token_id(2)
    d = H // HEADS
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (VOCAB, H), "output_norm.weight": (H,),
              "blk.0.attn_norm.weight": (H,), "blk.0.ffn_norm.weight": (H,),
              "blk.0.attn_q.weight": (HEADS * d, H), "blk.0.attn_k.weight": (KV_HEADS * d, H),
              "blk.0.attn_v.weight": (KV_HEADS * d, H), "blk.0.attn_output.weight": (H, H),
              "blk.0.ffn_gate.weight": (FF, H), "blk.0.ffn_up.weight": (FF, H),
              "blk.0.ffn_down.weight": (H, FF)}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    if extra_tensor is not None:
        name, raw, qtype = extra_tensor
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_default_model_config_and_weights_match_the_converted_checkpoint(smollm2_dir):
    from worker.default_model import find_gguf
    from worker.model_config import load_model_config
    from worker.weights import load_checkpoint_weights

    model = open_gguf(find_gguf())
    expected = load_model_config(smollm2_dir)
    expected.torch_dtype = None  # (the converted directory records its float32 dtype)
    assert model.config == expected
    assert model.chat_template and "<|im_start|>" in model.chat_template
    weights = load_checkpoint_weights(smollm2_dir)
    assert set(model.tensors) == set(weights)  # the tied lm_head absent on both sides
    for name in ("model.layers.0.self_attn.q_proj.weight",  # rows unpermuted, still Q4_1
                 "model.layers.29.self_attn.k_proj.weight",
                 "model.layers.7.mlp.gate_proj.weight", "model.embed_tokens.weight",
                 "model.layers.5.input_layernorm.weight"):
        tensor = model.tensors[name]
        assert tensor.shape == tuple(weights[name].shape)
        assert torch.equal(dequantize(tensor), weights[name].float()), name
    assert model.tensors["model.layers.0.self_attn.q_proj.weight"].qtype == "Q4_1"


def test_a_small_valid_file_reads(tmp_path):
    model = open_gguf(write_gguf(tmp_path / "ok.gguf"))
    assert model.config.num_key_value_heads == KV_HEADS and model.config.vocab_size == VOCAB
    assert model.config.tie_word_embeddings and model.config.eos_token_ids == [2]


def assert_one_line_error(path, *words):
    with pytest.raises(GGUFError) as err:
        open_gguf(str(path))
    message = str(err.value)
    assert "\n" not in message and os.path.basename(str(path)) in message
    for word in words:
        assert word in message, message


def test_truncated_files_are_one_clear_error(tmp_path):
    data = open(write_gguf(tmp_path / "full.gguf"), "rb").read()
    for cut in (3, 20, 200, len(data) // 2, len(data) - 7):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        assert_one_line_error(path)


def test_unsupported_architecture(tmp_path):
    assert_one_line_error(write_gguf(tmp_path / "gpt2.gguf", arch="gpt2"), "'gpt2'")


def test_unsupported_block_type(tmp_path):
    kind = gguf.GGMLQuantizationType.Q2_K
    nbytes = gguf.GGML_QUANT_SIZES[kind][1]
    # An untied output projection in Q2_K (one block of 256 values a row; its shape is checked
    # after its type).
    extra = ("output.weight", np.zeros((VOCAB, nbytes), np.uint8), kind)
    assert_one_line_error(write_gguf(tmp_path / "q2k.gguf", extra_tensor=extra), "Q2_K",
                          "output.weight")


def test_header_that_contradicts_the_tensors(tmp_path):
    assert_one_line_error(write_gguf(tmp_path / "ff.gguf", ff_in_header=FF * 2),
                          "mlp.gate_proj.weight")


def test_not_a_file(tmp_path):
    assert_one_line_error(tmp_path / "missing.gguf", "no such file")
    (tmp_path / "text.gguf").write_text("hello, not a model")
    assert_one_line_error(tmp_path / "text.gguf")
