"""The soak test's request mix: what each request asks for, how it is sent, how it is checked.

Every request is drawn from its own generator, seeded with (seed, phase, index), so a run is
reproducible and any single request can be rebuilt from its index. The mix (fractions are of
all requests):

- route: 70 % /v1/completions, 30 % /v1/chat/completions; 60 % streamed;
- prompt: 72 % short (5-32 tokens), 21 % medium (33-160), 7 % long (161-1,000), 60 % of the
  long ones a shared prefix (one of 8 fixed "documents" of 300-825 tokens) plus a unique
  tail, so the prefix cache is exercised (and its reference counts, with cancellations in
  the mix); completion prompts are token-id lists (60 %) or text, chat prompts text;
- output: max_tokens 1-8 (80 %), 9-40 (17 %), 41-200 (3 %); 20 % of the completions without
  stop strings set ignore_eos, so they run to max_tokens;

The mix is skewed to short requests so that 10,000 of them take about half an hour on a
2-core CPU with SmolLM2-135M (decode there is ~70-150 tok/s at concurrency 16, prefill
~700-900 tok/s), while the long prompts and outputs still come by the hundreds.
- sampling: temperature 0 or 1 (half each) with a seed (all of temperature 1, half of 0);
  25 % have one or two stop strings; 3 % ask for n=2;
- cancellation: 10 % are abandoned by the client: a stream is closed after a random number of
  events (0 = right after the response headers), a non-streamed request times out after a
  random 0.02-1.5 s (one that answers before that is an ordinary, checked, completion).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bench.prompts import HIGH_ID, LOW_ID

WORDS = (
    "the of and to in is was for on that with as by at from his her which this be had are "
    "not have one but were they all their there been has when who will more no if out so "
    "said what up its about into than them can only other new some could time these two may "
    "then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get "
    "here between both life being under never day same another know while last might us "
    "great old year off come since against go came right used take three house river city "
    "morning light water stone garden winter letter window music story engine market table "
    "question answer number system power field center night road friend mother father child "
    "quickly slowly quietly carefully suddenly finally almost always often perhaps"
).split()
QUESTIONS = [
    "Summarize the text above in one sentence.", "What is the main idea?",
    "Write a short poem about it.", "List three facts from the text.",
    "Explain this to a child.", "Continue the story.", "What happens next?",
    "Translate the first sentence into French.", "Give it a title.",
    "Is there anything strange about this text?",
]
STOP_STRINGS = [".", "\n", " the", ",", "!", "?", " and", "\n\n", "The", " a "]
SHARED_PREFIXES = 8
DOCUMENT_SEED = 777


@dataclass
class Spec:
    phase: str
    index: int
    route: str  # "completions" | "chat"
    stream: bool
    prompt_kind: str  # "ids" | "text" | "shared-ids" | "shared-text"
    size: str  # "short" | "medium" | "long"
    max_tokens: int
    temperature: float
    seed: int | None
    stop: list[str] | None
    ignore_eos: bool
    n: int
    # None, ("close", events) for a stream, ("timeout", seconds) for a non-streamed request.
    cancel: tuple | None
    prompt_ids: list[int] | None = None  # completions with a token-id prompt
    prompt_text: str | None = None  # completions with a text prompt
    messages: list[dict] | None = None  # chat
    body: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return f"{self.route}/{'stream' if self.stream else 'plain'}"

    @property
    def path(self) -> str:
        return "/v1/completions" if self.route == "completions" else "/v1/chat/completions"


def _words(rng: np.random.Generator, count: int) -> str:
    """About `count` tokens of English-looking text, in sentences."""
    words = rng.choice(WORDS, size=max(1, count)).tolist()
    out, sentence = [], 0
    for word in words:
        sentence += 1
        out.append(word.capitalize() if sentence == 1 else word)
        if sentence >= 6 and rng.random() < 0.15:
            out[-1] += "."
            sentence = 0
    return " ".join(out)


def shared_document_ids(k: int) -> list[int]:
    rng = np.random.default_rng([DOCUMENT_SEED, k])
    return rng.integers(LOW_ID, HIGH_ID, size=300 + 75 * k).tolist()  # 300-825 tokens


def shared_document_text(k: int) -> str:
    rng = np.random.default_rng([DOCUMENT_SEED, 1000 + k])
    return _words(rng, 280 + 70 * k)


def _prompt_len(rng: np.random.Generator) -> tuple[str, int]:
    r = rng.random()
    if r < 0.72:
        return "short", int(rng.integers(5, 33))
    if r < 0.93:
        return "medium", int(rng.integers(33, 161))
    return "long", int(rng.integers(161, 1001))


def _max_tokens(rng: np.random.Generator) -> int:
    r = rng.random()
    if r < 0.80:
        return int(rng.integers(1, 9))
    if r < 0.97:
        return int(rng.integers(9, 41))
    return int(rng.integers(41, 201))


def make_spec(seed: int, phase: str, index: int, model: str,
              cancel_fraction: float = 0.10) -> Spec:
    phase_key = {"warmup": 1, "load": 2}.get(phase, 3)
    rng = np.random.default_rng([seed, phase_key, index])
    route = "completions" if rng.random() < 0.70 else "chat"
    stream = bool(rng.random() < 0.60)
    size, length = _prompt_len(rng)
    shared = size == "long" and rng.random() < 0.6
    max_tokens = _max_tokens(rng)
    temperature = 0.0 if rng.random() < 0.5 else 1.0
    seed_value = int(rng.integers(0, 2**31)) if temperature > 0 or rng.random() < 0.5 else None
    stop = None
    if rng.random() < 0.25:
        stop = rng.choice(STOP_STRINGS, size=int(rng.integers(1, 3)), replace=False).tolist()
    n = 2 if rng.random() < 0.03 else 1
    cancel = None
    if rng.random() < cancel_fraction:
        if stream:
            cancel = ("close", int(rng.integers(0, max(2, max_tokens // 2 + 2))))
        else:
            cancel = ("timeout", round(float(rng.uniform(0.02, 1.5)), 3))
    spec = Spec(phase=phase, index=index, route=route, stream=stream, prompt_kind="",
                size=size, max_tokens=max_tokens, temperature=temperature, seed=seed_value,
                stop=stop, ignore_eos=False, n=n, cancel=cancel)
    if route == "completions":
        spec.ignore_eos = stop is None and rng.random() < 0.20
        as_ids = rng.random() < 0.60
        if shared:
            k = int(rng.integers(0, SHARED_PREFIXES))
            tail = int(rng.integers(5, 61))
            if as_ids:
                spec.prompt_kind = "shared-ids"
                spec.prompt_ids = shared_document_ids(k) + rng.integers(
                    LOW_ID, HIGH_ID, size=tail).tolist()
            else:
                spec.prompt_kind = "shared-text"
                spec.prompt_text = shared_document_text(k) + "\n\n" + _words(rng, tail)
        elif as_ids:
            spec.prompt_kind = "ids"
            spec.prompt_ids = rng.integers(LOW_ID, HIGH_ID, size=length).tolist()
        else:
            spec.prompt_kind = "text"
            spec.prompt_text = _words(rng, length)
    else:
        question = QUESTIONS[int(rng.integers(0, len(QUESTIONS)))]
        messages = []
        if shared:
            spec.prompt_kind = "shared-text"
            k = int(rng.integers(0, SHARED_PREFIXES))
            messages.append({"role": "system", "content": shared_document_text(k)})
            messages.append({"role": "user", "content": _words(rng, int(rng.integers(5, 40)))
                             + " " + question})
        else:
            spec.prompt_kind = "text"
            if rng.random() < 0.3:
                messages.append({"role": "system", "content": "You are a helpful assistant."})
            if length > 120 and rng.random() < 0.4:  # a conversation, not one message
                half = length // 2
                messages.append({"role": "user", "content": _words(rng, half)})
                messages.append({"role": "assistant", "content": _words(rng, half // 2)})
                messages.append({"role": "user", "content": question})
            else:
                messages.append({"role": "user", "content": _words(rng, max(1, length - 20))
                                 + " " + question})
        spec.messages = messages
    spec.body = build_body(spec, model)
    return spec


def build_body(spec: Spec, model: str) -> dict:
    body: dict = {"model": model, "max_tokens": spec.max_tokens, "temperature": spec.temperature,
                  "stream": spec.stream}
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.seed is not None:
        body["seed"] = spec.seed
    if spec.stop:
        body["stop"] = spec.stop if len(spec.stop) > 1 else spec.stop[0]
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.n > 1:
        body["n"] = spec.n
    if spec.route == "completions":
        body["prompt"] = spec.prompt_ids if spec.prompt_ids is not None else spec.prompt_text
    else:
        body["messages"] = spec.messages
    return body


def kv_touch_spec(seed: int, index: int, model: str, length: int) -> Spec:
    """A long unique token-id prompt with max_tokens=1: enough of them hand every KV block out
    once, so the worker's KV cache mapping is resident before RSS is measured."""
    rng = np.random.default_rng([seed, 4, index])
    spec = Spec(phase="kv-touch", index=index, route="completions", stream=False,
                prompt_kind="ids", size="long", max_tokens=1, temperature=0.0, seed=None,
                stop=None, ignore_eos=True, n=1, cancel=None,
                prompt_ids=rng.integers(LOW_ID, HIGH_ID, size=length).tolist())
    spec.body = build_body(spec, model)
    return spec


