import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.helpers import make_tiny_checkpoint  # noqa: E402


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
