#!/usr/bin/env bash
# One of the ZeRO++ paper's runs on DGX-2 style nodes (16 GPUs each), ZeRO-3 or ZeRO++, or
# the same run for a Llama-style model:
#
#   scripts/launch/paper_run.sh MODEL NODES SYSTEM TOKENS_PER_GPU [extra flags...]
#
#   MODEL           18b | 49b | 91b | 138b    -> configs/models/gpt_MODEL.args
#                   llama2_7b | llama3_8b | llama2_70b | llama_cpu_small
#                                             -> configs/models/MODEL.args
#   NODES           1 | 2 | 4 | 8 | 16 | 24   -> configs/hostfiles/dgx2_NODESnodes
#   SYSTEM          zero3 | zeropp            -> configs/ds_zero3_config.json | ds_zeropp_config.json
#                   zeropp_offload            -> configs/ds_zeropp_offload.json (ZeRO++ with the
#                                                optimizer and the weights in host memory)
#   TOKENS_PER_GPU  1K | 2K (or 1024, 2048)   -> micro batch = tokens / seq length (2 or 4 at 512;
#                   a multiple of the model's seq length: 4K or 8K for the Llama shapes)
#   extra flags     appended last, so they override the configs (e.g. --train-iters 1000)
#
# Environment:
#   DRY_RUN=1        plan instead of train: memory per GPU and bytes per iteration for this
#                    cluster, printed by one local process (no launcher, no GPU, no data)
#   PRINT_ONLY=1     print the command and exit
#   HOSTFILE         another hostfile (default: the DGX-2 placeholder for NODES)
#   GPUS_PER_NODE    default 16; with another value give a DS_CONFIG whose
#                    zero_hpz_partition_size divides it
#   DS_CONFIG        another DeepSpeed config for SYSTEM
#   TRAINING_ARGS    the shared training flags (default configs/models/paper_training.args,
#                    configs/models/llama_training.args for the llama* models)
#   DATA_PATH        indexed dataset prefix (default cache/data/pile_text_document)
#   RUN_DIR          where metrics files go (default cache/runs/paper)
#   DEEPSPEED, PYTHON  the launcher and the interpreter (default: .venv's when present)
#   RESTARTS=N       relaunch a failed run up to N times from its latest verified checkpoint
#                    (python -m megatron_lite.supervise; needs --save DIR --load DIR)
#   BACKOFF          seconds between relaunches (default 10)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

usage() {
  echo "usage: $0 MODEL NODES SYSTEM TOKENS_PER_GPU [extra flags...]" >&2
  echo "  MODEL 18b|49b|91b|138b|llama2_7b|llama3_8b|llama2_70b, NODES 1|2|4|8|16|24," >&2
  echo "  SYSTEM zero3|zeropp|zeropp_offload, TOKENS_PER_GPU 1K|2K (a multiple of the model's seq length)" >&2
  exit 2
}
die() {
  echo "error: $*" >&2
  exit 2
}

[ "$#" -ge 4 ] || usage
MODEL="$1" NODES="$2" SYSTEM="$3" TOKENS="$4"
shift 4

# Flags from an .args file: one or more per line, '#' starts a comment line.
read_args_file() {
  local file="$1" line words
  [ -f "$file" ] || die "no such file: $file"
  while IFS= read -r line || [ -n "$line" ]; do
    [[ "$line" =~ ^[[:space:]]*(#|$) ]] && continue
    read -ra words <<< "$line"
    FLAGS+=("${words[@]}")
  done < "$file"
}

flag_value() {  # the value after FLAG in the FLAGS collected so far (the last one wins)
  local flag="$1" value="" i
  for ((i = 0; i < ${#FLAGS[@]} - 1; i++)); do
    [ "${FLAGS[$i]}" = "$flag" ] && value="${FLAGS[$((i + 1))]}"
  done
  echo "$value"
}

case "$MODEL" in
  llama*) MODEL_NAME="$MODEL"
          TRAINING_ARGS="${TRAINING_ARGS:-$ROOT/configs/models/llama_training.args}" ;;
  *) MODEL_NAME="gpt_$MODEL"
     TRAINING_ARGS="${TRAINING_ARGS:-$ROOT/configs/models/paper_training.args}" ;;
esac
MODEL_FILE="$ROOT/configs/models/${MODEL_NAME}.args"
[ -f "$MODEL_FILE" ] \
  || die "unknown MODEL '$MODEL': no $MODEL_FILE (try 18b, 49b, 91b, 138b, llama2_7b, llama3_8b, llama2_70b)"
[[ "$NODES" =~ ^[1-9][0-9]*$ ]] || die "NODES must be a positive integer, got '$NODES'"
HOSTFILE="${HOSTFILE:-$ROOT/configs/hostfiles/dgx2_${NODES}nodes}"
GPUS_PER_NODE="${GPUS_PER_NODE:-16}"
case "$SYSTEM" in
  zero3) DS_CONFIG="${DS_CONFIG:-$ROOT/configs/ds_zero3_config.json}" ;;
  zeropp) DS_CONFIG="${DS_CONFIG:-$ROOT/configs/ds_zeropp_config.json}" ;;
  zeropp_offload) DS_CONFIG="${DS_CONFIG:-$ROOT/configs/ds_zeropp_offload.json}" ;;
  *) die "unknown SYSTEM '$SYSTEM': use zero3, zeropp or zeropp_offload" ;;
