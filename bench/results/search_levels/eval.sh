#!/bin/bash
# Build (if not cached) and evaluate the tiny default of search at a level: 200 held-out tasks, 1 sampled episode
# (temperature 1) and 1 greedy episode each, in $AGENT_TRL_CACHE (default /tmp/search_levels_cache), on $OMP_NUM_THREADS
# threads (default 1); a later --out wins.
# usage: eval.sh LEVEL MAX_COMPLETION_LENGTH [more evaluate/train flags]
L=$1; M=$2; shift 2
cd "$(git rev-parse --show-toplevel)" || exit 1
AGENT_TRL_CACHE=${AGENT_TRL_CACHE:-/tmp/search_levels_cache} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 .venv/bin/python -m agent_trl.evaluate \
  --config configs/grpo_search.yaml --model tiny:search --difficulty "$L" --num_eval_tasks 200 --samples 1 \
  --max_completion_length "$M" --max_turn_tokens 24 --out "/tmp/search_levels/eval_d$L" "$@"
