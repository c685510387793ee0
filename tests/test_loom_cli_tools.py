"""`loom chat` through a pseudo-terminal and `loom bench` against a running server: the
shared tiny server of the client tests (conftest.client_server)."""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import signal
import sys
import time

import httpx
import pytest

from tests.helpers import ROOT, child_pids, wait_gone

pexpect = pytest.importorskip("pexpect")


def loom(*args: str, timeout: float = 60):
    return terminal(sys.executable, ["-m", "api_server.cli", *args], timeout)


def terminal(program: str, args: list[str], timeout: float):
    # A terminal's program starts with Ctrl-C's default action, as a shell gives it, whatever
    # pytest inherited (a background job of a non-interactive shell ignores SIGINT, and an
    # ignored signal stays ignored across exec).
    return pexpect.spawn(program, args, cwd=ROOT,
                         env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin", "TERM": "dumb",
                              "NO_PROXY": "*"},
                         encoding="utf-8", timeout=timeout, dimensions=(40, 200),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(server.url + "/metrics").text
    pattern = re.escape(name) + r"\{[^}]*" + re.escape(labels) + r"[^}]*\}\s+(\S+)"
    return sum(float(v) for v in re.findall(pattern, text))


def prompt_tokens_of(server, chat, line: str) -> int:
    """Sends `line`, waits for the whole answer; the prompt tokens the server read for it."""
    name = "loom:request_prompt_tokens_sum"  # (recorded as each request finishes)
    before = metric(server, name)
    chat.sendline(line)
    chat.expect(">>> ", timeout=120)
    deadline = time.monotonic() + 10
    while metric(server, name) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(metric(server, name) - before)


def test_loom_chat_keeps_the_conversation_and_resets(client_server):
    srv = client_server
    chat = loom("chat", "--url", srv.url, "--temperature", "0", "--max-tokens", "64")
    try:
        chat.expect("loom chat with tiny")
        chat.expect(">>> ")
        first = prompt_tokens_of(srv, chat, "Hello")
        assert chat.before.split("\n", 1)[1].strip()  # the answer, after the echoed line
        # The conversation is kept: the next question's prompt holds the first turn.
        assert prompt_tokens_of(srv, chat, "Hello") > 2 * first - 5
        # After /reset the same question is the same prompt as the very first.
        chat.sendline("/reset")
        chat.expect(r"\(conversation forgotten\)")
        chat.expect(">>> ")
        assert prompt_tokens_of(srv, chat, "Hello") == first
        chat.sendline("/reset")
        chat.expect(">>> ")
        chat.sendline("/system Be brief.")
        chat.expect(r"\(system prompt set\)")
        chat.expect(">>> ")
        # (SmolLM2's template has a long default system prompt: "Be brief." replaces it.)
        assert prompt_tokens_of(srv, chat, "Hello") not in (0, first)
        chat.sendline("/quit")
        chat.expect(pexpect.EOF)
    finally:
        chat.close(force=True)
    assert chat.exitstatus == 0, chat.before


def test_loom_chat_ctrl_c_stops_the_answer_on_the_server(client_server):
    srv = client_server
    chat = loom("chat", "--url", srv.url, "--max-tokens", "960")
    try:
        chat.expect(">>> ")
        aborted = metric(srv, "loom:request_success_total", 'finished_reason="abort"')
        chat.sendline("Tell me a long story")
        chat.expect("Tell me a long story\r\n")  # (the terminal's echo of the line)
        chat.expect(r"\S{3}")  # the answer has begun
        chat.sendintr()
        chat.expect(r"\[stopped\]")
        chat.expect(">>> ")
        # The connection closed, so the server aborted the request (not run to its length).
        deadline = time.monotonic() + 30
        while metric(srv, "loom:request_success_total", 'finished_reason="abort"') == aborted:
            assert time.monotonic() < deadline, "the server did not abort the stopped answer"
            time.sleep(0.1)
        # The chat goes on.
        chat.sendline("/reset")
        chat.expect(r"\(conversation forgotten\)")
        chat.sendeof()
        chat.expect(pexpect.EOF)
    finally:
        chat.close(force=True)
    assert chat.exitstatus == 0, chat.before


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = child_pids(todo.pop())
        found += kids
        todo += kids
    return found


def test_loom_chat_with_a_model_starts_its_server_and_stops_it(tiny_model_dir):
    """`loom chat --model M`: the server it starts answers, and leaves with the chat (its
    API, scheduler and worker processes all gone). Run from a shell that outlives the chat,
    as in a terminal: were the chat the terminal's session leader, its exit would hang the
    server up whatever the chat did."""
    chat_cmd = shlex.join([sys.executable, "-m", "api_server.cli", "chat", "--model",
                           tiny_model_dir, "--max-tokens", "16",
                           "--serve-args", "--num-threads 1 --no-speech"])
    shell = terminal("/bin/sh", ["-c", f'{chat_cmd}; echo "chat exited $?"; sleep 60'], 180)
    try:
        shell.expect("starting loom serve --model ")
        shell.expect("loom chat with ")
        shell.expect(">>> ")
        processes = descendants(shell.pid)
        assert len(processes) >= 4, processes  # the chat, loom serve, its scheduler, worker
        shell.sendline("Hello")
        shell.expect("Hello\r\n")  # (the terminal's echo of the line)
        shell.expect(r"\S{3}")  # the answer, as it streams
        shell.expect(">>> ")
        shell.sendline("/quit")
        shell.expect("chat exited 0")
        assert wait_gone(processes, timeout=40), \
            [p for p in processes if os.path.exists(f"/proc/{p}")]
    finally:
        shell.close(force=True)


def test_loom_bench_writes_json_and_plots_matching_its_table(client_server, tmp_path):
    out = tmp_path / "results"
    bench = loom("bench", "--url", client_server.url, "--prompt-len", "16", "--output-len", "8",
                 "--concurrency", "1", "2", "--out", str(out), timeout=300)
    bench.expect(pexpect.EOF)
    bench.close()
    text = bench.before
    assert bench.exitstatus == 0, text
    (result,) = glob.glob(str(out / "*.json"))
    stem = result[:-len(".json")]
    for png in (stem + ".png", stem + "-latency.png"):
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", png
    with open(result) as f:
        results = json.load(f)
    assert results["server"]["model"] == "tiny"
    assert isinstance(results["config"]["prompt_seed"], int)  # (repeats the run: --prompt-seed)
    assert set(results["server"]["samples"]) == {"1", "2"}
    rows = {int(cells[1]): cells for line in text.splitlines()
            if (cells := line.split()) and cells[0] == "loom" and cells[1].isdigit()}
    assert set(rows) == {1, 2}, text
    for c, cells in rows.items():
        level = results["server"]["levels"][str(c)]
        assert level["completed"] == int(cells[9]) >= 4 and level["failed"] == int(cells[10]) == 0
        assert float(cells[2]) == round(level["output_tok_s"], 1)
        assert float(cells[3]) == round(level["requests_s"], 2)
        for cell, key in zip(cells[4:9], ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
                                          "e2e_p50_s")):
            assert float(cell) == round(level[key] * 1e3, 1), key
        assert len(results["server"]["samples"][str(c)]["ttft_s"]) == level["completed"]
