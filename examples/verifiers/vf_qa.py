"""A single-turn verifiers 0.4 environment on local data (taskset id "vf_qa"): the reply's number, exact match."""
import re

import verifiers.v1 as vf

ROWS = [("What is 2 + 2? Reply 'Answer: N'.", "4"), ("What is 3 + 5? Reply 'Answer: N'.", "8"),
        ("What is 9 - 4? Reply 'Answer: N'.", "5"), ("What is 1 + 1? Reply 'Answer: N'.", "2")]


class QAData(vf.TaskData):
    answer: str


class QATask(vf.Task[QAData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        found = re.search(r"Answer:\s*(-?\d+)", trace.last_reply or "")
        return float(bool(found) and found.group(1) == self.data.answer)

    @vf.reward(weight=0.5)
    async def has_digit(self, trace: vf.Trace) -> float:  # partial credit: the reward is a weighted sum
        return float(bool(re.search(r"\d", trace.last_reply or "")))

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class QATasksetConfig(vf.TasksetConfig):
    num_tasks: int = len(ROWS)


class QATaskset(vf.Taskset[QATask, QATasksetConfig]):
    def load(self):
        for i, (question, answer) in enumerate(ROWS[:self.config.num_tasks]):
            yield QATask(QAData(id=f"qa-{i}", prompt=question, answer=answer), self.config.task)


__all__ = ["QATaskset"]
