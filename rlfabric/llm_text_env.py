"""A GRPO run on a text env (``env.id``): the checks that run before any actor starts, and what the rollout
worker is given to play episodes."""

from __future__ import annotations

import asyncio
from typing import Any

from rlfabric import registry
from rlfabric.actors.llm_rollout import TextEnvSource
from rlfabric.agent_loop import EpisodeLimits
from rlfabric.config import ConfigError
from rlfabric.grpo_config import LLMConfig
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.text_env import call_env, make_text_env

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
