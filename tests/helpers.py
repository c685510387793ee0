"""Test helpers: tiny checkpoints built from a config, and `loom serve` as a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def make_tiny_checkpoint(target: str, tokenizer_dir: str, architecture: str = "llama",
                         seed: int = 0, **overrides) -> str:
    """A small randomly initialised (seeded) checkpoint with the real SmolLM2 tokenizer."""
    import torch
    import transformers

    common = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[architecture]
    if architecture == "qwen3":
        common.setdefault("head_dim", 16)
    config = config_cls(**common)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    if architecture in ("qwen2",):  # HF initialises biases to zero: make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    return save_with_tokenizer(model, target, tokenizer_dir)


def save_with_tokenizer(model, target: str, tokenizer_dir: str) -> str:
    """`model` saved as a checkpoint directory with the tokenizer files of `tokenizer_dir`."""
    os.makedirs(target, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.exists(src):
            shutil.copy(src, target)
    return target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            kids.append(int(entry))
    return kids


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float = 10.0) -> bool:
    """True once none of `pids` is alive (children may take a moment to notice)."""
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@dataclass
class LoomServer:
    proc: subprocess.Popen
    port: int
    log_path: str
    children: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in self.children) and time.monotonic() < deadline:
            time.sleep(0.1)
        return code


def start_server(model_dir: str | None, *args: str, timeout: float = 180.0,
                 log_path: str | None = None, threads: int | None = None,
                 speech: bool = False) -> LoomServer:
    """`loom serve` on a free loopback port. Tiny test models run on one thread: their ops
    are too small to split, and a second thread only adds barrier waits. The voice is only
    loaded for the tests that speak (it costs every other server 2 s and 200 MB)."""
    port = free_port()
    if threads is None:
        threads = 2 if model_dir is None or "SmolLM2" in model_dir else 1
    cmd = [sys.executable, "-m", "api_server.cli", "serve", "--port", str(port),
           "--num-threads", str(threads)]
    if model_dir is not None:
        cmd += ["--model", model_dir]
    cmd += list(args)
    if not speech:
        cmd.append("--no-speech")
    log_path = log_path or f"/tmp/loom-test-server-{port}.log"
    log = open(log_path, "w")
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    server = LoomServer(proc, port, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"loom serve exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 200:
                server.children = child_pids(proc.pid)
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"loom serve did not become healthy:\n{server.log()}")


def hf_greedy(model, tokenizer, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f)


def check_windows(runner) -> list[int]:
    """Make `runner.next_token` assert that each context's window (start_idx..active_idx)
    is exactly what the step feeds it: its positions, and its tokens (a FUTURE_TOKEN
    placeholder: the token the runner sampled last for it, unless it has ended). Returns
    the count of steps checked, kept current."""
    import numpy as np

    if hasattr(runner.next_token, "checked"):
        return runner.next_token.checked
    checked = [0]
    run = runner.next_token

    def next_token(step, contexts):
        starts = np.cumsum(step.query_lens) - step.query_lens
        for i, ctx in enumerate(contexts):
            q, s, first = int(step.query_lens[i]), int(step.seq_lens[i]), int(starts[i])
            assert (ctx.start_idx, ctx.active_idx) == (s - q, s), (ctx.request_id, i)
            fed, window = step.input_ids[first : first + q], ctx.tokens[s - q : s]
            real = fed >= 0
            assert (window[real] == fed[real]).all()
            state = runner.requests.get(ctx.request_id)  # (None: new in this step)
            if not real.all() and not ctx.is_done and state and state.output_tokens:
                assert window[-1] == state.output_tokens[-1]
        checked[0] += 1
        return run(step, contexts)

    next_token.checked = checked
    runner.next_token = next_token
    return checked
