#!/usr/bin/env bash
# The GPU check (docs/results.md): the Triton kernels against the reference and at HBM
# rate, the engine on NCCL against CPU/gloo, its streams' overlap and its host overhead, the
# engine under the CUDA sanitizer, and two ranks on two GPUs (when there are two), in under
# 10 minutes. Arguments go to scripts/gpu_check/run.py:
#   scripts/gpu_check.sh [--out DIR] [--quick] [--sections abcdefg] [--budget-s S]
# No set-up here: the GPU machine may have no network. PYTHON overrides the interpreter
# (default: the repository's .venv, which needs a CUDA build of torch and triton).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
# A bare name (PYTHON=python3) is looked up on the PATH.
if [[ "$PYTHON" != */* ]]; then PYTHON="$(command -v "$PYTHON" || echo "$PYTHON")"; fi
if [[ ! -x "$PYTHON" ]]; then
  echo "error: $PYTHON not found: run scripts/setup.sh first, or set PYTHON" >&2
  exit 2
fi
cd "$ROOT"
exec "$PYTHON" -m scripts.gpu_check.run "$@"
