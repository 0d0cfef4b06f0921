"""Recipes: the Python sandbox, each agent module through the real pool / server / engine and a training step,
geo3k's tool turns with images, LLM-as-judge failures, on-policy distillation, launch material."""
import json
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import molt
from conftest import file_state, run, small_config
from test_trainer import make_samples

ROOT = Path(__file__).resolve().parent.parent
sandbox = molt.import_path(str(ROOT / "rewards" / "sandbox.py"))
code_agent = molt.import_path(str(ROOT / "agents" / "code.py"))
grader = molt.import_path(str(ROOT / "rewards" / "math_grader.py"))
judge_agent = molt.import_path(str(ROOT / "agents" / "judge.py"))


def test_sandbox_runs_code_and_returns_its_output_and_plots():
    assert sandbox.run_python("print(6 * 7)") == "42\n"
    out, images = sandbox.run_python("from PIL import Image\nImage.new('RGB', (8, 8)).save('p.png')\n"
                                     "open('f.txt', 'w').write('kept inside')\nprint(open('f.txt').read())",
                                     with_images=True)
    assert out == "kept inside\n" and len(images) == 1 and images[0].size == (8, 8)
    assert "more characters truncated" in sandbox.run_python("print('x' * 100000)")
    assert "timed out" in sandbox.run_python("while True: pass", timeout=2)
    assert "ZeroDivisionError" in sandbox.run_python("1 / 0")
    assert sandbox.run_python("") == "Error: no code to run."


def test_code_reward_reads_the_fenced_block_and_splits_tests():
    reply = "Sure.\n```python\ndef square(x):\n    return x * x\n```\nDone."
    tests = ["assert square(3) == 9", "assert square(-2) == 4", "assert square(0) == 0"]
    assert code_agent.pass_fraction(code_agent.extract_code(reply), tests) == 1.0
    [first, even] = code_agent.grader.read_problem({"tests": ["assert first([]) == None", "assert is_even(2)"]}).tests
    assert (first.expr, first.parts, even.expr, even.parts) == ("_molt_v0 == None", ["first([])"], "_molt_v0",
                                                                ["is_even(2)"])


@pytest.mark.parametrize("text, score", [("Score: 7", 0.7), ("Score: 10/10", 1.0), ("Score: 3\nclear, but wrong", 0.3),
                                         (" Score:2 ", 0.2), ("Score: 7\n... final Score: 2", None),
                                         ("score = 10/10", None), ("**Score:** 3", None), ("Score: 11", None),
                                         ("great!", None), ("", None), (None, None)])
def test_judge_score_parsing(text, score):
    assert judge_agent.parse_score(text) == score


def run_agent(engine, path, agent, row, n=2, **overrides):
    async def main():
        pool = molt.AgentPool(small_config(**overrides), str(ROOT / agent), path, [engine])
        await pool.server.start()
        out = await pool.run_group(row, n, {"temperature": 1.0, "max_tokens": 48}, uuid.uuid4().hex)
        await pool.server.stop()
        return out
    return run(main())


ROWS = {"agents/math.py": {"prompt": "What is 2 + 3?", "label": "5"},
        "agents/chat_minimal.py": {"prompt": "What is 2 + 3?", "label": "5"},
        "agents/code.py": {"prompt": "Write add(a, b).", "label": {"tests": ["assert add(1, 2) == 3"]}},
        "agents/judge.py": {"prompt": "What is 2 + 3?", "label": "5"}}


@pytest.mark.parametrize("agent", sorted(ROWS))
def test_agent_episodes_feed_a_training_step(engine, tiny, tiny_trainer, agent):
    out = run_agent(engine, tiny, agent, ROWS[agent])
    assert out.failures == {} and len(out.samples) == 2
    assert all(any(s.mask) for s in out.samples) and len({s.rollout_id for s in out.samples}) == 2
    tok = AutoTokenizer.from_pretrained(tiny)
    label = ROWS[agent]["label"]
    for s in out.samples:  # each sample's reward is the agent's grade of exactly the tokens it records
        text = tok.decode([t for t, m in zip(s.tokens, s.mask) if m], skip_special_tokens=True)
        expect = {"agents/code.py": lambda: code_agent.pass_fraction(code_agent.extract_code(text), label["tests"]),
                  "agents/judge.py": lambda: s.info["judge/score"]}.get(agent, lambda: grader.grade(text, label))()
        assert s.reward == expect and 0.0 <= s.reward <= 1.0
    cfg, trainer = tiny_trainer
    metrics = molt.learn(cfg, {"policy": trainer}, out.samples + make_samples(1, 2))
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()) and metrics["grad_norm"] > 0