def check_result(spec: Spec, texts: dict[int, str], finish: dict[int, str | None],
                 usage: dict | None) -> str | None:
    """The first thing wrong with a completed response, or None. Only what the API promises:
    one finish_reason per choice ("stop" or "length"), usage within max_tokens, stop strings
    never in the output, ignore_eos running to max_tokens, token-id prompts counted exactly."""
    for i in range(spec.n):
        reason = finish.get(i)
        if reason not in ("stop", "length"):
            return f"choice {i}: finish_reason {reason!r}"
        if spec.stop:
            for s in spec.stop:
                if s in texts.get(i, ""):
                    return f"stop string {s!r} in the output"
        if spec.ignore_eos and not spec.stop and reason != "length":
            return f"ignore_eos without stop strings but finish_reason {reason!r}"
    if len(finish) != spec.n:
        return f"{len(finish)} choices, expected {spec.n}"
    if usage is None:
        return "no usage"
    completion = usage.get("completion_tokens")
    if not isinstance(completion, int) or completion < 0 or completion > spec.n * spec.max_tokens:
        return (f"usage.completion_tokens {completion!r} with max_tokens {spec.max_tokens} "
                f"x n={spec.n}")
    if spec.n == 1 and finish.get(0) == "length" and completion != spec.max_tokens:
        return f"finish_reason length after {completion} of {spec.max_tokens} tokens"
    if spec.prompt_ids is not None and usage.get("prompt_tokens") != len(spec.prompt_ids):
        return f"usage.prompt_tokens {usage.get('prompt_tokens')!r} for {len(spec.prompt_ids)} ids"
    return None
