"""Outside agents as a run's rollout: many agent episodes through one endpoint, their traces as trajectories.

With ``env.agent`` a run's episodes are agent functions (``rlfabric.agents``): for each task row, ``group_size``
episodes of ``agent(task, client)`` run at once, each with an ``openai.AsyncOpenAI`` client on a session of its
own, on an endpoint (``rlfabric.openai_endpoint``) started for the rollout on the worker's event loop. The policy
answers their calls through one ``ActBatcher``, so the calls of all episodes in flight reach the generators in
batches. Each exact segment of an episode's trace (``rlfabric.agent_trace``) is one trajectory row with the
episode's reward components; an episode that failed (its agent raised, hung, never called the model or returned
no rewards) gives no row and is counted with its error.

The same episodes with a scripted player answering the calls (``sft.player``) are the warm-up's demonstrations:
the agent's own messages and tool use, in its own format, with the loss on the player's turns.
"""

from __future__ import annotations

import asyncio
import functools
import json
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlfabric import shipping
from rlfabric.agent_loop import Player, episode_token_limit, scripted_player
from rlfabric.agent_trace import AgentTrace
from rlfabric.agents import Agent, AgentEpisode, play_agent, resolve_agent
from rlfabric.config import ConfigError
from rlfabric.grpo_config import LLMConfig
from rlfabric.models.chat_tokens import ChatTokens
from rlfabric.models.packed_batch import pack_trajectories
from rlfabric.openai_endpoint import OpenAIEndpoint, new_run_token
from rlfabric.policies.batching import ActBatcher
from rlfabric.tools import tool_call_parser
from rlfabric.trajectory import Trajectories, from_turns

# What the endpoint refused, by kind, as the run's metrics name it (rlfabric.openai_endpoint.OpenAIEndpoint.refused)
REFUSED_COUNTS = ("refused_unauthorized", "refused_unknown_session", "refused_bad_request")


@dataclass
class AgentSource:
    """What a rollout worker needs to play ``env.agent``: the agent function (pickled with its module when that
    is not installed, so a worker never imports the user's script), the spec that named it, the model folder
    whose tokenizer renders the calls, the tool-call parser, the episode deadline and the longest context a call
    may have before its turn's tokens."""

    spec: str
    agent: bytes
    model_dir: str
    tool_parser: str
    deadline_s: float
    max_context_tokens: int

    def load(self) -> Agent:
        return shipping.loads(self.agent)["agent"]


def agent_run_source(
    cfg: LLMConfig, tokenizer: Any, model_dir: str, context: int | None, agent: Agent | None = None
) -> AgentSource:
    """Check a run's ``env.agent`` before any actor starts (the agent resolves to an async function, the tool
    parser exists, the tokenizer can render chats; each a ConfigError naming its field) and return what the
    rollout workers are given. ``context``: the model's positions; a call may bring at most that (or
    ``env.max_episode_tokens``) less ``sampling.max_new_tokens`` tokens of conversation. ``agent``: the agent
    function when the run makes it (a verifiers environment's), instead of resolving ``env.agent``."""
    e = cfg.env
    if agent is None:
        agent = resolve_agent(e.agent, "env.agent")
    try:
        tool_call_parser(e.tool_parser, "env.tool_parser")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        ChatTokens(tokenizer)
    except ValueError as exc:
        raise ConfigError(f"model.path = {cfg.model.path!r} cannot serve chat calls: {exc}") from None
    limit = episode_token_limit(e.max_episode_tokens, context)
    return AgentSource(
        e.agent or e.verifiers.id,
        shipping.dumps_with_user_code({"agent": agent}),
        model_dir,
        e.tool_parser,
        e.agent_timeout_s,
        limit - cfg.sampling.max_new_tokens,
    )


