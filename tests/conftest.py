import os
import sys

import pytest

# Triton reads TRITON_INTERPRET as it is imported, and some libraries import it early (diffusers
# does): without a GPU, the kernel tests run Triton's interpreter from the session's start.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _one_certificate_bundle() -> str:
    """A CA bundle of one certificate (certifi's first), in a directory removed at exit."""
    import atexit
    import shutil
    import tempfile

    import certifi

    with open(certifi.where()) as f:
        bundle = f.read()
    end = "-----END CERTIFICATE-----"
    first = bundle[bundle.index("-----BEGIN CERTIFICATE-----"):bundle.index(end) + len(end)]
    directory = tempfile.mkdtemp(prefix="loom-tests-ca-")
    atexit.register(shutil.rmtree, directory, True)
    path = os.path.join(directory, "ca.pem")
    with open(path, "w") as f:
        f.write(first + "\n")
    return path


# No test talks TLS (every server is on loopback, plain HTTP), yet each httpx client, and so
# each OpenAI, Anthropic or LiteLLM client, loads a whole CA bundle as it is created (certifi's
# or the system's that SSL_CERT_FILE names): 34 ms a client, about a thousand a run (30 s).
# With a bundle of one certificate that is ~1 ms. (Servers the tests start inherit it too:
# they make no TLS connection either.)
os.environ["SSL_CERT_FILE"] = _one_certificate_bundle()

from tests.helpers import make_tiny_checkpoint  # noqa: E402


