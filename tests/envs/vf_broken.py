"""A malformed verifiers environment (taskset id "vf_broken"): row 0's reward raises, row 1's is not a number."""
import verifiers.v1 as vf


class BrokenData(vf.TaskData):
    kind: str


class BrokenTask(vf.Task[BrokenData]):
    @vf.reward
    async def broken(self, trace: vf.Trace) -> float:
        if self.data.kind == "raises":
            raise RuntimeError("this reward is broken")
        return float("nan")


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self):
        for i, kind in enumerate(["raises", "nan"]):
            yield BrokenTask(BrokenData(id=f"broken-{i}", prompt="Say hi.", kind=kind), self.config.task)


__all__ = ["BrokenTaskset"]