esac
if [[ "$TOKENS" =~ ^([1-9][0-9]*)[kK]$ ]]; then
  TOKENS_NUMBER=$(( BASH_REMATCH[1] * 1024 ))
elif [[ "$TOKENS" =~ ^[1-9][0-9]*$ ]]; then
  TOKENS_NUMBER="$TOKENS"
else
  die "TOKENS_PER_GPU must be a token count such as 1K, 2K or 1024, got '$TOKENS'"
fi

FLAGS=()
read_args_file "$MODEL_FILE"
SEQ_LENGTH="$(flag_value --seq-length)"
(( TOKENS_NUMBER % SEQ_LENGTH == 0 )) \
  || die "TOKENS_PER_GPU $TOKENS_NUMBER is not a multiple of the seq length $SEQ_LENGTH of $MODEL_FILE"
read_args_file "$TRAINING_ARGS"
DATA_PATH="${DATA_PATH:-$ROOT/cache/data/pile_text_document}"
RUN_DIR="${RUN_DIR:-$ROOT/cache/runs/paper}"
RUN_NAME="${MODEL_NAME}_${NODES}x${GPUS_PER_NODE}_${SYSTEM}_${TOKENS_NUMBER}tokens"
FLAGS+=(--micro-batch-size "$((TOKENS_NUMBER / SEQ_LENGTH))"
        --deepspeed --deepspeed_config "$DS_CONFIG"
        --data-path "$DATA_PATH"
        --metrics-file "$RUN_DIR/$RUN_NAME.jsonl")

if [ -x "$ROOT/.venv/bin/python" ]; then
  PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
  DEEPSPEED="${DEEPSPEED:-$ROOT/.venv/bin/deepspeed}"
else
  PYTHON="${PYTHON:-python}"
  DEEPSPEED="${DEEPSPEED:-deepspeed}"
fi

if [ "${DRY_RUN:-0}" = 1 ]; then
  COMMAND=("$PYTHON" "$ROOT/pretrain_zeropp_gpt.py" "${FLAGS[@]}" "$@"
           --dry-run --dry-run-nodes "$NODES" --dry-run-gpus-per-node "$GPUS_PER_NODE")
else
  [ -f "$HOSTFILE" ] || die "no hostfile $HOSTFILE (set HOSTFILE, or NODES to 1, 2, 4, 8, 16 or 24)"
  COMMAND=("$DEEPSPEED" --hostfile "$HOSTFILE" --num_nodes "$NODES" --num_gpus "$GPUS_PER_NODE"
           "$ROOT/pretrain_zeropp_gpt.py" "${FLAGS[@]}" "$@")
fi

if [ "${RESTARTS:-0}" != 0 ] && [ "${DRY_RUN:-0}" != 1 ]; then
  [[ "$RESTARTS" =~ ^[0-9]+$ ]] || die "RESTARTS must be a count of relaunches, got '$RESTARTS'"
  COMMAND=("$PYTHON" -m megatron_lite.supervise --restarts "$RESTARTS"
           --backoff "${BACKOFF:-10}" -- "${COMMAND[@]}")
fi

if [ "${PRINT_ONLY:-0}" = 1 ]; then
  printf '%q ' "${COMMAND[@]}"
  echo
  exit 0
fi
[ "${DRY_RUN:-0}" = 1 ] || mkdir -p "$RUN_DIR"
cd "$ROOT"
exec "${COMMAND[@]}"
