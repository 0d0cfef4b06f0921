"""A multi-turn tool environment (taskset id "vf_calc"): the model may call the calculator, then answers."""
import re

import verifiers.v1 as vf
from vf_calc_tools import CalcToolset

ROWS = [("Use the calculator for 17*23, then reply 'Answer: N'.", "391"),
        ("Use the calculator for 12*12, then reply 'Answer: N'.", "144")]


class CalcData(vf.TaskData):
    answer: str


class CalcTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalcTask(vf.Task[CalcData, vf.State, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list:
        return [CalcToolset(config.tools)]

    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        found = re.search(r"Answer:\s*(-?\d+)", trace.last_reply or "")
        return float(bool(found) and found.group(1) == self.data.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(sum(m.role == "tool" for m in (trace.branches[-1].messages if trace.branches else [])))


class CalcTasksetConfig(vf.TasksetConfig):
    task: CalcTaskConfig = CalcTaskConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcTasksetConfig]):
    def load(self):
        for i, (question, answer) in enumerate(ROWS):
            yield CalcTask(CalcData(id=f"calc-{i}", prompt=question, answer=answer), self.config.task)


__all__ = ["CalcTaskset"]
