"""An OpenEnv (0.10) environment: sums of small numbers, with one retry.

Written against the library alone (no megatron_rl import), as an OpenEnv environment package's server
side would be. Each reset draws a sum of `terms` numbers of 1 to `digits` digits from the reset seed
(the quickstart's reasoning-gym chain_sum questions, written out here); the action is the model's
reply; the step reward is 1 when the reply's last number is the sum, halved on the retry that follows a
wrong first answer. Train on it with `agent.environment:
openenv:openenv_arithmetic:ArithmeticEnvironment` (examples/configs/agent_openenv.yaml); serve it alone
with `uvicorn openenv_arithmetic:app`.
"""
from __future__ import annotations

import random
import re
from typing import Any, Optional
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class ArithmeticAction(Action):
    reply: str


class ArithmeticObservation(Observation):
    prompt: str = ""


class ArithmeticState(State):
    question: str = ""
    answer: int = 0
    attempts: int = 0


class ArithmeticEnvironment(Environment[ArithmeticAction, ArithmeticObservation, ArithmeticState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, terms: int = 2, digits: int = 2, attempts: int = 2):
        super().__init__()
        self.terms, self.digits, self.max_attempts = terms, digits, attempts
        self._state = ArithmeticState()

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> ArithmeticObservation:
        rng = random.Random(seed)
        numbers = [rng.randint(0, 10 ** rng.randint(1, self.digits) - 1) for _ in range(self.terms)]
        question = f"State the final answer to the following arithmetic problem: {' + '.join(map(str, numbers))} ="
        self._state = ArithmeticState(episode_id=episode_id or str(uuid4()), question=question, answer=sum(numbers))
        return ArithmeticObservation(prompt=question, reward=0.0, done=False)

    def step(self, action: ArithmeticAction, timeout_s: Optional[float] = None, **kwargs: Any) -> ArithmeticObservation:
        state = self._state
        state.step_count += 1
        state.attempts += 1
        numbers = re.findall(r"-?\d+", action.reply.replace(",", ""))
        correct = bool(numbers) and int(numbers[-1]) == state.answer
        if correct or state.attempts >= self.max_attempts:
            return ArithmeticObservation(prompt="", reward=float(correct) / state.attempts, done=True)
        return ArithmeticObservation(prompt=f"That is not right. Try again: {state.question}", reward=0.0, done=False)

    @property
    def state(self) -> ArithmeticState:
        return self._state


app = create_app(ArithmeticEnvironment, ArithmeticAction, ArithmeticObservation, env_name="arithmetic",
                 state_cls=ArithmeticState, max_concurrent_envs=64)
