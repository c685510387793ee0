"""Incremental detokenization and stop strings on the real SmolLM2 tokenizer."""

import pytest
from transformers import AutoTokenizer

from api_server.detokenizer import IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "Hello, world! How are you today?",
    "日本語のテキストと中文字符，还有한국어 문장도 있습니다。",
    "Emoji: 🚀🔥👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 mixed with ünïcödé ß æ ø å.",
    "def f(x):\n    return x ** 2  # ∑ ∫ √ ∞ ≠ ≤",
    "   leading spaces, tabs\tand\nnewlines\n\n",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("Say:"))
    pieces = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # never a half character on the wire


@pytest.mark.parametrize("chunk", [2, 3, 5])
def test_multi_token_pushes(tokenizer, chunk):
    text = TEXTS[2]
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    out = "".join(detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)) + detok.flush()
    assert out == text


def test_special_tokens_are_skipped(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("Hi there", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert "".join(detok.push([t]) for t in ids) + detok.flush() == "Hi there"


def feed(matcher, pieces):
    out = [matcher.push(p) for p in pieces]
    return out, "".join(out) + matcher.flush()


def test_stop_string_cut_and_never_leaked():
    m = StopStringMatcher(["STOP"])
    out, text = feed(m, ["abc S", "T", "OP and more"])
    assert text == "abc " and m.stopped
    assert out[0] == "abc " and out[1] == ""  # "S", "ST" held back until decided


def test_false_alarm_is_released():
    m = StopStringMatcher(["STOP"])
    out, text = feed(m, ["abc ST", "ART"])
    assert text == "abc START" and not m.stopped
    assert out == ["abc ", "START"]


def test_earliest_of_several_stops_wins():
    m = StopStringMatcher(["world", "o w"])
    _, text = feed(m, ["hello world"])
    assert text == "hell"


def test_no_stops_passes_through():
    m = StopStringMatcher([])
    assert feed(m, ["a", "b"])[1] == "ab"
