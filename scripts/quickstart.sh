#!/usr/bin/env bash
# From nothing to a trained small GPT on this machine's CPU, in about five minutes:
#   1. set up the environment (scripts/setup.sh, idempotent);
#   2. build the ~37 MB sample corpus (Pile format) into cache/corpus;
#   3. tokenize it with GPT-2's BPE into cache/data/pile_sample_text_document.{bin,idx};
#   4. pretrain a 4-layer GPT on 2 ranks (ZeRO-3, gloo) and print its validation loss.
# Steps 2 and 3 are skipped when their output exists. The metrics of the run land in
# cache/runs/quickstart/metrics.jsonl (one JSON object per log interval).
#
# Environment knobs: NPROC (ranks, default 2), TRAIN_ITERS (default 200), SKIP_SETUP=1 (the
# environment is managed elsewhere, e.g. a CI step already ran setup.sh).
# The DeepSpeed launcher works as well as torchrun on CPU; the same run with it is
#   .venv/bin/deepspeed --num_nodes 1 --num_gpus 2 pretrain_zeropp_gpt.py <same flags>
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
NPROC="${NPROC:-2}"
TRAIN_ITERS="${TRAIN_ITERS:-200}"
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

echo "[quickstart] pretraining a 4-layer GPT on $NPROC ranks for $TRAIN_ITERS iterations"
mkdir -p "$RUN_DIR"
rm -f "$RUN_DIR/metrics.jsonl"
"$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
  "$ROOT/pretrain_zeropp_gpt.py" \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 64 \
  --micro-batch-size 4 --global-batch-size 16 --train-iters "$TRAIN_ITERS" \
  --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 20 \
  --weight-decay 0.1 --clip-grad 1.0 \
  --log-interval 10 --eval-interval 50 --eval-iters 5 \
  --data-path "$DATASET" --split 969,30,1 --num-workers 1 \
  --zero-stage 3 --deepspeed --deepspeed_config "$ROOT/configs/ds_zero3_config.json" \
  --metrics-file "$RUN_DIR/metrics.jsonl"

echo "[quickstart] done in $(( $(date +%s) - started )) s (after setup); metrics: $RUN_DIR/metrics.jsonl"