async def play_agents(
    agent: Agent,
    tasks: Sequence[dict[str, Any]],
    chat: ChatTokens,
    *,
    batcher: ActBatcher | None = None,
    player: Player | None = None,
    tool_parser: str = "hermes",
    deadline_s: float = 120.0,
    max_context_tokens: int | None = None,
) -> tuple[list[AgentEpisode], dict[str, int]]:
    """One episode of ``agent`` per task, all at once, on an endpoint started here and answered by the policy
    behind ``batcher`` or by the scripted ``player``: (the episodes in task order, what the endpoint refused by
    kind). A call the policy failed (a lost generator) raises its error once every episode has ended."""
    import openai  # the client agents are written against; imported only where agents run

    endpoint = OpenAIEndpoint(
        batcher,
        chat,
        token=new_run_token(),
        player=player,
        tool_parser=tool_parser,
        max_context_tokens=max_context_tokens,
    )
    await endpoint.start()
    # one client, so one connection pool for every session; each episode's copy differs only in its base URL. Its
    # TLS context is made once per process: a new one costs ~20 ms, and the endpoint speaks plain HTTP anyway.
    http = openai.DefaultAsyncHttpxClient(verify=_tls_context())
    base_url = f"http://{endpoint.host}:{endpoint.port}/v1"
    shared = openai.AsyncOpenAI(
        base_url=base_url, api_key=endpoint.token, max_retries=0, timeout=deadline_s, http_client=http
    )
    try:

        async def one(i: int, task: dict[str, Any]) -> AgentEpisode:
            key = f"episode-{i}"
            url, trace = endpoint.open(key, task)
            client = shared.with_options(base_url=url)
            try:
                return await play_agent(agent, task, i, client, trace, deadline_s)
            finally:
                endpoint.close(key)

        played = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)), return_exceptions=True)
    finally:
        await shared.close()
        await endpoint.stop()
    for outcome in played:
        if isinstance(outcome, BaseException):
            raise outcome
    return list(played), {f"refused_{k}": v for k, v in endpoint.refused.items()}  # type: ignore[arg-type]


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


def agent_trajectories(
    episodes: Sequence[AgentEpisode], episode_ids: Sequence[int], group_ids: Sequence[int]
) -> Trajectories:
    """One row per exact segment of the episodes that did not fail, each with its episode's id and group (a
    harness that rewrote its history gives several rows of one episode); ``episode_ids`` and ``group_ids`` are
    per episode, failed ones included. A row is truncated when its last turn ran out of tokens."""
    rows = [(k, s) for k, e in enumerate(episodes) if e.error is None for s in e.trace.segments]
    return from_turns(
        [s.prompt for _, s in rows],
        [s.turns for _, s in rows],
        episode_ids=[episode_ids[k] for k, _ in rows],
        group_ids=[group_ids[k] for k, _ in rows],
        truncated=[s.truncated for _, s in rows],
    )


def episode_versions(episodes: Sequence[AgentEpisode]) -> np.ndarray:
    """[rows] the oldest policy version of each row's turns (``agent_trajectories``' order)."""
    return np.array(
        [min(t.version for t in s.turns) for e in episodes if e.error is None for s in e.trace.segments], np.int64
    )


def transcript_lines(trace: AgentTrace, skip: int = 0) -> list[str]:
    """The last segment's conversation, one message a line, each message after the first ``skip`` as
    ``role: text``, an assistant's tool calls as ``name(arguments)``."""
    if not trace.segments:
        return []
    lines = []
    for m in trace.segments[-1].messages[skip:]:
        calls = [f"{c['function']['name']}({json.dumps(c['function']['arguments'])})" for c in m.get("tool_calls", [])]
        lines.append(f"{m['role']}: {' '.join([m['content'], *calls]).strip()}")
    return lines


def transcript(trace: AgentTrace, separator: str = " | ") -> str:
    """The last segment's conversation on one line (``transcript_lines``), for the samples a run shows."""
    return separator.join(transcript_lines(trace))


class AgentDemonstrations:
    """The agent's episodes with ``sft.player`` answering its calls, as SFT batches (the warm-up of a run on
    ``env.agent``): the agent's messages in its own format, the loss on the player's turns."""

    def __init__(self, source: AgentSource, player_spec: str, tokenizer: Any) -> None:
        self.player = scripted_player(player_spec)
        self.agent = source.load()
        self.source = source
        self.chat = ChatTokens(tokenizer)
        self.pad_id = tokenizer.pad_token_id

    def trajectories(self, tasks: list[dict[str, Any]]) -> Trajectories:
        """The agent's episodes on ``tasks`` with the player answering; a failed episode is left out, and none
        left is an error naming the player and the first episode's error."""
        s = self.source
        episodes, _ = asyncio.run(
            play_agents(
                self.agent,
                tasks,
                self.chat,
                player=self.player,
                tool_parser=s.tool_parser,
                deadline_s=s.deadline_s,
                max_context_tokens=s.max_context_tokens,
            )
        )
        trajectories = agent_trajectories(episodes, list(range(len(tasks))), list(range(len(tasks))))
        if trajectories.num_rows == 0:
            raise ConfigError(f"sft.player: every demonstration episode failed; the first: {episodes[0].error}")
        return trajectories

    def batch(self, tasks: list[dict[str, Any]]) -> dict[str, np.ndarray]:
        """The SFT batch of the agent's episodes on ``tasks`` (``trajectories``), packed."""
        return pack_trajectories(self.trajectories(tasks), self.pad_id)
