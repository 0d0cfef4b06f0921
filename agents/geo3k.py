"""Geometry with a diagram and a Python tool (an Env: vision-language, multi-turn). Each turn the model either calls
the tool, <tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>, whose output (and any plot it
saves) comes back as the next observation, or answers in \\boxed{}; the answer is graded against the label.

    python molt.py --agent agents/geo3k.py                                      # offline: tiny-vl, bundled problems
    python molt.py --agent agents/geo3k.py --model Qwen/Qwen2.5-VL-3B-Instruct --data ~/geo3k/train \\
        --eval-data ~/geo3k/test --engine.num-engines 2 --train.num-ranks 4     # after examples/prepare_geo3k.py
"""
import os

import molt
from molt import Env, Result, StepEnvRunner

HERE = os.path.dirname(os.path.abspath(__file__))
grader = molt.import_path(os.path.join(HERE, "..", "rewards", "math_grader.py"))
sandbox = molt.import_path(os.path.join(HERE, "..", "rewards", "sandbox.py"))
sandbox.require()  # no sandbox, no launch: it fails here, at start, saying how to get bubblewrap

DEFAULTS = {"model": "tiny-vl", "data.path": os.path.join(HERE, "..", "examples", "geo3k_tiny.jsonl"),
            "rollout.max_turns": 4, "rollout.max_new_tokens": 128, "rollout.n_samples_per_prompt": 4,
            "rollout.batch_size": 4, "data.max_len": 2048, "train.lr": 1e-5, "steps": 20}


class Geo3k(Env):
    async def reset(self, prompt, label):
        self.label, self.tool_calls = label, 0
        return prompt

    async def step(self, action: str) -> Result:
        _, calls = molt.parse_tool_calls(action)
        code = next((sandbox.tool_code(c) for c in calls if c["name"] == "python"), None)
        if code is None or "\\boxed" in action:  # an answer, or no usable tool call: grade and stop
            verdict = await molt.offload(grader.grade_verdict, action, self.label)
            reward = float(verdict.correct)
            return Result(reward=reward, info={"geo3k/correct": reward, "geo3k/tool_calls": self.tool_calls,
                                               **verdict.info()})
        self.tool_calls += 1
        out, images = await molt.offload(sandbox.run_python, code, with_images=True)
        return Result(reward=0.0, terminated=False, observation=[{"role": "tool", "content": out}],
                      images=images or None, info={"geo3k/correct": 0.0, "geo3k/tool_calls": self.tool_calls})


AgentRunner = StepEnvRunner(Geo3k)
