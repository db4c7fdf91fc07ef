#!/usr/bin/env bash
# Idempotent set-up: a .venv in the repository root with torch, then this project and its
# dependencies. A second run with everything present only checks and returns in seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ZEROPP_VENV:-$ROOT/.venv}"
PYTHON_BIN="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV"
  "$PYTHON_BIN" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check --no-input -q)

# torch first, and only when missing: a plain `pip install deepspeed` with no torch present
# resolves a multi-GB CUDA build. On a GPU machine the user's own CUDA torch is kept.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing torch==2.13.0 (CPU build)"
  "${PIP[@]}" install "torch==2.13.0"
fi

stamp="$VENV/.zeropp-installed"
want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$PY" -c "import deepspeed, tiktoken, transformers, zeropp" >/dev/null 2>&1; then
  echo "[setup] environment up to date ($VENV)"
  exit 0
fi

echo "[setup] installing the project and its dependencies"
"${PIP[@]}" install wheel setuptools ninja packaging psutil py-cpuinfo pydantic hjson numpy
# deepspeed's setup.py imports torch: build it against the torch already in the venv so pip
# does not pull a second (CUDA) torch into an isolated build environment.
if ! "$PY" -c "import deepspeed" >/dev/null 2>&1; then
  DS_BUILD_OPS=0 "${PIP[@]}" install --no-build-isolation "deepspeed>=0.16"
fi
"${PIP[@]}" install -e "$ROOT[dev]"
echo "$want" > "$stamp"
echo "[setup] done ($VENV)"
