#!/usr/bin/env bash
# The GPU checks of one device lease, most important first, each under its own time limit inside one budget, so
# that a lease of a few minutes returns every result it had time for. Run on the lent machine, from the repo root:
#
#     bash benchmarks/gpu/lease_checks.sh [BUDGET_SECONDS]      # default 540; logs and JSON land in $OUT
#
# Needs two folders carried beside the working tree (both ignored by git):
#   .whl/  wheels of the versions we pin that the machine's image lacks (transformers, peft, datasets, pydantic and
#          their missing needs; docs/DECISIONS.md, "On a lent GPU");
#   .dev/  base/ (models/base without model.safetensors: config and tokenizer), tokenized/ (data/tokenized) and
#          labels.json (data/splits/labels.json). The weights are random there (benchmarks/gpu/random_base.py): the
#          GGUF is over the carry limit, and speed does not depend on the values.
# Order: the GPU test suite (kernels built, verified, the kernels stage end to end), the throughput benchmark
# against the Trainer recipes, then the plan's prediction against the run it plans (benchmarks/plan_accuracy.py).
set -u
OUT=${OUT:-/tmp/lease_out}
mkdir -p "$OUT"
budget=${1:-540}
began=$SECONDS

step() {  # NAME MAX_SECONDS COMMAND...: run under min(MAX, what is left), log to $OUT/NAME.log
    local name=$1 max=$2 left
    shift 2
    left=$(( budget - (SECONDS - began) ))
    if (( left < 30 )); then echo "skipped $name: ${left} s left" | tee -a "$OUT/summary.txt"; return; fi
    (( max > left )) && max=$left
    local t0=$SECONDS
    timeout -k 15 "$max" "$@" > "$OUT/$name.log" 2>&1  # -k: the compiled A/B outlived its TERM there once
    echo "$name: rc=$? in $(( SECONDS - t0 )) s (limit $max)" | tee -a "$OUT/summary.txt"
    tail -n 30 "$OUT/$name.log"
}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheels did not install"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'peft', peft.__version__, 'cpus', __import__('os').cpu_count())"
} 2>&1 | tee "$OUT/summary.txt"
python3 benchmarks/gpu/random_base.py .dev/base --tokenized .dev/tokenized --labels .dev/labels.json \
    || { echo "random_base failed"; exit 1; }

step pytest_gpu 240 python3 -m pytest -m gpu tests/gpu -v -s -p no:cacheprovider
step throughput 180 python3 benchmarks/train_throughput.py --steps 60 --batch-size 16
cp reports/benchmarks/train_throughput.json "$OUT/" 2>/dev/null
step plan_accuracy 150 python3 benchmarks/plan_accuracy.py --methods lora --lengths 128 --steps 40
cp reports/plan_accuracy.md "$OUT/" 2>/dev/null
echo "total $(( SECONDS - began )) s" | tee -a "$OUT/summary.txt"
