"""Test agent: long multi-turn episodes (so weight updates land mid-response) plus misbehaving episodes: some raise,
some hang past the timeout, some return something other than a Result. Rows pick the behaviour."""
import asyncio

from molt import Env, Result, StepEnvRunner


class LongTurns(Env):
    async def reset(self, prompt, label):
        self.turn, self.mode = 0, label
        return prompt

    async def step(self, action: str):
        self.turn += 1
        if self.mode == "raise" and self.turn == 2:
            raise RuntimeError("this environment crashed")
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "bad" and self.turn == 2:
            return {"reward": 1.0}
        return Result(reward=len(action) / 100, observation=f"Turn {self.turn} done; continue.", terminated=self.turn == 3)


AgentRunner = StepEnvRunner(LongTurns)
