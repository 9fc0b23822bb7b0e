#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite on CPU, the real-model tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q -p no:cacheprovider "$@"
