#!/usr/bin/env bash
# Create .venv and install gemma-tpu with everything the tests and the demo need (CPU).
# torch is pinned to the CPU build first: an unpinned install would pull several GB of CUDA wheels, and so would
# plain `torch==2.13.0` from PyPI (its Linux wheels are CUDA builds). `2.13.0+cpu` is the CPU build's own version:
# taken from wherever pip already finds it (a wheel directory in pip's config), else from PyTorch's CPU index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -m pip install -q "torch==2.13.0+cpu" 2>/dev/null; then
  python -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
    --extra-index-url https://pypi.org/simple
fi
python -m pip install -q -e ".[test,serve,embedded]"
python -c "import jax, tunix, qwix, transformers; print('setup ok: jax', jax.__version__, 'transformers', transformers.__version__)"
