"""Async vs synchronous training, and partial rollout vs abort-and-restart, measured in one run.

    .venv/bin/python scripts/bench_async.py [--steps 30] [--tokens 64] [molt.py flags for every run]

Runs molt.py three times on the copy agent with long responses (so rollout and training both take time):
synchronous (--train.async-queue-size 0), async with partial rollout (the default), async with abort-and-restart.
Prints median step times, the async step time over max(rollout time, train time) measured in the synchronous run
(goal <= 1.1), and tokens discarded and generated tokens/s for partial vs abort.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(name, args, extra):
    out = tempfile.mkdtemp(prefix=f"molt-bench-{name}-")
    cmd = [sys.executable, os.path.join(ROOT, "molt.py"), "--agent", "agents/copy.py", "--run-dir", out,
           "--steps", str(args.steps), "--rollout.max-new-tokens", str(args.tokens), "--data.max-len", "256",
           "--rollout.n-samples-per-prompt", "8", *extra]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][3:]  # skip warm-up steps
    med = {k: statistics.median(r[k] for r in rows) for k in ("time/step", "time/rollout_wait", "time/train",
                                                                "time/weight_sync")}
    med["tok/s"] = sum(r["tokens/generated"] for r in rows) / sum(r["time/step"] for r in rows)
    med["discarded"] = rows[-1]["rollout/tokens_discarded"]
    print(f"{name:8s} step {med['time/step']:.3f}s  rollout wait {med['time/rollout_wait']:.3f}s  "
          f"train {med['time/train']:.3f}s  sync {med['time/weight_sync']:.3f}s  {med['tok/s']:.0f} gen tok/s  "
          f"discarded {med['discarded']}")
    return med


def main(args):
    sync = run("sync", args, ["--train.async-queue-size", "0", *args.molt])
    partial = run("partial", args, args.molt)
    abort = run("abort", args, ["--rollout.update-mode", "abort", *args.molt])
    bound = max(sync["time/rollout_wait"], sync["time/train"] + sync["time/weight_sync"])
    print(f"async step / max(rollout, train) = {partial['time/step']:.3f} / {bound:.3f} = "
          f"{partial['time/step'] / bound:.2f} (goal <= 1.1); async vs sync step time "
          f"{partial['time/step'] / sync['time/step']:.2f}x")
    print(f"partial rollout: {partial['discarded']} tokens discarded, {partial['tok/s']:.0f} gen tok/s; "
          f"abort-and-restart: {abort['discarded']} discarded, {abort['tok/s']:.0f} gen tok/s "
          f"(throughput ratio partial/abort {partial['tok/s'] / abort['tok/s']:.2f})")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--tokens", type=int, default=64)
    known, rest = p.parse_known_args()
    known.molt = rest  # any other flags go to every molt.py run, e.g. --rollout.agent-pools 2
    main(known)
