#!/usr/bin/env bash
# Set up (idempotent), then run the test suite; the 15 slowest tests are listed at the end.
# Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$ROOT/.venv/bin/python" -m pytest --durations=15 "$@"
