"""The native all-layers decode step equals the Python layer loop it replaces."""

import numpy as np
import pytest
import torch

from pipelines import SamplingParams, TextContext
from pipelines.config import PipelineConfig
from pipelines.pipeline import every_row
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler
from tests.helpers import make_tiny_checkpoint
from worker.attention import build_attention_metadata
from worker.model_runner import ModelRunner
from worker.pipeline import feeding, run_step


# qwen2: a qkv bias; qwen3: q/k norms; gemma3: q/k norms, four norms a layer of 1 + w, GELU,
# sliding-window layers (a window of 8, shorter than most prompts below) with their own rotary
# base; bfloat16: bf16 weights and cache, float32 activations; quantized: GGUF blocks of three
# formats (QuantLinear) in place of the packed float32 projections; bf16 cache: quantized,
# with --kv-cache-dtype bfloat16 (float32 activations, the fused step and the Python path
# storing and reading the same rounded K/V)
@pytest.fixture(scope="module", params=[("llama", "float32"), ("qwen2", "float32"),
                                        ("llama", "bfloat16"), ("llama", "quantized"),
                                        ("qwen2", "quantized"), ("qwen3", "float32"),
                                        ("gemma3", "float32"), ("gemma3", "quantized"),
                                        ("gemma3", "bfloat16"), ("llama", "bf16 cache"),
                                        ("gemma3", "bf16 cache")])
def runner(request, smollm2_dir, tmp_path_factory):
    return make_runner(*request.param, 4, smollm2_dir, tmp_path_factory)


def make_runner(arch: str, dtype: str, page_size: int, smollm2_dir, tmp_path_factory):
    kv_dtype = "bfloat16" if dtype == "bf16 cache" else "auto"
    dtype = "quantized" if dtype == "bf16 cache" else dtype
    target = str(tmp_path_factory.mktemp(arch))
    if arch == "gemma3":
        from tests.test_gemma3 import make_tiny_gemma3

        path = make_tiny_gemma3(target, smollm2_dir, seed=3)
    else:
        path = make_tiny_checkpoint(target, smollm2_dir, architecture=arch, seed=3)
    runner = ModelRunner(PipelineConfig.for_model(
        path, dtype="float32" if dtype == "quantized" else dtype, kv_cache_page_size=page_size,
        kv_cache_memory=8 << 20, kv_cache_dtype=kv_dtype))
    assert runner.kv_cache.dtype == (torch.bfloat16 if kv_dtype == "bfloat16" or
                                     dtype == "bfloat16" else torch.float32)
    if arch == "qwen3":  # transformers starts q/k norms at 1: a swapped pair would not show
        with torch.no_grad():
            for layer in runner.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.normal_(1, 0.3)
    if dtype == "quantized":
        quantize_projections(runner.model, path)
    if runner.model.fused_decode is None:
        pytest.skip("no native kernels here")
    # Gemma's sliding layers attend through PyTorch on the Python path: float32 sums in
    # another order, which may move an activation across an 8-bit rounding step before a
    # quantized projection (one such flip: ~1.5e-3 in the logits; otherwise they agree to 1e-6).
    atol = 5e-3 if (arch, dtype) == ("gemma3", "quantized") else 1e-4
    return runner, atol


def quantize_projections(model, checkpoint: str) -> None:
    """Swap the projections for QuantLinear layers holding the checkpoint's weights as GGUF
    blocks (gguf's own quantizer), as a GGUF-loaded model will have them."""
    import gguf

    from worker.fused_decode import FusedDecode
    from worker.quant_linear import QuantLinear
    from worker.weights import load_checkpoint_weights

    weights = load_checkpoint_weights(checkpoint)
    kinds = {"qkv_proj": gguf.GGMLQuantizationType.Q8_0, "o_proj": gguf.GGMLQuantizationType.Q4_1,
             "gate_up_proj": gguf.GGMLQuantizationType.Q4_0,
             "down_proj": gguf.GGMLQuantizationType.Q8_0}
    for i, layer in enumerate(model.layers):
        src = f"model.layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        dense = {
            "qkv_proj": torch.cat([weights[f"{attn}{p}_proj.weight"] for p in "qkv"]),
            "o_proj": weights[f"{attn}o_proj.weight"],
            "gate_up_proj": torch.cat([weights[f"{mlp}gate_proj.weight"],
                                       weights[f"{mlp}up_proj.weight"]]),
            "down_proj": weights[f"{mlp}down_proj.weight"],
        }
        for name, weight in dense.items():
            parent = layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp
            bias = getattr(parent, name).bias
            if bias is not None:
                bias = bias[:weight.shape[0]]  # (a packed bias is padded to whole panels)
            raw = gguf.quants.quantize(weight.float().numpy(), kinds[name])
            setattr(parent, name, QuantLinear(kinds[name], raw, tuple(weight.shape), bias))
    model.fused_decode = FusedDecode.for_model(model)