def pytest_collection_finish(session):
    """Freeze what collection built (every test module's imports: torch, transformers,
    diffusers, litellm, the client libraries... a million objects) out of the garbage
    collector's reach. Otherwise each full collection in this process walks all of it,
    0.5-0.9 s a time, dozens of times a run, and stalls whatever test is in flight (a
    latency probe counts the pause against the server)."""
    import gc

    gc.collect()
    gc.freeze()
    # And full collections a tenth as often: what tests keep (tokenizers' vocabularies of
    # 50k-260k strings, oracle models) still made 72 of them a run, 15 s in all. Younger
    # generations are collected as before.
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 100)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from pipelines.checkpoint.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_model_dir(smollm2_dir, tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-llama")), smollm2_dir)


@pytest.fixture(scope="session")
def untied_tiny_model_dir(smollm2_dir, tmp_path_factory) -> str:
    """The tiny model with untied embeddings: its greedy text varies (a tied random model
    repeats its last token), for tests that compare texts across APIs."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-untied")), smollm2_dir,
                                tie_word_embeddings=False)


@pytest.fixture(scope="session")
def idefics3_dir(smollm2_dir, tmp_path_factory) -> str:
    """A tiny Idefics3 (tests/tiny_idefics3.py), built once for the vision tests."""
    from tests.tiny_idefics3 import make_tiny_idefics3

    return make_tiny_idefics3(str(tmp_path_factory.mktemp("tiny-idefics3")), smollm2_dir)


@pytest.fixture(scope="session")
def gguf_oracle():
    """transformers loading the default GGUF file (dequantized to float32), the oracle of the
    tests that serve that file (tests/gguf_oracle.py's GGUFOracle). Loaded once."""
    from pipelines.checkpoint.default_model import find_gguf
    from tests.gguf_oracle import GGUFOracle

    return GGUFOracle(find_gguf())


@pytest.fixture(scope="session")
def gemma3_oracle():
    """transformers loading Gemma 3 270M's GGUF file (float32): the oracle of the modules
    that serve it, loaded once (~4 s)."""
    from pipelines.checkpoint.default_model import gemma3_gguf
    from tests.gguf_oracle import GGUFOracle

    return GGUFOracle(gemma3_gguf())




@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    """(model, tokenizer): transformers' float32 SmolLM2, the oracle of the tests that serve
    that model. Loaded once; tests only read it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, tok


@pytest.fixture(scope="session")
def shared_server():
    """`shared_server(model_dir, *flags)`: one `loom serve` per model and flags for the whole
    session, so modules that need the same server share its start (seconds each). Only for
    tests whose assertions hold whatever traffic the server has seen: a test that counts
    metrics from zero, kills a process or stops the server starts its own. Each must still
    exit cleanly at the end."""
    from tests.helpers import start_server

    servers = {}

    def get(model_dir, *flags, speech=False):
        key = (model_dir, flags, speech)
        if key not in servers:
            servers[key] = start_server(model_dir, *flags, speech=speech)
        return servers[key]

    yield get
    codes = {key: srv.stop() for key, srv in servers.items()}
    assert all(code == 0 for code in codes.values()), codes


@pytest.fixture(scope="session")
def chunked_server(shared_server, smollm2_dir):
    """SmolLM2 prefilled 6 tokens a step, with a cache of 8 blocks x 16 tokens that eight
    concurrent requests overflow (so they are preempted and recomputed): test_server_oracle's
    chunked prefill and preemption tests' and test_logprobs' chunked logprobs."""
    kv_bytes = 8 * 16 * 2 * 30 * 3 * 64 * 4  # blocks x tokens x (k, v) x layers x heads x dim
    return shared_server(smollm2_dir, "--max-num-batched-tokens", "6", "--max-model-len", "128",
                         "--kv-cache-memory", str(kv_bytes))


@pytest.fixture(scope="session")
def flux_dir() -> str:
    """A tiny random FLUX directory (tests/tiny_flux.py), built once and cached."""
    from tests.tiny_flux import cached_tiny_flux

    return cached_tiny_flux()


@pytest.fixture(scope="session")
def features_server(shared_server, untied_tiny_model_dir, flux_dir, tmp_path_factory):
    """The untied tiny model served as "tiny" with a 512-token context and the features whose
    tests need a flag of their own: Llama 3 JSON tool calls, `flux_dir` beside it as
    "tiny-flux" (images up to 512 pixels a side), and chat templates sent by requests rendered
    in the sandbox: tests/test_tool_parsers.py's, tests/test_images_api.py's and
    tests/test_hostile_requests.py's trusted templates."""
    named = tmp_path_factory.mktemp("images") / "tiny-flux"  # (its id: the directory's name)
    named.symlink_to(flux_dir)
    return shared_server(untied_tiny_model_dir, "--served-model-name", "tiny", "--max-model-len",
                         "512", "--tool-call-parser", "llama3_json", "--image-model",
                         str(named), "--max-image-size", "512", "--trust-request-chat-template")


@pytest.fixture(scope="session")
def lora_dir(tmp_path_factory) -> str:
    """The directory tiny_server loads LoRA adapters from (tests/test_lora.py writes them)."""
    return str(tmp_path_factory.mktemp("lora-adapters"))


@pytest.fixture(scope="session")
def tiny_server(shared_server, tiny_model_dir, lora_dir):
    """The tiny model served as "tiny", for every test that needs no other flag (and a
    limit of 3 parallel tool calls, which tests/test_client_openai.py checks; LoRA adapters
    from `lora_dir`, loaded at run time by tests/test_lora.py)."""
    return shared_server(tiny_model_dir, "--served-model-name", "tiny",
                         "--max-parallel-tool-calls", "3", "--enable-lora", "--lora-dir",
                         lora_dir, "--max-num-loras", "3", "--max-lora-rank", "8")


@pytest.fixture(scope="session")
def client_server(tiny_server):
    """The server the client-library tests (tests/test_client_*.py) drive, each through a
    library's own public API."""
    return tiny_server


UNTIED_KEY = "test-key"


@pytest.fixture(scope="session")
def untied_server(shared_server, untied_tiny_model_dir):
    """The untied tiny model served as "tiny" with a 512-token context behind the API key
    `UNTIED_KEY`, taking bodies up to 2 MiB: the Anthropic and Responses API tests'."""
    return shared_server(untied_tiny_model_dir, "--served-model-name", "tiny", "--max-model-len",
                         "512", "--api-key", UNTIED_KEY, "--max-request-bytes", "2MiB")


@pytest.fixture(scope="session")
def guarded_server(shared_server, tiny_model_dir):
    """The tiny model served as "tiny" with a 256-token context, greedy where a request leaves
    temperature out, and tight bounds (64 sequences a request, 2000 queued tokens, 3 s for a
    request's head, one allowed web origin): the tests of bad and hostile requests'."""
    return shared_server(tiny_model_dir, "--max-model-len", "256", "--served-model-name", "tiny",
                         "--temperature", "0", "--max-sequences-per-request", "64",
                         "--max-queued-tokens", "2000", "--header-timeout", "3",
                         "--allowed-origins", "https://app.example")


@pytest.fixture(scope="session")
def vision_media_dir(tmp_path_factory):
    """A directory whose "allowed" subdirectory is the one `vision_server` reads file:// URLs
    from; the vision modules put their images in it (and beside it, to be refused)."""
    root = tmp_path_factory.mktemp("vision-media")
    (root / "allowed").mkdir()
    return root


@pytest.fixture(scope="session")
def vision_server(shared_server, idefics3_dir, vision_media_dir):
    """The tiny Idefics3 served as "vlm", prefilled 16 tokens a step (so that chunks meet
    images), at most 2 images a prompt and 9M pixels a request, with the voice:
    tests/test_vision.py's, tests/test_vision_apis.py's and the web chat's."""
    return shared_server(idefics3_dir, "--served-model-name", "vlm", "--max-num-batched-tokens",
                         "16", "--limit-mm-per-prompt", "2", "--allowed-local-media-path",
                         str(vision_media_dir / "allowed"), "--max-request-image-pixels",
                         "9000000", speech=True)
