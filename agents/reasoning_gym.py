"""reasoning-gym's procedural tasks as an Env: `--data reasoning-gym:TASK[,TASK...]` generates the prompts (a mix,
interleaved task by task), the model answers in <answer> tags and the library's own score_answer for that task is
the reward, graded off the event loop. Needs the envs extra (scripts/setup.sh installs it).

    python molt.py --agent agents/reasoning_gym.py                    # 3 easy tasks on the tiny model, offline
    python molt.py --agent agents/reasoning_gym.py --model Qwen/Qwen3-1.7B \\
        --data reasoning-gym:chain_sum,countdown,number_sorting --env.args '{"size": 2000, "seed": 1, "level": 1}'

--env.args: "size" (rows per task, 500), "seed" (the run's --seed), "level" (every task's config at that level of
its reasoning-gym curriculum), "config" ({task: {field: value}}, e.g. {"basic_arithmetic": {"max_terms": 2}}),
"system" (a reasoning-gym system prompt name, "default"). Without level or config a task takes its own defaults,
except the three of the default mix, which take EASY's (answers of a few characters). --eval-data takes the same
spelling; its rows come from seed + 1.
"""
import dataclasses
import itertools
import json

import molt
from molt import Env, Result, StepEnvRunner

SCHEME = "reasoning-gym:"
DEFAULTS = {"data.path": SCHEME + "basic_arithmetic,leg_counting,letter_counting", "rollout.max_new_tokens": 64,
            "rollout.n_samples_per_prompt": 4, "rollout.batch_size": 4, "steps": 4}
EASY = {"basic_arithmetic": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+", "-")),
        "leg_counting": dict(min_animals=1, max_animals=2, min_instances=1, max_instances=3),
        "letter_counting": dict(min_words=3, max_words=5)}  # the default mix's settings: answers of a few characters


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
                  "label": {"task": task, "entry": json.loads(json.dumps(e))}}  # tuples as lists, as a dump keeps them
                 for e in reasoning_gym.create_dataset(task, **task_config(task, args, seed))] for task in tasks]
    return [row for rows in itertools.zip_longest(*per_task) for row in rows if row]


class ReasoningGym(Env):  # Env.reset keeps the label ({"task", "entry"}) as self.label and shows the prompt
    async def step(self, action: str) -> Result:
        import reasoning_gym
        from reasoning_gym.utils import extract_answer
        answer = extract_answer(action)
        score = reasoning_gym.get_score_answer_fn(self.label["task"])
        reward = float(await molt.offload(score, answer, self.label["entry"]))
        return Result(reward=reward, info={f"rg/{self.label['task']}": reward,
                                           "rg/missing_answer": float(answer is None)})


AgentRunner = StepEnvRunner(ReasoningGym)
