"""Code generation: the model writes a function; the reward is the fraction of hidden unit tests it passes.

The solution runs in the sandbox (rewards/sandbox.py: bubblewrap, no network, limits). A test `assert CALL == LITERAL`
is split outside the sandbox: only CALL goes in, its value comes back as repr(), and the comparison with LITERAL
happens here, so the solution never sees an expected value and cannot report a pass: exiting early, printing a fake
result or rebinding builtins scores 0. (A bare `assert EXPR` expects True, which a solution could guess: prefer tests
that compare with a value.)

    python molt.py --agent agents/code.py
"""
import os
import re

import molt
from molt import Env, Result, StepEnvRunner

HERE = os.path.dirname(os.path.abspath(__file__))
sandbox = molt.import_path(os.path.join(HERE, "..", "rewards", "sandbox.py"))
sandbox.require()  # no sandbox, no launch: it fails here, at start, saying how to get bubblewrap

DEFAULTS = {"data.path": os.path.join(HERE, "..", "examples", "code_tiny.jsonl"), "rollout.max_new_tokens": 128,
            "rollout.n_samples_per_prompt": 4, "rollout.batch_size": 4, "steps": 10}
FENCE = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last fenced code block, or the whole reply."""
    blocks = FENCE.findall(text)
    return blocks[-1] if blocks else text


def pass_fraction(code: str, tests: list[str]) -> float:
    """The share of tests whose call returns the expected value, in [0, 1]."""
    if not tests:
        return 0.0
    calls, expected = zip(*(sandbox.split_test(t) for t in tests))
    values = sandbox.call_functions(code, list(calls))
    return sum(sandbox.matches(v, e) for v, e in zip(values, expected)) / len(tests)


class Code(Env):
    async def reset(self, prompt, label):
        self.tests = label["tests"]
        return prompt

    async def step(self, action: str) -> Result:
        reward = await molt.offload(pass_fraction, extract_code(action), self.tests)
        return Result(reward=reward, info={"code/pass_fraction": reward, "code/all_pass": float(reward == 1.0)})


AgentRunner = StepEnvRunner(Code)
