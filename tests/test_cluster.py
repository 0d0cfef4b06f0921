"""A real two-node Ray cluster, started on this machine with Ray's own commands as a user starts one: `ray start
--head` with token authentication (1 CPU), then `ray start --address` for a worker node (4 CPUs, so actors land on
both) that cannot see the project directory: it runs in its own mount namespace with an empty tmpfs laid over it,
as a node of a real cluster would not have the user's files. Molt joins from the project directory with the
quick-start's relative paths, so whatever runs on the worker node comes from what Molt shipped. Only the processes
this test starts are stopped."""
import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from test_faults import uninterrupted

ROOT = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).parent / "ray")
pytestmark = pytest.mark.slow
HEAD_IP, WORKER_IP = "127.0.0.1", "127.0.0.2"
# The quick start's math recipe (its agent loads rewards/math_grader.py beside it, which grades in rewards/sandbox.py's
# sandbox): synchronous, 4 groups of 2 per step, a checkpoint every 2 steps, every sync checked parameter by parameter.
STEPS = 10
RUN = ["--agent", "agents/math.py", "--rollout.batch-size", 4, "--rollout.n-samples-per-prompt", 2,
       "--rollout.max-new-tokens", 16, "--train.async-queue-size", 0, "--train.save-every", 2,
       "--train.check-weight-sync", "--dump-samples", "--train.lr", 1e-3, "--steps", STEPS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """Ray nodes started with `ray start --block`, each in its own session: stopping one kills its process tree
    (raylet, agents, the workers that host actors), which is what a node that dies looks like to the rest."""

    def __init__(self, tmp: Path, project: Path):
        self.tmp, self.project, self.nodes = tmp, project, {}
        token = tmp / "auth_token"
        token.write_text(secrets.token_hex(32))
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
        self.port = free_port()
        self.address = f"{HEAD_IP}:{self.port}"

    def start(self, name: str, cpus: int, *args, hide: bool = False):
        # a short temp dir per node (Ray's socket paths must fit 107 bytes); nodes on one machine sharing one would
        # unpack the shipped directory into the same place and race
        temp = tempfile.mkdtemp(prefix=f"molt-{name}-", dir="/tmp")
        cmd = [RAY, "start", "--block", f"--num-cpus={cpus}", f"--temp-dir={temp}", "--disable-usage-stats", *args]
        if hide:
            cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                   'mount -t tmpfs -o size=1m hidden "$0" && exec "$@"', str(self.project), *cmd]
        log = open(self.tmp / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.nodes[name] = (proc, temp)

    def start_head(self):
        self.start("head", 1, "--head", f"--port={self.port}", f"--node-ip-address={HEAD_IP}",
                   "--include-dashboard=false", f"--ray-client-server-port={free_port()}")

    def start_worker(self, name: str):
        self.start(name, 4, f"--address={self.address}", f"--node-ip-address={WORKER_IP}", hide=True)
        self.wait_for(2)

    def wait_for(self, n: int, timeout: float = 120):
        """Until the cluster has n live nodes (asked from a fresh process: the session's own Ray is another
        cluster)."""
        probe = ("import ray, sys, time\nray.init(address=sys.argv[1], logging_level='ERROR')\n"
                 "while sum(x['Alive'] for x in ray.nodes()) != int(sys.argv[2]): time.sleep(0.5)")
        subprocess.run([sys.executable, "-c", probe, self.address, str(n)], env=self.env, check=True,
                       timeout=timeout, capture_output=True)

    def kill(self, name: str):
        proc, temp = self.nodes.pop(name)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=30)
        shutil.rmtree(temp, ignore_errors=True)

    def stop(self):
        for name in list(self.nodes):
            self.kill(name)


@pytest.fixture
def cluster(tmp_path):
    """A user's fork of Molt in its own directory, and the cluster (head only; the test adds workers)."""
    project = tmp_path / "fork"
    project.mkdir()
    for name in ("molt.py", "agents", "rewards", "examples"):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, project / name)
    c = Cluster(tmp_path, project)
    c.start_head()
    try:
        c.wait_for(1)
        yield c
    finally:
        c.stop()


def molt(cluster, *args, env=None, wait=True):
    cmd = [sys.executable, "molt.py", "--ray-address", cluster.address, *map(str, args)]
    log = open(cluster.tmp / f"molt-{time.monotonic_ns()}.log", "w+")
    proc = subprocess.Popen(cmd, cwd=cluster.project, env=env or cluster.env, stdout=log, stderr=subprocess.STDOUT)
    if wait:
        proc.wait(timeout=900)
    proc.log = log
    return proc


def output(proc) -> str:
    proc.log.seek(0)
    return proc.log.read()


def metrics(run):
    return [json.loads(line) for line in open(run / "metrics.jsonl")]


def dumped(run, step):
    return [json.loads(line) for line in open(run / "samples" / f"step_{step:06d}.jsonl")]


def trained(run, step):
    """(prompt index, epoch) of each group trained at a step, in batch order."""
    return list(dict.fromkeys((s["prompt_index"], s["epoch"]) for s in dumped(run, step)))


