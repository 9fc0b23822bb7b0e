#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite on CPU, the real-model tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# Two workers (pytest-xdist): the suite is mostly single-threaded compiles and subprocesses, so a 2-core
# machine runs it in about half the time; real-model tests share one worker (see tests/conftest.py).
# One XLA compilation cache for this run, empty at its start (a user's own JAX_COMPILATION_CACHE_DIR is kept):
# the CLI tests start many processes that compile the same tiny programs (a subset ran in 588 s instead of 665 s,
# benchmarks/RESULTS.md "2026-11-25 (late morning)").
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  JAX_COMPILATION_CACHE_DIR=$(mktemp -d "${TMPDIR:-/tmp}/gemma-tpu-tests-xla.XXXXXX")
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
fi
export JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
# LLVM's optimization level 0 for XLA's CPU code (first, so a level in the user's own XLA_FLAGS wins): the tests'
# programs are tiny, their time is compiling, not running them. A tiny training run's CPU time fell ~27% (11.9 ->
# 8.7 s), the real 270M's tests rose ~7% (benchmarks/RESULTS.md "2026-11-29 (midday, CPU)"). Tests that start
# a child with its own XLA_FLAGS keep this flag through tests/conftest.py `xla_env`.
export XLA_FLAGS="--xla_backend_optimization_level=0${XLA_FLAGS:+ $XLA_FLAGS}"
# A crashed worker (an OOM kill) is not replaced: pytest-xdist 3.8 re-runs the test that killed it on each
# replacement under --dist loadgroup, and can then hang with every worker idle (pytest-xdist issues 1323, 1327,
# 1371; a suite run here stalled that way). Without a restart the crash fails the run: the crashed test is
# reported, the other worker goes on, the rest of the dead worker's share is not run.
python -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-2}" --dist loadgroup --max-worker-restart=0 \
  --durations=25 "$@"
