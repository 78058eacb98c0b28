#!/usr/bin/env bash
# The torch releases nbddp claims are the ones it is tested on: the core tests (tests/pool,
# tests/rank, tests/wire; the default tier, 2 workers) in a venv of each release.
#
#   bash scripts/torch_versions.sh                 # 2.13.0 2.14.1 2.15.0
#   bash scripts/torch_versions.sh 2.14.1          # one release
#
# Each venv is .venvs/torch-VERSION (kept: a second run installs nothing). On the project's
# machines 2.13.0 (CPU) and 2.14.1 (CUDA build, 5.5 GB) lie on disk, and pip's constraint
# file caps torch at 2.14.1: this script lifts it for its own pip calls (PIP_CONSTRAINT),
# so 2.15.0 comes from the registry (a CUDA build, about 3 GB of downloads; the tests run
# on the CPU). Prints a markdown table for docs/contributing.md; exits 1 if a release failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.13.0 2.14.1 2.15.0)
export PIP_CONSTRAINT=/dev/null  # (an empty value would leave the cap in place)
rows=()
failed=0
for v in "${versions[@]}"; do
    venv=.venvs/torch-$v
    log=.venvs/torch-$v.log
    mkdir -p .venvs
    if ! { [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"; } ||
        ! "$venv/bin/python" -m pip install -q "torch==$v" >"$log" 2>&1 ||
        ! "$venv/bin/python" -m pip install -q -e ".[test]" "torch==$v" >>"$log" 2>&1; then
        rows+=("| $v | could not be installed (see $log) | | |")
        failed=1
        continue
    fi
    start=$(date +%s)
    "$venv/bin/python" -m pytest -n 2 -q -p no:cacheprovider tests/pool tests/rank tests/wire \
        >>"$log" 2>&1
    rc=$?
    minutes=$(awk "BEGIN { printf \"%.1f\", ($(date +%s) - $start) / 60 }")
    summary=$(grep -E "(passed|failed|error).* in [0-9.]+s" "$log" | tail -1 | sed -E 's/^=+ | =+$//g; s/ in [0-9.]+s.*//')
    [ $rc = 0 ] || failed=1
    rows+=("| $v | $([ $rc = 0 ] && echo pass || echo FAIL) | ${summary:-no summary (see $log)} | $minutes |")
done
echo "| torch | result | pytest's summary | minutes |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
exit $failed
