"""A GRPO run on a text env (``env.id``): the checks that run before any actor starts, what the rollout worker is
given to play episodes, the warm-up's demonstration batches, and each step's episode counts."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from rlfabric import registry
from rlfabric.actor_slots import remote_cause
from rlfabric.actors.llm_rollout import TextEnvSource
from rlfabric.actors.rollout_meta import AGENT_COUNTS, EPISODE_COUNTS
from rlfabric.agent_loop import (
    Episode,
    EpisodeLimits,
    ScriptedTurns,
    close_env,
    episode_token_limit,
    episodes_to_trajectories,
    opening_messages,
    run_episodes,
    scripted_player,
)
from rlfabric.config import ConfigError
from rlfabric.grpo_config import BUILTIN_ALPHABETS, LLMConfig, LLMEnvConfig
from rlfabric.models.chat_tokens import ChatTokens, UnspellableText
from rlfabric.models.packed_batch import pack_trajectories
from rlfabric.text_env import call_env, make_text_env, text_env_factory
from rlfabric.tools import tool_call_parser
from rlfabric.trajectory import Trajectories


def check_tool_parser(e: LLMEnvConfig) -> None:
    """``env.tool_parser`` names a registered parser, and is not set where nothing reads it: a text env
    (``env.id``) parses its own calls (a ``ToolEnv``'s ``parser``, set through ``env.kwargs``), so a value other
    than the default there (a parser the user registered) would be silently ignored."""
    try:
        tool_call_parser(e.tool_parser, "env.tool_parser")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    default = next(f.default for f in dataclasses.fields(LLMEnvConfig) if f.name == "tool_parser")
    if e.id and e.tool_parser != default:
        raise ConfigError(
            f"env.tool_parser = {e.tool_parser!r} is not valid with env.id: a text env parses its own tool calls "
            "(ToolEnv's parser: set it through env.kwargs, e.g. {parser: hermes}); env.tool_parser is for env.agent, "
            "env.verifiers and env.openenv.tools"
        )


def check_takes_tool_servers(spec: str) -> None:
    """With ``env.tool_servers`` the env's factory is called with ``tool_servers={name: actor}`` in every rollout
    worker: one that cannot take that keyword is one line here, not a crash loop of the workers."""
    factory = registry.resolve(spec, "env.id")
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): the build itself will tell
        return
    # a default too: the check before Ray builds the env from env.kwargs alone, before any server runs
    takes = [p.kind is p.VAR_KEYWORD or (p.name == "tool_servers" and p.default is not p.empty) for p in parameters]
    if not any(takes):
        name = getattr(factory, "__qualname__", type(factory).__name__)
        raise ConfigError(
            f"env.id = {spec!r}: its factory {name} takes no tool_servers keyword with a default, and "
            "env.tool_servers hands it the servers as tool_servers={name: actor} (and the check before the run "
            "builds it without them): give it one, e.g. def make_env(tool_servers=None, ...)"
        )


def spelling_error(cfg: LLMConfig, what: str, exc: UnspellableText) -> ConfigError:
    """A ``ConfigError`` for text the model's tokenizer cannot spell, naming the setting that decides it and, for
    the builtin model, the named alphabets that have the characters."""
    m = cfg.model
    chars = ", ".join(map(repr, exc.characters))
    if m.path == "builtin":
        named = ", ".join(BUILTIN_ALPHABETS)
        fit = [
            repr(n) for n, a in BUILTIN_ALPHABETS.items() if n != m.builtin.alphabet and set(exc.characters) <= set(a)
        ]
        every = "a string of every character needed"
        fix = (
            f"set it to {' or '.join(fit)}, which has them (the named alphabets are {named}; 'tool' adds "
            f"{{}}[]\"'_\\ for JSON tool calls), or to {every}"
            if fit
            else f"no named alphabet ({named}) has them: set it to {every}"
        )
        return ConfigError(f"model.builtin.alphabet = {m.builtin.alphabet!r} has no {chars}, which {what} uses: {fix}")
    return ConfigError(
        f"model.path = {m.path!r}: its tokenizer has no token for {chars}, which {what} uses: leave them out of the "
        "text, or use a model whose tokenizer has them"
    )


def rows_spelling_error(
    cfg: LLMConfig, source: str, column: str, failed: list[tuple[str, UnspellableText]]
) -> ConfigError:
    """One ``spelling_error`` for every row of ``source`` (a data setting and its value) whose ``column`` the
    tokenizer cannot spell (``failed``: each row's name, e.g. "row 3", and its error): all the characters they
    lack, so one change of the alphabet fixes them, with the first such row's text to find it by."""
    chars = "".join(dict.fromkeys(c for _, exc in failed for c in exc.characters))
    row, first = failed[0]
    text = first.text if len(first.text) <= 40 else first.text[:37] + "..."
    rows = f"{len(failed)} rows, the first {row}" if len(failed) > 1 else row
    return spelling_error(cfg, f"the {column!r} column of {source} ({rows}: {text!r})", UnspellableText(chars, text))


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
    named = f"env.id = {e.id!r}" if what == "env.id" else f"env.openenv ({e.openenv.command or e.openenv.url})"
    if what == "env.id":
        check_tool_parser(e)
        if e.tool_servers:
            check_takes_tool_servers(spec)

    async def reset_once(env: Any) -> str:
        try:
            return str(await call_env(env.reset, first_task))
        finally:
            await close_env(env, e.step_timeout_s)  # an env holding a tool server session lets it go

    try:
        env = make_text_env(spec, kwargs)
        observation = asyncio.run(reset_once(env))
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's env code: its error, named
        raise ConfigError(
            f"{named}: building it and resetting it on the first task failed: {remote_cause(exc)}"
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
        chat = ChatTokens(tokenizer)
    except ValueError as exc:
        raise ConfigError(f"model.path = {cfg.model.path!r} cannot play text envs: {exc}") from None
    try:  # every episode's first prompt is like this one: text the model cannot spell fails here, not in a worker
        chat.prompt(opening_messages(env, observation))
    except UnspellableText as exc:
        raise spelling_error(cfg, f"the first task's opening ({named}: system prompt and observation)", exc) from None
    limit = episode_token_limit(e.max_episode_tokens, context)
    limits = EpisodeLimits(
        max_turns=e.max_turns,
        turn_tokens=cfg.sampling.max_new_tokens,
        max_episode_tokens=limit,
        step_timeout_s=e.step_timeout_s,
        on_env_error=e.on_env_error,
    )
    return TextEnvSource(spec, dict(kwargs), limits, registry.snapshot(), model_dir)


def stderr_note(message: str) -> None:
    """A note line as the run log prints one: the warm-up's batches are built where the log is not at hand."""
    print(f"rlfabric: {message}", file=sys.stderr, flush=True)


class DemonstrationReport:
    """What went wrong in the warm-up's demonstration episodes, told as it happens: the first failed episode and
    the first failed tool call of each kind, with the counts so far (later ones are counted, not printed), and once,
    when every tool call so far failed (a broken tool server: the demonstrations teach error replies). A failed
    episode is left out of the batch and a failed call is an observation like any other, so without this a warm-up
    on a broken server runs to its end without a word."""

    def __init__(self, note: Callable[[str], None] = stderr_note) -> None:
        self.note = note
        self.episodes = self.failed = self.calls = 0
        self.bad_calls: dict[str, int] = {}
        self.seen: set[str] = set()
        self.told_all_failed = False

    def add(self, episodes: list[Episode]) -> None:
        """Count a batch's episodes and note what is new in them."""
        new: list[tuple[str, str]] = []
        for episode in episodes:
            self.episodes += 1
            self.calls += episode.tool_calls
            for kind, count in episode.invalid_tool_calls.items():
                self.bad_calls[kind] = self.bad_calls.get(kind, 0) + count
            if episode.error is not None:
                self.failed += 1
                new += self._first("episode", "", episode.error)
            for kind, text in episode.tool_errors.items():
                new += self._first(f"call: {kind}", kind, text)
        for kind, text in new:
            self.note(self._line(kind, text))
        failed_calls = sum(n for kind, n in self.bad_calls.items() if kind != "malformed")
        if self.calls and failed_calls == self.calls and not self.told_all_failed:
            self.told_all_failed = True
            self.note(
                f"sft.player: every tool call of the {self.episodes} demonstration episodes so far failed "
                f"({self.calls} calls): the warm-up is training on error replies"
            )

    def _first(self, key: str, kind: str, text: str) -> list[tuple[str, str]]:
        if key in self.seen:
            return []
        self.seen.add(key)
        return [(kind, text)]

    def _line(self, kind: str, text: str) -> str:
        later = "the first of its kind: later ones are counted, not printed"
        if not kind:
            return (
                f"sft.player: a demonstration episode failed: {text} ({self.failed} of {self.episodes} so far; {later})"
            )
        return (
            f"sft.player: a demonstration's tool call failed ({kind}): {text} ({self.bad_calls.get(kind, 0)} of "
            f"{self.calls} calls so far; {later})"
        )


class Demonstrations:
    """The scripted player's episodes on a text env, as SFT batches (``sft.player``). Built once before the
    warm-up: the player and the env are resolved and the template's delimiters read here, not every step.
    ``report`` tells of failed episodes and tool calls as the batches are played."""

    def __init__(self, source: TextEnvSource, player_spec: str, tokenizer: Any) -> None:
        self.player = scripted_player(player_spec)
        self.chat = ChatTokens(tokenizer)
        self.make_env = text_env_factory(source.spec, source.kwargs)
        self.limits = source.limits
        self.pad_id = tokenizer.pad_token_id
        self.report = DemonstrationReport()

    def trajectories(self, tasks: list[dict[str, Any]]) -> Trajectories:
        """The player's episodes on ``tasks``, loss on its turns only. An episode that fails (its env raised) is
        left out (and reported); none left is an error naming the player."""
        turns = ScriptedTurns(self.player, self.chat)
        episodes = asyncio.run(run_episodes(self.make_env, tasks, turns, self.chat, self.limits))
        self.report.add(episodes)
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
