"""Single-turn math: the model answers in \\boxed{}, graded by rewards/math_grader.py (an Env: Molt owns the loop).

    python molt.py --agent agents/math.py                       # bundled tiny set, tiny model, offline
    python molt.py --agent agents/math.py --model Qwen/Qwen3-4B --data my_math.jsonl --train.lr 1e-6
"""
import importlib.util
import os

from molt import Env, Result, StepEnvRunner

_spec = importlib.util.spec_from_file_location("math_grader", os.path.join(os.path.dirname(__file__), "..",
                                                                           "rewards", "math_grader.py"))
grader = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(grader)

DEFAULTS = {"data.path": os.path.join(os.path.dirname(__file__), "..", "examples", "math_tiny.jsonl"),
            "rollout.max_new_tokens": 64, "rollout.n_samples_per_prompt": 4, "rollout.batch_size": 4, "steps": 4}


class MathEnv(Env):
    async def reset(self, prompt, label):
        self.label = label
        return prompt

    async def step(self, action: str) -> Result:
        answer = grader.extract_answer(action)
        reward = float(grader.is_equiv(answer, self.label))
        return Result(reward=reward, info={"math/correct": reward, "math/missing_answer": float(answer is None)})


AgentRunner = StepEnvRunner(MathEnv)
