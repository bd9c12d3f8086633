#!/bin/bash
# Shop and search level 2 built with the tokenizer that cuts `[` off the word after it (`tiny_split_brackets`), then
# evaluated as their default builds were (200 held-out tasks, one sampled and one greedy episode each), and the recall
# probe (recall.py) on the new builds and on the default ones. The two builds run side by side, one thread each: SFT of
# 8456 s (shop) and 5340 s (search) on two CPU cores. Outputs: /tmp/l2split/.
# usage: bench/results/split_brackets/run.sh [default shop build] [default search build]   (the folders for the probe)
cd "$(git rev-parse --show-toplevel)" || exit 1
export AGENT_TRL_CACHE=/tmp/l2split/cache OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
mkdir -p /tmp/l2split
.venv/bin/python -m agent_trl.evaluate --config configs/quickstart.yaml --model tiny:shop --difficulty 2 \
  --max_completion_length 896 --samples 1 --tiny_split_brackets true --out /tmp/l2split/eval_shop \
  > /tmp/l2split/eval_shop.txt 2>&1 &
bench/results/search_levels/eval.sh 2 960 --tiny_split_brackets true --out /tmp/l2split/eval_search \
  > /tmp/l2split/eval_search.txt 2>&1 &
wait
D=bench/results/split_brackets
.venv/bin/python bench/results/shop_levels/coupon.py /tmp/l2split/eval_shop/transcripts.jsonl \
  "$(ls -d /tmp/l2split/cache/tiny/tiny-shop-*)" | tee $D/coupon.txt
.venv/bin/python bench/results/search_levels/answers.py /tmp/l2split/eval_search/transcripts.jsonl | tee $D/answers.txt
{
  for build in /tmp/l2split/cache/tiny/tiny-shop-* $1; do echo "# $build"; .venv/bin/python $D/recall.py shop "$build"; done
  for build in /tmp/l2split/cache/tiny/tiny-search-* $2; do echo "# $build"; .venv/bin/python $D/recall.py search "$build"; done
  build=$(ls -d envs/shipped/tiny-terminal-*); echo "# $build"; .venv/bin/python $D/recall.py terminal "$build"
} 2>&1 | grep -v "gemm_4bit\|Loading weights" | tee $D/recall.txt
