"""reasoning-gym's procedural tasks as an Env: `--data reasoning-gym:TASK[,TASK...]` generates the prompts (a mix,
interleaved task by task), the model answers in <answer> tags and the library's own score_answer for that task is
the reward. The scorers read the answer as Python (sympy's parse_expr, eval), so they run where model code runs: in a
sandboxed worker (rewards/sandbox.py), a fresh fork per answer, killed at a deadline (a timeout scores as no answer
and is counted). The answer is cut from the reply here by a linear scan, at most ANSWER_CHARS of it. Where a
scorer misses its own task's invariant, the adapter checks it (INVARIANTS: puzzle24 accepts any four numbers that
make 24; here they must be the puzzle's). Needs the envs extra (scripts/setup.sh installs it).

    python molt.py --agent agents/reasoning_gym.py                    # 3 easy tasks on the tiny model, offline
    python molt.py --agent agents/reasoning_gym.py --model Qwen/Qwen3-1.7B \\
        --data reasoning-gym:chain_sum,countdown,number_sorting --env.args '{"size": 2000, "seed": 1, "level": 1}'

--env.args: "size" (rows per task, 500), "seed" (the run's --seed), "level" (every task's config at that level of
its reasoning-gym curriculum), "config" ({task: {field: value}}, e.g. {"basic_arithmetic": {"max_terms": 2}}),
"system" (a reasoning-gym system prompt name, "default"). Without level or config a task takes its own defaults,
except the three of the default mix, which take EASY's (answers of a few characters). --eval-data takes the same
spelling; its rows come from seed + 1.
"""
import base64
import dataclasses
import functools
import itertools
import json
import os
import pickle
import re

import molt
from molt import Env, Result, StepEnvRunner

SCHEME = "reasoning-gym:"
DEFAULTS = {"data.path": SCHEME + "basic_arithmetic,leg_counting,letter_counting", "rollout.max_new_tokens": 64,
            "rollout.n_samples_per_prompt": 4, "rollout.batch_size": 4, "steps": 4}
EASY = {"basic_arithmetic": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+", "-")),
        "leg_counting": dict(min_animals=1, max_animals=2, min_instances=1, max_instances=3),
        "letter_counting": dict(min_words=3, max_words=5)}  # the default mix's settings: answers of a few characters
ANSWER_CHARS = 4096  # a longer answer is no answer: no scorer reads more
TIMEOUT = float(os.environ.get("MOLT_GRADER_TIMEOUT", 5))
# Runs in the sandboxed worker. The entry travels pickled (the host generated it): its tuples stay tuples, which
# arc_agi's and rearc's scorers compare against.
SCORER = r'''
import base64, pickle
import reasoning_gym
def handler(req):
    entry = pickle.loads(base64.b64decode(req["entry"]))
    return {"score": float(reasoning_gym.get_score_answer_fn(req["task"])(req["answer"], entry))}
'''


def task_config(task: str, args: dict, seed: int) -> dict:
    """create_dataset's keyword arguments for one task: its curriculum level if asked, then the overrides."""
    from reasoning_gym.factory import create_curriculum
    cfg = {"size": args.get("size", 500), "seed": seed}
    if "level" in args:
        curriculum = create_curriculum(task)
        curriculum.set_global_level(args["level"])
        cfg = dataclasses.asdict(curriculum.generate_configuration(cfg))
    return {**cfg, **args.get("config", {}).get(task, EASY.get(task, {}) if "level" not in args else {})}


def load_data(spec: str, cfg, evaluation: bool) -> list[dict]:
    """Prompt rows for --data / --eval-data reasoning-gym:TASKS; any other spelling is read as a data file."""
    if not spec.startswith(SCHEME):
        return molt.read_rows(spec, cfg.data)
    import reasoning_gym
    from reasoning_gym.utils import SYSTEM_PROMPTS
    args = json.loads(cfg.env.args)
    seed = args.get("seed", cfg.seed) + evaluation  # evaluation rows differ from training rows
    system = SYSTEM_PROMPTS[args.get("system", "default")]
    tasks = [t for t in spec[len(SCHEME):].split(",") if t]
    per_task = [[{"prompt": [{"role": "system", "content": system}, {"role": "user", "content": e["question"]}],
                  "label": {"task": task, "entry": json.loads(json.dumps(e, default=repr)),  # to read, in dumps
                            "pickled": base64.b64encode(pickle.dumps(e)).decode()}}  # to score
                 for e in reasoning_gym.create_dataset(task, **task_config(task, args, seed))] for task in tasks]
    return [row for rows in itertools.zip_longest(*per_task) for row in rows if row]


