"""Single-turn math: the model answers in \\boxed{}, graded by rewards/math_grader.py (an Env: Molt owns the loop).

    python molt.py --agent agents/math.py                       # bundled tiny set, tiny model, offline
    python molt.py --agent agents/math.py --model Qwen/Qwen3-4B --data my_math.jsonl --train.lr 1e-6
"""
import os

import molt
from molt import Env, Result, StepEnvRunner

HERE = os.path.dirname(os.path.abspath(__file__))
grader = molt.import_path(os.path.join(HERE, "..", "rewards", "math_grader.py"))

DEFAULTS = {"data.path": os.path.join(HERE, "..", "examples", "math_tiny.jsonl"),
            "rollout.max_new_tokens": 64, "rollout.n_samples_per_prompt": 4, "rollout.batch_size": 4, "steps": 4}


class MathEnv(Env):  # Env.reset keeps the label as self.label and shows the prompt
    async def step(self, action: str) -> Result:
        answer = grader.extract_answer(action)
        verdict = await molt.offload(grader.check, answer, grader.label_answer(self.label))  # off the event loop
        reward = float(verdict.correct)
        return Result(reward=reward, info={"math/correct": reward, "math/missing_answer": float(answer is None),
                                           **verdict.info()})


AgentRunner = StepEnvRunner(MathEnv)
