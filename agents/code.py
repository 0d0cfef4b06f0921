"""Code generation: the model writes a function; the reward is the fraction of hidden unit tests that pass when
its code runs in the sandbox (rewards/sandbox.py: time, memory, process and network limits).

    python molt.py --agent agents/code.py
"""
import asyncio
import json
import os
import re

import molt
from molt import Env, Result, StepEnvRunner

HERE = os.path.dirname(os.path.abspath(__file__))
sandbox = molt.import_path(os.path.join(HERE, "..", "rewards", "sandbox.py"))

DEFAULTS = {"data.path": os.path.join(HERE, "..", "examples", "code_tiny.jsonl"), "rollout.max_new_tokens": 128,
            "rollout.n_samples_per_prompt": 4, "rollout.batch_size": 4, "steps": 10}
FENCE = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last fenced code block, or the whole reply."""
    blocks = FENCE.findall(text)
    return blocks[-1] if blocks else text


def pass_fraction(code: str, tests: list[str]) -> float:
    """Run the code, then each test (an assert statement) in the same sandboxed process; count the passes."""
    harness = code + "\n\n_tests, _passed = " + json.dumps(tests) + ", 0\nfor _t in _tests:\n    try:\n" \
        "        exec(_t)\n        _passed += 1\n    except BaseException:\n        pass\nprint('@@passed', _passed)\n"
    out = sandbox.run_python(harness)
    found = re.findall(r"@@passed (\d+)", out)
    return int(found[-1]) / len(tests) if found and tests else 0.0


class Code(Env):
    async def reset(self, prompt, label):
        self.tests = label["tests"]
        return prompt

    async def step(self, action: str) -> Result:
        reward = await asyncio.to_thread(pass_fraction, extract_code(action), self.tests)
        return Result(reward=reward, info={"code/pass_fraction": reward, "code/all_pass": float(reward == 1.0)})


AgentRunner = StepEnvRunner(Code)
