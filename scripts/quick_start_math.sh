#!/usr/bin/env bash
# Single node, real model: GRPO on math with a boxed-answer reward. Prompts: a jsonl with "prompt" and "label".
#   bash scripts/quick_start_math.sh my_math.jsonl [Qwen/Qwen3-4B]
set -euo pipefail
cd "$(dirname "$0")/.."
data="${1:?usage: quick_start_math.sh PROMPTS.jsonl [MODEL]}"
model="${2:-Qwen/Qwen3-4B}"
gpus=$(nvidia-smi -L | wc -l)
engines=$(( gpus / 2 > 0 ? gpus / 2 : 1 ))
exec .venv/bin/python molt.py --agent agents/math.py --model "$model" --data "$data" \
  --engine.num-engines "$engines" --train.num-ranks $(( gpus - engines > 0 ? gpus - engines : 1 )) \
  --data.max-len 8192 --rollout.max-new-tokens 4096 --rollout.batch-size 32 --rollout.n-samples-per-prompt 8 \
  --train.lr 1e-6 --train.micro-batch-size 4 --train.async-queue-size 1 --algo.is-level geo --algo.is-mode mask \
  --train.save-every 50 --steps 500