def test_judge_failures_are_counted_and_not_rewarded(engine, tiny):
    garbled = run_agent(engine, tiny, "agents/judge.py", ROWS["agents/judge.py"])  # a random judge: no score
    down = run_agent(engine, tiny, "agents/judge.py", ROWS["agents/judge.py"], **{"judge.url": "http://127.0.0.1:9/v1"})
    for out in (garbled, down):
        assert out.failures == {}  # a judge failure costs the reward, not the episode
        assert all(s.info["judge/failed"] == 1.0 and s.reward == 0.0 for s in out.samples)


PLOT = "from PIL import Image; Image.new('RGB', (56, 56)).save('plot.png'); print(6 * 7)"
FORCE_TOOL = {"regex": r'<tool_call>\{"name": "python", "arguments": \{"code": "' +
              PLOT.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.").replace("*", r"\*") + r'"\}\}</tool_call>'}


def geo3k_row():
    return json.loads(open(ROOT / "examples" / "geo3k_tiny.jsonl").readline())


@pytest.mark.parametrize("agent", ["agents/geo3k.py", "agents/chat_geo3k.py"])
def test_geo3k_tool_turns_carry_images_and_mask_tool_output(vl_engine, tiny_vl, agent):
    async def main():
        pool = molt.AgentPool(small_config(**{"data.max_len": 2048, "rollout.max_turns": 3}), str(ROOT / agent),
                              tiny_vl, [vl_engine])
        await pool.server.start()
        out = await pool.run_group(geo3k_row(), 1, {"temperature": 1.0, "max_tokens": 160,
                                                    "structured_outputs": FORCE_TOOL}, "g")
        await pool.server.stop()
        return pool, out
    pool, out = run(main())
    assert out.failures == {}
    [s] = out.samples
    assert s.info["geo3k/tool_calls"] >= 2  # every turn was a (forced) tool call
    assert s.n_images >= 3  # the diagram plus the plot of each tool run
    context = pool.codec.tokenizer.decode([t for t, m in zip(s.tokens, s.mask) if not m])
    responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context, re.S)
    assert len(responses) >= 2 and all("42\n" in r and "<|image_pad|>" in r for r in responses)  # output + plot
    assert not any(s.mask)  # every turn was guided (a forced call): all context, nothing trained


@pytest.mark.slow
def test_geo3k_runs_end_to_end(geo3k_run):
    run_dir, _ = geo3k_run
    samples = [json.loads(line) for line in open(run_dir / "samples" / "step_000002.jsonl")]
    assert samples and all(s["n_images"] >= 1 for s in samples)
    assert (run_dir / "checkpoints" / "step_000002" / "model.safetensors").exists()
    m = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    # the trainer's forward over the same tokens and pixels gives the engine's log-probs (vision tower included)
    assert m[0]["rollout/logprob_gap"] <= 1e-3 and m[0]["rollout/staleness_max"] == 0
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in m)


@pytest.mark.slow
def test_on_policy_distillation_brings_the_student_to_the_teacher(tmp_path, tiny):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny, teacher)
    state = file_state(tiny)
    g = torch.Generator().manual_seed(3)
    from safetensors.torch import save_file
    save_file({k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in state.items()},
              teacher / "model.safetensors")
    run_dir = tmp_path / "distill"
    proc = subprocess.run([sys.executable, str(ROOT / "molt.py"), "--algo.estimator", "on_policy_distill",
                           "--ref.model", teacher, "--data", "examples/math_tiny.jsonl", "--run-dir", run_dir,
                           "--steps", "24", "--train.lr", "3e-3", "--rollout.n-samples-per-prompt", "4",
                           "--rollout.batch-size", "64", "--rollout.max-new-tokens", "32", "--data.max-len", "256"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kl = [json.loads(line)["kl/ref"] for line in open(run_dir / "metrics.jsonl")]
    # 2,048 sampled tokens a step: fewer leave the per-token KL estimate too noisy to move a random-init student
    assert sum(kl[-3:]) / 3 < 0.8 * sum(kl[:3]) / 3, kl  # measured: 0.32 -> 0.21 (0.66x) over 24 steps


def test_teacher_must_share_the_tokenizer(tiny, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["model"]["vocab"]["zz"] = max(tok["model"]["vocab"].values()) + 1
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="must share the policy's tokenizer"):
        molt.check_same_tokenizer(tiny, str(other))


def test_launch_material_parses():
    for script in [*ROOT.glob("scripts/*.sh"), *ROOT.glob("scripts/slurm/*.sh")]:
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    proc = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
