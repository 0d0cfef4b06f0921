"""Start-up: how long `molt.py --agent agents/copy.py` takes to its first step, and where the time goes.

    .venv/bin/python scripts/bench_startup.py [--rounds 5] [--against OTHER_CHECKOUT]

1. time to the first step: wall seconds from launch until the run's metrics.jsonl holds step 1 (median of --rounds;
   with --against, the other checkout's molt.py alternates with this one's, each run alone);
2. the parts, each alone after its own Ray start: Ray's local cluster, the engine actor, the agent pool actor and the
   trainer, from creation to ready; and the floor under them: importing vLLM's engine, and torch with transformers, in
   a fresh interpreter.
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

ROOT = Path(__file__).resolve().parent.parent


def first_step_seconds(molt_py: Path) -> float:
    """Launch the copy task for 2 steps; seconds until metrics.jsonl holds step 1 (then the run is left to finish)."""
    with tempfile.TemporaryDirectory(prefix="molt-startup-") as tmp:
        metrics = Path(tmp) / "run" / "metrics.jsonl"
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, str(molt_py), "--agent", str(ROOT / "agents" / "copy.py"), "--steps",
                                 "2", "--run-dir", str(Path(tmp) / "run")], cwd=molt_py.parent,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        while not (metrics.exists() and metrics.read_text().strip()):
            if proc.poll() is not None:
                raise RuntimeError(f"{molt_py} ended before its first step: {proc.stderr.read()[-2000:]}")
            time.sleep(0.02)
        seconds = time.perf_counter() - t0
        proc.communicate()
    return seconds


PART = """
import sys, time
sys.path.insert(0, {root!r})
import molt, ray
cfg = molt.parse_config(["--agent", {agent!r}])
t = time.perf_counter(); molt.ray_init(cfg); ray_s = time.perf_counter() - t
path, t = molt.resolve_model(cfg.model), time.perf_counter()
if {part!r} == "engine":
    molt.start_engines(cfg, path)
elif {part!r} == "pool":
    ray.get([p.ping.remote() for p in molt.launch_pools(cfg, path, [])])
elif {part!r} == "trainer":
    molt.launch_models(cfg, path, None)
print("PART", ray_s, time.perf_counter() - t, flush=True)
"""


def part_seconds(part: str) -> tuple[float, float]:
    """(Ray's start, the part from creation to ready), in a fresh driver."""
    code = PART.format(root=str(ROOT), agent=str(ROOT / "agents" / "copy.py"), part=part)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    line = next(x for x in out.stdout.splitlines() if x.startswith("PART "))
    return tuple(float(x) for x in line.split()[1:])


def import_seconds(modules: str) -> float:
    out = subprocess.run([sys.executable, "-c", f"import time; t = time.perf_counter(); import {modules}; "
                          "print('IMPORT', time.perf_counter() - t, flush=True)"], capture_output=True, text=True)
    return float(next(x for x in out.stdout.splitlines() if x.startswith("IMPORT ")).split()[1])


def main(args):
    contenders = {"this checkout": ROOT / "molt.py"}
    if args.against:
        contenders[f"{args.against}"] = Path(args.against).resolve() / "molt.py"
    times = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, path in contenders.items():
            times[name].append(first_step_seconds(path))
    for name, t in times.items():
        print(f"time to the first step, {name}: median {statistics.median(t):.1f} s "
              f"({', '.join(f'{x:.1f}' for x in t)})")
    parts = {p: [part_seconds(p) for _ in range(args.rounds)] for p in ("engine", "pool", "trainer")}
    ray_s = statistics.median(r for runs in parts.values() for r, _ in runs)
    print(f"parts alone: Ray's local cluster {ray_s:.1f} s; " + "; ".join(
        f"{p} {statistics.median(s for _, s in runs):.1f} s" for p, runs in parts.items()))
    floor = {m: statistics.median(import_seconds(m) for _ in range(args.rounds))
             for m in ("vllm.v1.engine.async_llm", "torch, transformers")}
    print("imports alone: " + "; ".join(f"{m} {s:.1f} s" for m, s in floor.items()))
    print(json.dumps({"first_step": {k: statistics.median(v) for k, v in times.items()}, "ray": ray_s,
                      "parts": {p: statistics.median(s for _, s in r) for p, r in parts.items()}, "imports": floor}))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--against", default="", help="another checkout whose molt.py alternates with this one's")
    main(p.parse_args())