# several lengths: partial blocks, different tables; one long sequence alone: its attention
# split by chunks of positions over the threads (a window's reach starting in a later chunk)
@pytest.mark.parametrize("lengths", [(3, 17, 40, 9), (150,)])
def test_decode_step_logits_equal_the_python_path(runner, lengths):
    runner, atol = runner
    blocks = BlockManager(runner.num_blocks, 4)
    sched = Scheduler(PipelineConfig().replace(max_length=runner.max_model_len), blocks)
    rng = np.random.default_rng(0)
    for n in lengths:
        sched.add_request(TextContext(max_length=n + 8, tokens=rng.integers(5, 400, n),
                                      sampling_params=SamplingParams(temperature=0.0)))
    step = sched.schedule()
    sched.update(step, run_step(runner, step))  # prefill (the Python path)
    for _ in range(3):
        step = sched.schedule()
        batch = step.batch
        assert (batch.query_lens == 1).all()
        meta = build_attention_metadata(batch.query_lens, batch.seq_lens, batch.block_tables, 4)
        assert runner.model.fused_decode.applies(meta)
        fused, python = both_paths(runner, batch.input_ids, meta)
        torch.testing.assert_close(fused, python, rtol=1e-4, atol=atol)
        sched.update(step, run_step(runner, step))


def both_paths(runner, input_ids: np.ndarray, meta) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's logits of one step, by the fused step and by the Python path."""
    ids = torch.from_numpy(input_ids.astype(np.int64))
    ids[ids < 0] = 7  # placeholders of the overlap scheduler: any token does here
    rows = torch.arange(len(ids))
    fused_path = runner.model.fused_decode
    with torch.inference_mode():
        fused = runner.model(ids, meta, runner.kv_cache, rows)
        runner.model.fused_decode = None
        try:
            python = runner.model(ids, meta, runner.kv_cache, rows)
        finally:
            runner.model.fused_decode = fused_path
    return fused, python


# 16-token blocks: the prefill kernel's, which mixed steps need
@pytest.fixture(scope="module", params=[("llama", "quantized"), ("qwen2", "float32"),
                                        ("qwen3", "float32"), ("llama", "bfloat16"),
                                        ("gemma3", "quantized"), ("gemma3", "bf16 cache")])
def runner16(request, smollm2_dir, tmp_path_factory):
    return make_runner(*request.param, 16, smollm2_dir, tmp_path_factory)


def test_mixed_step_logits_equal_the_python_path(runner16):
    """Steps of decodes beside prompt chunks (chunked prefill, 24 tokens a step; prompts
    longer than Gemma's window of 8) run in the one native call, the chunks' attention by the
    prefill kernel: every row's logits equal the Python path's, with the rows as scheduled
    (decodes first) and reversed (a decode row after a chunk's: gathered and scattered)."""
    runner, atol = runner16
    blocks = BlockManager(runner.num_blocks, 16)
    sched = Scheduler(PipelineConfig().replace(max_length=runner.max_model_len,
                                               max_batch_input_tokens=24), blocks)
    rng = np.random.default_rng(1)

    def add(n: int) -> None:
        sched.add_request(TextContext(max_length=n + 8, tokens=rng.integers(5, 400, n),
                                      sampling_params=SamplingParams(temperature=0.0)))

    def compare(batch, order: np.ndarray) -> None:
        starts = np.concatenate([[0], np.cumsum(batch.query_lens)])
        ids = np.concatenate([batch.input_ids[starts[i]:starts[i + 1]] for i in order])
        meta = build_attention_metadata(batch.query_lens[order], batch.seq_lens[order],
                                        batch.block_tables[order], 16)
        assert runner.model.fused_decode.applies(meta, runner.kv_cache)
        fused, python = both_paths(runner, ids, meta)
        torch.testing.assert_close(fused, python, rtol=1e-4, atol=atol)

    add(6)
    add(11)
    mixed = 0
    for i in range(14):
        if i in (2, 6):
            add(50 if i == 2 else 30)  # (chunked over the next steps, beside the decodes)
        step = sched.schedule()
        batch = step.batch
        if (batch.query_lens > 1).any() and (batch.query_lens == 1).any():
            mixed += 1
            order = np.arange(len(batch.query_lens))
            compare(batch, order)
            compare(batch, order[::-1].copy())
        sched.update(step, run_step(runner, step))
    assert mixed >= 3


