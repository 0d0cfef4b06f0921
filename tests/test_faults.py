"""Faults, end to end: python molt.py as a subprocess, killed with SIGKILL (every process of the run: driver, Ray,
engines, trainers) at three points and resumed; a weight update that fails on one engine; resume refusals; a stalled
rollout. Failures are injected through MOLT_FAULTS (molt.fault), which fires at a named point of a real run."""
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from molt import RolloutManager, load_rows, lr_lambda, parse_config

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
# the 10 copy prompts, 4 groups of 2 per step (an epoch every 2.5 steps); a checkpoint every 2 steps
SMALL = ["--agent", ROOT / "agents" / "copy.py", "--rollout.batch-size", 4,
         "--rollout.n-samples-per-prompt", 2, "--train.save-every", 2, "--dump-samples", "--train.lr", 1e-3]


def command(*args):
    return [sys.executable, str(ROOT / "molt.py"), *map(str, args)]


def molt(*args, faults="", timeout=900, ok=True, cwd=ROOT):
    proc = subprocess.run(command(*args), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "MOLT_FAULTS": faults})
    assert (proc.returncode == 0) == ok, proc.stderr[-5000:]
    if "--run-dir" in args:  # whatever way it ended, no process of the run outlives it (an engine core above all)
        alive = left_behind(Path(args[args.index("--run-dir") + 1]))
        assert not alive, f"processes of the run outlived it: {alive}"
    return proc


def left_behind(run_dir: Path, grace=15.0) -> list:
    """Processes of the run still alive `grace` s after it ended: its actors carry MOLT_LOG_DIR=<run>/logs."""
    logs, deadline = str((run_dir / "logs").resolve()), time.time() + grace
    while True:
        alive = []
        for p in psutil.process_iter():
            try:
                if p.environ().get("MOLT_LOG_DIR") == logs:
                    alive.append(p)
            except psutil.Error:
                pass
        if not alive or time.time() > deadline:
            return [p.pid for p in alive]
        time.sleep(0.5)


def killed_at(run_dir: Path, point: str, *args, faults: str, timeout=900):
    """Start a run that freezes at the fault point, then SIGKILL every process of it (a node dying there)."""
    log = open(run_dir.parent / f"{run_dir.name}-{point}.log", "w")
    proc = subprocess.Popen(command("--run-dir", run_dir, *args), cwd=ROOT, stdout=log, stderr=log,
                            env={**os.environ, "MOLT_FAULTS": faults}, start_new_session=True)
    marker, t0 = run_dir / f"fault-{point}", time.time()
    while not marker.exists():
        assert proc.poll() is None, open(log.name).read()[-5000:]
        assert time.time() - t0 < timeout, f"the run never reached {point}"
        time.sleep(0.2)
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(tree, timeout=30)
    return json.loads(marker.read_text() or "{}")


def metrics(run_dir):
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]


def trained(run_dir, step):
    """(prompt index, epoch) of each group trained at a step, in batch order."""
    rows = [json.loads(line) for line in open(Path(run_dir) / "samples" / f"step_{step:06d}.jsonl")]
    groups = {}
    for r in rows:
        groups.setdefault(r["group_id"], (r["prompt_index"], r["epoch"]))
    return list(groups.values())


def uninterrupted(*args) -> tuple[list, list]:
    """What an uninterrupted synchronous run of these flags trains at each step, ((prompt index, epoch) of each group
    in batch order, and its learning rate): the data's seeded order drawn a batch at a time by Molt's own
    RolloutManager (with no filter every drawn group is trained), and the schedule's rate at each step."""
    cfg = parse_config([str(a) for a in args])
    manager = RolloutManager(cfg, load_rows(cfg.data.path, cfg.data, cfg), [])
    b, schedule = cfg.rollout.batch_size, lr_lambda(cfg.train, cfg.steps)
    draws = [manager.next_prompt() for _ in range(cfg.steps * b)]
    return ([sorted(draws[i:i + b], key=lambda d: (d[1], d[0])) for i in range(0, len(draws), b)],
            [cfg.train.lr * schedule(step) for step in range(cfg.steps)])


