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

# DeepSpeed compiles its C++ ops on first use (FusedAdam's CPU kernel, the shared-memory
# collectives its CPU backend loads): about 150 CPU-seconds that would otherwise land in
# whichever test or run comes first. They are built here, once per environment, as
# DS_BUILD_* would at install; a build that fails only warns: the first use then builds, or
# reports, as before. The folder is the environment's own (TORCH_EXTENSIONS_DIR, which
# scripts/test.sh sets the same way) unless the caller names one: a build records the paths
# of the environment it was made for, and two checkouts sharing ~/.cache/torch_extensions
# would rebuild each other's ops at every switch, inside whatever runs first.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"
prebuild_deepspeed_ops() {
  local ops="$TORCH_EXTENSIONS_DIR"
  if [ -f "$ops/fused_adam/fused_adam.so" ] \
      && [ -f "$ops/deepspeed_shm_comm/deepspeed_shm_comm.so" ]; then
    return 0
  fi
  echo "[setup] building DeepSpeed's ops for this machine (once, a few minutes)"
  "$PY" - <<'PY' || echo "[setup] warning: DeepSpeed's ops were not built; their first use will try"
import deepspeed.ops
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.op_builder import FusedAdamBuilder

FusedAdamBuilder().load(verbose=False)
shm = get_accelerator().create_op_builder("ShareMemCommBuilder")  # as deepspeed.comm loads it
if shm is not None and deepspeed.ops.__compatible_ops__.get(shm.NAME, False):
    shm.load(verbose=False)
PY
}

stamp="$VENV/.zeropp-installed"
want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$PY" -c "import deepspeed, tiktoken, transformers, zeropp" >/dev/null 2>&1; then
  prebuild_deepspeed_ops
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
prebuild_deepspeed_ops
echo "[setup] done ($VENV)"