def extract_answer(text: str) -> str | None:
    """reasoning_gym.utils.extract_answer's answer (the last <answer>...</answer> of a left-to-right scan, stripped)
    in linear time: the library's lazy regex is quadratic on unclosed tags (4.9 s for an 8k-token reply)."""
    found, pos = None, 0
    while (start := text.find("<answer>", pos)) >= 0 and (end := text.find("</answer>", start + 8)) >= 0:
        found, pos = (start + 8, end), end + 9
    return text[found[0]:found[1]].strip() if found else None


def uses_the_puzzles_numbers(answer: str, entry: dict) -> bool:
    return sorted(int(n) for n in re.findall(r"\d+", answer)) == sorted(entry["metadata"]["numbers"])


INVARIANTS = {"puzzle24": uses_the_puzzles_numbers}  # task -> (answer, entry) -> bool, what its scorer misses
# Scorers that run the answer as Python (sympy's parse_expr, eval): their answers must be data, not code, or the code
# could write the score its own fork reports. Allowed names (string contents included): one character, capitals only
# (letter strings; sympy's S, E, QQ) and MATH. A run of other letters (fullwidth, which Python folds to ASCII) is a
# long name too.
EVALUATES = {"countdown", "puzzle24", "polynomial_multiplication", "simple_integration", "intermediate_integration",
             "n_queens", "string_insertion", "spiral_matrix", "binary_matrix"}
MATH = {"sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "sinh", "cosh", "tanh", "exp", "log", "ln",
        "sqrt", "pi", "oo"}


def is_data(answer: str) -> bool:
    """No name in the answer that Python or sympy could call (builtins, module globals, dunders, sympy's API)."""
    names = (w.lstrip("0123456789") for w in re.findall(r"\w+", answer))  # numbers: no name; 2x: x
    return all(len(n) <= 1 or n.isupper() and n.isalpha() or n in MATH for n in names)


@functools.cache
def scorers():
    sandbox = molt.import_path(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                            "rewards", "sandbox.py"))
    return sandbox.WorkerPool(SCORER, int(os.environ.get("MOLT_GRADER_WORKERS", min(4, os.cpu_count() or 1))))


def score(task: str, answer: str | None, label: dict) -> dict:
    """The library's score in the sandbox; a sandbox that cannot start raises (an error, never a reward)."""
    refused = answer is not None and (len(answer) > ANSWER_CHARS or task in EVALUATES and not is_data(answer))
    answer = None if refused else answer
    out = scorers().call({"task": task, "answer": answer, "entry": label["pickled"]}, TIMEOUT)
    failed = {"reward/grader_timeouts": float(bool(out.get("timeout"))), "rg/scorer_errors": float("error" in out),
              "rg/refused_answers": float(refused)}
    if "score" not in out:  # a timeout, or the scorer raised: the library's score for no answer
        out = scorers().call({"task": task, "answer": None, "entry": label["pickled"]}, TIMEOUT)
    check = INVARIANTS.get(task)
    if check and answer is not None and not check(answer, label["entry"]):
        out = {"score": min(out.get("score", 0.0), 0.01)}  # 0.01: the library's score for a wrong answer
    return {"score": float(out.get("score", 0.0)), **failed}


class ReasoningGym(Env):  # Env.reset keeps the label ({"task", "entry", "pickled"}) as self.label, shows the prompt
    async def step(self, action: str) -> Result:
        answer = extract_answer(action)
        out = await molt.offload(score, self.label["task"], answer, self.label)
        reward = out.pop("score")
        return Result(reward=reward, info={f"rg/{self.label['task']}": reward, "rg/missing_answer": float(answer is None),
                                           **out})


AgentRunner = StepEnvRunner(ReasoningGym)
