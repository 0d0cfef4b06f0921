#!/usr/bin/env bash
# Multi-node Molt on Slurm: a Ray head on the first node, workers on the others, then molt.py joins the cluster.
#   sbatch --nodes 4 --gpus-per-node 8 scripts/slurm/ray_cluster.sh --agent agents/math.py --model ... --data ...
#SBATCH --job-name=molt
#SBATCH --exclusive
#SBATCH --ntasks-per-node=1
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}"
port=6379
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
head="${nodes[0]}"
head_ip=$(srun --nodes=1 --ntasks=1 -w "$head" hostname --ip-address | awk '{print $1}')
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # every Ray worker imports molt by name
srun --nodes=1 --ntasks=1 -w "$head" .venv/bin/ray start --head --node-ip-address="$head_ip" --port=$port \
  --num-gpus="${SLURM_GPUS_PER_NODE:-8}" --block &
sleep 20
for node in "${nodes[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" .venv/bin/ray start --address="$head_ip:$port" \
    --num-gpus="${SLURM_GPUS_PER_NODE:-8}" --block &
done
sleep 20
.venv/bin/python molt.py --ray-address "$head_ip:$port" "$@"
