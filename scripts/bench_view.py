"""The viewer at scale: a synthetic run of 1,000 dumped samples of 1,000 tokens each (10 steps x 100, every channel
filled: versions, behaviour and trainer log-probs, IS weight, advantages), then `molt.py view` on it.

    .venv/bin/python scripts/bench_view.py [--samples 1000] [--tokens 1000] [--steps 10]

Prints the HTML size, the seconds `molt.py view` took, and headless Chromium's time to the page's first full render
(the page stamps body[data-ready] with performance.now() once the newest step's sample list is drawn), median of 3.
"""
import argparse
import json
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sample(rng, n_tokens, step, k):
    prompt = n_tokens // 4
    mask = [0] * prompt + [1] * (n_tokens - prompt)
    lp = [round(-rng.expovariate(1.0), 6) if m else 0.0 for m in mask]
    tr = [x + rng.gauss(0, 0.01) if m else 0.0 for x, m in zip(lp, mask)]
    return {"rollout_id": f"{step}-{k}", "group_id": f"{step}-{k // 8}", "segment": 0, "prompt_index": k, "epoch": 0,
            "tokens": [rng.randrange(115) for _ in range(n_tokens)], "mask": mask, "logprobs": lp,
            "versions": [step - 1 - rng.randrange(2) if m else -1 for m in mask], "temperatures": [None] * n_tokens,
            "reward": float(rng.random() < 0.5), "score": None, "n_images": 0, "finish_reason": "length", "info": {},
            "trainer": {"trainer_logprobs": [round(x, 4) for x in tr], "is_weight": [1.0] * n_tokens,
                        "is_masked": [0.0] * n_tokens, "advantages": [0.5 if k % 2 else -0.5] * n_tokens}}


def main(args):
    rng, run = random.Random(0), Path(tempfile.mkdtemp(prefix="molt-bench-view-"))
    (run / "samples").mkdir()
    (run / "config.json").write_text(json.dumps({"model": "tiny", "agent": "synthetic"}))
    per_step = args.samples // args.steps
    with open(run / "metrics.jsonl", "w") as m:
        for step in range(1, args.steps + 1):
            with open(run / "samples" / f"step_{step:06d}.jsonl", "w") as f:
                for k in range(per_step):
                    f.write(json.dumps(sample(rng, args.tokens, step, k)) + "\n")
            m.write(json.dumps({"step": step, "reward/mean": rng.random(), "rollout/staleness_max": 1,
                                "tokens/generated": 75000, "time/step": 2.0, "is/masked_frac": 0.0}) + "\n")
    dump_mb = sum(p.stat().st_size for p in (run / "samples").iterdir()) / 2**20
    t = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "molt.py"), "view", str(run)], check=True, capture_output=True)
    write_s = time.perf_counter() - t
    page = run / "view.html"
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    (run / "empty.html").write_text("<html><body data-ready=0>empty</body></html>")
    paints, walls, empty = [], [], []
    for _ in range(3):  # alternating with an empty page: Chromium's own start-up is the baseline
        for url, out in ((page.as_uri() + f"#step={args.steps}&sample=0", walls), ((run / "empty.html").as_uri(), empty)):
            t = time.perf_counter()
            dom = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=60000",
                                  "--dump-dom", url], capture_output=True, text=True, timeout=300).stdout
            out.append(time.perf_counter() - t)
            paints += [float(re.search(r'data-ready="([\d.]+)"', dom).group(1))] if out is walls else []
    print(f"{args.samples} samples x {args.tokens} tokens ({dump_mb:.0f} MiB of dumps): view.html "
          f"{page.stat().st_size / 2**20:.1f} MiB, written in {write_s:.1f} s (molt.py view, start-up included)")
    print(f"headless Chromium, median of 3: page with step {args.steps} and its sample 0 rendered "
          f"{statistics.median(walls):.2f} s wall vs an empty page {statistics.median(empty):.2f} s "
          f"(difference {statistics.median(walls) - statistics.median(empty):.2f} s); the page's own clock at render "
          f"{statistics.median(paints):.0f} ms (virtual time)")
    shutil.rmtree(run)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--steps", type=int, default=10)
    main(p.parse_args())
