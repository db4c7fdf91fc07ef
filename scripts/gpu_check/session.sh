#!/usr/bin/env bash
# Everything a lent GPU should measure, in one call, each part under its own time limit, so
# one that fails or overruns leaves the others their results:
#
#   OUT=DIR bash scripts/gpu_check/session.sh [PARTS]      (PARTS default: check graph train side)
#
#   check  the GPU check's sections a (kernels bit-exact), b (kernel bandwidth at 1, 8 and
#          64 MiB, host us per launch) and e (host against GPU at the 18B's block shape)
#   graph  the iteration as one CUDA graph against eager (scripts.gpu_check.graph_check)
#   train  the application with --cuda-graph against without (torchrun, bf16 ZeRO-3, mock data)
#   side   one GPU side by side: this engine, FSDP2, DeepSpeed (scripts.gpu_check.side_by_side;
#          DeepSpeed's wheels carried in .whl_ds/, see that script's docstring)
#   profile  the host's Python profile of one iteration (scripts.bench.host_profile)
#
# Writes at most 8 files into OUT (what the device machine sends back): the JSON of each part,
# session.log and logs.tgz (every part's log). No network there; python3 is the machine's
# own (torch with CUDA).
#
# The device runs one command for at most 600 s, so the parts share BUDGET_S (default 570 s):
# each runs under its own limit cut to what is left, a part that would start with under 30 s
# left is skipped and named in session.log (run it in a second call), and logs.tgz is
# rewritten after every part, so a call that is stopped still returns what finished.
set -u
OUTDIR=${OUT:?set OUT to the directory for the results}
PARTS=${*:-check graph train side}
BUDGET_S=${BUDGET_S:-570}
MIN_PART_S=30
export PYTHONUNBUFFERED=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
mkdir -p "$OUTDIR"
WORK=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$OUTDIR/session.log" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  >> "$OUTDIR/session.log" 2>&1

limit_of() {  # limit_of SECONDS: a part's limit, cut to what is left of the session's budget
  local left=$((BUDGET_S - SECONDS))
  echo $(( $1 < left ? $1 : left ))
}

part() {  # part NAME SECONDS COMMAND...: run with a limit, log to WORK/NAME.log
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET_S - SECONDS))
  if (( left < MIN_PART_S )); then
    echo "$name: skipped, $left s of the session's $BUDGET_S s left" | tee -a "$OUTDIR/session.log"
    return 0
  fi
  limit=$(limit_of "$limit")
  local began=$SECONDS
  # SIGTERM at the limit (each part then stops its children and keeps what finished), and
  # SIGKILL 10 s later if it has not ended.
  timeout -k 10 "$limit" "$@" > "$WORK/$name.log" 2>&1
  local status=$?
  echo "$name: exit $status after $((SECONDS - began)) s" | tee -a "$OUTDIR/session.log"
  tail -n 25 "$WORK/$name.log"
  tar czf "$OUTDIR/logs.tgz" -C "$WORK" . 2>/dev/null
}

for p in $PARTS; do
  case $p in
    check)
      part check 200 env PYTHON=python3 bash scripts/gpu_check.sh --sections abe --budget-s 175 \
        --out "$WORK/gc"
      cp "$WORK/gc/gpu_check.json" "$OUTDIR/gpu_check.json" 2>/dev/null ;;
    graph)
      part graph 150 python3 -m scripts.gpu_check.graph_check --out "$WORK/graph" --iterations 20
      cp "$WORK/graph/gpu_graph_check.json" "$OUTDIR/" 2>/dev/null ;;
    train)
      ARGS=(--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
            --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 8
            --lr 3e-4 --lr-warmup-iters 5 --train-iters 30 --log-interval 5 --eval-iters 0
            --eval-interval 1000 --mock-data --tokenizer-type NullTokenizer --vocab-size 50257
            --bf16 --zero-stage 3 --attention-dropout 0 --hidden-dropout 0)
      part train_eager 120 python3 -m torch.distributed.run --standalone --nproc_per_node 1 pretrain_zeropp_gpt.py \
        "${ARGS[@]}" --metrics-file "$WORK/train_eager.jsonl"
      part train_graph 120 python3 -m torch.distributed.run --standalone --nproc_per_node 1 pretrain_zeropp_gpt.py \
        "${ARGS[@]}" --cuda-graph --metrics-file "$WORK/train_graph.jsonl"
      python3 - "$WORK" > "$OUTDIR/train_graph_vs_eager.json" <<'EOF'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
rows = {}
for mode in ("eager", "graph"):
    path = work / f"train_{mode}.jsonl"
    rows[mode] = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
print(json.dumps(rows, indent=1))
EOF
      ;;
    side)
      # DeepSpeed and what it needs travel as wheels (WHEELS, default .whl_ds/: see
      # scripts/gpu_check/side_by_side.py); only the side-by-side run sees them.
      WHEELS=${WHEELS:-$ROOT/.whl_ds}
      part side_wheels 60 python3 -m pip install -q --no-index --no-deps --no-compile \
        --target /tmp/ds_site "$WHEELS"/*.whl
      mkdir -p "$WORK/side"
      # Its own budget is what the part's limit leaves, less 20 s to stop a worker and
      # write the JSON (SIGTERM at the limit also stops it and keeps what finished).
      side_budget=$(( $(limit_of 380) - 20 ))
      part side 380 env PYTHONPATH="/tmp/ds_site${PYTHONPATH:+:$PYTHONPATH}" \
        python3 -m scripts.gpu_check.side_by_side --out "$WORK/side/side_by_side.json" \
        --budget $(( side_budget > 0 ? side_budget : 0 )) --system-timeout 180
      cp "$WORK/side/"*.json "$OUTDIR/" 2>/dev/null ;;
    profile)
      part profile 90 python3 -m scripts.bench.host_profile --out "$WORK/profile" --layers 2 \
        --micro-batch 2 ;;
    *) echo "unknown part $p" | tee -a "$OUTDIR/session.log" ;;
  esac
done
tar czf "$OUTDIR/logs.tgz" -C "$WORK" . 2>/dev/null
rm -rf "$WORK"
ls -la "$OUTDIR"
