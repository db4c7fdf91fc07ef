#!/usr/bin/env bash
# GPT 18B (configs/models/gpt_18b.args) on DGX-2 nodes: ZeRO-3 or ZeRO++.
#   scripts/launch/gpt_18b.sh NODES zero3|zeropp 1K|2K [extra flags...]
# DRY_RUN=1 prints the memory and communication plan; see paper_run.sh for the rest.
exec "$(dirname "${BASH_SOURCE[0]}")/paper_run.sh" 18b "$@"
