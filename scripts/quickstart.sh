#!/usr/bin/env bash
# From nothing to a trained small GPT on this machine's CPU, in about five minutes:
#   1. set up the environment (scripts/setup.sh, idempotent);
#   2. build the ~37 MB sample corpus (Pile format) into cache/corpus;
#   3. tokenize it with GPT-2's BPE into cache/data/pile_sample_text_document.{bin,idx};
#   4. pretrain a 4-layer GPT with ZeRO++ on 4 ranks simulating 2 nodes x 2 (deepspeed launcher,
#      gloo), print its validation loss, then the cross-node bytes per iteration beside
#      those of a short ZeRO-3 run of the same model.
# Steps 2 and 3 are skipped when their output exists. The metrics of the runs land in
# cache/runs/quickstart/{zeropp,zero3}.jsonl (one JSON object per log interval).
#
# Environment knobs: NPROC (ranks, default 4), TRAIN_ITERS (default 100), SKIP_SETUP=1 (the
# environment is managed elsewhere, e.g. a CI step already ran setup.sh).
# torchrun works as well: .venv/bin/python -m torch.distributed.run --nproc_per_node 4 ...
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
NPROC="${NPROC:-4}"
TRAIN_ITERS="${TRAIN_ITERS:-100}"
CORPUS="$ROOT/cache/corpus"
DATA_PREFIX="$ROOT/cache/data/pile_sample"
DATASET="${DATA_PREFIX}_text_document"
RUN_DIR="$ROOT/cache/runs/quickstart"
# One thread per rank: the ranks already use every core, more threads only contend.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

if [ "${SKIP_SETUP:-0}" != 1 ]; then
  bash "$ROOT/scripts/setup.sh"
fi
started=$(date +%s)

echo "[quickstart] sample corpus -> $CORPUS"
"$PY" -m data.sample_corpus --output "$CORPUS"

if [ -f "$DATASET.bin" ] && [ -f "$DATASET.idx" ]; then
  echo "[quickstart] $DATASET exists; skipping preprocessing"
else
  echo "[quickstart] tokenizing with GPT-2 BPE, 2 workers -> $DATASET"
  mkdir -p "$(dirname "$DATA_PREFIX")"
  "$PY" -m data.preprocess --input "$CORPUS" --output-prefix "$DATA_PREFIX" \
    --tokenizer-type GPT2BPETokenizer --append-eod --workers 2
fi
"$PY" - "$DATASET" <<'EOF'
import os, sys
from data.indexed_dataset import IndexedDataset, data_file_path
dataset = IndexedDataset(sys.argv[1])
megabytes = os.path.getsize(data_file_path(sys.argv[1])) / 1e6
print(f"[quickstart] dataset {sys.argv[1]}: {dataset.num_documents:,} documents, "
      f"{dataset.num_tokens:,} tokens, {megabytes:.1f} MB of token ids")
EOF

# The same small GPT for both runs; 4 ranks simulate 2 nodes x 2 ranks (--ranks-per-node 2).
MODEL_FLAGS=(--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 64
  --micro-batch-size 4 --global-batch-size 16
  --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 20
  --weight-decay 0.1 --clip-grad 1.0 --log-interval 10 --eval-iters 5
  --data-path "$DATASET" --split 969,30,1 --num-workers 0 --zero-stage 3 --deepspeed
  --ranks-per-node 2)
launch() {  # the deepspeed launcher, 4 CPU ranks (it falls back to gloo without GPUs)
  "$ROOT/.venv/bin/deepspeed" --num_nodes 1 --num_gpus "$NPROC" --master_port "${MASTER_PORT:-29533}" \
    "$ROOT/pretrain_zeropp_gpt.py" "${MODEL_FLAGS[@]}" "$@"
}

echo "[quickstart] ZeRO++ (qwZ + hpZ + qgZ): a 4-layer GPT on $NPROC ranks as 2 nodes x 2," \
  "$TRAIN_ITERS iterations"
mkdir -p "$RUN_DIR"
rm -f "$RUN_DIR"/*.jsonl
launch --train-iters "$TRAIN_ITERS" --eval-interval 50 \
  --deepspeed_config "$ROOT/configs/ds_zeropp_cpu2x2.json" --metrics-file "$RUN_DIR/zeropp.jsonl"

echo "[quickstart] ZeRO-3 baseline, same model and cluster, 10 iterations for its traffic"
if ! launch --train-iters 10 --lr-warmup-iters 2 --eval-interval 1000 --eval-iters 0 \
  --deepspeed_config "$ROOT/configs/ds_zero3_config.json" --metrics-file "$RUN_DIR/zero3.jsonl" \
  > "$RUN_DIR/zero3.log" 2>&1; then
  cat "$RUN_DIR/zero3.log"
  exit 1
fi
grep -E "^ iteration +10/" "$RUN_DIR/zero3.log"

echo "[quickstart] bytes sent per rank per iteration (fp32 weights on CPU):"
"$PY" -m scripts.bench.compare_comm zero3="$RUN_DIR/zero3.jsonl" zeropp="$RUN_DIR/zeropp.jsonl"
echo "[quickstart] done in $(( $(date +%s) - started )) s (after setup); metrics in $RUN_DIR"
