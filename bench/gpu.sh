#!/usr/bin/env bash
# On one CUDA GPU, in under 8 minutes: the cuda-marked tests (inductor, CUDA graphs with
# padded buckets, async checks, bf16, training, a small HF decoder generating), then the
# side-by-side benches (eager, torch.compile, safe_compile) with inductor's default mode
# and with mode="reduce-overhead" (CUDA graphs). Prints one summary at the end.
#
#   bench/gpu.sh                 # from the repository root, the project's venv active
#   PYTHON=.venv/bin/python bench/gpu.sh
#
# Each step has its own time limit (the three add up to 7.5 min): a step that runs out
# is reported as such, and the script goes on. Logs go to $OUT (or a temp dir).
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
LOGS=${OUT:-$(mktemp -d)}
export PYTHONPATH=${PWD}${PYTHONPATH:+:$PYTHONPATH}
started=$(date +%s)

"$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' || {
    echo "bench/gpu.sh: no CUDA GPU visible to torch; nothing run" >&2
    exit 2
}
gpu=$("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(0), "| torch", torch.__version__)')

step() {  # step NAME SECONDS COMMAND...: run with a limit, keep its log and wall time
    local name=$1 limit=$2
    shift 2
    local t0=$(date +%s)
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    echo "$name $rc $(( $(date +%s) - t0 ))" >>"$LOGS/steps"
}
: >"$LOGS/steps"

step tests 270 "$PYTHON" -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py
step bench-default 90 "$PYTHON" bench/compare.py --device cuda --workloads mlp-32,block,gpt2 \
    --warmup 5 --rounds 9
step bench-reduce-overhead 90 "$PYTHON" bench/compare.py --device cuda --mode reduce-overhead \
    --workloads mlp-32,block,gpt2 --warmup 5 --rounds 9

echo
echo "=== safecompile on $gpu: summary ==="
while read -r name rc secs; do
    case $rc in
        0) verdict=ok ;;
        124) verdict="TIMED OUT" ;;
        *) verdict="FAILED (exit $rc)" ;;
    esac
    printf '%-22s %-18s %4ss\n' "$name" "$verdict" "$secs"
done <"$LOGS/steps"
echo
echo "tests: $(grep -E '(passed|failed|error)' "$LOGS/tests.log" | tail -1)"
grep -E '^(FAILED|ERROR)' "$LOGS/tests.log" | head -10
for bench in bench-default bench-reduce-overhead; do
    echo
    echo "$bench:"
    grep -E '^\|' "$LOGS/$bench.log" || tail -5 "$LOGS/$bench.log"
done
echo
echo "total $(( $(date +%s) - started )) s; logs in $LOGS"
