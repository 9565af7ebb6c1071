"""A GRPO run on a text env (``env.id``): the checks that run before any actor starts, what the rollout worker is
given to play episodes, the warm-up's demonstration batches, and each step's episode counts."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from rlfabric import registry, shipping
from rlfabric.actors.llm_rollout import EPISODE_COUNTS, TextEnvSource
from rlfabric.agent_loop import EpisodeLimits, Player, ScriptedTurns, episodes_to_trajectories, run_episodes
from rlfabric.config import ConfigError
from rlfabric.grpo_config import LLMConfig
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.models.llm_batch import pack_trajectories
from rlfabric.text_env import call_env, make_text_env, text_env_factory

DEFAULT_EPISODE_TOKENS = 2048  # when the model's config does not say how long its context is


def text_env_source(
    cfg: LLMConfig, tokenizer: Any, model_dir: str, first_task: dict, context: int | None
) -> TextEnvSource:
    """Build the env once and reset it on the first task (an env that cannot be built or reset fails here, in
    one line naming ``env.id``), check the tokenizer can format turns, and return the worker's ``TextEnvSource``.
    ``context``: the model's maximum positions, the default of ``env.max_episode_tokens``."""
    e = cfg.env
    try:
        env = make_text_env(e.id, e.kwargs)
        asyncio.run(call_env(env.reset, first_task))
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's env code: its error, named
        raise ConfigError(
            f"env.id = {e.id!r}: building it and resetting it on the first task failed: {type(exc).__name__}: {exc}"
        ) from None
    try:
        ChatTokens(tokenizer)
    except ValueError as exc:
        raise ConfigError(f"model.path = {cfg.model.path!r} cannot play text envs: {exc}") from None
    limit = e.max_episode_tokens or context or DEFAULT_EPISODE_TOKENS
    if context is not None and limit > context:
        raise ConfigError(f"env.max_episode_tokens = {limit} is not valid: the model's context is {context} positions")
    limits = EpisodeLimits(
        max_turns=e.max_turns,
        turn_tokens=cfg.sampling.max_new_tokens,
        max_episode_tokens=limit,
        step_timeout_s=e.step_timeout_s,
        on_env_error=e.on_env_error,
    )
    return TextEnvSource(e.id, dict(e.kwargs), limits, registry.snapshot(), model_dir)


def scripted_player(spec: str) -> Player:
    """The ``sft.player`` function, or one ConfigError naming it."""
    player = shipping.import_callable(spec)
    if not callable(player):
        raise ConfigError(f"sft.player = {spec!r} is not valid: not an importable 'package.module:function'")
    return player


class Demonstrations:
    """The scripted player's episodes on a text env, as SFT batches (``sft.player``). Built once before the
    warm-up: the player and the env are resolved and the template's delimiters read here, not every step."""

    def __init__(self, source: TextEnvSource, player_spec: str, tokenizer: Any) -> None:
        self.player = scripted_player(player_spec)
        self.chat = ChatTokens(tokenizer)
        self.make_env = text_env_factory(source.spec, source.kwargs)
        self.limits = source.limits
        self.pad_id = tokenizer.pad_token_id

    def batch(self, tasks: list[dict[str, Any]]) -> dict[str, np.ndarray]:
        """The SFT batch of the player's episodes on ``tasks``: their token rows, loss on its turns only. An
        episode that fails (its env raised) is left out; none left is an error naming the player."""
        turns = ScriptedTurns(self.player, self.chat)
        episodes = asyncio.run(run_episodes(self.make_env, tasks, turns, self.chat, self.limits))
        trajectories = episodes_to_trajectories(episodes, list(range(len(tasks))), list(range(len(tasks))))
        if trajectories.num_rows == 0:
            raise ConfigError(f"sft.player: every demonstration episode failed; the first: {episodes[0].error}")
        return pack_trajectories(trajectories, self.pad_id)


def episode_totals(scored: list[dict[str, Any]], samples: int) -> dict[str, float]:
    """A step's text-env episode counts (turns, env errors, tool calls, invalid tool calls by kind and in all),
    summed over its rollouts; nothing for single-turn runs."""
    if not any("turns" in m for m in scored):
        return {}
    totals = {key: float(sum(m.get(key, 0) for m in scored)) for key in EPISODE_COUNTS}
    totals["invalid_tool_calls"] = sum(v for k, v in totals.items() if k.startswith("invalid_tool_calls_"))
    totals["turns_mean"] = totals.pop("turns") / max(samples, 1)
    return totals