def check_exact(run: Path, steps: range):
    """Every step: every episode was graded, the sync reached every engine parameter, the engine and the trainer
    computed the same log-probs, and every trainable token was sampled by the policy the step trained (synchronous:
    version step - 1)."""
    m = {r["step"]: r for r in metrics(run)}
    # every episode graded: the grader came with the agent, and its sandbox started on the worker node
    assert not [(k, r[k]) for r in m.values() for k in r if k.startswith("rollout/failed") and r[k]]
    assert all(r["episodes"] == 8 and "math/missing_answer" in r for r in m.values())
    # each update is reported once, by the step that waited for it (a checkpoint step waits for two)
    assert sum("sync/stale_params" in m[step] for step in steps) >= len(steps) // 2
    for step in steps:
        assert m[step].get("sync/stale_params", 0) == 0, step
        assert m[step]["rollout/logprob_gap"] < 1e-5, (step, m[step]["rollout/logprob_gap"])
        for s in dumped(run, step):
            assert {v for v, keep in zip(s["versions"], s["mask"]) if keep} == {step - 1}, step


def nodes_of(run: Path) -> dict:
    """actor name -> the IP of the node it ran on."""
    placement = json.loads((run / "placement.json").read_text())
    return {actor: node["ip"] for node in placement.values() for actor in node["actors"]}


def test_two_nodes_token_auth_shipping_and_a_lost_node(cluster, tmp_path):
    # without the token: one line naming what is missing, before Ray's own 20 s of retries
    bare = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    refused = molt(cluster, *RUN, "--run-dir", tmp_path / "refused", env=bare)
    assert refused.returncode != 0
    assert "requires token authentication: set RAY_AUTH_MODE=token" in output(refused), output(refused)[-3000:]
    assert "Failed to connect" not in output(refused)

    # two nodes; the worker node dies mid-run: the run ends naming it, and --resume on a new worker continues exactly
    cluster.start_worker("worker-1")
    broken = tmp_path / "broken"
    proc = molt(cluster, *RUN, "--run-dir", broken, wait=False)
    deadline = time.time() + 600
    while not (broken / "metrics.jsonl").exists() or len(metrics(broken)) < 3:
        assert proc.poll() is None, output(proc)[-5000:]
        assert time.time() < deadline
        time.sleep(0.2)
    where = nodes_of(broken)
    assert where["policy-0"] == WORKER_IP and where["engine-0"] != where["policy-0"]  # weights crossed nodes
    assert where["pool-0"] == WORKER_IP  # the agent module came from the shipped copy: the original is hidden there
    assert "[molt] 2 nodes:" in output(proc)
    cluster.kill("worker-1")
    proc.wait(timeout=300)
    lost = re.search(r"node \w+ \(127\.0\.0\.2\) left the Ray cluster .* with (.*); --resume continues from "
                     r"step_(\d+)", output(proc))
    assert proc.returncode != 0 and lost, output(proc)[-5000:]
    assert "policy-0" in lost.group(1) and "pool-0" in lost.group(1)
    cluster.start_worker("worker-2")
    proc = molt(cluster, *RUN, "--run-dir", broken, "--resume")
    assert proc.returncode == 0, output(proc)[-5000:]
    assert f"resumed at step {int(lost.group(2))}" in output(proc)
    assert [r["step"] for r in metrics(broken)] == list(range(1, STEPS + 1))  # each step once
    groups, _ = uninterrupted("--agent", ROOT / "agents" / "math.py", *RUN[2:])
    assert [trained(broken, step) for step in range(1, STEPS + 1)] == groups  # what an unbroken run trains
    check_exact(broken, range(1, STEPS + 1))


SRUN = """#!/bin/bash
# srun on one machine: every node of the allocation is this machine; each Ray node gets its own temp dir
node=n0
while [[ "$1" == -* ]]; do case "$1" in -w) node="$2"; shift 2;; *) shift;; esac; done
[[ "$*" == *"ray start"* ]] && exec "$@" --temp-dir="$MOLT_TEST_TMP/$node"
exec "$@"
"""


def test_the_slurm_script_starts_a_cluster_molt_joins_as_is(tmp_path):
    """scripts/slurm/ray_cluster.sh on a two-node allocation (srun and scontrol stand-ins run each node's command on
    this machine): its head and worker start with a token of its own, it waits for both, and Molt joins, places actors
    on both and trains."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text(SRUN)
    (bin_ / "scontrol").write_text("#!/bin/sh\nprintf 'n0\\nn1\\n'\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    temp, run = tempfile.mkdtemp(prefix="molt-slurm-", dir="/tmp"), tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PATH=f"{bin_}:{env['PATH']}", SLURM_JOB_NODELIST="n[0-1]", SLURM_GPUS_ON_NODE="0",
               SLURM_SUBMIT_DIR=str(ROOT), RAY_PORT=str(free_port()), MOLT_TEST_TMP=temp)
    log = open(tmp_path / "job.log", "w+")  # a file, not a pipe: the nodes it leaves running would hold a pipe open
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "slurm" / "ray_cluster.sh"), "--agent", "agents/copy.py",
                             "--steps", "3", "--run-dir", str(run)], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        proc.wait(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing of the job left
            os.killpg(proc.pid, 9)  # the Ray nodes it left running, as the end of a Slurm job does
        shutil.rmtree(temp, ignore_errors=True)
    log.seek(0)
    out = log.read()
    assert proc.returncode == 0, out[-5000:]
    assert "[molt] 2 nodes:" in out and len(json.loads((run / "placement.json").read_text())) == 2
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