def test_sync_run_killed_at_three_points_resumes_exactly(tmp_path):
    """Synchronous mode: after each kill and --resume, every step trains the prompts, in the order and with the
    learning rate, of an uninterrupted run of the same seed; metrics hold each step once."""
    broken = tmp_path / "broken"
    args = [*SMALL, "--steps", 9, "--train.async-queue-size", 0, "--train.lr-schedule", "linear",
            "--train.warmup-steps", 2]
    killed_at(broken, "rollout", *args, faults="rollout:step=3")  # waiting for step 3's batch (checkpoint: step 2)
    killed_at(broken, "train", "--resume", *args, faults="train:step=5")  # inside step 5's optimizer step (ckpt 4)
    # while writing step 6's checkpoint: its half-written directory must be ignored and removed
    killed_at(broken, "checkpoint", "--resume", *args, faults="checkpoint:step=6")
    assert list((broken / "checkpoints").glob(".step_*.tmp"))
    proc = molt("--run-dir", broken, "--resume", *args)
    assert "resumed at step 4" in proc.stderr
    assert not list((broken / "checkpoints").glob(".step_*.tmp"))
    m, (groups, rates) = metrics(broken), uninterrupted(*args)
    assert [r["step"] for r in m] == list(range(1, 10))  # cut back at each resume: every step once
    assert [trained(broken, step) for step in range(1, 10)] == groups
    assert [r["lr"] for r in m] == pytest.approx(rates)  # the schedule resumed where it was
    assert json.loads((broken / "config.json").read_text())["steps"] == 9


def test_async_run_killed_mid_step_trains_every_prompt_of_each_epoch_once(tmp_path):
    """Async mode: the groups finished but not trained at the checkpoint and the prompts in flight are restored, so
    over the resumed lineage each epoch trains each prompt exactly once, and no token is newer than its step."""
    run = tmp_path / "async"
    args = [*SMALL, "--steps", 9, "--train.async-queue-size", 2, "--rollout.groups-in-flight", 8,
            "--rollout.max-staleness", 100]
    state = killed_at(run, "train", *args, faults="train:step=5")
    ckpt = json.loads((run / "checkpoints" / "step_000004" / "molt_state.json").read_text())
    assert ckpt["rollout"]["finished_groups"] > 0  # there was finished, untrained work to lose
    molt("--run-dir", run, "--resume", *args)
    per_epoch = collections.defaultdict(collections.Counter)
    for step in range(1, 10):
        for prompt, epoch in trained(run, step):
            per_epoch[epoch][prompt] += 1
        for s in (json.loads(line) for line in open(run / "samples" / f"step_{step:06d}.jsonl")):
            assert max(v for v, m in zip(s["versions"], s["mask"]) if m) <= step - 1
    for epoch in (0, 1, 2):  # 36 groups trained: three whole epochs of the 10 prompts, and part of a fourth
        assert per_epoch[epoch] == collections.Counter(range(10)), epoch
    assert all(c == 1 for counts in per_epoch.values() for c in counts.values())  # nothing trained twice
    assert state is not None


