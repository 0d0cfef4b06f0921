"""What isolation costs: the sandbox and the code reward against the unisolated baselines, in one run, alternating.

    .venv/bin/python scripts/bench_sandbox.py [--rounds 5]

Contenders, each timed alone and in turn every round (medians over rounds):
- a bare `python -I -c 'print(1)'` subprocess, then sandbox.run_python('print(1)') (bubblewrap, seccomp, cgroups, as
  root the drop to the sandbox uid);
- the 20 MBPP-style problems of examples/code_mbpp_style.jsonl graded the way MBPP's own harness does it (solution,
  set-up and assertions exec'd in one bare subprocess, where the solution could forge any of them), then by
  rewards/code_grader.py (the solution's calls in its sandbox, the comparison in a second one);
- each agent CLI's start (`--version`: Codex CLI, Claude Code, opencode, installed by scripts/setup.sh) bare, then
  through sandbox.run_program as agents/cli.py runs it (a work directory given to the sandbox uid, the relay's Python
  parent listening for the session).
Prints each median in milliseconds and the ratio to its baseline.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import molt  # noqa: E402

grader = molt.import_path(str(ROOT / "rewards" / "code_grader.py"))
sandbox = grader.sandbox


def bare(source: str):
    subprocess.run([sys.executable, "-I", "-c", source], capture_output=True, check=False, timeout=60)


def mbpp_harness(rows):
    """MBPP's own way: one process per problem runs the solution, the set-up and the assertions together."""
    for r in rows:
        label = r["label"]
        bare("\n".join([r["solution"], *label.get("test_imports", []), label.get("test_setup_code", ""),
                        *label["test_list"]]))


def in_sandbox(binary: str, relay: str):
    work = tempfile.mkdtemp()
    try:
        sandbox.run_program([binary, "--version"], work, 60, (4000, relay), {"PATH": "/usr/bin:/bin"}, b"",
                            [os.path.dirname(binary)])
    finally:
        shutil.rmtree(work)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def main(args):
    rows = [json.loads(line) for line in (ROOT / "examples" / "code_mbpp_style.jsonl").read_text().splitlines()]
    problems = [grader.read_problem(r["label"]) for r in rows]
    contenders = {
        "bare python": lambda: bare("print(1)"),
        "sandbox.run_python": lambda: sandbox.run_python("print(1)"),
        "MBPP harness, 20 problems": lambda: mbpp_harness(rows),
        "code_grader, 20 problems": lambda: [grader.grade(r["solution"], p) for r, p in zip(rows, problems)],
    }
    relay = tempfile.mkdtemp() + "/s"  # (never connected to: --version asks nothing)
    pairs = [("sandbox.run_python", "bare python"), ("code_grader, 20 problems", "MBPP harness, 20 problems")]
    for cli in ("codex", "claude", "opencode"):
        binary = os.path.realpath(ROOT / ".venv" / "clis" / "node_modules" / ".bin" / cli)
        contenders[f"{cli} --version"] = lambda b=binary: subprocess.run([b, "--version"], capture_output=True)
        contenders[f"{cli} --version, run_program"] = lambda b=binary: in_sandbox(b, relay)
        pairs.append((f"{cli} --version, run_program", f"{cli} --version"))
    for fn in contenders.values():  # warm-up: imports, the checker's worker, page cache
        fn()
    times = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            times[name].append(timed(fn))
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, base in pairs:
        print(f"{name}: {median[name]:.1f} ms, {base}: {median[base]:.1f} ms, ratio {median[name] / median[base]:.2f}")
    shutil.rmtree(os.path.dirname(relay))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    main(p.parse_args())
