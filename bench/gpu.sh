#!/usr/bin/env bash
# On one CUDA GPU, in under 8 minutes: the cuda-marked tests (inductor, CUDA graphs with
# padded buckets, async checks, bf16, training, a small HF decoder generating), then the
# side-by-side benches (eager, torch.compile, safe_compile) with inductor's default mode
# and with mode="reduce-overhead" (CUDA graphs). Prints one summary at the end.
#
#   bench/gpu.sh                 # from the repository root, the project's venv active
#   PYTHON=.venv/bin/python bench/gpu.sh
#
# Each step has its own time limit (the three add up to 8 min): a step that runs out
# is reported as such, and the script goes on. Each test runs in a pytest process of its
# own, so one that crashes the interpreter (a segfault in a kernel launch) is reported as
# crashed and the others still run. Logs go to $OUT (or a temp dir).
set -u -f  # -f: test ids hold brackets, never globs
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

each_test() {  # every cuda test in its own process; one line per test: "RESULT rc id"
    local id rc bad=0
    for id in $("$PYTHON" -m pytest -q --collect-only -m cuda -p no:cacheprovider tests/test_cuda.py | grep '::'); do
        "$PYTHON" -m pytest -q -m cuda -p no:cacheprovider "$id"
        rc=$?
        echo "RESULT $rc $id"
        [ "$rc" -eq 0 ] || bad=1
    done
    return $bad
}
step tests 300 bash -c "PYTHON='$PYTHON'; set -f; $(declare -f each_test); each_test"
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
echo "tests, one process each:"
while read -r _ rc id; do
    case $rc in
        0) verdict=passed ;;
        5) verdict="not run (deselected)" ;;
        1) verdict=FAILED ;;
        13[0-9]) verdict="CRASHED (signal $((rc - 128)))" ;;
        *) verdict="exit $rc" ;;
    esac
    printf '  %-10s %s\n' "$verdict" "$id"
done < <(grep '^RESULT ' "$LOGS/tests.log")
grep -E '^(FAILED|ERROR)' "$LOGS/tests.log" | head -10
for bench in bench-default bench-reduce-overhead; do
    echo
    echo "$bench:"
    grep -E '^\|' "$LOGS/$bench.log" || tail -5 "$LOGS/$bench.log"
done
echo
echo "total $(( $(date +%s) - started )) s; logs in $LOGS"
