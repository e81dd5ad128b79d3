#!/usr/bin/env bash
# The tests on other torch releases: by default the floor in pyproject.toml ("torch>=X.Y",
# its newest patch release) and the newest torch on the index.
#
#   scripts/torch_matrix.sh                      # floor and newest, the suite less -m inductor
#   scripts/torch_matrix.sh 2.11.0               # the versions named
#   TORCH_MATRIX_TESTS="tests/test_rollback.py tests/test_torchcompat.py" scripts/torch_matrix.sh
#
# Each version gets a venv of its own, /tmp/venv-torch<version>, holding torch and its own
# dependencies only; every other package (pytest, structlog, opentelemetry, ...) comes from
# the project's venv (.venv, or BASE_VENV) through a .pth file, which is never changed.
# Releases other than the pinned 2.13.0+cpu are CUDA builds (~4 GB with their nvidia-*
# packages) that run on CPU. The pip configuration may cap torch: PIP_CONSTRAINT naming an
# empty file lifts that cap for these installs only. Prints one summary line per version and
# exits non-zero if any version's run failed.
set -euo pipefail
cd "$(dirname "$0")/.."

base=${BASE_VENV:-.venv}
python="$base/bin/python"
shared=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
empty=$(mktemp)
trap 'rm -f "$empty"' EXIT

floor=$(sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml | head -n 1)
newest() {
  PIP_CONSTRAINT="$empty" "$python" -m pip index versions torch 2>/dev/null \
    | sed -n 's/^torch (\(.*\))$/\1/p'
}

if [ "$#" -gt 0 ]; then
  versions=("$@")
else
  versions=("$floor.*" "$(newest)")
fi
# shellcheck disable=SC2206 # a list of test paths, split on spaces
tests=(${TORCH_MATRIX_TESTS:-tests})

status=0
summary=()
for spec in "${versions[@]}"; do
  venv="/tmp/venv-torch${spec//\*/x}"
  if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
    PIP_CONSTRAINT="$empty" "$venv/bin/python" -m pip install -q "torch==$spec"
    echo "import site; site.addsitedir('$shared')" >"$(
      "$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
    )/zz_project_venv.pth"
  fi
  version=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
  log="/tmp/torch-matrix-$version.log"
  set +e
  PYTHONPATH="$PWD" "$venv/bin/python" -m pytest -q -m "not inductor" -p no:cacheprovider \
    "${tests[@]}" >"$log" 2>&1
  rc=$?
  set -e
  [ "$rc" -eq 0 ] || status=1
  summary+=("torch $version: $(tail -n 1 "$log") (exit $rc; log $log)")
done
printf '%s\n' "${summary[@]}"
exit "$status"
