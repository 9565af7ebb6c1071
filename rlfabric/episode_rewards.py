"""Reward functions on multi-turn episodes: each finished episode scored as one sample, its scores on its turns.

With ``rewards.functions`` beside ``env.id`` (or an OpenEnv server), the rollout worker sends each group's finished
episodes to its reward services, as single-turn runs send completions (``rlfabric.reward_pool``). An episode is one
``RewardInput`` (``episode_input``):

- ``prompt``: the env's opening observation, what the policy was asked;
- ``completion``: the policy's turns and the observations shown between them, joined by line breaks:
  ``turn_0 \\n obs_0 \\n turn_1 ... turn_n`` (an observation after the last turn is not shown to the policy, so it
  is not here either);
- ``steps``: one per turn, tiling the completion: step 0 is turn 0, step k is ``"\\n" + obs_(k-1) + "\\n" + turn_k``
  (the action with what led to it), so a process reward model scoring the prefix prompt + steps[0..k] sees the
  conversation up to the end of turn k;
- ``metadata``: the task row without its prompt column; ``finish_reason`` "length" when the episode was cut, else
  "stop"; ``num_tokens`` the tokens the policy sampled.

The scores become per-turn rewards, exactly like the env's own components (``add_scores``): an outcome function's
components on the last turn, a process function's components on each turn. So the record's ``step_rewards`` hold
them on the turns' spans and ``final_rewards`` their sum over the episode, as for every component of a text env.
A component name the env gives too fails the episode (one line naming it): two sources would add up unnoticed.

An outside agent's episode (``env.agent``, ``agent_episode_input``) is one sample too: ``prompt`` the first user
message of its last segment (the conversation it ended with), ``completion`` the messages after it, one a line as
``role: text`` (an assistant's tool calls as ``name(arguments)``), and ``steps`` one per model call of that segment,
tiling the completion: step k is the lines after step k-1's up to the call's own reply (``"\\n"`` before each
step but the first), so step 0 also holds the messages before the first reply and the last step any after it.
Outcome components join the components the agent returned, on every segment's last turn as the agent's own do;
a process reward's per-step components go on the last segment's turns, and each earlier segment's row (a harness
that rewrote its history) gets their episode totals on its last turn (``add_agent_scores``). When a reply of the
segment came before its first user message, the conversation is one step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rlfabric.agent_loop import Episode
from rlfabric.agent_rollout import transcript_lines
from rlfabric.agents import AgentEpisode
from rlfabric.data import row_metadata
from rlfabric.rewards import RewardInput, RewardResult


def episode_steps(episode: Episode) -> list[str]:
    """The episode's steps as text, one per turn: turn 0, then ``"\\n" + observation before + "\\n" + turn``."""
    steps = []
    for k, text in enumerate(episode.texts):
        steps.append(text if k == 0 else f"\n{episode.observations[k - 1]}\n{text}")
    return steps


def episode_input(episode: Episode, task: dict[str, Any], prompt_key: str) -> RewardInput:
    """The ``RewardInput`` of one finished episode (see the module docstring)."""
    steps = episode_steps(episode)
    return RewardInput(
        prompt=episode.opening,
        completion="".join(steps),
        metadata=row_metadata(task, prompt_key),
        finish_reason="length" if episode.truncated else "stop",
        num_tokens=sum(len(t.sampled) for t in episode.turns),
        steps=steps,
    )


def agent_episode_input(episode: AgentEpisode, task: dict[str, Any], prompt_key: str) -> RewardInput:
    """The ``RewardInput`` of one finished outside-agent episode (see the module docstring)."""
    segment = episode.trace.segments[-1]
    first_user = next((k for k, m in enumerate(segment.messages) if m["role"] == "user"), None)
    prompt = str(task.get(prompt_key, "")) if first_user is None else str(segment.messages[first_user]["content"])
    skip = 0 if first_user is None else first_user + 1
    lines = transcript_lines(episode.trace, skip)
    return RewardInput(
        prompt=prompt,
        completion="\n".join(lines),
        metadata=row_metadata(task, prompt_key),
        finish_reason="length" if segment.truncated else "stop",
        num_tokens=sum(len(t.sampled) for s in episode.trace.segments for t in s.turns),
        steps=agent_steps(lines, [at - skip for at in segment.replies_at]),
    )


