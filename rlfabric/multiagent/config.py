"""The ``multi_agent`` section of a PPO config: which policies act in a game, which agent each one plays, the
critic (MAPPO or IPPO) and self-play. Validated with the rest of the config, before any actor starts."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from rlfabric.config_base import require

POLICY_KINDS = ("neural", "random", "scripted", "llm", "frozen")


@dataclass
class PolicySpec:
    # neural: a trainable MLP policy with its own learner, optimizer and versions. random: uniform over the legal
    # actions. scripted: a fixed rule, ``rule`` = a shipped one ("tictactoe") or "package.module:function" taking
    # (flat observations [B, D], action masks [B, A] or None) and returning B actions. llm: a language model served
    # by a generator actor, acting on ``render``'s text of its observation; the first digits of its reply are the
    # move; frozen unless ``train``. frozen: a neural policy trained before, loaded from ``checkpoint`` and never
    # updated.
    kind: Literal["neural", "random", "scripted", "llm", "frozen"] = "neural"
    rule: str | None = None
    # llm: a Hugging Face model folder, or "builtin" (the small character-level model the project builds)
    model: str = "builtin"
    # llm: the observation as text: a shipped renderer ("tictactoe") or "package.module:function(obs, mask) -> str"
    render: str | None = None
    temperature: float = 1.0
    max_new_tokens: int = 2
    # llm: train it on its moves (rlfabric.multiagent.llm_turns): each move's reward is the agent's return from that
    # move to the end of its episode, minus invalid_move_penalty when the reply named no legal move; GRPO's loss with
    # the iteration's moves as one group, AdamW at ``lr``, its own learner actor (1 CPU).
    train: bool = False
    lr: float = 1e-4
    invalid_move_penalty: float = 1.0
    # frozen: a PPO run directory (its latest checkpoint) or a checkpoint file, and the policy in it to load
    # (null: the run's only trainable policy)
    checkpoint: str | None = None
    from_policy: str | None = None


@dataclass
class SelfPlayConfig:
    # Off: every agent plays the policy it is mapped to. On: in each episode one agent mapped to ``policy`` (chosen
    # at random) plays the learning policy and its other agents play a frozen snapshot drawn from the opponent pool.
    enabled: bool = False
    policy: str = "main"
    # A snapshot of the learning policy joins the pool every this many versions (null: never on a schedule) ...
    snapshot_every: int | None = 10
    # ... or when its win rate against the pool over the last win_rate_window games reaches this (null: never).
    win_rate_threshold: float | None = None
    win_rate_window: int = 100
    min_games: int = 50  # games since the last snapshot before the win-rate trigger may fire
    max_size: int = 20  # snapshots kept (the oldest leave first)
    # How an episode's opponent is drawn: uniform, recency (newer more often), pfsp (prioritized fictitious
    # self-play: snapshots the learner beats less often are drawn more often).
    sampling: Literal["uniform", "recency", "pfsp"] = "uniform"
    pfsp_power: float = 2.0
    elo_k: float = 16.0
    # The share of episodes in which every seat plays the current learning policy (each seat's steps train it);
    # the rest are played against the pool. OpenAI Five played 80% against itself, 20% against past selves.
    latest_prob: float = 0.5
    # Each move of a snapshot opponent is a uniformly random legal move with this probability: it takes the
    # learner into positions its own past selves never reach (self-play alone converges to narrow lines of play).
    opponent_epsilon: float = 0.0


@dataclass
class MultiAgentConfig:
    # Policies by name; {} means one trainable neural policy, "shared", that every agent plays (shared parameters).
    policies: dict[str, PolicySpec] = field(default_factory=dict)
    # Agent id pattern (fnmatch, e.g. "adversary_*") -> policy name, first match wins; {} maps every agent to the
    # one policy. "<agent>" alone maps one agent. Or "package.module:function": function(agent_id) -> policy name.
    policy_mapping: dict[str, str] | str = field(default_factory=dict)
    # independent: each policy's critic sees the agent's observation (IPPO). centralized: it sees the env's global
    # state() (or every agent's observation concatenated) and a one-hot of the agent (MAPPO).
    critic: Literal["independent", "centralized"] = "independent"
    self_play: SelfPlayConfig = field(default_factory=SelfPlayConfig)
    # Baselines the final policy is evaluated against in a game with self-play: "random", "scripted:<rule>".
    eval_opponents: list[str] = field(default_factory=lambda: ["random"])
    # With self-play: every this many iterations, eval_games greedy games against each eval opponent are logged
    # (win_rate_vs_<opponent>); the final evaluation plays eval_games too (0: no periodic evaluation).
    eval_every: int = 10
    eval_games: int = 100


DEFAULT_POLICY = "shared"

# The PolicySpec keys each kind reads (kind itself aside); a key another kind reads, set away from its default, is
# refused: it would be ignored (a neural policy's learning rate is ppo.lr, not its lr).
KEYS_BY_KIND = {
    "neural": (),
    "random": (),
    "scripted": ("rule",),
    "llm": ("model", "render", "temperature", "max_new_tokens", "train", "lr", "invalid_move_penalty"),
    "frozen": ("checkpoint", "from_policy"),
}
TRAINED_LLM_KEYS = ("lr", "invalid_move_penalty")
KIND_KEY_NOTES = {"neural": " (a neural policy learns with the ppo section's settings: ppo.lr, ...)"}


def policy_specs(cfg: MultiAgentConfig) -> dict[str, PolicySpec]:
    """The policies of a game: those configured, or the one shared trainable policy."""
    return dict(cfg.policies) or {DEFAULT_POLICY: PolicySpec()}


def trainable_policies(cfg: MultiAgentConfig) -> list[str]:
    """Names of the trainable policies (neural ones, and llm ones with ``train``), in config order: one learner
    each."""
    return [name for name, spec in policy_specs(cfg).items() if is_trained(spec)]


def is_trained(spec: PolicySpec) -> bool:
    return spec.kind == "neural" or (spec.kind == "llm" and spec.train)


def trained_neural_policies(cfg: MultiAgentConfig) -> list[str]:
    """The neural policies (they always train), in config order: a PPO learner each."""
    return [name for name, spec in policy_specs(cfg).items() if spec.kind == "neural"]


def trained_llm_policies(cfg: MultiAgentConfig) -> list[str]:
    """The llm policies with ``train``, in config order: a GameLLMLearner each."""
    return [name for name, spec in policy_specs(cfg).items() if spec.kind == "llm" and spec.train]


def unused_keys(spec: PolicySpec) -> list[str]:
    """The keys of ``spec`` set away from their defaults that its kind never reads (``lr`` of an llm policy that
    does not train included)."""
    default = PolicySpec()
    read = set(KEYS_BY_KIND[spec.kind]) - (set() if spec.kind != "llm" or spec.train else set(TRAINED_LLM_KEYS))
    return [
        f.name
        for f in fields(PolicySpec)
        if f.name != "kind" and f.name not in read and getattr(spec, f.name) != getattr(default, f.name)
    ]


def validate_multi_agent(cfg: MultiAgentConfig) -> None:
    specs = policy_specs(cfg)
    for name, spec in specs.items():
        require(
            spec.kind != "llm" or bool(spec.render),
            f"multi_agent.policies.{name}.render",
            spec.render,
            "an llm policy needs a renderer of its observation: 'tictactoe' or 'package.module:function'",
        )
        require(spec.temperature >= 0, f"multi_agent.policies.{name}.temperature", spec.temperature, "must be >= 0")
        require(
            spec.max_new_tokens >= 1, f"multi_agent.policies.{name}.max_new_tokens", spec.max_new_tokens, "must be >= 1"
        )
        require(
            not spec.train or spec.kind == "llm",
            f"multi_agent.policies.{name}.train",
            spec.train,
            "only an llm policy takes train (a neural policy always trains; the others never do)",
        )
        require(spec.lr > 0, f"multi_agent.policies.{name}.lr", spec.lr, "must be > 0")
        require(
            spec.invalid_move_penalty >= 0,
            f"multi_agent.policies.{name}.invalid_move_penalty",
            spec.invalid_move_penalty,
            "must be >= 0",
        )
        require(
            spec.kind != "scripted" or bool(spec.rule),
            f"multi_agent.policies.{name}.rule",
            spec.rule,
            "a scripted policy needs a rule: 'tictactoe' or 'package.module:function'",
        )
        require(
            spec.kind != "frozen" or bool(spec.checkpoint),
            f"multi_agent.policies.{name}.checkpoint",
            spec.checkpoint,
            "a frozen policy needs the run directory or checkpoint file to load it from",
        )
        for key in unused_keys(spec):
            readers = [kind for kind, keys in KEYS_BY_KIND.items() if key in keys]
            trained = " with train: true" if key in TRAINED_LLM_KEYS else ""
            require(
                False,
                f"multi_agent.policies.{name}.{key}",
                getattr(spec, key),
                f"a {spec.kind} policy does not use it, only {' or '.join(readers)}{trained} does"
                + KIND_KEY_NOTES.get(spec.kind, ""),
            )
    require(
        bool(trainable_policies(cfg)),
        "multi_agent.policies",
        sorted(specs),
        "at least one policy must train: kind neural, or kind llm with train: true",
    )
    require(
        not isinstance(cfg.policy_mapping, str) or ":" in cfg.policy_mapping,
        "multi_agent.policy_mapping",
        cfg.policy_mapping,
        "must be a mapping of agent patterns to policies, or 'package.module:function'",
    )
    for pattern, policy in cfg.policy_mapping.items() if isinstance(cfg.policy_mapping, dict) else []:
        require(
            policy in specs,
            f"multi_agent.policy_mapping.{pattern}",
            policy,
            f"must name a policy of multi_agent.policies ({', '.join(sorted(specs))})",
        )
    require(
        bool(cfg.policy_mapping) or len(specs) == 1,
        "multi_agent.policy_mapping",
        cfg.policy_mapping,
        "with several policies, map agents to them (e.g. {'player_1': main, 'player_2': opponent})",
    )
    sp = cfg.self_play
    if sp.enabled:
        require(
            sp.policy in specs and specs[sp.policy].kind == "neural",
            "multi_agent.self_play.policy",
            sp.policy,
            "must name a neural policy of multi_agent.policies "
            f"({', '.join(n for n, s in specs.items() if s.kind == 'neural') or 'none'})",
        )
        require(
            sp.snapshot_every is None or sp.snapshot_every >= 1,
            "multi_agent.self_play.snapshot_every",
            sp.snapshot_every,
            "must be >= 1 or null",
        )
        require(
            sp.win_rate_threshold is None or 0 < sp.win_rate_threshold <= 1,
            "multi_agent.self_play.win_rate_threshold",
            sp.win_rate_threshold,
            "must be in (0, 1] or null",
        )
        require(
            sp.snapshot_every is not None or sp.win_rate_threshold is not None,
            "multi_agent.self_play.snapshot_every",
            sp.snapshot_every,
            "set it or win_rate_threshold: otherwise no snapshot ever joins the pool",
        )
        require(sp.win_rate_window >= 1, "multi_agent.self_play.win_rate_window", sp.win_rate_window, "must be >= 1")
        require(sp.min_games >= 0, "multi_agent.self_play.min_games", sp.min_games, "must be >= 0")
        require(sp.max_size >= 1, "multi_agent.self_play.max_size", sp.max_size, "must be >= 1")
        require(sp.pfsp_power > 0, "multi_agent.self_play.pfsp_power", sp.pfsp_power, "must be > 0")
        require(sp.elo_k > 0, "multi_agent.self_play.elo_k", sp.elo_k, "must be > 0")
        require(
            0 <= sp.opponent_epsilon <= 1,
            "multi_agent.self_play.opponent_epsilon",
            sp.opponent_epsilon,
            "must be in [0, 1]",
        )
        require(0 <= sp.latest_prob < 1, "multi_agent.self_play.latest_prob", sp.latest_prob, "must be in [0, 1)")
    require(cfg.eval_every >= 0, "multi_agent.eval_every", cfg.eval_every, "must be >= 0 (0: only at the end)")
    require(cfg.eval_games >= 1, "multi_agent.eval_games", cfg.eval_games, "must be >= 1")
    for name in cfg.eval_opponents:
        require(
            name == "random" or (name.startswith("scripted:") and len(name) > len("scripted:")),
            "multi_agent.eval_opponents",
            name,
            "each must be 'random' or 'scripted:<rule>' (e.g. scripted:tictactoe)",
        )
