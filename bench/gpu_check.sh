#!/usr/bin/env bash
# GPU checks for MoE routing replay (R3) and vLLM generation in the agent loop. One prepared script, ~5 minutes.
#
#   bash bench/gpu_check.sh            # from anywhere; assumes `pip install -r requirements.txt` was done
#   PYTHON=/path/to/python bash bench/gpu_check.sh
#
# 1. bf16 sampler vs fp32 trainer on a tiny random Qwen3-MoE on cuda: record routes during a bf16 `generate`, score the
#    samples in fp32 with free routing and with replay; max/mean |delta log p| and flips (specs/routing-replay.md §7).
# 2. AgentGRPOTrainer on cuda in bf16 with activation checkpointing, 2 GRPO steps with and without routing_replay.
# 3. If vLLM is importable: one GRPO step of the agent loop with TRL's vLLM colocate generation, and the init-time
#    refusal of routing_replay with vLLM (routes must come from the engine; HF hooks cover HF generate only).
# Every check prints a PASS or FAIL line; the exit code is non-zero if any failed. Nothing is downloaded.
set -u
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TRL_EXPERIMENTAL_SILENCE=1 TOKENIZERS_PARALLELISM=false
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
failed=0
start=$(date +%s)
logs=$(mktemp -d)

run_check() {  # name, timeout in seconds, command...: print its PASS/FAIL/INFO lines; on failure, the log's tail
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  grep -E "^(PASS|FAIL|INFO)" "$logs/$name.log"
  if [ $rc -ne 0 ]; then
    failed=1
    [ $rc -eq 124 ] && echo "FAIL $name: timed out after ${limit}s" || echo "FAIL $name: exit code $rc"
    echo "---- last lines of $logs/$name.log"
    tail -n 25 "$logs/$name.log"
  fi
}

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "WARN nvidia-smi unavailable"
"$PYTHON" -c "import torch, transformers, trl; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'available', torch.cuda.is_available(), '| transformers', transformers.__version__, '| trl', trl.__version__)" \
  || { echo "FAIL imports"; exit 1; }

echo "== 1-2: routing replay on cuda (bf16 sampler vs fp32 trainer; trainer in bf16)"
run_check replay 180 "$PYTHON" bench/gpu_replay_check.py

echo "== 3: vLLM generation in the agent loop"
if "$PYTHON" -c "import vllm" 2>/dev/null; then
  run_check vllm 240 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 1 bench/gpu_replay_check.py --vllm
else
  echo "SKIP vllm: not importable (pip install vllm to run the vLLM agent-loop check)"
fi

echo "== done in $(( $(date +%s) - start )) s: $([ $failed -eq 0 ] && echo 'ALL PASS' || echo 'SOME CHECKS FAILED') (logs: $logs)"
exit $failed
