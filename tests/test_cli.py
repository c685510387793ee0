"""The command line: documented flags, one-line start-up errors, dying children."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, pid_alive, start_server, wait_gone

LOOM = [sys.executable, "-m", "api_server.cli"]
ENV = dict(os.environ, PYTHONPATH=ROOT)


def run(*args, timeout=60):
    return subprocess.run(LOOM + list(args), capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=ENV)


def test_help_documents_every_flag():
    out = run("serve", "--help").stdout
    for flag in ("--host", "--port", "--model", "--max-num-seqs", "--max-num-batched-tokens",
                 "--kv-cache-memory", "--log-level", "--dtype", "--max-model-len",
                 "--served-model-name", "--block-size", "--no-prefix-caching",
                 "--allow-unauthenticated"):
        assert flag in out


def test_readme_flag_table_and_help_agree():
    """Each row of README.md's configuration table names flags in its first column (in
    backticks); every one of them is a flag of `loom serve --help`, and every setting with a
    flag is in some row under at least one of its spellings."""
    import re

    from pipelines.config import PipelineConfig
    from pipelines.flags import flag_names, setting_fields

    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    table = readme.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `-")]
    documented = {flag for row in rows for flag in re.findall(r"`(-[-a-z0-9]+)`", row)}
    helped = set(re.findall(r"(?<![\w-])(--?[a-z][-a-z0-9]*)", run("serve", "--help").stdout))
    assert documented and documented <= helped, documented - helped
    undocumented = [name for name, _, _, flag in setting_fields(PipelineConfig)
                    if flag is not None
                    and not documented & {*flag_names(name, flag), *flag.negations}]
    assert not undocumented, undocumented


def test_max_and_vllm_spellings_land_on_the_same_setting(tiny_model_dir):
    import msgspec

    from api_server.cli import build_parser, serve_config_from_args

    def config(*flags):
        args = build_parser().parse_args(["serve", "--model", tiny_model_dir, *flags])
        return serve_config_from_args(args)

    pairs = [(["--max-batch-size", "3"], ["--max-num-seqs", "3"]),
             (["--max-length", "100"], ["--max-model-len", "100"]),
             (["--max-batch-input-tokens", "50"], ["--max-num-batched-tokens", "50"]),
             (["--kv-cache-page-size", "8"], ["--block-size", "8"]),
             (["--devices", "gpu:1"], ["--device", "cuda:1"]),
             (["--quantization-encoding", "int8"], ["--quantization", "int8"]),
             (["--device-memory-utilization", "0.5"], ["--gpu-memory-utilization", "0.5"]),
             (["--no-enable-prefix-caching"], ["--no-prefix-caching"]),
             (["--model-path", "/elsewhere"], ["--model", "/elsewhere"]),
             (["--prompt-lookup-max", "6"], ["--ngram-prompt-lookup-max", "6"]),
             (["--prompt-lookup-min", "1"], ["--ngram-prompt-lookup-min", "1"]),
             (["--num-speculative-tokens", "3", "--suffix-decoding-min-token-prob", "0.5"],
              ["--speculative-config", '{"num_speculative_tokens": 3, '
                                       '"suffix_decoding_min_token_prob": 0.5}'])]
    default = config()
    for max_flags, vllm_flags in pairs:
        assert config(*max_flags) == config(*vllm_flags) != default, max_flags
    cfg = config("--enforce-eager", "--max-num-seqs", "3", "--no-speech")
    assert (cfg.device_config.cuda_graphs, cfg.max_batch_size,
            cfg.speech_config.enable_speech) == (False, 3, False)
    # (What every process is handed: it travels as msgpack as well.)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(cfg), type=type(cfg)) == cfg


def test_sampling_defaults_are_bounded_like_a_requests(tiny_model_dir):
    r = run("serve", "--model", tiny_model_dir, "--top-p", "0", timeout=30)
    assert r.returncode == 1 and r.stderr.startswith("loom: error: --top-p: Expected")
    assert r.stderr.count("\n") == 1


def test_speculative_decoding_settings_are_checked(tiny_model_dir, tmp_path, capsys):
    """Its settings are checked; ngram, suffix and draft are served (not with tensor
    parallelism), a draft in either spelling; a draft whose tokenizer differs from the
    served model's is refused at start-up with one clear line."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from api_server.cli import build_parser, main, serve_configs_from_args
    from pipelines.config import PipelineConfig
    from tests.helpers import make_tiny_checkpoint

    draft = '{"method": "draft_model", "model": "%s"}' % tiny_model_dir
    for flags in (["--speculative-method", "ngram"],
                  ["--speculative-method", "suffix", "--num-speculative-tokens", "8"],
                  ["--speculative-config", '{"method": "suffix"}']):
        assert main(["serve", "--model", tiny_model_dir, *flags, "-tp", "2"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("loom: error: --speculative-method with --tensor-parallel-size")
    for flags in (["--speculative-method", "draft", "--draft-model-path", tiny_model_dir],
                  ["--speculative-config", draft],  # (vLLM's spelling)
                  ["--speculative-config", '{"method": "ngram"}', "--speculative-method",
                   "draft", "--draft-model-path", tiny_model_dir]):  # (the flag wins)
        args = build_parser().parse_args(["serve", "--model", tiny_model_dir, *flags])
        spec = serve_configs_from_args(args)[0].speculative_config
        assert (spec.speculative_method, spec.draft_model_path) == ("draft", tiny_model_dir)
    words = tmp_path / "words"
    words.mkdir()
    vocab = {f"w{i}": i for i in range(63)} | {"[UNK]": 63}
    Tokenizer(WordLevel(vocab, unk_token="[UNK]")).save(str(words / "tokenizer.json"))
    other = make_tiny_checkpoint(str(tmp_path / "other"), str(words), vocab_size=64,
                                 bos_token_id=0, eos_token_id=1, pad_token_id=1)
    capsys.readouterr()  # (the checkpoint's progress bar)
    assert main(["serve", "--model", tiny_model_dir, "--speculative-method", "draft",
                 "--draft-model-path", other]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"loom: error: --draft-model-path {other}: its tokenizer differs "
                          f"from the served model's (64 tokens against 49152")
    assert err.count("\n") == 1
    for config, problem in (('{"method": "eagle"}', "method eagle: not ngram, suffix"),
                            ('{"n": 3}', "n: not among the fields"),
                            ('{"num_speculative_tokens": "3"}',
                             "got `str` - at `$.num_speculative_tokens`"),
                            ("ngram", "not a JSON object")):
        with pytest.raises(SystemExit):
            main(["serve", "--speculative-config", config])
        assert problem in capsys.readouterr().err
    for flags, problem in ((["--speculative-method", "draft"], "--draft-model-path"),
                           (["--prompt-lookup-min", "5"], "--prompt-lookup-min"),
                           (["--num-speculative-tokens", "0"], "--num-speculative-tokens")):
        assert main(["serve", "--model", tiny_model_dir, *flags]) == 1
        assert problem in capsys.readouterr().err
    # (vLLM's rule: suffix decoding proposes up to its tree's depth unless told.)
    suffix = PipelineConfig().replace(speculative_method="suffix")
    assert suffix.speculative_config.num_draft_tokens == 24
    assert PipelineConfig().speculative_config.num_draft_tokens == 5
    assert suffix.replace(num_speculative_tokens=3).speculative_config.num_draft_tokens == 3


def test_network_facing_host_needs_an_api_key(tiny_model_dir):
    env = {k: v for k, v in ENV.items() if k != "LOOM_API_KEY"}
    started = time.monotonic()
    r = subprocess.run(LOOM + ["serve", "--model", tiny_model_dir, "--host", "0.0.0.0",
                               "--port", "0"], capture_output=True, text=True, timeout=30,
                       cwd=ROOT, env=env)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("loom: error: --host 0.0.0.0") and r.stderr.count("\n") == 1
    assert "--api-key" in r.stderr and "--allow-unauthenticated" in r.stderr
    assert time.monotonic() - started < 15  # refused before any model is loaded


def test_which_hosts_count_as_loopback():
    import msgspec

    from api_server.launcher import StartupError, check_exposure, is_loopback
    from pipelines.config import ServerConfig

    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "10.0.0.5", "192.168.1.1", "example.com",
                 "::ffff:1.2.3.4"):
        assert not is_loopback(host), host
    cfg = ServerConfig(host="0.0.0.0")
    with pytest.raises(StartupError):
        check_exposure(cfg)
    for allowed in (dict(api_key="k"), dict(allow_unauthenticated=True), dict(host="::1")):
        check_exposure(msgspec.structs.replace(cfg, **allowed))


def test_wrong_model_path_is_one_clear_line(tmp_path):
    r = run("serve", "--model", str(tmp_path / "missing"), timeout=30)
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "no such directory" in r.stderr


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    r = run("serve", "--model", str(tmp_path), timeout=30)
    assert r.returncode == 1 and "unsupported architecture" in r.stderr
    assert "Traceback" not in r.stderr


def test_port_in_use(tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        started = time.monotonic()
        r = run("serve", "--model", tiny_model_dir, "--port", str(port), timeout=30)
    assert r.returncode == 1 and "cannot listen" in r.stderr
    assert time.monotonic() - started < 15
    assert "Traceback" not in r.stderr


def test_too_little_kv_cache_memory(tiny_model_dir):
    r = run("serve", "--model", tiny_model_dir, "--kv-cache-memory", "1KiB", timeout=60)
    assert r.returncode == 1 and "KV cache" in r.stderr
    assert "Traceback" not in r.stderr


def test_dead_worker_makes_the_server_exit_nonzero(tiny_model_dir):
    srv = start_server(tiny_model_dir)
    # Kill the worker (the child that owns the model): the server must notice and exit.
    os.kill(_worker_pid(srv.children), signal.SIGKILL)
    code = srv.proc.wait(timeout=20)
    assert code != 0
    assert "died" in srv.log()
    assert wait_gone(srv.children)


def _worker_pid(children):
    """The worker is the child with the most memory (it holds the weights)."""
    def rss(pid):
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1])
    return max((p for p in children if pid_alive(p)), key=rss)