def test_decode_step_reads_every_row_as_a_gather_does(runner):
    """A decode step whose every sequence samples computes its logits without gathering the
    rows (its inputs' logits_rows are `every_row`, which the model tells by identity): the
    same logits, bit for bit, as those rows gathered. Rows narrowed otherwise are gathered."""
    runner, _ = runner
    blocks = BlockManager(runner.num_blocks, 4)
    sched = Scheduler(PipelineConfig().replace(max_length=runner.max_model_len), blocks)
    for n in (5, 12, 3):
        sched.add_request(TextContext(max_length=n + 8, tokens=np.arange(5, 5 + n),
                                      sampling_params=SamplingParams(temperature=0.0)))
    step = sched.schedule()
    sched.update(step, run_step(runner, step))  # prefill
    step = sched.schedule()
    with feeding(step) as contexts, torch.inference_mode():
        for ctx in contexts:  # (placeholders of the overlap scheduler: any token does here)
            ctx.tokens[ctx.start_idx:ctx.active_idx] = 7
        inputs = runner.model.prepare_initial_token_inputs(
            contexts, kv_cache_inputs=runner.kv_manager.fetch(contexts, step.batch.block_tables))
        assert inputs.logits_rows is every_row(3)
        whole = runner.model.execute(inputs).next_token_logits
        inputs.narrow(np.arange(3), 3)
        assert inputs.logits_rows is not every_row(3)
        assert torch.equal(runner.model.execute(inputs).next_token_logits, whole)
        inputs.narrow(np.array([2, 0]), 2)
        torch.testing.assert_close(runner.model.execute(inputs).next_token_logits,
                                   whole[[2, 0]], rtol=1e-5, atol=1e-5)


def test_decode_step_metadata_equals_the_general_build():
    """A step of one-token rows takes build_attention_metadata's shortcut; its metadata must
    be what the general build gives those rows (here: the same rows with a prefill chunk
    after them, which takes the general build): positions, slots, tables (padding read as
    block 0) and the mask the Python path attends with."""
    rng = np.random.default_rng(0)
    block_size = 4
    for _ in range(20):
        n = int(rng.integers(1, 6))
        seq_lens = rng.integers(1, 30, n).astype(np.int32)
        width = int(-(-seq_lens.max() // block_size)) + int(rng.integers(0, 3))
        tables = np.full((n + 1, width), -1, np.int32)
        for i, s in enumerate(seq_lens):
            used = -(-int(s) // block_size)
            tables[i, :used] = rng.choice(200, used, replace=False)
        tables[n, 0] = 201  # (the prefill chunk's: 3 tokens, one block)
        decode = build_attention_metadata(np.ones(n, np.int32), seq_lens, tables[:n],
                                          block_size)
        general = build_attention_metadata(np.append(np.ones(n, np.int32), 3),
                                           np.append(seq_lens, 3), tables, block_size)
        assert torch.equal(decode.positions, general.positions[:n])
        assert torch.equal(decode.slot_mapping, general.slot_mapping[:n])
        assert len(decode.groups) == 1
        got, want = decode.groups[0], general.groups[0]
        for name, value in vars(want).items():
            if isinstance(value, torch.Tensor):
                mine = getattr(got, name)
                assert mine.dtype == value.dtype and torch.equal(mine, value), name
            else:
                assert getattr(got, name) == value, name
