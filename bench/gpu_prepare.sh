#!/usr/bin/env bash
# bench/gpu_prepare.sh: on the development machine, what bench/gpu_check.sh needs to travel to
# a lent GPU machine (which has PyTorch, Triton and transformers, and no network):
#   .whl/           Loom's other dependencies as CPython 3.12 manylinux wheels (~12 MB)
#   .gpu/tokenizer/ the default model's tokenizer (the checkpoints are built there)
# Both are kept out of git (.git/info/exclude); pass them as the device run's `carry`.
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || printf '/.whl/\n/.gpu/\n' >> .git/info/exclude
PLATFORMS=""
for p in manylinux_2_17 manylinux_2_24 manylinux_2_26 manylinux_2_27 manylinux_2_28 \
         manylinux_2_31 manylinux_2_34 manylinux2014 manylinux1; do
    PLATFORMS="$PLATFORMS --platform ${p}_x86_64"
done
# The versions this checkout's venv runs (pip freeze), for the packages the GPU image lacks.
# (transformers, tokenizers and huggingface_hub stay the image's: both sides of the oracle
# tests use the same one there.)
for name in pyzmq msgspec msgpack-numpy starlette uvicorn httptools llguidance jsonschema \
            jsonschema-specifications referencing rpds-py openai jiter distro pydantic \
            pydantic_core annotated-types typing-inspection sniffio gguf httpx2 httpcore2 \
            truststore typing_extensions anyio; do
    version=$($PY -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$version" ] || { echo "skip $name (not installed here)"; continue; }
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp $PLATFORMS -d .whl "$name==$version"
done
mkdir -p .gpu/tokenizer
MODEL=$($PY -c "from pipelines.checkpoint.default_model import ensure_default_model as m; print(m())")
for f in tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json; do
    [ -f "$MODEL/$f" ] && cp "$MODEL/$f" .gpu/tokenizer/
done
du -sh .whl .gpu
