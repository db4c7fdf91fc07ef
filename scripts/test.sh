#!/usr/bin/env bash
# Set up (idempotent), then run the test suite on two workers (pytest-xdist, a file per worker
# at a time; ZEROPP_TEST_WORKERS=0 runs it in one process); the 15 slowest tests are listed at
# the end. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$ROOT/.venv/bin/python" -m pytest -n "${ZEROPP_TEST_WORKERS:-2}" --dist loadfile \
  --durations=15 "$@"
