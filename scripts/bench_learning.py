"""Time to reward 0.9 on the copy task: Molt (full stack) vs a minimal single-process GRPO loop vs TRL's GRPOTrainer
(when `pip install trl` worked), same model, data and hyperparameters (16 prompts x 8 samples, temperature 1,
lr 5e-4 AdamW, one update per batch, 2 new tokens). "Reached" = mean reward of the last 10 steps >= 0.9.

    .venv/bin/python scripts/bench_learning.py [--max-steps 600] [--skip-trl]

Prints steps and training seconds to the target for each, start-up time separately, and the ratios.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import molt  # noqa: E402

ROWS = [json.loads(line) for line in open(os.path.join(ROOT, "examples", "copy.jsonl"))]


def minimal_loop(max_steps: int, seed=0):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    t_start = time.perf_counter()
    path = molt.resolve_model("tiny")
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.0)
    rng, recent = random.Random(seed), []
    startup, t0 = time.perf_counter() - t_start, time.perf_counter()
    for step in range(1, max_steps + 1):
        batch = [rng.choice(ROWS) for _ in range(16)]
        ids = torch.tensor([tok(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                                        add_generation_prompt=True), add_special_tokens=False)
                            ["input_ids"] for r in batch]).repeat_interleave(8, 0)
        L = ids.shape[1]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
        texts = tok.batch_decode(out[:, L:], skip_special_tokens=True)
        r = torch.tensor([float(t.startswith(batch[i // 8]["label"])) for i, t in enumerate(texts)]).view(16, 8)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
        logp = model(out).logits[:, L - 1:-1].float().log_softmax(-1).gather(-1, out[:, L:, None])[..., 0]
        (-(adv[:, None] * logp).mean()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        recent = (recent + [r.mean().item()])[-10:]
        if len(recent) == 10 and sum(recent) / 10 >= 0.9:
            return step, time.perf_counter() - t0, startup
    return None, time.perf_counter() - t0, startup


def molt_run(max_steps: int):
    out = tempfile.mkdtemp(prefix="molt-bench-learn-")
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "molt.py"), "--agent", "agents/copy.py", "--run-dir",
                           out, "--steps", str(max_steps), "--target-reward", "0.9"], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    total = time.perf_counter() - t
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    train = sum(r["time/step"] for r in rows)
    reached = sum(r["reward/mean"] for r in rows[-10:]) / 10 >= 0.9
    startup = float(proc.stderr.split("start-up ")[1].split("s")[0])
    return (rows[-1]["step"] if reached else None), train, startup, total


def trl_run(max_steps: int):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    path = molt.resolve_model("tiny")
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]}
                              for r in ROWS] * (max_steps * 2))

    def reward(completions, label, **_):
        return [float(c[0]["content"].startswith(lab)) for c, lab in zip(completions, label)]

    class Stop(TrainerCallback):
        recent, reached, t0 = [], None, None

        def on_step_begin(self, args, state, control, **kw):
            Stop.t0 = Stop.t0 or time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                Stop.recent = (Stop.recent + [logs["reward"]])[-10:]
                if len(Stop.recent) == 10 and sum(Stop.recent) / 10 >= 0.9:
                    Stop.reached, control.should_training_stop = state.global_step, True

    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=128, num_generations=8,
                      max_completion_length=2, learning_rate=5e-4, temperature=1.0, top_k=0, top_p=1.0, beta=0.0,
                      logging_steps=1, max_steps=max_steps, report_to=[], use_cpu=True, save_strategy="no",
                      lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, seed=0)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), reward_funcs=reward,
                          args=args, train_dataset=data, processing_class=AutoTokenizer.from_pretrained(path),
                          callbacks=[Stop()])
    startup = time.perf_counter() - t_start
    trainer.train()
    return Stop.reached, time.perf_counter() - (Stop.t0 or t_start), startup


def main(args):
    results = {"minimal loop": minimal_loop(args.max_steps)}
    steps, train, startup, _ = molt_run(args.max_steps)
    results["molt"] = (steps, train, startup)
    if not args.skip_trl:
        try:
            results["TRL GRPOTrainer"] = trl_run(args.max_steps)
        except ImportError as err:
            print(f"TRL not available ({err}); pip install trl to include it")
    for name, (steps, train, startup) in results.items():
        reached = f"reached 0.9 at step {steps}" if steps else f"not reached in {args.max_steps} steps"
        print(f"{name:16s} {reached:28s} training {train:7.1f}s ({train / (steps or args.max_steps):.3f}s/step), "
              f"start-up {startup:5.1f}s")
    base = results["minimal loop"][1]
    for name in results:
        print(f"time to 0.9, {name} / minimal loop: {results[name][1] / base:.2f}x (excluding start-up)")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=600)
    p.add_argument("--skip-trl", action="store_true")
    main(p.parse_args())
