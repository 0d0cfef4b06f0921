"""kill -9, then --resume: how long until training goes on, and how much finished work survives.

    .venv/bin/python scripts/bench_resume.py [--rounds 3]

Each round runs the copy task asynchronously (2 batches queued ahead, 8 prompt groups in flight, a checkpoint every 2
steps) and kills every process of the run (driver, Ray, engines, trainers) while step 5's rollout is under way, right
after the checkpoint of step 4. It then resumes and reports:
  - the time from the kill to the first newly trained step (the resumed run's whole start-up included);
  - finished groups recovered / finished groups queued at the kill (read from the live rollout manager at the kill);
  - the prompts that were in flight, which the resumed run re-issues.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--agent", str(ROOT / "agents" / "copy.py"), "--rollout.batch-size", "4", "--rollout.n-samples-per-prompt", "4",
        "--train.async-queue-size", "2", "--rollout.groups-in-flight", "8", "--train.save-every", "2",
        "--rollout.max-staleness", "100", "--steps", "7"]


def one_round(seed: int) -> dict:
    run = Path(tempfile.mkdtemp(prefix="molt-bench-resume-")) / "run"
    cmd = [sys.executable, str(ROOT / "molt.py"), "--run-dir", str(run), "--seed", str(seed), *ARGS]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "MOLT_FAULTS": "rollout:step=5"}, start_new_session=True)
    marker = run / "fault-rollout"
    while not marker.exists():
        if proc.poll() is not None:
            sys.exit(f"the run ended before the kill point (exit {proc.returncode})")
        time.sleep(0.05)
    at_kill = json.loads(marker.read_text())["finished_groups"]
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    t_kill = time.time()
    for p in tree:
        p.kill()
    psutil.wait_procs(tree, timeout=30)
    saved = json.loads((run / "checkpoints" / "step_000004" / "molt_state.json").read_text())["rollout"]
    resumed = subprocess.Popen(cmd + ["--resume"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    while not any(json.loads(line)["step"] == 5 for line in open(run / "metrics.jsonl")):
        if resumed.poll() is not None:
            sys.exit(resumed.stderr.read()[-3000:])
        time.sleep(0.05)
    t_first = time.time() - t_kill
    resumed.wait()
    return {"seconds": t_first, "at_kill": at_kill, "restored": saved["finished_groups"],
            "in_flight": saved["in_flight"]}


def main(args):
    rounds = [one_round(seed) for seed in range(args.rounds)]
    for r in rounds:
        print(f"kill -> first new step {r['seconds']:5.1f} s; finished groups at the kill {r['at_kill']}, restored "
              f"{r['restored']}; prompts in flight re-issued {r['in_flight']}")
    fraction = sum(r["restored"] for r in rounds) / max(1, sum(r["at_kill"] for r in rounds))
    print(f"median kill -> first new trained step {statistics.median(r['seconds'] for r in rounds):.1f} s; "
          f"finished work recovered {fraction:.2f} ({sum(r['restored'] for r in rounds)} of "
          f"{sum(r['at_kill'] for r in rounds)} groups)")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    main(p.parse_args())
