#!/usr/bin/env bash
# The whole low-bandwidth lab, then the write-up (docs/lab.md, docs/img/*.png). Needs root.
#
#   sudo bash scripts/bench/run_all.sh
#
# 1. throughput of every system at three link rates (unlimited, 1gbit, 100mbit) on a
#    simulated 2 nodes x 2 ranks cluster (scripts/sim_cluster.sh, brought up and down by
#    run_lab for each rate);
# 2. convergence: ZeRO-3 vs ZeRO++ (int4 and int8 gradients), 300 iterations at 2 x 2;
# 3. the quantization-kernel micro-benchmark (bench_kernels, 16 MiB tensors);
# 4. report: tables and figures into docs/lab.md and docs/img/.
# Each step is a module of the scripts.bench package, run as `python -m scripts.bench.<name>`
# from the repository root.
#
# About 28 minutes on 2 otherwise idle cores: 100mbit ~9 min, 1gbit and unlimited ~4 min
# each, convergence ~10 min (3 x 300 iterations at ~0.6 s), kernels and report under a
# minute. Timings are only meaningful on a quiet machine; the JSON records the load average
# before and after each step. The cluster is taken down on any exit, also after an error or
# Ctrl-C.
#
# Knobs (environment): LAB_OUT (results directory, default cache/lab/<date>),
# LAB_SYSTEMS (comma list for run_lab), LAB_CONVERGENCE_ITERS (default 300),
# LAB_ITERS_UNLIMITED / LAB_ITERS_1GBIT / LAB_ITERS_100MBIT (timed iterations: 5 / 3 / 2).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
OUT="${LAB_OUT:-$ROOT/cache/lab/$(date -u +%Y%m%d-%H%M%S)}"
ALL_SYSTEMS="zero3,qwz,hpz,qgz,zeropp,fsdp2,fsdp2_hybrid,ds_zero3,ds_zero3_hpz,ds_zeropp"
SYSTEMS="${LAB_SYSTEMS:-$ALL_SYSTEMS}"
CONVERGENCE_ITERS="${LAB_CONVERGENCE_ITERS:-300}"

if [[ $EUID -ne 0 ]]; then
  echo "run_all.sh: needs root for the simulated cluster (network namespaces, tc); rerun" \
    "with sudo" >&2
  exit 2
fi
[[ -x "$PY" ]] || { echo "run_all.sh: $PY missing; run scripts/setup.sh first" >&2; exit 2; }

trap 'bash "$ROOT/scripts/sim_cluster.sh" down >/dev/null 2>&1 || true' EXIT
mkdir -p "$OUT"
# One thread per rank: four ranks already share the two cores.
export OMP_NUM_THREADS=1
started=$(date +%s)
stamp() { echo "[run_all] $(( $(date +%s) - started )) s: $*"; }

for rate_and_iters in "unlimited:${LAB_ITERS_UNLIMITED:-5}" "1gbit:${LAB_ITERS_1GBIT:-3}" \
  "100mbit:${LAB_ITERS_100MBIT:-2}"; do
  rate="${rate_and_iters%%:*}"
  iters="${rate_and_iters##*:}"
  stamp "throughput at $rate ($iters timed iterations per system)"
  "$PY" -m scripts.bench.run_lab --rate "$rate" --iters "$iters" --warmup 1 --nodes 2 \
    --ranks-per-node 2 --systems "$SYSTEMS" --out "$OUT/lab_$rate.json"
done

stamp "convergence ($CONVERGENCE_ITERS iterations per variant)"
"$PY" -m scripts.bench.convergence --train-iters "$CONVERGENCE_ITERS" --out "$OUT/convergence.json"

stamp "quantization kernels"
"$PY" -m scripts.bench.bench_kernels --sizes-mib 16 --out "$OUT/kernels.json"

stamp "report"
"$PY" -m scripts.bench.report "$OUT"/lab_*.json "$OUT/convergence.json" "$OUT/kernels.json" \
  --doc "$ROOT/docs/lab.md" --images "$ROOT/docs/img"
stamp "done; results in $OUT, write-up in docs/lab.md"
