"""GPU acceptance: the CUDA paths no CPU test can reach, one line per check with its figure, within --budget seconds
(8 minutes) in all. On a machine without CUDA it exits at once (status 2) saying so.

    .venv/bin/python scripts/gpu_check.py [--only NAME] [--timeout 150] [--budget 480]

Checks (each a subprocess with its own timeout, so one failure does not hide the others):
  train-dense    AutoModel FSDP2 train step on a random ~0.5B Qwen3 (bf16): tokens/s
  train-moe      the same on the small random MoE (tiny-moe)
  packing        the 0.5B model's step with micro-batches packed into rows (--train.pack-samples under a token
                 budget) vs 8 padded samples each, on lengths 144-1152: loss difference, tokens/s ratio, attention
  rollout        vLLM CUDA engine through Molt vs raw vLLM (scripts/bench_rollout.py): ratio
  logprob-gap    one GPU in turn: the engine samples from the 0.5B checkpoint, then the trainer scores the same tokens
                 (bf16 both): the largest train/rollout log-prob gap
  weight-sync    (2 GPUs: trainer and engine, vLLM's NCCL transfer; NCCL refuses two ranks on one GPU) a policy update
                 into the engine on the 0.5B model: GB/s, and the log-prob gap after it
  routing        routing capture -> replay (scripts/cuda_check_moe.py): expert mismatch with and without replay
  copy-task      (2 GPUs) `molt.py --agent agents/copy.py --target-reward 0.9`: steps and seconds to the target
  knob-*         each CUDA-only parallelism / memory flag in a 2-step copy-task run (train tp / cp / ep, sequence
                 parallel, full and optimizer offload, packed rows, engine dp / expert parallel / MTP); one needing more GPUs than the machine
                 has prints "skip" with the count (MTP also needs MOLT_MTP_MODEL: a model with an MTP head)
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PY = sys.executable


def random_qwen3(hidden=896, layers=24) -> str:
    """A random Qwen3 of about 0.5B parameters with the tiny tokenizer (no hub on these machines)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    import molt
    tok = molt.tiny_tokenizer()
    cfg = Qwen3Config(vocab_size=32768, hidden_size=hidden, intermediate_size=4864, num_hidden_layers=layers,
                      num_attention_heads=14, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    out = os.path.join(tempfile.gettempdir(), "molt-gpu-check-qwen3-0.5b")
    if not os.path.exists(os.path.join(out, "config.json")):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(out)
        tok.save_pretrained(out)
    return out


def samples(n=32, prompt=128, resp=256, seed=0, spread=False):
    """n samples in groups of 8; spread: response lengths from 1/16 of resp to 4 x resp instead of all resp."""
    import random

    import molt
    rng, out = random.Random(seed), []
    for g in range(n // 8):
        p = [rng.randrange(5, 100) for _ in range(prompt)]
        for k in range(8):
            s = molt.Sample(group_id=str(g), rollout_id=f"{g}-{k}", reward=float(rng.random() > 0.5))
            s.extend(p)
            r = rng.randint(resp // 16, 4 * resp) if spread else resp
            s.extend([rng.randrange(5, 100) for _ in range(r)], [-4.6] * r, [0] * r)
            out.append(s)
    return out


def config(dtype="bfloat16"):
    import molt
    cfg = molt.Config()
    cfg.data.max_len, cfg.train.micro_batch_size, cfg.engine.dtype = 2048, 8, dtype
    cfg.engine.gpu_memory_utilization = 0.35
    molt.validate_config(cfg)
    return cfg


def train(model: str):
    import molt
    cfg, path = config(), (random_qwen3() if model == "dense" else molt.resolve_model("tiny-moe"))
    molt.ray_init(cfg)
    group, batch = molt.ModelGroup(cfg, path, "policy", total_steps=10), samples()
    backend = group.workers[0].__ray_call__.remote(lambda w: type(w.model).__module__)
    molt.learn(cfg, {"policy": group}, batch)  # warm-up
    t = time.perf_counter()
    for _ in range(3):
        molt.learn(cfg, {"policy": group}, batch)
    tokens = 3 * sum(len(s.tokens) for s in batch)
    import ray
    print(f"{tokens / (time.perf_counter() - t):.0f} tokens/s (model class from {ray.get(backend)})")


def packing():
    """Same batch, same initial weights: padded micro-batches of 8 vs packed rows under 8 x the mean length (flash
    attention's varlen kernel when flash-attn is installed; the line names the attention that ran)."""
    import ray

    import molt
    batch, results = samples(spread=True), {}
    tokens = sum(len(s.tokens) for s in batch)
    for budget in (0, 8 * tokens // len(batch)):
        cfg = config()
        cfg.train.max_tokens_per_micro_batch, cfg.train.pack_samples = budget, bool(budget)
        molt.ray_init(cfg)
        group = molt.ModelGroup(cfg, random_qwen3(), "policy", total_steps=10)
        attn = ray.get(group.workers[0].__ray_call__.remote(lambda w: w.model.config._attn_implementation))
        first = molt.learn(cfg, {"policy": group}, batch)
        t = time.perf_counter()
        molt.learn(cfg, {"policy": group}, batch)
        results[bool(budget)] = (first["loss/policy"], tokens / (time.perf_counter() - t))
        for w in group.workers:
            ray.kill(w)
    (l0, r0), (l1, r1) = results[False], results[True]
    print(f"packed / padded tokens/s {r1 / r0:.2f} ({r1:.0f} vs {r0:.0f}); first-step loss difference "
          f"{abs(l1 - l0):.2e}; attention {attn}")


def probe(engine):
    """A 64-token sample of the engine's, as a Sample."""
    import ray

    import molt
    [c] = ray.get(engine.generate.remote(molt.EngineRequest([5, 6, 7, 8], sampling={
        "max_tokens": 64, "temperature": 1.0, "ignore_eos": True})))
    s = molt.Sample(rollout_id="probe")
    s.extend([5, 6, 7, 8])
    s.add_turn(c)
    return s, c.logprobs


def gap(group, sample, logprobs) -> float:
    """Largest |trainer log-prob - engine log-prob| over the sampled tokens."""
    import ray

    import molt
    ours = group.forward(ray.put([sample]), molt.shard_plan([sample], 1, 1))[0][3:]
    return max(abs(a - b) for a, b in zip(ours, logprobs))


def logprob_gap():
    import ray

    import molt
    cfg, path = config(), random_qwen3()
    molt.ray_init(cfg)
    [engine] = molt.start_engines(cfg, path)
    s, logprobs = probe(engine)
    ray.kill(engine)  # its GPU goes to the trainer
    group = molt.ModelGroup(cfg, path, "policy", total_steps=10)
    print(f"bf16 train/rollout log-prob gap max {gap(group, s, logprobs):.4f} over {len(logprobs)} tokens")


def weight_sync():
    import molt
    cfg, path = config(), random_qwen3()
    molt.ray_init(cfg)
    engines = molt.start_engines(cfg, path)
    group = molt.ModelGroup(cfg, path, "policy", total_steps=10)
    molt.learn(cfg, {"policy": group}, samples())
    sync, times = molt.WeightSync(cfg, group, engines), []
    for v in range(1, 5):
        t = time.perf_counter()
        sync.start(v)
        sync.wait()
        times.append(time.perf_counter() - t)
        out = sync.take()
    best = sorted(times)[len(times) // 2]
    print(f"{out['sync/bytes'] / best / 1e9:.2f} GB/s ({out['sync/bytes'] / 2**20:.0f} MiB in {best * 1e3:.0f} ms, "
          f"native {sync.native}); bf16 log-prob gap after it max {gap(group, *probe(engines[0])):.4f}")


CHECKS = {
    "train-dense": [PY, __file__, "--inner", "train-dense"],
    "train-moe": [PY, __file__, "--inner", "train-moe"],
    "rollout": [PY, os.path.join(ROOT, "scripts", "bench_rollout.py"), "--rounds", "3"],
    "packing": [PY, __file__, "--inner", "packing"],
    "logprob-gap": [PY, __file__, "--inner", "logprob-gap"],
    "weight-sync": [PY, __file__, "--inner", "weight-sync"],
    "routing": [PY, os.path.join(ROOT, "scripts", "cuda_check_moe.py")],
    "copy-task": [PY, os.path.join(ROOT, "molt.py"), "--agent", "agents/copy.py", "--target-reward", "0.9",
                  "--steps", "400", "--run-dir", os.path.join(tempfile.gettempdir(), "molt-gpu-check-copy")],
}
# name: (GPUs the run needs: trainer ranks + engine GPUs, molt.py flags); checks not named need 1
KNOBS = {
    "knob-train-tp": (3, ["--train.num-ranks", "2", "--train.tp-size", "2"]),
    "knob-train-sp": (3, ["--train.num-ranks", "2", "--train.tp-size", "2", "--train.sequence-parallel"]),
    "knob-train-cp": (3, ["--train.num-ranks", "2", "--train.cp-size", "2"]),
    "knob-train-ep": (3, ["--model", "tiny-moe", "--train.num-ranks", "2", "--train.ep-size", "2"]),
    "knob-offload": (3, ["--train.num-ranks", "2", "--train.offload", "full"]),
    "knob-offload-opt": (2, ["--train.offload", "optimizer"]),
    "knob-pack": (2, ["--train.pack-samples", "--train.max-tokens-per-micro-batch", "4096"]),
    "knob-engine-dp": (3, ["--engine.dp-size", "2"]),
    "knob-engine-ep": (2, ["--model", "tiny-moe", "--engine.expert-parallel"]),
    "knob-mtp": (2, ["--model", os.environ.get("MOLT_MTP_MODEL", ""), "--engine.mtp-tokens", "1"]),
}
CHECKS.update({name: [PY, os.path.join(ROOT, "molt.py"), "--agent", "agents/copy.py", "--steps", "2", "--run-dir",
                       os.path.join(tempfile.gettempdir(), f"molt-gpu-check-{name}"), *flags]
               for name, (_, flags) in KNOBS.items()})
NEEDS = {"weight-sync": 2, "copy-task": 2, **{name: need for name, (need, _) in KNOBS.items()}}
INNER = {"train-dense": lambda: train("dense"), "train-moe": lambda: train("moe"), "packing": packing,
         "logprob-gap": logprob_gap, "weight-sync": weight_sync}


def main(args):
    import torch
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; this script checks the GPU paths and has nothing to run on CPU",
              file=sys.stderr)
        sys.exit(2)
    if args.inner:
        return INNER[args.inner]()
    print(f"gpu_check on {torch.cuda.get_device_name(0)}")
    failed, start = 0, time.perf_counter()
    for name, cmd in CHECKS.items():
        if args.only and args.only not in name:
            continue
        need, left = NEEDS.get(name, 1), args.budget - (time.perf_counter() - start)
        if need > torch.cuda.device_count() or (name == "knob-mtp" and not os.environ.get("MOLT_MTP_MODEL")):
            print(f"skip {name:12s} needs {need} GPUs (this machine has {torch.cuda.device_count()})"
                  + (" and MOLT_MTP_MODEL" if name == "knob-mtp" else ""), flush=True)
            continue
        if left < 30:
            print(f"skip {name:12s} the {args.budget} s budget is spent", flush=True)
            continue
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=min(args.timeout, left))
            lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
            ok, tail = proc.returncode == 0, (lines[-1] if lines else "")
        except subprocess.TimeoutExpired:
            ok, tail = False, f"timed out after {min(args.timeout, left):.0f} s"
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name:12s} {time.perf_counter() - t:5.0f}s  {tail[:300]}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="")
    p.add_argument("--timeout", type=int, default=150, help="seconds per check")
    p.add_argument("--budget", type=int, default=480, help="seconds for all checks; the rest print skip")
    p.add_argument("--inner", choices=list(INNER), help=argparse.SUPPRESS)
    main(p.parse_args())
