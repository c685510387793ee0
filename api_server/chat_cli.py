"""`loom chat`: an interactive terminal chat with a running server (--url) or one it starts
(--model). It streams each answer, keeps the conversation, and reads a few commands: /reset,
/system TEXT, /quit. Ctrl-C stops the answer being written (the connection is closed, so the
server frees the request); Ctrl-D or /quit leaves.

Only the standard library: it must work in any installed Loom.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

HELP = "commands: /reset (forget the conversation), /system TEXT (set the system prompt), /quit"


def build_parser(sub) -> argparse.ArgumentParser:
    c = sub.add_parser("chat", help="chat with a model in the terminal",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = c.add_mutually_exclusive_group()
    where.add_argument("--url", default=None,
                       help="a running server, e.g. http://127.0.0.1:8000 (default, when "
                            "--model is not given)")
    where.add_argument("--model", default=None,
                       help="start `loom serve --model M` on a free loopback port for this chat")
    c.add_argument("--served-model", default=None,
                   help="the model id to ask; default: the first text model of /v1/models")
    c.add_argument("--api-key", default=None, help="default: LOOM_API_KEY")
    c.add_argument("--system", default="", help="system prompt")
    c.add_argument("--temperature", type=float, default=None)
    c.add_argument("--max-tokens", type=int, default=1024)
    c.add_argument("--serve-args", default="",
                   help="extra `loom serve` flags with --model, e.g. \"--num-threads 4\"")
    return c


class Client:
    def __init__(self, base_url: str, api_key: str | None) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        # A proxy from the environment must not see a loopback chat.
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def open(self, path: str, body: dict | None = None, timeout: float = 600.0):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, headers=self.headers)
        return self.opener.open(request, timeout=timeout)

    def text_model(self) -> str:
        with self.open("/v1/models", timeout=10) as response:
            models = json.load(response).get("data") or []
        for model in models:
            if model.get("task") != "speech":
                return model["id"]
        raise RuntimeError(f"{self.base_url}/v1/models lists no text model")

    def stream(self, body: dict):
        """The answer's text pieces as they arrive."""
        with self.open("/v1/chat/completions", body) as response:
            for raw in response:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if event.get("error"):
                    raise RuntimeError(event["error"].get("message", "error"))
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        yield piece


def error_text(exc: Exception) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        try:
            return f"{exc.code}: {json.load(exc)['error']['message']}"
        except (ValueError, KeyError, TypeError):
            return f"{exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return f"cannot reach the server: {exc.reason}"
    return str(exc)


def answer(client: Client, model: str, messages: list[dict], args) -> str:
    """Streams one answer to the terminal; Ctrl-C stops it (what came so far is kept)."""
    body = {"model": model, "messages": messages, "stream": True, "max_tokens": args.max_tokens}
    if args.temperature is not None:
        body["temperature"] = args.temperature
    text = []
    try:
        for piece in client.stream(body):
            text.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    except KeyboardInterrupt:
        # Leaving the `with` closed the connection: the server aborts the request.
        sys.stdout.write("\n[stopped]\n")
    sys.stdout.flush()
    return "".join(text)


def chat(client: Client, model: str, args) -> int:
    system = args.system
    messages: list[dict] = []
    print(f"loom chat with {model} at {client.base_url}; {HELP}; Ctrl-C stops an answer, "
          f"Ctrl-D leaves", flush=True)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        if not line.strip():
            continue
        if line.strip() in ("/quit", "/exit", "/bye"):
            return 0
        if line.strip() == "/reset":
            messages.clear()
            print("(conversation forgotten)", flush=True)
            continue
        if line.startswith("/system"):
            system = line[len("/system"):].strip()
            print(f"(system prompt {'set' if system else 'cleared'})", flush=True)
            continue
        if line.startswith("/"):
            print(f"unknown command; {HELP}", flush=True)
            continue
        messages.append({"role": "user", "content": line})
        prompt = ([{"role": "system", "content": system}] if system else []) + messages
        try:
            reply = answer(client, model, prompt, args)
        except Exception as exc:  # noqa: BLE001 - one line, then the next question
            messages.pop()
            print(f"error: {error_text(exc)}", flush=True)
            continue
        messages.append({"role": "assistant", "content": reply})


def start_server(args) -> tuple[subprocess.Popen, str, str]:
    """`loom serve --model M` on a free loopback port; (process, base URL, log path)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.NamedTemporaryFile("w", prefix="loom-chat-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "api_server.cli", "serve", "--model", args.model,
           "--host", "127.0.0.1", "--port", str(port), *args.serve_args.split()]
    print(f"starting loom serve --model {args.model} (log: {log.name}) ...", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    started = note = time.monotonic()
    while proc.poll() is None:
        try:
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                    base + "/health", timeout=2) as response:
                if response.status == 200:
                    return proc, base, log.name
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
        if time.monotonic() - note >= 5:
            note = time.monotonic()
            print(f"  still starting ({note - started:.0f}s)", flush=True)
    with open(log.name, errors="replace") as f:
        tail = f.read()[-2000:]
    raise RuntimeError(f"loom serve exited with {proc.returncode}:\n{tail}")


def main(args) -> int:
    api_key = args.api_key or os.environ.get("LOOM_API_KEY")
    proc = None
    try:
        if args.model is not None:
            proc, base, _ = start_server(args)
        else:
            base = args.url or "http://127.0.0.1:8000"
        client = Client(base, api_key)
        model = args.served_model or client.text_model()
        return chat(client, model, args)
    except (RuntimeError, urllib.error.URLError, OSError) as exc:
        print(f"loom chat: error: {error_text(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
