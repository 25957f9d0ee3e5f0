#!/usr/bin/env bash
# `make test`'s stages, in order: the first that fails stops the run. Each prints its time,
# and the run ends with a table of them. BIN: the venv's bin folder (make passes it).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
declare -a done_stages=()

stage() {
    local name=$1
    shift
    local started=$SECONDS
    echo "::: stage $name: $*"
    "$@"
    local rc=$?
    local took=$((SECONDS - started))
    done_stages+=("$(printf '%-12s %5d s  %s' "$name" "$took" "$([ $rc = 0 ] && echo passed || echo "FAILED (exit $rc)")")")
    echo "::: stage $name: $([ $rc = 0 ] && echo passed || echo FAILED) in ${took} s"
    if [ $rc != 0 ]; then
        printf '::: %s\n' "${done_stages[@]}"
        echo "::: stopped at stage $name"
        exit $rc
    fi
}

stage lint make --no-print-directory lint
stage unit "$BIN/python" -m pytest tests/unit
stage integration "$BIN/python" -m pytest tests/integration
stage e2e "$BIN/python" -m pytest tests/e2e
printf '::: %s\n' "${done_stages[@]}"
echo "::: all stages passed in ${SECONDS} s"
