#!/bin/bash
# The probes of this folder's README, on builds made before (paths as arguments, in this order):
#   SHOP2      the default shop level-2 build (2000 SFT steps), ../shop_levels/
#   SPLIT2     the shop level-2 build with tiny_split_brackets, ../split_brackets/
#   SEARCH1    the default search level-1 build, SEARCH2 the default search level-2 build, ../search_levels/
#   TERM1      the default terminal level-1 build with the code: label, ../terminal_levels/
#   MIXCONT    SHOP2 continued 500 steps on levels 1 and 2 (../search_levels/continue_sft.py SHOP2 <out> 500 1 1 2;
#              <out>/plus500)
#   SCRATCH    the checkpoints folder of build_mix.py shop <SCRATCH> 2000 300 1 2
#   SEARCHG    the search level-2 build with tiny_guidance_frac 0.5 (eval.sh 2 960 --tiny_guidance_frac 0.5)
# usage: run.sh SHOP2 SPLIT2 SEARCH1 SEARCH2 TERM1 MIXCONT SCRATCH SEARCHG
set -e
SHOP2=$1 SPLIT2=$2 SEARCH1=$3 SEARCH2=$4 TERM1=$5 MIXCONT=$6 SCRATCH=$7 SEARCHG=$8
cd "$(git rev-parse --show-toplevel)"
D=bench/results/level_mix
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
PY=.venv/bin/python
quiet() { grep -v "Loading weights"; }
{
  for a in "terminal envs/shipped/tiny-terminal-5522e4c3ab280cb9 50 2" "terminal $TERM1 50 1" "shop $SHOP2 50 2" \
           "shop $SPLIT2 50 2" "search $SEARCH1 50 1" "search $SEARCH2 50 2" "search $SEARCHG 50 2" \
           "shop $SCRATCH/checkpoint-1200 50 1" "shop $SCRATCH/checkpoint-1200 50 2"; do
    $PY $D/attention.py $a 2>&1 | quiet; echo
  done
} > $D/attention.txt
{
  for L in 1 2; do $PY bench/results/split_brackets/recall.py shop "$SHOP2" 200 $L 2>&1 | quiet; done
  for L in 1 2; do $PY bench/results/split_brackets/recall.py shop "$MIXCONT" 200 $L 2>&1 | quiet; done
  for step in 300 600 900 1200 1500; do
    [ -d "$SCRATCH/checkpoint-$step" ] || continue
    for L in 1 2; do echo "checkpoint-$step"; $PY bench/results/split_brackets/recall.py shop "$SCRATCH/checkpoint-$step" 100 $L 2>&1 | quiet; done
  done
  $PY bench/results/split_brackets/recall.py search "$SEARCHG" 200 2 2>&1 | quiet
} > $D/recall.txt
