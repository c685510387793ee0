"""The PipelineModel interface (MAX's names) on its own: a prefill through
prepare_initial_token_inputs, then decode steps through prepare_next_token_inputs, give
transformers' logits and greedy tokens on the same weights; log probabilities are the raw
logits' log-softmax."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipelines.config import PipelineConfig
from pipelines.context import TextContext
from pipelines.pipeline import KVCacheMixin, ModelOutputs, PagedKVCacheManager, PipelineModel
from tests.helpers import make_tiny_checkpoint
from worker.model_runner import ModelRunner

BLOCK = 4


@pytest.fixture(scope="module")
def model_and_oracle(smollm2_dir, tmp_path_factory):
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("pm")), smollm2_dir, seed=3)
    runner = ModelRunner(PipelineConfig.for_model(path, kv_cache_page_size=BLOCK,
                                                  kv_cache_memory=8 << 20))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return runner, hf, AutoTokenizer.from_pretrained(path)


def _contexts(prompts: list[list[int]]) -> list[TextContext]:
    return [TextContext(tokens=np.array(p), max_length=64) for p in prompts]


def test_prefill_then_next_token_inputs_follow_transformers(model_and_oracle):
    runner, hf, tok = model_and_oracle
    model = runner.model
    assert isinstance(model, PipelineModel)
    prompts = [tok.encode("The quick brown fox"), tok.encode("In 1492, Columbus sailed the")]
    steps = 6
    # Each sequence gets enough blocks for its prompt and the decode steps, disjoint.
    per_seq = -(-(max(map(len, prompts)) + steps) // BLOCK)
    tables = np.arange(len(prompts) * per_seq, dtype=np.int32).reshape(len(prompts), per_seq)
    contexts = _contexts(prompts)
    with torch.inference_mode():
        kv = runner.kv_manager.fetch(contexts, tables)
        inputs = model.prepare_initial_token_inputs(contexts, kv_cache_inputs=kv,
                                                    return_n_logits=-1)
        outputs = model.execute(inputs)
        # Echo (every row's logits): each prompt token's log probability after the first.
        first = torch.tensor(tok.encode("x"))  # (any token: compared below for row 0 only)
        echo = model.compute_log_probabilities(inputs, outputs, first.expand(2), [2, 0],
                                               [True, False])
        want = torch.log_softmax(hf(torch.tensor([prompts[0]])).logits[0], dim=-1)
        assert echo[1] is None and len(echo[0].token_log_probabilities) == len(prompts[0])
        torch.testing.assert_close(
            torch.tensor(echo[0].token_log_probabilities[:-1]),
            want[torch.arange(len(prompts[0]) - 1), torch.tensor(prompts[0][1:])],
            atol=2e-4, rtol=1e-4)
        generated = [[] for _ in prompts]
        for _ in range(steps):
            tokens = outputs.next_token_logits.argmax(dim=-1)
            for g, t in zip(generated, tokens.tolist()):
                g.append(t)
            # The oracle's logits for the same next position.
            for i, p in enumerate(prompts):
                full = torch.tensor([p + generated[i][:-1]])
                expected = hf(full).logits[0, -1]
                torch.testing.assert_close(outputs.next_token_logits[i], expected,
                                           atol=2e-4, rtol=1e-4)
            logprobs = model.compute_log_probabilities(inputs, outputs, tokens, [0, 3],
                                                       [False, False])
            raw = torch.log_softmax(outputs.next_token_logits[1], dim=-1)
            assert logprobs[0] is None
            [chosen] = logprobs[1].token_log_probabilities
            assert chosen == pytest.approx(raw[tokens[1]].item(), abs=1e-5)
            assert list(logprobs[1].top_log_probabilities[0]) == raw.topk(3).indices.tolist()
            inputs = model.prepare_next_token_inputs(tokens, inputs)
            outputs = model.execute(inputs)
    for p, g in zip(prompts, generated):
        want = hf.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False)
        assert g == want[0, len(p):].tolist()


def test_next_token_inputs_refuse_a_missing_block(model_and_oracle):
    runner, _, tok = model_and_oracle
    prompt = tok.encode("abcd efgh")[:BLOCK]  # exactly one full block
    contexts = _contexts([prompt])
    with torch.inference_mode():
        kv = runner.kv_manager.fetch(contexts, np.array([[0, -1]], dtype=np.int32))
        inputs = runner.model.prepare_initial_token_inputs(contexts, kv_cache_inputs=kv)
        with pytest.raises(ValueError, match="KV block"):
            runner.model.prepare_next_token_inputs(torch.tensor([5]), inputs)


def test_kv_cache_sizing_is_the_mixins_one_path(model_and_oracle):
    """MAX's KVCacheMixin: the footprint is --kv-cache-memory's whole blocks, the estimate is
    in bytes (whole blocks of what it is given), and load_kv_manager allocates exactly that:
    what the runner holds."""
    runner, _, _ = model_and_oracle
    model = runner.model
    assert isinstance(model, KVCacheMixin)
    available = model.estimate_memory_footprint()
    size = model.estimate_kv_cache_size(available)
    assert 8 << 20 >= available > (8 << 20) - model.kv_block_bytes and size == available
    assert model.estimate_kv_cache_size(available + model.kv_block_bytes - 1) == size
    assert size == runner.kv_cache.numel() * runner.kv_cache.element_size()
    manager = model.load_kv_manager(torch.device("cpu"), size + model.kv_block_bytes - 1)
    assert isinstance(manager, PagedKVCacheManager) and manager.page_size == BLOCK
    cache = manager.cache
    assert cache.shape == runner.kv_cache.shape and cache.dtype == runner.kv_cache.dtype
    # (A GPU's footprint profiles the largest step through the contract: it runs here too.)
    model._profile_forward()


class OneAttentionLayer(PipelineModel):
    """The smallest model written against the contract: each token's q/k/v looked up in
    tables, one `attend`, its output as the logits."""

    HEADS, KV_HEADS, DIM = 4, 2, 8

    def __init__(self, pipeline_config, session, vocab: int = 50) -> None:
        super().__init__(pipeline_config, session)
        g = torch.Generator().manual_seed(0)
        self.q = torch.randn(vocab, self.HEADS, self.DIM, generator=g)
        self.k = torch.randn(vocab, self.KV_HEADS, self.DIM, generator=g)
        self.v = torch.randn(vocab, self.KV_HEADS, self.DIM, generator=g)

    def prepare_initial_token_inputs(self, context_batch, kv_cache_inputs=None,
                                     return_n_logits=1):
        ids = torch.from_numpy(np.concatenate([ctx.next_tokens for ctx in context_batch]))
        return SimpleNamespace(ids=ids, kv_cache_inputs=kv_cache_inputs)

    def prepare_next_token_inputs(self, next_tokens, prev_model_inputs):
        raise NotImplementedError

    def execute(self, model_inputs):
        ids, kv = model_inputs.ids, model_inputs.kv_cache_inputs
        out = kv.attend(0, self.q[ids], self.k[ids], self.v[ids]).flatten(1)
        last = torch.from_numpy(np.cumsum(kv.query_lens) - 1)
        return ModelOutputs(next_token_logits=out[last], logits=out)


def test_attend_is_causal_attention_over_chunks_in_the_paged_cache():
    """Two sequences fed in chunks of different sizes (then a decode token each), their
    blocks scattered in the cache: each step's rows equal plain causal attention (SDPA, GQA)
    over the whole sequence, and positions are each token's own."""
    m = OneAttentionLayer
    model = m(PipelineConfig(), torch.device("cpu"))
    cache = torch.zeros(1, 2, 12, BLOCK, m.KV_HEADS, m.DIM)
    manager = PagedKVCacheManager(cache, BLOCK)
    prompts = [np.arange(3, 14), np.array([7, 1, 9, 4, 4, 2])]
    tables = np.array([[6, 0, 9, 1], [4, 11, -1, -1]], np.int32)
    contexts = [TextContext(tokens=p, max_length=32) for p in prompts]
    windows = [[(0, 5), (0, 4)], [(5, 11), (4, 6)]]  # prompt chunks, then one decode each
    fed: list[list[torch.Tensor]] = [[], []]
    for step in range(3):
        if step < 2:
            for ctx, (start, active) in zip(contexts, windows[step]):
                ctx.set_token_indices(start_idx=start, active_idx=active)
        else:
            for ctx, token in zip(contexts, (21, 30)):
                ctx.update(token)
        kv = manager.fetch(contexts, tables)
        want_positions = np.concatenate([np.arange(c.start_idx, c.active_idx) for c in contexts])
        assert kv.positions.tolist() == want_positions.tolist()
        outputs = model.execute(model.prepare_initial_token_inputs(contexts, kv))
        rows = np.cumsum([0] + [c.active_idx - c.start_idx for c in contexts])
        for i, ctx in enumerate(contexts):
            fed[i].append(outputs.logits[rows[i] : rows[i + 1]])
            ids = torch.from_numpy(ctx.tokens[: ctx.active_idx])
            q, k, v = (t[ids].transpose(0, 1)[None] for t in (model.q, model.k, model.v))
            want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            want = want[0].transpose(0, 1).flatten(1)[ctx.start_idx : ctx.active_idx]
            torch.testing.assert_close(fed[i][-1], want, atol=1e-5, rtol=1e-5)
    assert [sum(len(r) for r in rows_) for rows_ in fed] == [12, 7]
