"""Which policy plays which agent of a game, checked against the env's agents and spaces.

The same plan is made by the driver before any actor starts (so a bad mapping is one config error) and by every
rollout worker for its copies.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from rlfabric import shipping
from rlfabric.multiagent.config import MultiAgentConfig, policy_specs, trainable_policies
from rlfabric.multiagent.spaces import AgentSpaces, agent_spaces


def map_agents(agents: list[str], mapping: dict[str, str] | str, policies: list[str]) -> dict[str, str]:
    """agent -> policy: the first ``mapping`` pattern (fnmatch) that matches the agent, or what the function
    ``mapping`` names ("package.module:function", called with the agent id) returns; with no mapping, the one
    policy. An agent no pattern matches, or mapped to no policy of ``policies``, is a ValueError naming it."""
    if not mapping:
        return dict.fromkeys(agents, policies[0])
    if isinstance(mapping, str):
        function = shipping.import_callable(mapping)
        if function is None:
            raise ValueError(f"multi_agent.policy_mapping = {mapping!r}: not an importable 'package.module:function'")
        out = {agent: function(agent) for agent in agents}
        wrong = {a: p for a, p in out.items() if p not in policies}
        if wrong:
            agent, policy = next(iter(wrong.items()))
            raise ValueError(
                f"multi_agent.policy_mapping = {mapping!r} maps agent {agent!r} to {policy!r}, not a policy of "
                f"multi_agent.policies ({', '.join(policies)})"
            )
        return out
    out = {}
    for agent in agents:
        policy = next((p for pattern, p in mapping.items() if fnmatch.fnmatchcase(agent, pattern)), None)
        if policy is None:
            raise ValueError(
                f"multi_agent.policy_mapping: agent {agent!r} matches none of {sorted(mapping)}; add a pattern for it"
            )
        out[agent] = policy
    return out


@dataclass
class GamePlan:
    """A game's agents, what each one's policy sees (``spaces``), agent -> policy, and each policy's spaces."""

    agents: list[str]
    spaces: dict[str, AgentSpaces]
    mapping: dict[str, str]
    policy_spaces: dict[str, AgentSpaces]


def plan_game(env: Any, cfg: MultiAgentConfig, mapping: dict[str, str] | None = None) -> GamePlan:
    """The plan for ``env`` (a PettingZoo env) under ``cfg``, or a ValueError (UnsupportedSpaceError is one) naming
    the config field or agent at fault. ``mapping``: agent -> policy already resolved (by the driver), else
    ``cfg.policy_mapping`` is resolved here."""
    agents = list(env.possible_agents)
    spaces = {a: agent_spaces(env.observation_space(a), env.action_space(a), a) for a in agents}
    if mapping is None:
        mapping = map_agents(agents, cfg.policy_mapping, list(policy_specs(cfg)))
    policy_spaces: dict[str, AgentSpaces] = {}
    for agent, policy in mapping.items():
        mine = spaces[agent]
        if policy in policy_spaces and not policy_spaces[policy].same_as(mine):
            other = policy_spaces[policy]
            raise ValueError(
                f"multi_agent.policy_mapping: policy {policy!r} plays agents with different spaces ({agent!r}: "
                f"{mine.obs_dim} observations, {mine.action}; another: {other.obs_dim}, {other.action}); map them "
                "to different policies"
            )
        policy_spaces.setdefault(policy, mine)
    missing = [p for p in trainable_policies(cfg) if p not in policy_spaces]
    if missing:
        raise ValueError(
            f"multi_agent.policy_mapping: trainable policy {missing[0]!r} plays no agent of {agents}; map an agent "
            "to it or make it kind: random/scripted"
        )
    seats = [a for a, p in mapping.items() if p == cfg.self_play.policy]
    if cfg.self_play.enabled and len(seats) < 2:
        raise ValueError(
            f"multi_agent.self_play.policy: {cfg.self_play.policy!r} plays {len(seats)} agent(s) of {agents}; "
            "self-play needs it mapped to at least two (one plays it, the others its snapshots)"
        )
    return GamePlan(agents, spaces, mapping, policy_spaces)
