"""pipelines/checkpoint/gguf_file.py against the default model's GGUF file (whose converted checkpoint
transformers made from the same file) and against small hostile files written with gguf's own
writer: every problem is one GGUFError line, never another exception."""

import os
import struct
import time

import gguf
import numpy as np
import pytest
import torch

from pipelines.checkpoint.gguf_file import GGUFError, dequantize, open_gguf

H, HEADS, KV_HEADS, FF, VOCAB = 32, 2, 1, 64, 8


def write_gguf(path, arch="llama", ff_in_header=FF, extra_tensor=None, arrays=None) -> str:
    """A one-layer model in float32 (with optionally one more, raw tensor, and more arrays in
    its metadata)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, values in (arrays or {}).items():
        writer.add_array(key, values)
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
    from pipelines.checkpoint.default_model import find_gguf
    from pipelines.checkpoint.model_config import load_model_config
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


def write_raw_header(path, fields: bytes, n_fields=1) -> str:
    """A GGUF file of no tensors whose metadata is `fields`, as bytes (what gguf's writer
    cannot write: arrays nested a thousand deep, or millions of strings written fast)."""
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, n_fields) + fields)
    return str(path)


def key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def test_nested_arrays_are_one_clear_error(tmp_path, capsys):
    """Arrays of arrays (two levels) read; deeper ones are refused by key, and a file nesting
    them 100,000 deep is the same one line, not a RecursionError, also from `loom serve`."""
    from api_server.cli import main

    model = open_gguf(write_gguf(tmp_path / "two.gguf", arrays={"junk": [[1, 2], [3]]}))
    assert model.config.vocab_size == VOCAB
    assert_one_line_error(write_gguf(tmp_path / "three.gguf", arrays={"junk": [[[1]]]}),
                          "junk", "nested more than 2 deep")
    levels = struct.pack("<IQ", 9, 1) * 100_000  # (array of 1 array) ... of no uint32
    path = write_raw_header(tmp_path / "deep.gguf", key("deep.key") + struct.pack("<I", 9)
                            + levels + struct.pack("<IQ", 4, 0))
    assert_one_line_error(path, "deep.key", "nested more than 2 deep")
    assert main(["serve", "--model", path]) == 1
    assert capsys.readouterr().err == ("loom: error: deep.gguf: deep.key: arrays nested more "
                                       "than 2 deep (a GGUF model's metadata nests none)\n")


def test_millions_of_strings_are_refused_fast(tmp_path):
    """5M empty strings (40 MB) in one array, or 2.4M split over two, are refused in well under
    the 27 s that stepping through them took; so is a count the file's bytes cannot hold."""
    empty = struct.pack("<Q", 0)
    one = key("junk") + struct.pack("<IIQ", 9, 8, 5_000_000) + empty * 5_000_000
    two = b"".join(key(f"junk{i}") + struct.pack("<IIQ", 9, 8, 1_200_000) + empty * 1_200_000
                   for i in range(2))
    claims = key("junk") + struct.pack("<IIQ", 9, 8, 1 << 40) + empty * 1000
    for name, fields, n_fields in (("one.gguf", one, 1), ("two.gguf", two, 2),
                                   ("claims.gguf", claims, 1)):
        path = write_raw_header(tmp_path / name, fields, n_fields)
        started = time.monotonic()
        assert_one_line_error(path, "junk")
        assert time.monotonic() - started < 5, name
    many_keys = write_raw_header(tmp_path / "keys.gguf", b"", n_fields=1 << 40)
    assert_one_line_error(many_keys, "metadata keys")


# -- Gemma 3 ------------------------------------------------------------------------------------

GEMMA_LAYERS, GEMMA_HEAD_DIM, SPECIALS = 6, 16, ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>",
                                               "<start_of_turn>", "<end_of_turn>"]
GEMMA_TOKENS = SPECIALS + ["\n", "▁", "a", "b", "▁a", "▁b", "user", "model"]


