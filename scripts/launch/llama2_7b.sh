#!/usr/bin/env bash
# llama2_7b (configs/models/llama2_7b.args, a Llama-style model) on DGX-2 nodes: ZeRO-3 or ZeRO++,
# with the flags of configs/models/llama_training.args.
#   scripts/launch/llama2_7b.sh NODES zero3|zeropp TOKENS_PER_GPU [extra flags...]
# DRY_RUN=1 prints the memory and communication plan; see paper_run.sh for the rest.
exec "$(dirname "${BASH_SOURCE[0]}")/paper_run.sh" llama2_7b "$@"
