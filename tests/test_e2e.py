"""End to end: python molt.py as a subprocess with tiny budgets (real Ray, vLLM engine, FSDP2 trainer, weight sync)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def molt(*args, timeout=1200):
    proc = subprocess.run([sys.executable, str(ROOT / "molt.py"), *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc


def metrics(run_dir):
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]


def dumped(run_dir, step):
    return [json.loads(line) for line in open(Path(run_dir) / "samples" / f"step_{step:06d}.jsonl")]


REQUIRED = ["step", "policy_version", "reward/mean", "samples", "tokens/generated", "time/step", "time/rollout_wait",
            "time/train", "time/weight_sync", "rollout/logprob_gap", "rollout/staleness_max",
            "rollout/tokens_discarded", "loss/policy", "entropy", "grad_norm", "is/masked_frac"]


@pytest.mark.core
def test_a_synchronous_run_is_on_policy_at_every_step(tmp_path):
    """The short end-to-end run of the core tier: 3 synchronous steps of the copy task through Ray, the engine, the
    agent pool, the trainer and the weight sync. Every trained token was sampled by the policy version it trains
    (staleness 0, each dumped token's version the step's), and trainer and engine compute the same log-probs for it."""
    run = tmp_path / "run"
    molt("--agent", "agents/copy.py", "--run-dir", run, "--train.async-queue-size", 0, "--dump-samples", "--steps", 3)
    m = metrics(run)
    assert [r["step"] for r in m] == [1, 2, 3] and all(k in r for k in REQUIRED for r in m)
    assert all(r["rollout/staleness_max"] == 0 and r["rollout/tokens_discarded"] == 0 for r in m)
    assert max(r["rollout/logprob_gap"] for r in m) <= 1e-3  # measured: <= 3e-7 (fp32 on CPU)
    for r in m:
        samples = dumped(run, r["step"])
        assert len(samples) == r["samples"] > 0
        assert {v for s in samples for v, k in zip(s["versions"], s["mask"]) if k} == {r["step"] - 1}


def test_copy_task_learns_and_resumes(tmp_path):
    """The one proof that RL learns, end to end (asynchronous, the default), then a resume from its checkpoint."""
    run = tmp_path / "run"
    molt("--agent", "agents/copy.py", "--run-dir", run, "--target-reward", 0.9, "--dump-samples",
         "--train.save-every", 100, "--steps", 1000, "--train.lr", 1e-3)
    m = metrics(run)
    last = m[-1]["step"]
    # --target-reward stopped it: the last 10 steps averaged 0.9 before the 1000-step budget ran out, starting from a
    # random model that almost never answers right (measured: 0.0-0.02 over the first 10 steps). Sampling is not
    # seeded per request, so runs differ: at lr 1e-3 measured 142 / 169 / 180 steps (the agent's default 5e-4:
    # 213-222, agents/copy.py; with 8 samples per prompt 267-590, and once over 1,000 in CI)
    assert last < 1000 and sum(r["reward/mean"] for r in m[-10:]) / 10 >= 0.9
    assert sum(r["reward/mean"] for r in m[:10]) / 10 < 0.2
    assert all(k in m[-1] for k in REQUIRED)
    assert all(r["rollout/tokens_discarded"] == 0 for r in m if "rollout/tokens_discarded" in r)
    assert m[0]["rollout/logprob_gap"] <= 1e-3  # step 1 is on-policy
    assert json.loads((run / "config.json").read_text())["train"]["async_queue_size"] == 1
    assert (run / "samples" / f"step_{last:06d}.jsonl").exists()
    ckpt = run / "checkpoints" / f"step_{last:06d}"
    assert (ckpt / "model.safetensors").exists() and (ckpt / "config.json").exists()
    proc = molt("--agent", "agents/copy.py", "--run-dir", run, "--resume", "--steps", last + 3, "--train.lr", 1e-3)
    assert f"resumed at step {last}" in proc.stderr
    # a clean console: Molt's own lines and the bar; vLLM, Ray and torch wrote to the run's logs/ instead
    lines = [x for x in (proc.stdout + proc.stderr).replace("\r", "\n").splitlines() if x.strip()]
    ours = [x for x in lines if not x.startswith("molt: ")]  # the bar's lines start "molt: "
    assert len(ours) <= 15 and not any(" INFO " in x or "WARNING" in x or "pid=" in x for x in lines), ours
    assert any(" INFO " in p.read_text() for p in (run / "logs").glob("engine-*.log"))
    assert [r["step"] for r in metrics(run)[-3:]] == [last + 1, last + 2, last + 3]
    assert metrics(run)[-1]["reward/mean"] >= 0.7  # it continued from the learned weights, not from scratch


def test_updates_land_mid_episode_and_bad_agents_cost_only_their_episode(tmp_path):
    run = tmp_path / "run"
    molt("--agent", "tests/agents/long_turns.py", "--data", "tests/agents/long_turns.jsonl", "--run-dir", run,
         "--steps", 8, "--dump-samples", "--rollout.batch-size", 4, "--rollout.n-samples-per-prompt", 2,
         "--rollout.max-new-tokens", 48, "--rollout.groups-in-flight", 8, "--rollout.agent-timeout", 3,
         "--rollout.max-staleness", 8, "--train.lr", 1e-4, "--data.max-len", 512)
    m = metrics(run)
    assert [r["step"] for r in m] == list(range(1, 9))
    assert all(r["rollout/tokens_discarded"] == 0 for r in m)
    switched = 0
    for r in m:
        samples = dumped(run, r["step"])
        version = r["step"] - 1  # the batch of step k trains policy version k - 1
        assert r["rollout/staleness_max"] == max(version - min(v for v, k in zip(s["versions"], s["mask"]) if k)
                                                 for s in samples)
        for s in samples:  # a response (a run of sampled tokens) whose tokens came from two policy versions
            runs, cur = [], []
            for v, k in zip(s["versions"], s["mask"]):
                if k:
                    cur.append(v)
                elif cur:
                    runs, cur = runs + [cur], []
            switched += sum(len(set(x)) > 1 for x in runs + [cur])
    assert switched > 0
    # crashing and garbage-returning episodes fail at their second turn and are counted; the hanging ones never end
    # on their own, and the run finishes all its steps regardless (their timeout is counted in test_agents, where the
    # group waits for it: here it may fire after the last step)
    failed = {k: sum(r.get(k, 0) for r in m) for k in ("rollout/failed/error", "rollout/failed/bad_result")}
    assert all(v > 0 for v in failed.values()), failed
