#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite on CPU, the real-model tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# Two workers (pytest-xdist): the suite is mostly single-threaded compiles and subprocesses, so a 2-core
# machine runs it in about half the time; real-model tests share one worker (see tests/conftest.py).
python -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-2}" --dist loadgroup --durations=25 "$@"
