"""Section 1: the config tree, its flags and the launch refusals (each names the flag the user must change)."""
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import molt

ROOT = Path(__file__).resolve().parent.parent
COPY = str(ROOT / "agents" / "copy.py")


def parse(*argv):
    return molt.parse_config([str(a) for a in argv])


def test_flags_override_agent_defaults_which_override_the_dataclass():
    cfg = parse("--agent", COPY, "--rollout.batch-size", 3, "--data", "x.jsonl")
    assert cfg.rollout.batch_size == 3  # flag over the agent's DEFAULTS (16)
    assert cfg.train.lr == 5e-4 and cfg.model == "tiny"  # the agent's DEFAULTS over the dataclass (1e-6)
    assert cfg.data.path == "x.jsonl"  # the short flag
    assert parse().rollout.batch_size == 16


@pytest.mark.parametrize("loss, low, high, agg", [("ppo", 0.2, 0.28, "token"), ("gspo", 3e-4, 4e-4, "seq"),
                                                  ("cispo", 0.2, 5.0, "token")])
def test_each_loss_gets_its_own_defaults(loss, low, high, agg):
    a = parse("--algo.loss", loss).algo
    assert (a.clip_low, a.clip_high, a.loss_agg) == (low, high, agg)


def test_explicit_clip_and_aggregation_win_over_the_loss_defaults():
    a = parse("--algo.loss", "gspo", "--algo.clip-high", 0.001, "--algo.loss-agg", "token").algo
    assert (a.clip_low, a.clip_high, a.loss_agg) == (3e-4, 0.001, "token")


@pytest.mark.parametrize("argv, message", [
    (["--algo.estimator", "grpo", "--rollout.n-samples-per-prompt", 1], "n-samples-per-prompt >= 2"),
    (["--algo.estimator", "on_policy_distill"], "needs --ref.model"),
    (["--algo.kl-coef", 0.1], "needs a reference model"),
    (["--algo.kl-in-reward", "--algo.kl-coef", 0.1, "--ref.model", "tiny"], "would ignore it"),  # grpo: group estimator
    (["--algo.estimator", "rloo", "--algo.kl-in-reward", "--algo.kl-coef", 0.1, "--ref.model", "tiny"],
     "would ignore it"),
    (["--algo.estimator", "reinforce", "--algo.kl-in-reward", "--ref.model", "tiny"], "kl-coef > 0"),
    (["--rollout.top-p", 0.9], "top-p < 1"),
    (["--algo.loss", "cispo", "--algo.clip-high", 0.5], "absolute ceiling"),
    (["--algo.dual-clip", 3, "--algo.loss", "gspo"], "PPO-only"),
    (["--algo.dual-clip", 0.5], "must be > 1"),
    (["--algo.filter-range", 0.9, 0.1], "LOW < HIGH"),
    (["--rollout.batch-size", 0], "batch-size"),
    (["--train.num-ranks", 4, "--train.tp-size", 3], "multiple of --train.tp-size x --train.cp-size"),
    (["--train.num-ranks", 4, "--train.tp-size", 2, "--train.cp-size", 4], r"\(8\)"),
    (["--train.num-ranks", 4, "--train.ep-size", 3], r"--train.ep-size \(3\)"),
    (["--train.sequence-parallel"], "needs --train.tp-size > 1"),
    (["--train.offload", "full"], "needs --train.num-ranks > 1"),
    (["--engine.mtp-tokens", 2, "--train.routing-replay"], "does not line up"),
    (["--engine.mtp-tokens", 2], "--no-engine.prefix-caching"),
    (["--engine.dp-size", 0], ">= 1"),
    (["--rollout.agent-pools", -1], "agent-pools must be >= 0"),
    (["--mode", "sft"], "--mode sft needs --data"),
    (["--mode", "dpo"], "rl or sft"),
])
def test_invalid_combinations_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        parse(*argv)


def test_kl_in_reward_is_accepted_where_it_has_an_effect():
    for est in ("reinforce", "gae"):
        assert parse("--algo.estimator", est, "--algo.kl-in-reward", "--algo.kl-coef", 0.1,
                     "--ref.model", "tiny").algo.kl_in_reward


def test_launch_refusals_that_need_the_cluster(tiny):
    routing = parse("--agent", COPY, "--train.routing-replay")
    with pytest.raises(ValueError, match="on CUDA"):
        molt.check_launch(routing, tiny, gpus=0)
    routing.train.backend = "automodel"  # with GPUs, AutoModel's routers have no per-token replay hook
    with pytest.raises(ValueError, match="--train.backend hf"):
        molt.check_launch(routing, tiny, gpus=8)
    routing.train.backend = "hf"
    molt.check_launch(routing, tiny, gpus=8)  # accepted
    with pytest.raises(ValueError, match="--agent is required"):
        molt.check_launch(parse(), tiny, gpus=0)
    molt.check_launch(parse("--algo.estimator", "on_policy_distill", "--ref.model", "tiny"), tiny, gpus=0)
    check = parse("--agent", COPY, "--train.check-weight-sync")
    molt.check_launch(check, tiny, gpus=0)  # CPU: Molt's own reload names what it missed
    with pytest.raises(ValueError, match="--train.check-weight-sync checks Molt's own reload"):
        molt.check_launch(check, tiny, gpus=8)  # CUDA: vLLM's transfer loads, and names nothing


