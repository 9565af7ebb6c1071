"""Multi-turn episodes of text envs, many in flight at once, built token by token.

``run_episodes`` plays one episode per task concurrently (asyncio tasks): each resets its own env, asks the
policy for a turn through the shared ``ActBatcher`` (so the episodes' requests reach the generators in batches,
each under its episode's session key, so a generator continues the episode's stored KV instead of prefilling its
earlier turns again), steps the env with the sampled text under a deadline, and appends the sampled ids and the
env's reply tokens (``ChatTokens``) to its sequence, until the env ends the episode or a limit cuts it.
``episodes_to_trajectories`` turns the finished episodes into one trajectory record (loss mask 1 exactly on
sampled tokens, one step span per turn, rewards by component per turn and per episode).

**State keys** (for step-level credit, GiGPO): a text env MAY have a method ``state_key()`` (sync or async, called
like its other methods, under the step deadline) that returns a hashable key of the env state the agent is about
to act in, e.g. a str digest of the tool server's session state. ``play`` calls it before each policy turn; the
key goes into the turn (``TurnTokens.state_key``) and from there into the record's ``state_keys``, where steps of
one group with equal keys form a step group. A call that raises, misses its deadline or returns an unhashable
value costs the episode nothing: that step gets a key of its own (``rlfabric.trajectory.UniqueStep``, never
grouped with another) and counts in ``Episode.env_errors`` and ``Episode.state_key_errors``. None is no key.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rlfabric import shipping
from rlfabric.config import ConfigError
from rlfabric.models.chat_tokens import ChatTokens, UnspellableText
from rlfabric.policies.batching import ActBatcher
from rlfabric.text_env import TextEnv, TextStep, call_env
from rlfabric.trajectory import NO_VERSION, Trajectories, TurnTokens, from_turns

DEFAULT_EPISODE_TOKENS = 2048  # an episode's token budget when the model's config does not say how long its context is
# A scripted player of a text env: (task, the chat so far as role/content messages) -> the next action's text.
Player = Callable[[dict[str, Any], list[dict[str, str]]], str]


@dataclass(frozen=True)
class EpisodeLimits:
    """``max_turns`` policy turns; ``turn_tokens``: the most a turn samples (the sampling's max_new_tokens), so
    a turn is started only when prompt and turns so far plus ``turn_tokens`` fit in ``max_episode_tokens``;
    ``step_timeout_s``: deadline of each reset and step; ``on_env_error``: a step that raises or misses its
    deadline ends the episode as failed (``fail``) or is shown to the agent as an error observation
    (``observe``)."""

    max_turns: int = 8
    turn_tokens: int = 32
    max_episode_tokens: int = 1024
    step_timeout_s: float = 30.0
    on_env_error: Literal["fail", "observe"] = "fail"

    def __post_init__(self) -> None:
        if self.on_env_error not in ("fail", "observe"):
            raise ValueError(f"on_env_error = {self.on_env_error!r}: expected 'fail' or 'observe'")
        if self.max_turns < 1 or self.turn_tokens < 1 or self.step_timeout_s <= 0:
            raise ValueError("max_turns, turn_tokens and step_timeout_s must be positive")


@dataclass
class Episode:
    """One played episode: its first prompt ids, its turns as tokens, the sampled texts, and how it ended."""

    task_index: int
    prompt: list[int]
    turns: list[TurnTokens] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    # the env's opening observation, and the observation shown after each turn ("" after the last): the episode's
    # text as the policy saw it, for reward functions (``rlfabric.episode_rewards``)
    opening: str = ""
    observations: list[str] = field(default_factory=list)
    truncated: bool = False
    error: str | None = None  # why the episode failed (its env raised or hung); failed episodes are not trained
    # env calls that raised or hung and the episode went on: steps shown to the agent (on_env_error = "observe")
    # and state_key calls
    env_errors: int = 0
    state_key_errors: int = 0  # state_key calls that raised, hung or returned an unhashable key (in env_errors too)
    tool_calls: int = 0  # tool calls the env ran or refused (TextStep.info["tool_calls"])
    invalid_tool_calls: dict[str, int] = field(default_factory=dict)  # by kind (TextStep.info, rlfabric.tools)
    # the first error text the agent was shown for each kind of invalid call (TextStep.info["tool_errors"]), so a
    # warm-up whose tool calls all fail can say why
    tool_errors: dict[str, str] = field(default_factory=dict)

    @property
    def rewards(self) -> dict[str, float]:
        """Reward components summed over the turns."""
        total: dict[str, float] = {}
        for turn in self.turns:
            for name, value in turn.rewards.items():
                total[name] = total.get(name, 0.0) + value
        return total


@dataclass
class Turn:
    """One turn's action: the token ids (as sampled), their behaviour logprobs, the version that chose them, their
    text, and why sampling stopped ("stop", or "length" when the turn ran out of tokens)."""

    sampled: list[int]
    logprobs: list[float]
    version: int
    text: str
    finish_reason: str = "stop"


class PolicyTurns:
    """One episode's turns from a policy over token contexts, through an ``ActBatcher`` shared by the episodes in
    flight; ``session`` keys the episode's requests (see ``rlfabric.engines.session_cache``)."""

    def __init__(self, batcher: ActBatcher, session: str | None = None) -> None:
        self.batcher = batcher
        self.session = session

    async def next_turn(self, context: list[int], messages: list[dict[str, str]], task: dict[str, Any]) -> Turn:
        acted = await self.batcher.act(context, self.session)
        return Turn(
            list(acted.actions[0]),
            list(acted.logprobs[0]),
            int(acted.versions[0]),
            str(acted.info["text"][0]),
            str(acted.info.get("finish_reason", ["stop"])[0]),
        )


def episode_token_limit(max_episode_tokens: int | None, context: int | None) -> int:
    """The tokens an episode may span: ``env.max_episode_tokens``, else the model's ``context`` (its positions),
    else ``DEFAULT_EPISODE_TOKENS``; a ConfigError when it exceeds the context."""
    limit = max_episode_tokens or context or DEFAULT_EPISODE_TOKENS
    if context is not None and limit > context:
        raise ConfigError(f"env.max_episode_tokens = {limit} is not valid: the model's context is {context} positions")
    return limit


def scripted_player(spec: str) -> Player:
    """The ``sft.player`` function, or one ConfigError naming it."""
    player = shipping.import_callable(spec)
    if not callable(player):
        raise ConfigError(f"sft.player = {spec!r} is not valid: not an importable 'package.module:function'")
    return player


class ScriptedTurns:
    """Demonstration turns from a scripted ``Player``: its text tokenized and closed with the template's
    end-of-turn token (so a model trained on them learns to stop); logprob 0 and no policy version."""

    def __init__(self, player: Player, chat: ChatTokens) -> None:
        self.player, self.chat = player, chat

    async def next_turn(self, context: list[int], messages: list[dict[str, str]], task: dict[str, Any]) -> Turn:
        text = str(self.player(task, messages))
        try:
            ids = self.chat.text_ids(text) + self.chat.turn_close[:1]
        except UnspellableText as exc:  # the player's doing, the same on every task like it: one line, not a trace
            raise ConfigError(f"sft.player: a demonstration turn cannot be tokenized: {exc}") from None
        return Turn(ids, [0.0] * len(ids), NO_VERSION, text)


def _describe(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return f"missed its {timeout_s:g}s deadline"
    return f"{type(exc).__name__}: {exc}"


async def _env_call(limits: EpisodeLimits, method: Any, *args: Any) -> Any:
    return await asyncio.wait_for(call_env(method, *args), limits.step_timeout_s)


async def _state_key(env: TextEnv, episode: Episode, limits: EpisodeLimits) -> Hashable | None:
    """The env's ``state_key()`` now (None when it has none); a failed call is counted and gives None, so the step
    gets a key of its own (see the module docstring)."""
    method = getattr(env, "state_key", None)
    if method is None:
        return None
    try:
        key = await _env_call(limits, method)
        hash(key)  # an unhashable key could not group steps: refused here, not in the learner
        return key
    except Exception:  # noqa: BLE001 - a key is an optional extra: the episode goes on without it
        episode.env_errors += 1
        episode.state_key_errors += 1
        return None


def opening_messages(env: TextEnv, observation: str) -> list[dict[str, str]]:
    """An episode's first messages: the env's ``system_prompt`` (when it has one), then its first observation."""
    system = getattr(env, "system_prompt", None)
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": observation}]


async def play(
    env: TextEnv,
    task: dict[str, Any],
    task_index: int,
    turns: PolicyTurns | ScriptedTurns,
    chat: ChatTokens,
    limits: EpisodeLimits,
) -> Episode:
    """One episode of ``env`` on ``task`` (see the module docstring). A failing policy call raises: the caller
    decides what a lost generator means; a failing env ends the episode as failed or as an observation."""
    try:
        observation = await _env_call(limits, env.reset, task)
    except Exception as exc:  # noqa: BLE001 - any env failure is the episode's, recorded
        return Episode(task_index, [], error=f"reset {_describe(exc, limits.step_timeout_s)}")
    messages = opening_messages(env, str(observation))
    try:
        prompt = chat.prompt(messages)
    except UnspellableText as exc:  # this task's text, not the run's: the episode fails, counted and named
        return Episode(task_index, [], opening=str(observation), error=f"the opening could not be tokenized: {exc}")
    episode = Episode(task_index, prompt, opening=str(observation))
    context = list(episode.prompt)
    for _ in range(limits.max_turns):
        if len(context) + limits.turn_tokens > limits.max_episode_tokens:
            episode.truncated = True
            return episode
        state_key = await _state_key(env, episode, limits)
        turn = await turns.next_turn(context, messages, task)
        sampled, text = turn.sampled, turn.text
        try:
            step = await _env_call(limits, env.step, text)
            if not isinstance(step, TextStep):
                raise TypeError(f"step returned {type(step).__name__}, expected TextStep")
        except Exception as exc:  # noqa: BLE001 - recorded as the episode's error or shown to the agent
            reason = f"step {_describe(exc, limits.step_timeout_s)}"
            if limits.on_env_error == "fail":
                episode.error = reason
                return episode
            episode.env_errors += 1
            step = TextStep(f"error: {reason}")
        episode.tool_calls += int(step.info.get("tool_calls", 0))
        for kind, count in step.info.get("invalid_tool_calls", {}).items():
            episode.invalid_tool_calls[kind] = episode.invalid_tool_calls.get(kind, 0) + int(count)
        for kind, text in step.info.get("tool_errors", {}).items():
            episode.tool_errors.setdefault(kind, str(text))
        done = step.terminated or step.truncated
        try:
            reply = [] if done else chat.reply(sampled, str(step.observation))
        except Exception as exc:  # noqa: BLE001 - e.g. a character the tokenizer has no token for
            episode.error = f"observation could not be tokenized: {type(exc).__name__}: {exc}"
            return episode
        episode.turns.append(TurnTokens(sampled, turn.logprobs, turn.version, reply, dict(step.rewards), state_key))
        episode.texts.append(text)
        episode.observations.append("" if done else str(step.observation))
        messages += [{"role": "assistant", "content": text}, {"role": chat.role, "content": str(step.observation)}]
        context += sampled + reply
        if done:
            episode.truncated = step.truncated and not step.terminated
            return episode
    episode.truncated = True  # out of turns
    return episode


async def run_episodes(
    make_env: Callable[[], TextEnv],
    tasks: Sequence[dict[str, Any]],
    turns: ActBatcher | PolicyTurns | ScriptedTurns,
    chat: ChatTokens,
    limits: EpisodeLimits,
) -> list[Episode]:
    """One episode per task, all in flight at once, each on its own env from ``make_env``; in task order. The
    turns come from a policy (an ``ActBatcher`` over it; each episode's requests under a session key of its own)
    or a scripted player (``ScriptedTurns``). Each env is closed when its episode ends (``close_env``)."""
    run = uuid.uuid4().hex[:12]  # session keys unique across calls and workers sharing a generator

    def source(i: int) -> PolicyTurns | ScriptedTurns:
        return PolicyTurns(turns, f"{run}/{i}") if isinstance(turns, ActBatcher) else turns

    async def one(i: int, task: dict[str, Any]) -> Episode:
        env = make_env()
        try:
            return await play(env, task, i, source(i), chat, limits)
        finally:
            await close_env(env, limits.step_timeout_s)

    return list(await asyncio.gather(*(one(i, task) for i, task in enumerate(tasks))))


async def close_env(env: TextEnv, timeout_s: float) -> None:
    """Call ``env.close()`` if it has one (an env holding a tool server session, say), within ``timeout_s``; the
    episode is over, so a close that fails or hangs costs nothing of it."""
    close = getattr(env, "close", None)
    if close is None:
        return
    try:
        await asyncio.wait_for(call_env(close), timeout_s)
    except Exception:  # noqa: BLE001, S110 - see the docstring
        pass


def episodes_to_trajectories(
    episodes: Sequence[Episode], episode_ids: Sequence[int], group_ids: Sequence[int]
) -> Trajectories:
    """The record of the episodes that did not fail (see ``rlfabric.trajectory.from_turns``); ``episode_ids``
    and ``group_ids`` are per episode, failed ones included."""
    kept = [i for i, e in enumerate(episodes) if e.error is None]
    return from_turns(
        [episodes[i].prompt for i in kept],
        [episodes[i].turns for i in kept],
        episode_ids=[episode_ids[i] for i in kept],
        group_ids=[group_ids[i] for i in kept],
        truncated=[episodes[i].truncated for i in kept],
    )
