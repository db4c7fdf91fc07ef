#!/usr/bin/env bash
# Set up (idempotent), then run the test suite on two workers (pytest-xdist, a file per worker
# at a time; ZEROPP_TEST_WORKERS=0 runs it in one process); the 15 slowest tests are listed at
# the end. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ZEROPP_VENV:-$ROOT/.venv}"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Bytecode caches for the project's own modules (ignored by git): the suite starts a few
# hundred Python processes, and without caches each compiled every module it imported again.
unset PYTHONDONTWRITEBYTECODE
# DeepSpeed's ops as setup.sh built them, in this environment's own folder
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"
exec "$VENV/bin/python" -m pytest -n "${ZEROPP_TEST_WORKERS:-2}" --dist loadfile --durations=15 "$@"
