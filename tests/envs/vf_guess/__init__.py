"""A multi-turn verifiers environment for the tests: the environment plays the user (`Env.run` answers
each guess with 'higher' or 'lower'), a task reward and an environment-recorded reward term."""
import re

import verifiers.v1 as vf

SYSTEM = "Guess the secret integer in [1, 100]. Reply with just a number."


class GuessData(vf.TaskData):
    secret: int


class GuessTask(vf.Task[GuessData]):
    @vf.reward(weight=1.0)
    async def solved(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == str(self.data.secret))

    @vf.metric
    async def guesses(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        for secret in (37, 80, 3, 64):
            yield GuessTask(GuessData(id=f"guess-{secret}", prompt="I picked a number. Your first guess?",
                                      system_prompt=SYSTEM, secret=secret), self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig(max_turns=10)
    max_guesses: int = 5


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as chat:
            segment = await chat.turn()
            guesses = 1
            while not segment.terminated:
                found = re.search(r"-?\d+", segment.last_reply)
                guess = int(found.group()) if found else None
                if guess == task.data.secret or guesses >= self.config.max_guesses:
                    break
                segment = await chat.turn("higher" if guess is None or guess < task.data.secret else "lower")
                guesses += 1
        chat.trace.record_reward("efficiency", 1.0 / guesses, 0.5)


__all__ = ["GuessTaskset", "GuessEnv"]
