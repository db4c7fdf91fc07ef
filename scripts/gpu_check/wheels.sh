#!/usr/bin/env bash
# The wheels the GPU session's side-by-side part installs there (the GPU machine has no
# network): DeepSpeed 0.19.8 and the pure-Python packages it needs that the machine's image
# lacks, into .whl_ds/ (ignored by git), for the image's Python (3.12, x86_64 Linux).
#
#   bash scripts/gpu_check/wheels.sh [DIR]          (DIR default: .whl_ds)
#
# then carry DIR with the working tree and run
#   OUT=$OUT WHEELS=.whl_ds bash scripts/gpu_check/session.sh check graph train side
# (scripts/gpu_check/side_by_side.py's docstring says what the image already has).
# Needs a package registry and scripts/setup.sh's environment (DeepSpeed's build imports
# torch). The versions are those setup.sh installs here, so both sides run the same code.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DIR="${1:-$ROOT/.whl_ds}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
TARGET_PYTHON=3.12
if [[ ! -x "$PYTHON" ]]; then
  echo "error: $PYTHON not found: run scripts/setup.sh first, or set PYTHON" >&2
  exit 2
fi
version_of() {  # the installed version of a distribution, or an error naming it
  "$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" \
    2>/dev/null || { echo "error: $1 is not installed in $PYTHON's environment" >&2; exit 2; }
}
# (Each version is assigned first: a failed lookup inside a larger word would not stop
# the script under set -e.)
deepspeed_version=$(version_of deepspeed)
pins=()
for dist in hjson pydantic pydantic_core annotated-types typing-inspection typing_extensions; do
  version=$(version_of "$dist")
  pins+=("$dist==$version")
done
mkdir -p "$DIR"
# DeepSpeed is built from its source distribution with no ops (they are JIT-built on the
# GPU machine if used; the side by side uses torch's AdamW): a pure-Python wheel.
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" \
  "deepspeed==$deepspeed_version"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET_PYTHON" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$DIR" "${pins[@]}"
ls -1 "$DIR"
du -sh "$DIR"
