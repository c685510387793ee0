#!/usr/bin/env bash
# bench/gpu_check.sh: the GPU worker on a real GPU, in one run of at most ~7 minutes (a lent
# GPU machine has PyTorch, Triton and transformers; the rest travels as wheels in .whl/, the
# SmolLM2 tokenizer in .gpu/tokenizer/, both made by bench/gpu_prepare.sh; results: docs/performance.md).
#
#   OUT=/tmp/gpu-check bash bench/gpu_check.sh          # every stage: $OUT/gpu-check.tgz
#   STAGES="steps serve_graphs" bash bench/gpu_check.sh  # some of them (models are rebuilt)
#
# Stages, each with a time limit, its log in $OUT/<stage>.log and a line in $OUT/summary.txt;
# a stage whose limit no longer fits the budget ($BUDGET seconds in all) is skipped:
#   models        two random Llama checkpoints from configs (bench/gpu_models.py)
#   tests         tests/test_cuda.py on the small one (transformers on the same GPU as oracle)
#   steps         decode step vs the weights' read time, graphs on/off, transformers'
#                 sequential generate() (bench/gpu_steps.py), on the 1B-shaped one
#   serve_graphs  `loom serve --device cuda` under bench.run at c=1/16/64
#   serve_eager   the same with --enforce-eager
#   serve_tokens_N  serve_graphs with a step budget of N tokens (--max-num-batched-tokens N)
set -u
RESULT=${OUT:-/tmp/gpu-check}  # gets one archive of everything (a device run returns few files)
OUT=/tmp/gpu-check-work
BUDGET=${BUDGET:-400}
STAGES=${STAGES:-tests steps serve_graphs serve_eager}
PY=${PYTHON:-python3}
MODELS=${MODELS:-/tmp/gpu-models}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s)

stage() {  # stage NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 started rc
    shift 2
    if [ $(( $(date +%s) - T0 + limit )) -gt "$BUDGET" ]; then
        echo "$name skipped: ${limit}s does not fit the budget" | tee -a "$OUT/summary.txt"
        return 1
    fi
    echo "== $name (limit ${limit}s)"
    started=$(date +%s)
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $(( $(date +%s) - started ))s" | tee -a "$OUT/summary.txt"
    tail -n "${TAIL:-12}" "$OUT/$name.log"
    [ $rc -ne 0 ] && grep -E "^(E  |FAILED|ERROR|Traceback)" "$OUT/$name.log" | head -n 40
    return $rc
}

# Into the machine's Python itself (it is given back after the run): the tests' servers
# start with PYTHONPATH set to the checkout alone.
if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        .whl/*.whl > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem \
    --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda',
torch.version.cuda, 'transformers', transformers.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/gpu.txt"

stage models 90 $PY -m bench.gpu_models .gpu/tokenizer "$MODELS" || exit 1
SERVE="--device cuda --no-speech --max-model-len 2048"
LOAD=(--model-dir "$MODELS/llama-1b" --dtype bfloat16 --concurrency 1 16 64 --skip-ceiling
      --skip-baseline --prompt-len 256 --output-len 128 --requests-per-client 2
      --ttft-pairs 0 --retries 0)
for s in $STAGES; do
    case $s in
    tests) stage tests 150 env LOOM_CUDA_MODEL_DIR="$MODELS/small" \
        $PY -m pytest -q -p no:cacheprovider -rf tests/test_cuda.py ;;
    steps) stage steps 100 $PY -m bench.gpu_steps "$MODELS/llama-1b" --out "$OUT/steps.json" ;;
    serve_graphs) stage serve_graphs 110 $PY -m bench.run "${LOAD[@]}" --serve-args "$SERVE" \
        --out "$OUT/serve_graphs.json" ;;
    serve_eager) stage serve_eager 90 $PY -m bench.run "${LOAD[@]}" \
        --serve-args "$SERVE --enforce-eager" --out "$OUT/serve_eager.json" ;;
    serve_tokens_*) stage "$s" 90 $PY -m bench.run "${LOAD[@]}" --serve-args \
        "$SERVE --max-num-batched-tokens ${s#serve_tokens_}" --out "$OUT/$s.json" ;;
    esac
done
cp -f /tmp/loom-test-server-*.log "$OUT/" 2>/dev/null
mkdir -p "$RESULT"
tar czf "$RESULT/gpu-check.tgz" -C "$OUT" .
echo "== summary ($(( $(date +%s) - T0 ))s)"
cat "$OUT/summary.txt"