def agent_steps(lines: list[str], reply_lines: list[int]) -> list[str] | None:
    """The conversation's steps, one per model call: ``lines`` (one message each) cut after each call's reply
    (``reply_lines``, its line index), joined by ``"\\n"`` and tiling ``"\\n".join(lines)``; lines after the last reply
    join the last step. None (one step) when a reply lies before the first line or there is none."""
    if not reply_lines or reply_lines[0] < 0:
        return None
    ends = [*reply_lines[:-1], len(lines) - 1]
    starts = [0, *(end + 1 for end in ends[:-1])]
    return [
        "\n".join(lines[a : b + 1]) if k == 0 else "\n" + "\n".join(lines[a : b + 1])
        for k, (a, b) in enumerate(zip(starts, ends, strict=True))
    ]


def add_agent_scores(episode: AgentEpisode, result: RewardResult) -> None:
    """Add a reward result to an outside agent's episode: its outcome components join the agent's returned
    components, on every segment's last turn; a process reward's per-step components go on the last segment's
    turns (``AgentTrace.add_step_rewards``). A failed result, a component the agent returned too, or a step count
    other than the segment's turns fails the episode instead."""
    if result.error is not None:
        episode.error = result.error
        return
    steps = result.step_components or []
    clash = sorted((set(result.components) | {k for step in steps for k in step}) & set(episode.rewards))
    if clash:
        episode.error = (
            f"reward component {clash[0]!r} comes from both the agent and rewards.functions: rename one of them"
        )
        return
    given = dict(result.components)
    if len(steps) == 1 and len(episode.trace.segments[-1].turns) != 1:  # a conversation scored as one step
        given.update(steps[0])
    elif steps:
        try:
            episode.rewards.update(episode.trace.add_step_rewards(steps))
        except ValueError as exc:
            episode.error = str(exc)
            return
    scores = {name: float(value) for name, value in given.items()}
    episode.rewards.update(scores)
    episode.trace.add_rewards(scores)


def add_scores(episode: Episode, result: RewardResult) -> None:
    """Put a reward result on the episode's turns: its outcome components added to the last turn's rewards, its
    per-step components to each turn's. A failed result, or one naming a component the env gives too, fails the
    episode (``episode.error``) instead."""
    if result.error is not None:
        episode.error = result.error
        return
    steps = result.step_components or []
    given = set(result.components) | {k for step in steps for k in step}
    clash = sorted(given & set(episode.rewards))
    if clash:
        episode.error = (
            f"reward component {clash[0]!r} comes from both the env and rewards.functions: rename one of them"
        )
        return
    if steps and len(steps) != len(episode.turns):
        episode.error = f"a process reward scored {len(steps)} steps of an episode of {len(episode.turns)} turns"
        return
    for turn, step in zip(episode.turns, steps, strict=False):
        for name, value in step.items():
            turn.rewards[name] = turn.rewards.get(name, 0.0) + float(value)
    if episode.turns:
        last = episode.turns[-1].rewards
        for name, value in result.components.items():
            last[name] = last.get(name, 0.0) + float(value)


def score_episodes(
    score: Callable[[list[list[RewardInput]]], list[list[RewardResult]]],
    episodes: Sequence[Episode] | Sequence[AgentEpisode],
    tasks: list[dict[str, Any]],
    group_size: int,
    prompt_key: str,
) -> None:
    """Score the finished episodes (a text env's or an outside agent's), ``group_size`` consecutive ones per group
    (``score``: a reward pool's, one call for all groups), and put each result on its episode (``add_scores``,
    ``add_agent_scores``); ``tasks[i]`` is episode i's task row. Episodes that already failed are not scored."""
    groups = [
        [i for i in range(start, start + group_size) if episodes[i].error is None]
        for start in range(0, len(episodes), group_size)
    ]
    inputs = [[_input(episodes[i], tasks[i], prompt_key) for i in group] for group in groups]
    for group, group_results in zip(groups, score(inputs), strict=True):
        for i, result in zip(group, group_results, strict=True):
            episode = episodes[i]
            if isinstance(episode, AgentEpisode):
                add_agent_scores(episode, result)
            else:
                add_scores(episode, result)


def _input(episode: Episode | AgentEpisode, task: dict[str, Any], prompt_key: str) -> RewardInput:
    if isinstance(episode, AgentEpisode):
        return agent_episode_input(episode, task, prompt_key)
    return episode_input(episode, task, prompt_key)
