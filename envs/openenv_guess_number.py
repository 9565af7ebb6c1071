"""GuessNumber as an OpenEnv environment server, written with OpenEnv's own API (``openenv.core``): an
``Environment`` with pydantic ``Action`` / ``Observation`` / ``State`` models, served by ``create_app`` (HTTP and
WebSocket routes ``/reset``, ``/step``, ``/state``, ``/ws``), one environment per WebSocket session.

The game is ``rlfabric.envs.guess_number``'s, with the same texts (so its scripted players play it): ``reset``
takes the task's ``secret`` and ``high`` and says ``Guess my number, 1 to {high}.``; an action's ``text`` is read
for its first integer and answered ``higher``, ``lower``, ``Right.`` (reward 1, done) or ``Say a number.``
(metadata ``invalid`` 1). Serve it with
``python -m uvicorn rlfabric.envs.openenv_guess_number:app --host 127.0.0.1 --port PORT`` in a Python that has
``openenv`` (``env.openenv.command`` starts it in the run's OpenEnv actor). Example: ``examples/openenv_grpo.yaml``.
"""

from __future__ import annotations

import re
from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

_NUMBER = re.compile(r"-?\d+")


class GuessAction(Action):
    text: str = ""


class GuessObservation(Observation):
    text: str = ""


class GuessState(State):
    secret: int = 0
    high: int = 16


class GuessNumberEnvironment(Environment):
    """One game per session (see the module docstring)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = GuessState(episode_id=str(uuid4()))

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, secret: int = 1, high: int = 16, **kwargs: Any
    ) -> GuessObservation:
        if not 1 <= int(secret) <= int(high):
            raise ValueError(f"secret = {secret}: must lie in 1..{high}")
        self._state = GuessState(episode_id=episode_id or str(uuid4()), secret=int(secret), high=int(high))
        return GuessObservation(text=f"Guess my number, 1 to {high}.", reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        s = self._state
        s.step_count += 1
        found = _NUMBER.search(action.text)
        if found is None:
            return GuessObservation(text="Say a number.", reward=0.0, metadata={"invalid": 1.0})
        guess = int(found.group())
        if guess == s.secret:
            return GuessObservation(text="Right.", reward=1.0, done=True)
        return GuessObservation(text="higher" if guess < s.secret else "lower", reward=0.0)

    @property
    def state(self) -> GuessState:
        return self._state


app = create_app(
    GuessNumberEnvironment,
    GuessAction,
    GuessObservation,
    env_name="guess_number",
    max_concurrent_envs=512,
    state_cls=GuessState,
)
