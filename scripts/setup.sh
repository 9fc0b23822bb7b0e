#!/usr/bin/env bash
# Create .venv and install gemma-tpu with everything the tests and the demo need (CPU).
# torch is pinned to the CPU build first: an unpinned install would pull several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,serve,embedded]"
python -c "import jax, tunix, qwix, transformers; print('setup ok: jax', jax.__version__, 'transformers', transformers.__version__)"