def write_gemma3_gguf(path, sliding_window=8, skip=(), with_tokenizer=False) -> str:
    """A six-layer Gemma 3 file as llama.cpp's converter writes one: norms stored as 1 + w,
    no key for the layer pattern, the local rotary base nor the attention scale."""
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(128)
    writer.add_embedding_length(H)
    writer.add_block_count(GEMMA_LAYERS)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(GEMMA_HEAD_DIM)
    writer.add_value_length(GEMMA_HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    if sliding_window:
        writer.add_sliding_window(sliding_window)
    writer.add_token_list(GEMMA_TOKENS)
    if with_tokenizer:
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([0.0] * len(GEMMA_TOKENS))
        writer.add_token_types([3] * len(SPECIALS) + [1] * (len(GEMMA_TOKENS) - len(SPECIALS)))
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    rng = np.random.default_rng(0)
    q, kv = HEADS * GEMMA_HEAD_DIM, KV_HEADS * GEMMA_HEAD_DIM
    shapes = {"token_embd.weight": (len(GEMMA_TOKENS), H), "output_norm.weight": (H,)}
    for i in range(GEMMA_LAYERS):
        shapes.update({f"blk.{i}.{name}": shape for name, shape in {
            "attn_norm.weight": (H,), "attn_q.weight": (q, H), "attn_k.weight": (kv, H),
            "attn_v.weight": (kv, H), "attn_q_norm.weight": (GEMMA_HEAD_DIM,),
            "attn_k_norm.weight": (GEMMA_HEAD_DIM,), "attn_output.weight": (H, q),
            "post_attention_norm.weight": (H,), "ffn_norm.weight": (H,),
            "ffn_gate.weight": (FF, H), "ffn_up.weight": (FF, H), "ffn_down.weight": (H, FF),
            "post_ffw_norm.weight": (H,)}.items()})
    for name, shape in shapes.items():
        if name not in skip:
            writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gemma3_config_has_llama_cpps_fixed_values(tmp_path):
    config = open_gguf(write_gemma3_gguf(tmp_path / "g.gguf")).config
    assert config.architecture == "Gemma3ForCausalLM" and config.hidden_act == "gelu_pytorch_tanh"
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert config.sliding_window == 8 and config.head_dim == GEMMA_HEAD_DIM
    assert (config.rope_theta, config.rope_local_theta) == (1e6, 10_000.0)
    assert config.query_pre_attn_scalar == GEMMA_HEAD_DIM  # the key length, as llama.cpp
    assert config.final_logit_softcapping is None and config.tie_word_embeddings
    assert config.eos_token_ids == [1, 6]  # <eos> and <end_of_turn>
    # No sliding window in the header: every layer global (llama.cpp's reading).
    config = open_gguf(write_gemma3_gguf(tmp_path / "full.gguf", sliding_window=None)).config
    assert config.layer_types == ["full_attention"] * GEMMA_LAYERS
    assert config.sliding_window is None


def test_gemma3_tensors_map_to_its_four_norms_minus_one(tmp_path):
    path = write_gemma3_gguf(tmp_path / "g.gguf")
    reader = gguf.GGUFReader(path)
    stored = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors}
    tensors = open_gguf(path).tensors
    norms = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
             "attn_k_norm": "self_attn.k_norm"}
    for i in (0, GEMMA_LAYERS - 1):
        for src, dst in norms.items():
            got = tensors[f"model.layers.{i}.{dst}.weight"]
            assert got.qtype == "F32"
            assert np.array_equal(got.data, stored[f"blk.{i}.{src}.weight"] - np.float32(1))
        # q and k rows as stored: only llama.cpp's "llama" files have them permuted.
        for src, dst in (("attn_q", "q_proj"), ("attn_k", "k_proj")):
            got = tensors[f"model.layers.{i}.self_attn.{dst}.weight"]
            assert np.array_equal(got.data, stored[f"blk.{i}.{src}.weight"])
    assert np.array_equal(tensors["model.norm.weight"].data,
                          stored["output_norm.weight"] - np.float32(1))
    assert len(tensors) == 2 + GEMMA_LAYERS * 13


def test_gemma3_files_lacking_a_norm(tmp_path):
    path = write_gemma3_gguf(tmp_path / "nonorm.gguf", skip={"blk.3.post_ffw_norm.weight"})
    assert_one_line_error(path, "model.layers.3.post_feedforward_layernorm.weight")
    path = write_gemma3_gguf(tmp_path / "noqk.gguf", skip={"blk.0.attn_q_norm.weight"})
    assert_one_line_error(path, "model.layers.0.self_attn.q_norm.weight")


