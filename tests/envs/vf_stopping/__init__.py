"""A verifiers taskset whose task has a @vf.stop hook, which the bridge refuses by name."""
import verifiers.v1 as vf


class StoppingTask(vf.Task[vf.TaskData]):
    @vf.stop
    async def enough(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def anything(self, trace: vf.Trace) -> float:
        return 1.0


class StoppingTaskset(vf.Taskset[StoppingTask, vf.TasksetConfig]):
    def load(self):
        yield StoppingTask(vf.TaskData(id="one", prompt="Say hi."), self.config.task)


__all__ = ["StoppingTaskset"]
