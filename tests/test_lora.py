"""LoRA adapters (PEFT format) over the tiny model, loaded through /v1/load_lora_adapter into
tiny_server (--enable-lora, --max-num-loras 3, --max-lora-rank 8): greedy tokens and log
probabilities equal transformers + peft for each adapter alone and in a batch mixing the base
model and three adapters (one prompt for all, so a prefix-cache block shared across adapters
would show); a fourth adapter evicts the least recently used; in-use adapters are not
unloaded; bad adapters get 400s and the server keeps serving. The same oracle on SmolLM2
itself, served with two adapters given at start (its own server: the last test)."""

import asyncio
import json
import os
import shutil

import httpx
import pytest
import torch

TOL = 2e-4
MAX_TOKENS = 8
# name: (rank, alpha, target modules)
ADAPTERS = {
    "alpha": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                      "down_proj"]),
    "beta": (4, 8, ["q_proj", "v_proj"]),
    "gamma": (2, 4, ["o_proj", "gate_proj", "up_proj", "down_proj"]),
    "delta": (6, 6, ["k_proj", "o_proj", "down_proj"]),
}


def make_adapter(base_dir: str, target: str, rank: int, alpha: int, modules: list[str],
                 seed: int) -> str:
    """A random PEFT LoRA adapter of the base model (lora_B too, so it changes the output)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules,
                                            init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)  # (peft's random B is small beside the tiny model's weights)
    peft.save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model's ops are too small to split: a second thread only waits on the
    other (10x slower on the shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, lora_dir, one_thread):
    """{name: directory} of the four adapters, written into the server's --lora-dir."""
    return {name: make_adapter(tiny_model_dir, os.path.join(lora_dir, name), *spec, seed=i)
            for i, (name, spec) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def server(tiny_server, adapters):
    """tiny_server with alpha, beta and gamma loaded; every adapter unloaded at the end
    (other modules share the server)."""
    for name in ("alpha", "beta", "gamma"):
        r = httpx.post(tiny_server.url + "/v1/load_lora_adapter",
                       json={"lora_name": name, "lora_path": adapters[name]})
        assert r.status_code == 200, r.text
    yield tiny_server
    for name in ADAPTERS:
        httpx.post(tiny_server.url + "/v1/unload_lora_adapter", json={"lora_name": name})


@pytest.fixture(scope="module")
def prompt_ids(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # (More than two 16-token KV blocks: the prefix cache would share them if keyed alike.)
    return tok("LoRA adapters let one base model serve many fine-tuned variants: each adds "
               "a low-rank update to some projections, and requests for different adapters "
               "share one batch.")["input_ids"]


def peft_greedy(base_dir: str, adapter_dir: str | None, prompt_ids: list[int]):
    """(greedy token ids, log_softmax rows of the steps) of transformers, with peft applying
    the adapter at `adapter_dir` (None: the base alone)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    ids, rows = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            rows.append(torch.log_softmax(logits, -1))
            ids.append(int(rows[-1].argmax()))
    return ids[len(prompt_ids):], rows


@pytest.fixture(scope="module")
def oracle(tiny_model_dir, adapters, prompt_ids):
    """name (None: the base) -> peft_greedy's answer."""
    return {name: peft_greedy(tiny_model_dir, adapters.get(name), prompt_ids)
            for name in [None, *ADAPTERS]}


async def complete(client, url, model, prompt_ids):
    r = await client.post(url + "/v1/completions", json={
        "model": model, "prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model  # (an adapter's answer names the adapter, as vLLM's)
    lp = r.json()["choices"][0]["logprobs"]
    return [int(t.removeprefix("token_id:")) for t in lp["tokens"]], lp["token_logprobs"]


def check(got, want, name):
    tokens, logprobs = got
    want_tokens, rows = want
    assert tokens == want_tokens, name
    for k, token in enumerate(tokens):
        assert abs(logprobs[k] - rows[k][token].item()) < TOL, (name, k)


def test_models_lists_adapters_with_their_base(server, adapters):
    models = httpx.get(server.url + "/v1/models").json()["data"]
    cards = {m["id"]: m for m in models}
    for name in ("alpha", "beta", "gamma"):
        assert cards[name]["parent"] == "tiny"
        assert cards[name]["root"] == os.path.realpath(adapters[name])
    assert httpx.get(server.url + "/v1/models/beta").json()["parent"] == "tiny"


def test_each_adapter_alone_matches_peft(server, oracle, prompt_ids):
    """One at a time, base first: an adapter's request after the base's (same prompt) must
    not reuse the base's KV blocks."""
    async def go():
        async with httpx.AsyncClient() as client:
            return [await complete(client, server.url, model, prompt_ids)
                    for model in ("tiny", "alpha", "beta", "gamma")]

    results = asyncio.run(go())
    for name, got in zip([None, "alpha", "beta", "gamma"], results):
        check(got, oracle[name], name)
    assert oracle["alpha"][0] != oracle[None][0] or \
        abs(results[1][1][0] - results[0][1][0]) > 1e-3  # (the adapters do change the model)


def test_every_api_names_the_adapter_that_answered(server):
    """Chat (whole and streamed), Responses and Anthropic Messages echo the requested
    adapter's name in `model`, as OpenAI clients and routers read it."""
    msgs = [{"role": "user", "content": "hi"}]
    chat = {"model": "beta", "messages": msgs, "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "beta"
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={**chat, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {"beta"}
    r = httpx.post(server.url + "/v1/responses", timeout=60,
                   json={"model": "beta", "input": "hi", "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "beta"
    r = httpx.post(server.url + "/v1/messages", timeout=60,
                   json={"model": "beta", "messages": msgs, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "beta"


def test_a_batch_mixing_base_and_three_adapters_matches_peft(server, oracle, prompt_ids):
    models = ["tiny", "alpha", "beta", "gamma"] * 2

    async def go():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(complete(client, server.url, m, prompt_ids)
                                          for m in models))

    for model, got in zip(models, asyncio.run(go())):
        check(got, oracle[None if model == "tiny" else model], model)


def test_an_adapter_loaded_at_run_time_is_used_and_evicts_the_oldest(server, adapters, oracle,
                                                                     prompt_ids):
    r = httpx.post(server.url + "/v1/load_lora_adapter",
                   json={"lora_name": "delta", "lora_path": adapters["delta"]})
    assert r.status_code == 200, r.text
    # Four adapters, three slots: delta takes the least recently used one; all still answer.
    async def go():
        async with httpx.AsyncClient() as client:
            return [await complete(client, server.url, m, prompt_ids)
                    for m in ("delta", "alpha", "beta", "gamma", "delta")]

    for model, got in zip(("delta", "alpha", "beta", "gamma", "delta"), asyncio.run(go())):
        check(got, oracle[model], model)


def test_lora_requests_info_shows_the_running_adapter(server, adapters, prompt_ids):
    def gauge():
        text = httpx.get(server.url + "/metrics").text
        return next(line for line in text.splitlines()
                    if line.startswith("vllm:lora_requests_info{"))

    with httpx.stream("POST", server.url + "/v1/completions", json={
            "model": "beta", "prompt": prompt_ids, "max_tokens": 200, "ignore_eos": True,
            "stream": True}, timeout=120) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        running = gauge()
        # Unloading an adapter a request runs is refused, and the request goes on.
        refused = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "beta"})
        for _ in lines:
            pass
    assert 'max_lora="3"' in running and 'running_lora_adapters="beta"' in running, running
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "lora_in_use"
    assert 'running_lora_adapters=""' in gauge()
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "beta"})
    assert r.status_code == 200
    assert httpx.post(server.url + "/v1/completions", json={
        "model": "beta", "prompt": "x", "max_tokens": 1}).status_code == 404
    r = httpx.post(server.url + "/v1/load_lora_adapter",
                   json={"lora_name": "beta", "lora_path": adapters["beta"]})
    assert r.status_code == 200, r.text


def bad_adapter(lora_dir, name, adapters, edit) -> str:
    """A copy of alpha with `edit(config dict, directory)` applied."""
    target = os.path.join(lora_dir, name)
    shutil.copytree(adapters["alpha"], target, dirs_exist_ok=True)
    with open(os.path.join(target, "adapter_config.json")) as f:
        config = json.load(f)
    edit(config, target)
    with open(os.path.join(target, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return target


def test_bad_adapters_get_400_and_the_server_keeps_serving(server, adapters, lora_dir,
                                                           tmp_path, prompt_ids):
    from safetensors.torch import save_file

    def wrong_shapes(config, target):
        save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                   torch.zeros(4, 32),
                   "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
                   torch.zeros(64, 4)}, os.path.join(target, "adapter_model.safetensors"))

    def rank_16(config, target):
        save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                   torch.zeros(16, 64),
                   "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
                   torch.zeros(64, 16)}, os.path.join(target, "adapter_model.safetensors"))

    def no_weights(config, target):
        os.remove(os.path.join(target, "adapter_model.safetensors"))

    cases = {
        "shapes": (bad_adapter(lora_dir, "bad-shapes", adapters, wrong_shapes),
                   "do not fit the base model"),
        "rank": (bad_adapter(lora_dir, "bad-rank", adapters, rank_16), "--max-lora-rank 8"),
        "missing": (bad_adapter(lora_dir, "bad-missing", adapters, no_weights),
                    "no adapter_model.safetensors"),
        "nothing": (os.path.join(lora_dir, "no-such-adapter"), "no such directory"),
        "outside": (shutil.copytree(adapters["alpha"], str(tmp_path / "elsewhere")),
                    "outside the directories"),
        "traversal": (os.path.join(lora_dir, "..", "elsewhere"), "outside the directories"),
    }
    for case, (path, message) in cases.items():
        r = httpx.post(server.url + "/v1/load_lora_adapter",
                       json={"lora_name": f"bad-{case}", "lora_path": path})
        assert r.status_code == 400, (case, r.text)
        error = r.json()["error"]
        assert message in error["message"] and error["param"] == "lora_path", (case, error)
    for body, param in [({"lora_name": "alpha", "lora_path": adapters["alpha"]}, "lora_name"),
                        ({"lora_name": "tiny", "lora_path": adapters["alpha"]}, "lora_name"),
                        ({"lora_path": adapters["alpha"]}, "lora_name")]:
        r = httpx.post(server.url + "/v1/load_lora_adapter", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 404
    models = {m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]}
    assert not any(m.startswith("bad-") for m in models)
    assert httpx.post(server.url + "/v1/completions", json={
        "model": "alpha", "prompt": prompt_ids, "max_tokens": 2}).status_code == 200


def test_lora_paths_flags_name_and_check_adapters(tiny_model_dir, adapters):
    """MAX's --lora-paths NAME=PATH ... and vLLM's --lora-modules, resolved by the CLI; a bad
    adapter stops the start with its reason."""
    from api_server.cli import StartupError, build_parser, serve_config_from_args

    def config(*flags):
        args = build_parser().parse_args(["serve", "--model", tiny_model_dir, *flags])
        return serve_config_from_args(args).lora_config

    lora = config("--enable-lora", "--lora-paths", f"a={adapters['alpha']}",
                  adapters["beta"], "--lora-modules", f"c={adapters['gamma']}",
                  "--max-lora-rank", "8")
    assert lora.lora_paths == (f"a={os.path.realpath(adapters['alpha'])}",
                               f"beta={os.path.realpath(adapters['beta'])}",
                               f"c={os.path.realpath(adapters['gamma'])}")
    with pytest.raises(StartupError, match="--max-lora-rank 4"):
        config("--enable-lora", "--lora-paths", adapters["alpha"], "--max-lora-rank", "4")
    with pytest.raises(StartupError, match="needs --enable-lora"):
        config("--lora-paths", adapters["alpha"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [5, 8])
def test_native_deltas_equal_pytorch_for_rows_of_mixed_adapters(dtype, rank):
    """worker/kernels/lora.c (the decode step's and the prefill hooks' deltas): each row with
    its own slot, in blocks of a few rows of one adapter, a fused projection's parts apart;
    base rows untouched. Widths that leave a vector and a scalar tail."""
    from worker.lora import _native_kernel, _Target

    kernel = _native_kernel(torch.device("cpu"), torch.float32)
    if kernel is None:
        pytest.skip("no C compiler: the PyTorch path runs")
    import ctypes

    torch.manual_seed(rank)
    shapes = {"q_proj": (24, 40), "k_proj": (8, 40), "v_proj": (13, 40)}
    target = _Target(tuple(shapes), shapes, 3, rank, dtype, torch.float32, torch.device("cpu"))
    for slot in range(3):
        a, b = target.zeros()
        for p in range(3):  # (block-diagonal b: part p's rank columns feed its outputs only)
            cols = slice(p * rank, (p + 1) * rank)
            a[:, cols] = torch.randn(40, rank)
            b[cols, target.out_offsets[p]:target.out_offsets[p + 1]] = torch.randn(
                rank, target.out_offsets[p + 1] - target.out_offsets[p])
        target.store(slot, a, b)
    row_slots = torch.randint(-1, 3, (23,), dtype=torch.int32)
    x, y = torch.randn(23, 40), torch.randn(23, 45)
    want = y.clone()
    for t, slot in enumerate(row_slots.tolist()):
        if slot >= 0:
            want[t] += (x[t] @ target.A_compute[slot]) @ target.B_compute[slot]
    assert kernel.loom_lora_add(ctypes.byref(target.native), row_slots.data_ptr(), 23,
                                x.data_ptr(), 40, y.data_ptr(), 45, 45, 40) == 0
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


# SmolLM2 itself (float32), two adapters of other ranks and targets given at start.
SMOLLM2_ADAPTERS = {"wide": (8, 16, ADAPTERS["alpha"][2]),
                    "attn": (4, 4, ["q_proj", "k_proj", "v_proj", "o_proj"])}


@pytest.fixture(scope="module")
def smollm2_lora(smollm2_dir, tmp_path_factory, one_thread):
    """(server, {name: adapter dir}): SmolLM2 served with SMOLLM2_ADAPTERS (--lora-paths)."""
    from tests.helpers import start_server

    root = tmp_path_factory.mktemp("smollm2-lora")
    dirs = {name: make_adapter(smollm2_dir, str(root / name), *spec, seed=20 + i)
            for i, (name, spec) in enumerate(SMOLLM2_ADAPTERS.items())}
    srv = start_server(smollm2_dir, "--enable-lora", "--max-lora-rank", "8", "--max-num-loras",
                       "2", "--lora-paths", *(f"{n}={d}" for n, d in dirs.items()))
    yield srv, dirs
    assert srv.stop() == 0


def test_smollm2_adapters_alone_and_mixed_with_the_base_match_peft(smollm2_lora, smollm2_dir):
    """The issue's oracle on the default model: each adapter alone, then a batch mixing the
    base and both adapters, greedy tokens and logprobs equal to transformers + peft."""
    from transformers import AutoTokenizer

    srv, dirs = smollm2_lora
    ids = AutoTokenizer.from_pretrained(smollm2_dir)(
        "Adapters change how a model answers: here is a short story about a lighthouse "
        "keeper who")["input_ids"]
    want = {name: peft_greedy(smollm2_dir, dirs.get(name), ids) for name in [None, *dirs]}
    assert want["wide"][0] != want[None][0]  # (the adapter does change the answer)
    model_name = next(card["id"] for card in httpx.get(srv.url + "/v1/models").json()["data"]
                      if not card.get("parent"))
    names = {model_name: None, "wide": "wide", "attn": "attn"}

    async def go():
        async with httpx.AsyncClient() as client:
            alone = [await complete(client, srv.url, m, ids) for m in names]
            mixed = await asyncio.gather(*(complete(client, srv.url, m, ids)
                                           for m in list(names) * 2))
            return alone, mixed

    alone, mixed = asyncio.run(go())
    for model, got in zip(list(names) + list(names) * 2, alone + mixed):
        check(got, want[names[model]], model)