def test_chat_template_fallback(tmp_path, monkeypatch):
    """A gemma3 file without a chat template gets Gemma 3's; a file of another architecture
    without one is served without (completions only)."""
    from transformers import AutoTokenizer

    from pipelines.checkpoint.gguf_tokenizer import gguf_tokenizer_dir

    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    gemma = AutoTokenizer.from_pretrained(gguf_tokenizer_dir(
        write_gemma3_gguf(tmp_path / "g.gguf", with_tokenizer=True)))
    messages = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"},
                {"role": "assistant", "content": "a b"}, {"role": "user", "content": "b"}]
    assert gemma.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<bos><start_of_turn>user\na\n\nb<end_of_turn>\n<start_of_turn>model\na b<end_of_turn>\n"
        "<start_of_turn>user\nb<end_of_turn>\n<start_of_turn>model\n")
    writer = gguf.GGUFWriter(str(tmp_path / "l.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(GEMMA_TOKENS)
    writer.add_token_scores([0.0] * len(GEMMA_TOKENS))
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(GEMMA_TOKENS) - len(SPECIALS)))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_tensor("token_embd.weight", np.zeros((len(GEMMA_TOKENS), H), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    llama = AutoTokenizer.from_pretrained(gguf_tokenizer_dir(str(tmp_path / "l.gguf")))
    assert llama.chat_template is None and llama("a b")["input_ids"][0] == 2


def write_llama_tokenizer_gguf(path) -> str:
    """A llama file with a tokenizer and a chat template (no weights: the tokenizer only)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(GEMMA_TOKENS)
    writer.add_token_scores([0.0] * len(GEMMA_TOKENS))
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(GEMMA_TOKENS) - len(SPECIALS)))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_chat_template("{{ messages[0].content }}")
    writer.add_tensor("token_embd.weight", np.zeros((len(GEMMA_TOKENS), H), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_tokenizer_cache_is_private(tmp_path, monkeypatch, capsys):
    """The tokenizer cache (a chat template is code) is created 0700; one group or others can
    write into is passed over for a private directory, with one warning line; a cached file
    others could have changed is rebuilt."""
    from transformers import AutoTokenizer

    from pipelines.checkpoint.gguf_tokenizer import gguf_tokenizer_dir

    cache = tmp_path / "cache"
    monkeypatch.setenv("LOOM_CACHE_DIR", str(cache))
    model = write_llama_tokenizer_gguf(tmp_path / "l.gguf")
    built = gguf_tokenizer_dir(model)
    assert built.startswith(str(cache / "gguf-tokenizers") + os.sep)
    for directory in (cache, cache / "gguf-tokenizers", built):
        assert os.stat(directory).st_mode & 0o777 == 0o700, directory

    def plant():  # what another user with write access would do
        for name in os.listdir(built):
            if name.endswith(".jinja") or name == "tokenizer_config.json":
                text = open(os.path.join(built, name)).read()
                open(os.path.join(built, name), "w").write(text.replace("[0].content", "|length"))
        assert AutoTokenizer.from_pretrained(built).chat_template == "{{ messages|length }}"

    def template(directory):
        return AutoTokenizer.from_pretrained(directory).chat_template

    plant()
    os.chmod(cache / "gguf-tokenizers", 0o770)
    capsys.readouterr()
    private = gguf_tokenizer_dir(model)
    assert not private.startswith(str(cache)) and template(private) == (
        "{{ messages[0].content }}")
    warning = capsys.readouterr().err.splitlines()[0]
    assert warning.startswith("loom: warning: the cache directory ") and "mode 770" in warning
    # A private directory again, but a planted file (left group-writable) is rebuilt in place.
    os.chmod(cache / "gguf-tokenizers", 0o700)
    config = os.path.join(built, "tokenizer_config.json")
    os.chmod(config, 0o664)
    assert gguf_tokenizer_dir(model) == built and template(built) == "{{ messages[0].content }}"
    assert not os.stat(config).st_mode & 0o022


def test_model_cache_others_can_write_is_refused(tmp_path, monkeypatch):
    from pipelines.checkpoint.cache_dirs import UnsafeCacheError
    from pipelines.checkpoint.default_model import cache_dir

    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    assert cache_dir() == str(tmp_path / "cache" / "models")
    assert os.stat(cache_dir()).st_mode & 0o777 == 0o700
    os.chmod(tmp_path / "cache", 0o777)
    with pytest.raises(UnsafeCacheError) as err:
        cache_dir()
    assert "\n" not in str(err.value) and "writable by group or others (mode 777)" in str(err.value)
