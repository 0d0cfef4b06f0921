"""Code generation: the model writes a function; the reward is the share of the problem's unit tests it passes.

rewards/code_grader.py grades it: each test assertion (plain `assert ...` lists, MBPP's test_list with test_imports /
test_setup_code, HumanEval's check(candidate) with entry_point) is split so that only the calls into the solution run
in its sandbox (rewards/sandbox.py: bubblewrap, no network, limits) and come back as plain data; the comparison runs
in a second sandbox the solution never touches. Exiting early, printing a fake result, returning an object that
equals everything or shadowing `sorted` / `math` scores 0. Tests that cannot be split so are refused and counted
(reward/unsplittable_tests); a problem none of whose tests can be is an error, not a reward.

    python molt.py --agent agents/code.py
"""
import os
import re

import molt
from molt import Env, Result, StepEnvRunner

HERE = os.path.dirname(os.path.abspath(__file__))
grader = molt.import_path(os.path.join(HERE, "..", "rewards", "code_grader.py"))
grader.sandbox.require()  # no sandbox, no launch: it fails here, at start, saying how to get bubblewrap

DEFAULTS = {"data.path": os.path.join(HERE, "..", "examples", "code_tiny.jsonl"), "rollout.max_new_tokens": 128,
            "rollout.n_samples_per_prompt": 4, "rollout.batch_size": 4, "steps": 10}
FENCE = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last fenced code block, or the whole reply."""
    blocks = FENCE.findall(text)
    return blocks[-1] if blocks else text


def pass_fraction(code: str, tests: list[str]) -> float:
    """The share of a plain list of assertions the code passes, in [0, 1]."""
    return grader.grade(code, grader.read_problem({"tests": tests}))


class Code(Env):
    async def reset(self, prompt, label):
        self.problem = grader.read_problem(label)
        if not self.problem.tests:
            raise ValueError(f"none of this problem's {self.problem.unsplittable} tests can be graded where the "
                             "solution cannot reach (see rewards/code_grader.py)")
        return prompt

    async def step(self, action: str) -> Result:
        reward = await molt.offload(grader.grade, extract_code(action), self.problem)
        return Result(reward=reward, info={"code/pass_fraction": reward, "code/all_pass": float(reward == 1.0),
                                           "reward/unsplittable_tests": float(self.problem.unsplittable)})


AgentRunner = StepEnvRunner(Code)
