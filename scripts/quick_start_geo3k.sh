#!/usr/bin/env bash
# Single node, real vision-language model: the geo3k tool agent. Prepares the data set first (needs network).
#   bash scripts/quick_start_geo3k.sh [Qwen/Qwen2.5-VL-3B-Instruct]
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-Qwen/Qwen2.5-VL-3B-Instruct}"
[ -d "$HOME/geo3k/train" ] || .venv/bin/python examples/prepare_geo3k.py --out "$HOME/geo3k"
gpus=$(nvidia-smi -L | wc -l)
engines=$(( gpus / 2 > 0 ? gpus / 2 : 1 ))
exec .venv/bin/python molt.py --agent agents/geo3k.py --model "$model" --data "$HOME/geo3k/train" \
  --eval-data "$HOME/geo3k/test" --eval.every 20 --engine.num-engines "$engines" \
  --train.num-ranks $(( gpus - engines > 0 ? gpus - engines : 1 )) --data.max-len 8192 \
  --rollout.max-new-tokens 1024 --rollout.max-turns 5 --rollout.batch-size 16 --rollout.n-samples-per-prompt 8 \
  --train.lr 1e-6 --train.micro-batch-size 2 --train.save-every 50 --steps 300
