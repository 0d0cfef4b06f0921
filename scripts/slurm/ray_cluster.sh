#!/usr/bin/env bash
# Multi-node Molt on Slurm: a Ray head on the first node, a Ray worker on each other node, then molt.py joins the
# cluster from the first node (where sbatch runs this script) and ships this directory to every node.
#   sbatch --nodes 2 --gpus-per-node 8 scripts/slurm/ray_cluster.sh --agent agents/math.py --model ... --data ...
# Token authentication is on: the job makes one token and srun hands it to every node in the environment, so no
# token file has to be shared. The run directory, --model and large --data belong on a filesystem every node sees.
# RAY_PORT (default 6379) is the head's port.
#SBATCH --job-name=molt
#SBATCH --exclusive
#SBATCH --ntasks-per-node=1
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}"
port="${RAY_PORT:-6379}"
gpus="${SLURM_GPUS_ON_NODE:-8}"
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
head_ip=$(srun --nodes=1 --ntasks=1 -w "${nodes[0]}" hostname --ip-address | awk '{print $1}')
export RAY_AUTH_MODE=token
RAY_AUTH_TOKEN=$(.venv/bin/python -c "import secrets; print(secrets.token_hex(32))")
export RAY_AUTH_TOKEN

srun --nodes=1 --ntasks=1 -w "${nodes[0]}" .venv/bin/ray start --head --node-ip-address="$head_ip" --port=$port \
  --num-gpus="$gpus" --include-dashboard=false --disable-usage-stats --block &
for node in "${nodes[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" .venv/bin/ray start --address="$head_ip:$port" --num-gpus="$gpus" \
    --disable-usage-stats --block &
done
# Wait until every node has joined (a worker retries until the head is up), at most 5 minutes.
.venv/bin/python - "$head_ip:$port" "${#nodes[@]}" <<'EOF'
import sys, time
import ray
address, want = sys.argv[1], int(sys.argv[2])
deadline = time.time() + 300
while True:
    try:
        ray.init(address=address, logging_level="ERROR")
        break
    except ConnectionError:
        if time.time() > deadline:
            raise
        time.sleep(5)
while (alive := sum(n["Alive"] for n in ray.nodes())) < want:
    if time.time() > deadline:
        sys.exit(f"only {alive} of {want} Ray nodes joined in 5 minutes")
    time.sleep(2)
EOF
.venv/bin/python molt.py --ray-address "$head_ip:$port" "$@"
