"""A GRPO run on a text env (``env.id``): the checks that run before any actor starts, what the rollout worker is
given to play episodes, the warm-up's demonstration batches, and each step's episode counts."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from rlfabric import registry
from rlfabric.actors.llm_rollout import TextEnvSource
from rlfabric.actors.rollout_meta import AGENT_COUNTS, EPISODE_COUNTS
from rlfabric.agent_loop import (
    EpisodeLimits,
    ScriptedTurns,
    close_env,
    episode_token_limit,
    episodes_to_trajectories,
    run_episodes,
    scripted_player,
)
from rlfabric.config import ConfigError
from rlfabric.grpo_config import LLMConfig
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.models.packed_batch import pack_trajectories
from rlfabric.text_env import call_env, make_text_env, text_env_factory
from rlfabric.trajectory import Trajectories


def text_env_source(
    cfg: LLMConfig,
    tokenizer: Any,
    model_dir: str,
    first_task: dict,
    context: int | None,
    spec: str | None = None,
    kwargs: dict[str, Any] | None = None,
) -> TextEnvSource:
    """Build the env once and reset it on the first task (an env that cannot be built or reset fails here, in
    one line naming ``env.id``), check the tokenizer can format turns, and return the worker's ``TextEnvSource``.
    ``context``: the model's maximum positions, the default of ``env.max_episode_tokens``. ``spec`` and
    ``kwargs``: the text env the run made itself (an OpenEnv environment's), instead of ``env.id`` and
    ``env.kwargs``."""
    e = cfg.env
    spec, kwargs = (spec, kwargs or {}) if spec else (e.id, e.kwargs)
    what = "env.openenv" if e.openenv.command or e.openenv.url else "env.id"

    async def reset_once(env: Any) -> None:
        try:
            await call_env(env.reset, first_task)
        finally:
            await close_env(env, e.step_timeout_s)  # an env holding a tool server session lets it go

    try:
        env = make_text_env(spec, kwargs)
        asyncio.run(reset_once(env))
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's env code: its error, named
        named = f"env.id = {e.id!r}" if what == "env.id" else f"env.openenv ({e.openenv.command or e.openenv.url})"
        raise ConfigError(
            f"{named}: building it and resetting it on the first task failed: {type(exc).__name__}: {exc}"
        ) from None
    if cfg.grpo.step_credit == "gigpo" and not callable(getattr(env, "state_key", None)):
        raise ConfigError(
            f"grpo.step_credit = 'gigpo' needs env states to group steps by, and env.id = {e.id!r} has no state_key() "
            "method: use step_mix, or give the env a state_key() (docs/trajectories.md)"
        )
    # An env's count components (tool calls, say) are not rewards: it weighs them 0 unless rewards.weights does not.
    for name, weight in (getattr(env, "default_reward_weights", None) or {}).items():
        cfg.rewards.weights.setdefault(name, float(weight))
    try:
        ChatTokens(tokenizer)
    except ValueError as exc:
        raise ConfigError(f"model.path = {cfg.model.path!r} cannot play text envs: {exc}") from None
    limit = episode_token_limit(e.max_episode_tokens, context)
    limits = EpisodeLimits(
        max_turns=e.max_turns,
        turn_tokens=cfg.sampling.max_new_tokens,
        max_episode_tokens=limit,
        step_timeout_s=e.step_timeout_s,
        on_env_error=e.on_env_error,
    )
    return TextEnvSource(spec, dict(kwargs), limits, registry.snapshot(), model_dir)


class Demonstrations:
    """The scripted player's episodes on a text env, as SFT batches (``sft.player``). Built once before the
    warm-up: the player and the env are resolved and the template's delimiters read here, not every step."""

    def __init__(self, source: TextEnvSource, player_spec: str, tokenizer: Any) -> None:
        self.player = scripted_player(player_spec)
        self.chat = ChatTokens(tokenizer)
        self.make_env = text_env_factory(source.spec, source.kwargs)
        self.limits = source.limits
        self.pad_id = tokenizer.pad_token_id

    def trajectories(self, tasks: list[dict[str, Any]]) -> Trajectories:
        """The player's episodes on ``tasks``, loss on its turns only. An episode that fails (its env raised) is
        left out; none left is an error naming the player."""
        turns = ScriptedTurns(self.player, self.chat)
        episodes = asyncio.run(run_episodes(self.make_env, tasks, turns, self.chat, self.limits))
        trajectories = episodes_to_trajectories(episodes, list(range(len(tasks))), list(range(len(tasks))))
        if trajectories.num_rows == 0:
            raise ConfigError(f"sft.player: every demonstration episode failed; the first: {episodes[0].error}")
        return trajectories

    def batch(self, tasks: list[dict[str, Any]]) -> dict[str, np.ndarray]:
        """The SFT batch of the player's episodes on ``tasks`` (``trajectories``), packed."""
        return pack_trajectories(self.trajectories(tasks), self.pad_id)


def episode_totals(scored: list[dict[str, Any]], samples: int) -> dict[str, float]:
    """A step's text-env episode counts (turns, env errors, tool calls, invalid tool calls by kind and in all;
    with an outside agent its rewrites and the endpoint's refusals), summed over its rollouts; nothing for
    single-turn runs."""
    if not any("turns" in m for m in scored):
        return {}
    totals = {key: float(sum(m.get(key, 0) for m in scored)) for key in EPISODE_COUNTS}
    for key in AGENT_COUNTS:  # an outside agent's episodes: rewritten histories and refused requests
        if any(key in m for m in scored):
            totals[key] = float(sum(m.get(key, 0) for m in scored))
    totals["invalid_tool_calls"] = sum(v for k, v in totals.items() if k.startswith("invalid_tool_calls_"))
    totals["turns_mean"] = totals.pop("turns") / max(samples, 1)
    return totals


def tool_server_commands(tool_servers: list[str] | dict[str, str]) -> dict[str, str]:
    """``env.tool_servers`` as {name: command line}: a shipped task server's name alone stands for its HTTP command
    (``python -m rlfabric.envs.<name>_server --http {port} --host {host}``). A command with ``{port}`` serves
    streamable HTTP on it; one without is a stdio server, run behind the stdio gateway (a process per session)."""
    from rlfabric.envs.task_library import TASK_SERVERS

    named = tool_servers if isinstance(tool_servers, dict) else dict.fromkeys(tool_servers, "")
    commands = {}
    for name, command in named.items():
        if not command:
            if name not in TASK_SERVERS:
                raise ConfigError(
                    f"env.tool_servers: {name!r} is not a shipped task server ({', '.join(TASK_SERVERS)}); give its "
                    "command line, stdio ({mine: 'my-mcp-server'}) or streamable HTTP on {port} "
                    "({mine: 'my-mcp-server --port {port}'})"
                )
            command = TASK_SERVERS[name].http_command
        commands[name] = command
    return commands


def start_tool_servers(
    tool_servers: list[str] | dict[str, str], source: TextEnvSource, demonstrations: Demonstrations | None
) -> dict[str, Any]:
    """Start one supervised ``ToolServer`` actor per ``env.tool_servers`` entry and wait until each serves (a
    server that does not start is one error naming it, its command and its log); the env's factory then gets
    ``tool_servers={name: actor}`` among its kwargs, in the rollout workers and for the warm-up's episodes."""
    import ray

    from rlfabric.actors.tool_server import ToolServer
    from rlfabric.llm_resources import SETUP_TIMEOUT_S

    commands = tool_server_commands(tool_servers)
    if not commands:
        return {}
    handles = {name: ToolServer.remote(name, command) for name, command in commands.items()}
    try:
        ray.get([h.start.remote() for h in handles.values()], timeout=SETUP_TIMEOUT_S)
    except Exception as exc:
        stop_tool_servers(handles)
        cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
        raise ConfigError(f"env.tool_servers: {cause}") from None
    source.kwargs["tool_servers"] = handles
    if demonstrations is not None:
        demonstrations.make_env = text_env_factory(source.spec, source.kwargs)
    return handles


def stop_tool_servers(handles: dict[str, Any]) -> None:
    """Stop the supervised tool servers (their processes end with them) and their actors."""
    import ray

    try:
        ray.get([h.stop.remote() for h in handles.values()], timeout=10)
    except Exception:  # noqa: BLE001, S110 - killed below either way; their servers die with them
        pass
    for handle in handles.values():
        ray.kill(handle, no_restart=True)


def tool_server_restarts(handles: dict[str, Any]) -> int | None:
    """How many times the supervised tool servers were restarted (None when the run has none, or they do not
    answer within 10 s)."""
    import ray

    if not handles:
        return None
    try:
        return sum(h["restarts"] for h in ray.get([a.health.remote() for a in handles.values()], timeout=10))
    except Exception:  # noqa: BLE001 - a summary figure, not worth failing the run's end for
        return None