def test_cuda_only_knobs_and_the_gpu_plan_are_checked_before_anything_starts(tiny):
    cfg = parse("--agent", COPY, "--train.num-ranks", 2, "--train.tp-size", 2, "--train.sequence-parallel",
                "--engine.dp-size", 2, "--engine.expert-parallel", "--engine.mtp-tokens", 1,
                "--no-engine.prefix-caching", "--train.offload", "full", "--train.pack-samples")
    with pytest.raises(ValueError) as err:
        molt.check_launch(cfg, tiny, gpus=0)
    for flag in molt.CUDA_FLAGS:  # every one named, ep-size and cp-size excepted (not set here)
        assert (flag in str(err.value)) == (flag not in ("--train.cp-size", "--train.ep-size")), flag
    assert molt.placement(cfg) == {"policy": 2, "engines": 2}
    with pytest.raises(ValueError, match=r"needs 4 GPUs \(policy 2, engines 2\) but the cluster has 3"):
        molt.check_launch(cfg, tiny, gpus=3)
    packed = parse("--agent", COPY, "--train.pack-samples")
    with pytest.raises(ValueError, match="flash attention's varlen kernels"):  # no flash-attn package here
        molt.check_launch(packed, tiny, gpus=2)
    with pytest.raises(ValueError, match="text models only"):
        molt.check_launch(packed, molt.resolve_model("tiny-vl"), gpus=2)
    cfg.train.backend = "hf"  # tensor parallelism is AutoModel's
    with pytest.raises(ValueError, match="--train.tp-size, --train.sequence-parallel need the AutoModel backend"):
        molt.check_launch(cfg, tiny, gpus=4)
    gae = parse("--agent", COPY, "--algo.estimator", "gae", "--train.num-ranks", 2, "--ref.model", "tiny",
                "--engine.num-engines", 3, "--engine.tp-size", 2)
    assert molt.placement(gae) == {"policy": 2, "engines": 6, "critic": 2, "ref": 1}
    with pytest.raises(ValueError, match="needs 11 GPUs"):
        molt.check_launch(gae, tiny, gpus=8)


def test_estimator_traits_decide_what_a_run_needs():
    est = molt.ESTIMATORS
    assert {k for k, e in est.items() if e.groups} == {"reinforce_baseline", "rloo", "grpo", "dr_grpo"}
    assert {k for k, e in est.items() if e.critic} == {"gae"}
    assert {k for k, e in est.items() if e.teacher} == {"on_policy_distill"}
    algo = molt.resolve_loss_defaults(molt.AlgoConfig(kl_coef=0.1))
    assert molt.kl_in_loss(algo) and not molt.kl_in_advantage(algo)
    algo.kl_in_reward = True
    assert not molt.kl_in_loss(algo) and molt.kl_in_advantage(algo)
    distill = molt.resolve_loss_defaults(molt.AlgoConfig(estimator="on_policy_distill", kl_coef=0.1))
    assert not molt.kl_in_loss(distill) and molt.kl_in_advantage(distill)


@pytest.mark.parametrize("args, flag", [
    (["--agent", "agents/copy.py", "--data", "missing.jsonl"], "--data missing.jsonl"),
    (["--agent", "agents/copy.py", "--model", "/nonexistent/model"], "--model /nonexistent/model"),
    (["--agent", "agents/nope.py"], "--agent agents/nope.py"),
    (["--agent", "agents/copy.py", "--eval-data", "./held/out.parquet"], "--eval-data ./held/out.parquet"),
    (["--agent", "agents/copy.py", "--ref.model", "runs/x/checkpoints/step_000001"], "--ref.model runs/x"),
])
def test_a_missing_path_is_one_line_naming_the_flag_before_anything_starts(args, flag):
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "molt.py"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and time.perf_counter() - t < 5
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and flag in lines[0] and "no such file" in lines[0], proc.stderr[-2000:]


def test_a_hub_id_is_not_mistaken_for_a_path():
    molt.check_path("--model", "Qwen/Qwen3-4B")  # org/name: left to the hub
    molt.check_path("--data", "openai/gsm8k")
    with pytest.raises(molt.UsageError, match="--data data/gsm8k.jsonl"):
        molt.check_path("--data", "data/gsm8k.jsonl")


def test_local_paths_are_made_absolute_on_the_driver_and_hub_ids_are_left(tmp_path, monkeypatch):
    """Actors run in another working directory (on a cluster, Ray's copy of the shipped directory): every local path
    they get was resolved where the user typed it."""
    monkeypatch.chdir(ROOT)
    cfg = molt.parse_config(["--agent", "agents/copy.py", "--model", "Qwen/Qwen3-4B", "--run-dir", "runs/x",
                             "--eval-data", "examples/math_tiny.jsonl"])
    molt.check_paths(cfg)
    assert cfg.agent == str(ROOT / "agents" / "copy.py") and cfg.run_dir == str(ROOT / "runs" / "x")
    assert cfg.data.path == str(ROOT / "examples" / "copy.jsonl")  # the agent's DEFAULTS had "agents/../examples"
    assert cfg.data.eval_path == str(ROOT / "examples" / "math_tiny.jsonl")
    assert cfg.model == "Qwen/Qwen3-4B"


def test_a_ray_address_nobody_answers_fails_at_once_naming_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(molt.UsageError, match=f"--ray-address 127.0.0.1:{port}: no Ray cluster answers there"):
            molt.check_ray_auth(f"127.0.0.1:{port}")
