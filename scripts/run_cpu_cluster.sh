#!/usr/bin/env bash
# The paper's program on this machine: 4 CPU ranks simulating 2 nodes x 2 ranks (gloo), a
# small GPT (configs/models/gpt_cpu_small.args) with all three ZeRO++ optimizations
# (configs/ds_zeropp_cpu2x2.json), on the tokenized sample corpus.
#
#   scripts/run_cpu_cluster.sh [extra flags...]     e.g. --train-iters 10
#
# Environment:
#   DRY_RUN=1     print the memory and communication plan of this 2 x 2 cluster and exit
#   PRINT_ONLY=1  print the command and exit
#   DATA_PATH     indexed dataset prefix (default cache/data/pile_sample_text_document,
#                 built by scripts/quickstart.sh)
#   DS_CONFIG     another DeepSpeed config (e.g. configs/ds_zero3_config.json for the baseline)
#   RUN_DIR       where the metrics file goes (default cache/runs/cpu_cluster)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
NODES=2
RANKS_PER_NODE=2
DATA_PATH="${DATA_PATH:-$ROOT/cache/data/pile_sample_text_document}"
DS_CONFIG="${DS_CONFIG:-$ROOT/configs/ds_zeropp_cpu2x2.json}"
RUN_DIR="${RUN_DIR:-$ROOT/cache/runs/cpu_cluster}"
# One thread per rank: four ranks already share the cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

FLAGS=()
for file in "$ROOT/configs/models/gpt_cpu_small.args" "$ROOT/configs/models/cpu_training.args"; do
  while IFS= read -r line || [ -n "$line" ]; do
    [[ "$line" =~ ^[[:space:]]*(#|$) ]] && continue
    read -ra words <<< "$line"
    FLAGS+=("${words[@]}")
  done < "$file"
done
FLAGS+=(--deepspeed --deepspeed_config "$DS_CONFIG" --data-path "$DATA_PATH"
        --metrics-file "$RUN_DIR/metrics.jsonl")

if [ "${DRY_RUN:-0}" = 1 ]; then
  # One process planning for the 2 x 2 cluster: the node size is a dry-run flag here.
  COMMAND=("$PYTHON" "$ROOT/pretrain_zeropp_gpt.py" "${FLAGS[@]}" "$@"
           --dry-run --dry-run-nodes "$NODES" --dry-run-gpus-per-node "$RANKS_PER_NODE")
else
  COMMAND=("$PYTHON" -m torch.distributed.run --standalone
           --nproc_per_node "$((NODES * RANKS_PER_NODE))"
           "$ROOT/pretrain_zeropp_gpt.py" "${FLAGS[@]}" --ranks-per-node "$RANKS_PER_NODE" "$@")
fi

if [ "${PRINT_ONLY:-0}" = 1 ]; then
  printf '%q ' "${COMMAND[@]}"
  echo
  exit 0
fi
if [ "${DRY_RUN:-0}" != 1 ]; then
  if [ ! -f "$DATA_PATH.bin" ] || [ ! -f "$DATA_PATH.idx" ]; then
    echo "error: no dataset at $DATA_PATH.{bin,idx}; build it with: bash scripts/quickstart.sh" >&2
    echo "  (or: $PYTHON -m data.sample_corpus --output cache/corpus && $PYTHON -m data.preprocess" \
      "--input cache/corpus --output-prefix cache/data/pile_sample --tokenizer-type" \
      "GPT2BPETokenizer --append-eod --workers 2)" >&2
    exit 1
  fi
  mkdir -p "$RUN_DIR"
fi
cd "$ROOT"
exec "${COMMAND[@]}"