def test_a_failed_weight_update_never_mislabels_a_token(tmp_path):
    """Two engines, synchronous. Engine 1 cannot stage version 3 (no space in shared memory): it keeps version 2's
    weights and label. Engine 0's worker fails half-way through loading version 5: it leaves the run. Every token
    labelled with the trained version is one the trainer's weights reproduce; the run finishes on one engine."""
    run = tmp_path / "failing"
    molt("--run-dir", run, *SMALL, "--steps", 7, "--train.async-queue-size", 0, "--engine.num-engines", 2,
         faults="stage:engine=1:version=3,load:engine=0:version=5")
    m = metrics(run)
    assert [r["step"] for r in m] == list(range(1, 8))
    # each failure is seen by the wait for its own update (version v's is waited at the start of step v + 1): the
    # engine whose load failed leaves during that update, before it could sample under the new label
    assert [r.get("sync/failed", 0) for r in m] == [0, 0, 0, 1, 0, 0, 0]
    assert [r.get("sync/engines_lost", 0) for r in m] == [0, 0, 0, 0, 0, 1, 0]
    assert m[3]["rollout/staleness_max"] == 1  # step 4 trains engine 1's version-2 tokens, labelled as such
    for r in m:
        if r["rollout/staleness_max"] == 0:  # labelled current: sampled by the trained weights
            assert r["rollout/logprob_gap"] <= 1e-3, r


def test_resume_refuses_a_different_experiment_and_finds_the_newest_run(tmp_path):
    runs = tmp_path / "runs"
    run = runs / "20260101-000000"
    molt("--run-dir", run, *SMALL, "--steps", 2)
    for change, field in [(["--model", "tiny-moe"], "model"), (["--algo.estimator", "rloo"], "algo.estimator"),
                          (["--data.max-prompts", 6], "data set")]:
        proc = molt("--run-dir", run, "--resume", *SMALL, "--steps", 3, *change, ok=False)
        assert field in proc.stderr and "--force" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert json.loads((run / "config.json").read_text())["model"] == "tiny"  # the original config is kept
    proc = molt("--resume", *SMALL, "--steps", 3, "--model", "tiny-moe", ok=False, cwd=tmp_path)  # no --run-dir
    assert str(Path("runs") / "20260101-000000") in proc.stderr
    proc = molt("--resume", *SMALL, "--steps", 3, ok=False, cwd=tmp_path / "runs")
    assert "no run to resume" in proc.stderr
    molt("--run-dir", run, "--resume", "--force", *SMALL, "--steps", 3, "--algo.estimator", "rloo")
    changes = [json.loads(line) for line in open(run / "config_changes.jsonl")]
    assert changes[-1]["changed"]["algo.estimator"] == ["grpo", "rloo"] and changes[-1]["step"] == 2
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]


def test_a_stalled_rollout_ends_the_run_with_a_message(tmp_path):
    proc = molt("--agent", ROOT / "tests/agents/long_turns.py", "--data", ROOT / "tests/agents/hang.jsonl", "--run-dir",
                tmp_path / "stall", "--steps", 3, "--rollout.agent-timeout", 100000, "--rollout.stall-timeout", 8,
                ok=False, timeout=150)  # start-up (~25 s) + the 8 s stall; a run without the watchdog hangs until here
    assert "no trainable prompt group in 8 s" in proc.stderr and "no pool progress" in proc.stderr
    assert "agents are stuck outside the model" in proc.stderr


@pytest.mark.parametrize("verbose", [False, True], ids=["default", "verbose"])
def test_an_engine_that_fails_to_start_prints_its_root_cause_and_where_the_logs_are(tmp_path, verbose):
    run = tmp_path / "run"
    proc = molt("--agent", ROOT / "agents/copy.py", "--run-dir", run, "--steps", 2, "--engine.kv-cache-gb", 5000,
                *(["--verbose"] if verbose else []), ok=False, timeout=300)
    if verbose:  # the logs stream as they come, and the traceback ends the run
        assert "(EngineActor pid=" in proc.stderr and "Traceback" in proc.stderr
        return
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert lines[0].startswith("molt: error in EngineActor.__init__") and len(lines) <= 5, proc.stderr[-3000:]
    engine_log = run / "logs" / "engine-0.log"
    # vLLM's engine core raises a vague error; the root cause it logged is on the console, with its log file
    assert any(str(engine_log) in x and "5000.0 GiB" in x for x in lines), proc.stderr
    assert "Traceback" in (run / "logs" / "driver.log").read_text() and "Traceback" not in proc.stderr
