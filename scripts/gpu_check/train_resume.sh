#!/usr/bin/env bash
# The application end to end on one GPU, as a user starts it (torchrun, NCCL, bf16, ZeRO++
# with qwZ and qgZ; hpZ 1 on one rank): 30 iterations of a 153M GPT with a checkpoint at 20,
# then a second run that resumes from iteration 20 and trains to 30. Compare the two
# metrics files' iterations 25 and 30 (docs/gpu_runs.md has the H100's).
#
#   OUT=DIR bash scripts/gpu_check/train_resume.sh
#
# Needs the tokenized sample corpus (scripts/quickstart.sh, or data.sample_corpus +
# data.preprocess, writes cache/data/pile_sample_text_document.{bin,idx}); the GPU machine
# needs no network. Sizes: LAYERS, HIDDEN, SEQ, ITERS, SAVE_AT, WARM (warm-up iterations);
# T1/T2 limit each run's seconds; TORCHRUN and CK (checkpoint directory) may be overridden.
set -u
OUTDIR=${OUT:-cache/gpu_train_resume}; CK=${CK:-/tmp/gpu_train_resume_ckpt}
TORCHRUN=${TORCHRUN:-torchrun}
mkdir -p "$OUTDIR"
CONFIG="$OUTDIR/ds_config.json"
python3 - "$CONFIG" <<'EOF'
import json, sys
config = json.load(open("configs/ds_zeropp_config.json"))
config["zero_optimization"]["zero_hpz_partition_size"] = 1  # one rank: one hpZ group
config["bf16"] = {"enabled": True}
json.dump(config, open(sys.argv[1], "w"), indent=1)
EOF
ARGS="--num-layers ${LAYERS:-8} --hidden-size ${HIDDEN:-1024} --num-attention-heads 16
  --seq-length ${SEQ:-1024} --micro-batch-size 4 --global-batch-size 8 --lr 3e-4
  --lr-warmup-iters ${WARM:-5} --log-interval 5 --eval-interval 1000 --eval-iters 0
  --tokenizer-type NullTokenizer --vocab-size 50257
  --data-path cache/data/pile_sample_text_document --split 969,30,1 --num-workers 0
  --bf16 --deepspeed --deepspeed_config $CONFIG"
rm -rf "$CK" "$CK.resumed"
# shellcheck disable=SC2086  # ARGS is a list of flags
timeout "${T1:-120}" "$TORCHRUN" --standalone --nproc_per_node 1 pretrain_zeropp_gpt.py $ARGS \
  --train-iters "${ITERS:-30}" --save "$CK" --save-interval "${SAVE_AT:-20}" \
  --metrics-file "$OUTDIR/uninterrupted.jsonl" > "$OUTDIR/train.log" 2>&1
echo "uninterrupted run: exit status $?"
# Resume from the checkpoint at SAVE_AT, not the last one: point `latest` at it.
echo "iter_$(printf %07d "${SAVE_AT:-20}")" > "$CK/latest"
# shellcheck disable=SC2086
timeout "${T2:-90}" "$TORCHRUN" --standalone --nproc_per_node 1 pretrain_zeropp_gpt.py $ARGS \
  --train-iters "${ITERS:-30}" --load "$CK" --save "$CK.resumed" --save-interval 1000 \
  --metrics-file "$OUTDIR/resumed.jsonl" >> "$OUTDIR/train.log" 2>&1
echo "resumed run: exit status $?"
grep -v "^\s" "$OUTDIR/train.log" | grep -i "error\|resumed\|saved" | tail -8
