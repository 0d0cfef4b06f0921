"""The learning check: prompt "copy: 7", reward 1 if the answer starts with "7". A random tiny model learns it on a
laptop CPU in a few minutes through the whole stack (Ray, vLLM engine, FSDP2 trainer, weight sync, async queue).

    python molt.py --agent agents/copy.py                             # mean reward >= 0.9 within the default steps
    python molt.py --agent agents/copy.py --train.async-queue-size 0  # synchronous, on-policy
"""
import os

from molt import Env, Result, StepEnvRunner

DEFAULTS = {
    "model": "tiny",
    "data.path": os.path.join(os.path.dirname(__file__), "..", "examples", "copy.jsonl"),
    "steps": 600,
    # 16, not 8: with 8 a group is too often all wrong in the first ~150 steps (no signal); measured on 3 seeds,
    # async: 16 -> 213 / 222 / 217 steps to 0.9 (115-178 s), 8 -> 590 / 267 / 518 (131-205 s), and once > 1,000
    "rollout.n_samples_per_prompt": 16,
    "rollout.batch_size": 16,
    "rollout.max_new_tokens": 2,
    "train.lr": 5e-4,
    "train.micro_batch_size": 64,
    "data.max_len": 128,
}


class Copy(Env):  # Env.reset keeps the label as self.label and shows the prompt
    async def step(self, action: str) -> Result:
        return Result(reward=float(action.startswith(self.label)))


AgentRunner = StepEnvRunner(Copy)
