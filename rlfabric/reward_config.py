"""The reward sections of a GRPO config: reward functions, the efficiency penalty, how components combine,
shadow verifiers, process rewards (``rewards``) and the reward model a run trains first (``reward_model``), with
their checks. Documented key by key in docs/config.md."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rlfabric.config_base import ConfigError, positive, require


@dataclass
class RewardFunctionConfig:
    # A registered reward name ("arithmetic", "countdown", "math", "length") or "package.module:function".
    name: str = "arithmetic"
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class EfficiencyConfig:
    # Adaptive efficiency penalty (rlfabric.algorithms.step_credit.efficiency_penalty), added to the scalar reward:
    # -weight * max(0, c - m) / max(m, 1), c a row's call count, m the median count of its group's successful rows
    # (of all its rows when none succeeded). 0: off.
    weight: float = 0.0
    # Reward components that are counts (summed into c), e.g. [tool_calls]: weight 0 in the scalar reward unless
    # rewards.weights names them.
    counts: list[str] = field(default_factory=list)
    # The component whose value > 0 marks a successful row.
    success: str = "correct"
    # "on_success": only successful rows are penalised; "always": every row.
    apply: Literal["on_success", "always"] = "on_success"


@dataclass
class CombineConfig:
    # How the components become the scalar reward (rlfabric.algorithms.reward_combination): clip, gate, optionally
    # normalise each component within its group (MO-GRPO), then the weighted sum of rewards.weights.
    normalize: bool = False
    # {component: [low, high]}: clip the component first.
    clip: dict[str, list[float]] = field(default_factory=dict)
    # {component: gate}: the component counts only on rows whose gate component is > 0 (e.g. {brevity: correct}).
    gates: dict[str, str] = field(default_factory=dict)


@dataclass
class ShadowConfig:
    # A second reward beside the training one, never used for learning (rlfabric.rewards.shadow): its functions
    # score `sample` of each rollout's groups on their own reward workers; its verdicts against the training
    # reward's are logged per step (shadow_disagreement, shadow_false_positive, shadow_false_negative). []: off.
    functions: list[RewardFunctionConfig] = field(default_factory=list)
    sample: float = 1.0
    # A sample passes the shadow when this component > threshold, and the training reward when train_component
    # > train_threshold.
    component: str = "correct"
    threshold: float = 0.5
    train_component: str = "correct"
    train_threshold: float = 0.5


# rewards.process.split: how a completion is cut into steps (rlfabric.rewards.process.step_starts).
SPLIT_NAMES = ("none", "newline", "blank_line")
SPLIT_TAGS = ("tag:", "end_tag:")  # "tag:TEXT": a step starts at each TEXT; "end_tag:TEXT": one ends after each
OUTCOME_SPANS = ("all", "answer", "none")
PROCESS_SPANS = ("all", "reasoning", "none")


def parse_split(value: str) -> tuple[str, str]:
    """``rewards.process.split`` as (kind, tag text): ("newline", ""), ("tag", "<step>"), ...; ValueError naming
    what is allowed for anything else."""
    if value in SPLIT_NAMES:
        return value, ""
    for prefix in SPLIT_TAGS:
        if isinstance(value, str) and value.startswith(prefix) and len(value) > len(prefix):
            return prefix[:-1], value[len(prefix) :]
    raise ValueError(
        f"split {value!r}: must be one of {', '.join(SPLIT_NAMES)}, 'tag:TEXT' (a step starts at each TEXT) or "
        "'end_tag:TEXT' (a step ends after each TEXT)"
    )


@dataclass
class ProcessConfig:
    # Process rewards (docs/process_rewards.md): cut each single-turn completion into steps, score the steps with
    # the process rewards among rewards.functions (@process_reward: process_reward_model, arithmetic_steps, ...),
    # put their components on the steps' token spans and the outcome components on the last step's (the answer
    # span). "none": one step, the whole completion; "newline": a step ends after each line break; "blank_line":
    # after each blank line; "tag:TEXT": a step starts at each TEXT; "end_tag:TEXT": a step ends after each TEXT.
    # With env.id the steps are the agent's turns (keep "none").
    split: str = "none"
    # The spans that get the episode (outcome) term of grpo.step_credit's advantage: "all", "answer" (the last
    # step) or "none".
    outcome_spans: str = "all"
    # The spans that get its step (process) term: "all", "reasoning" (every step but the last) or "none". A span
    # that gets neither term gets no loss.
    process_spans: str = "all"


@dataclass
class RewardsConfig:
    functions: list[RewardFunctionConfig] = field(default_factory=lambda: [RewardFunctionConfig()])
    # Weight of each named component in the scalar reward; a component not listed counts with the weight its
    # reward function declares (@default_weights: the built-in verifiers' format weighs 0), else 1.
    weights: dict[str, float] = field(default_factory=dict)
    num_workers: int = 1
    num_cpus: float = 0.5
    # GPUs per reward worker (a fraction shares one): a model the worker loads itself (a reward model, a process
    # reward model, a frozen likelihood model) with device "auto" or "cuda" runs on it. Ray hides GPUs from an
    # actor that asks for none. A judge runs on generator actors of its own.
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # extra Ray resources per reward worker
    # Deadline for scoring one group; a function that hangs or raises costs only its group's samples.
    timeout_s: float = 30.0
    efficiency: EfficiencyConfig = field(default_factory=EfficiencyConfig)
    combine: CombineConfig = field(default_factory=CombineConfig)
    shadow: ShadowConfig = field(default_factory=ShadowConfig)
    process: ProcessConfig = field(default_factory=ProcessConfig)

    @property
    def num_actors(self) -> int:
        """Reward-service actors a run starts: ``num_workers`` when there are reward functions (an env, an agent
        or a rubric may give every reward), and one for the shadow verifiers when any."""
        return (self.num_workers if self.functions else 0) + int(bool(self.shadow.functions))

    def scalar_weights(self) -> dict[str, float]:
        """The weights of the scalar reward: ``weights``, and 0 for the count components of ``efficiency`` that
        ``weights`` does not name (counts are not rewards)."""
        return {**{name: 0.0 for name in self.efficiency.counts}, **self.weights}

    def component_references(self) -> list[tuple[str, str]]:
        """(field, component name) for every component these sections name (``rlfabric.reward_names`` checks
        them): ``weights``, ``combine.clip`` and ``combine.gates`` (gated and gate), with the efficiency penalty on
        ``efficiency.counts`` and ``efficiency.success``, and with shadow verifiers ``shadow.train_component``."""
        named = [("rewards.weights", name) for name in self.weights]
        named += [("rewards.combine.clip", name) for name in self.combine.clip]
        named += [("rewards.combine.gates", name) for pair in self.combine.gates.items() for name in pair]
        if self.efficiency.weight:
            named += [("rewards.efficiency.counts", name) for name in self.efficiency.counts]
            named.append(("rewards.efficiency.success", self.efficiency.success))
        if self.shadow.functions:
            named.append(("rewards.shadow.train_component", self.shadow.train_component))
        return named


@dataclass
class RewardModelConfig:
    # "classifier": a sequence-classification reward model, one output per head, trained with Bradley-Terry
    # ({name: reward_model} serves it). "judge": a generative judge, a causal LM trained to write the verdicts the
    # judge service asks for (rlfabric.judge; {name: judge} serves it on its own generators).
    kind: Literal["classifier", "judge"] = "classifier"
    # Preference pairs to train a reward model from before RL ("": none; rlfabric.reward_model_training): a
    # .jsonl/.parquet file of {prompt, chosen, rejected[, head]} rows, or task:arithmetic_pairs. Its model is
    # saved in the run directory (reward_model/), where {name: reward_model} without a path serves it.
    pairs: str = ""
    num_pairs: int = 2000
    # Held-out pairs (prompts not among the training pairs), ranked before training and every eval_every steps.
    num_eval: int = 200
    # The model's outputs, one per head, named as reward components; a pair's "head" column picks the head it trains.
    heads: list[str] = field(default_factory=lambda: ["reward"])
    # With model.path builtin, the reward model's own size (null: model.builtin's): a reward model may be larger
    # than the policy it judges.
    num_layers: int | None = None
    hidden_size: int | None = None
    # Next-token training of the reward model's backbone on the chosen texts first (model.path's weights, or a new
    # builtin model): the supervised model the reward model starts from.
    lm_steps: int = 1000
    # Bradley-Terry steps on the pairs.
    steps: int = 500
    batch_size: int = 32
    lr: float = 1.0e-3
    # The gap m in -log sigmoid(r_chosen - r_rejected - m).
    margin: float = 0.0
    eval_every: int = 100


def validate_rewards(r: RewardsConfig, env_id: str, step_credit: str = "none") -> None:
    """Range and cross-field checks of the ``rewards`` section (``env_id``: the field that names where the run's
    episodes come from, e.g. "env.id", "" for single-turn completions;
    ``step_credit``: grpo.step_credit, which process rewards act through)."""
    for i, fn in enumerate(r.functions):
        require(bool(fn.name), f"rewards.functions[{i}].name", fn.name, "must name a reward function")
    _validate_efficiency(r.efficiency)
    _validate_combine(r.combine)
    _validate_shadow(r.shadow, env_id)
    _validate_process(r.process, env_id, step_credit)


def _validate_efficiency(e: EfficiencyConfig) -> None:
    positive("rewards.efficiency.weight", e.weight, allow_zero=True)
    require(
        all(isinstance(c, str) and c for c in e.counts) and len(set(e.counts)) == len(e.counts),
        "rewards.efficiency.counts",
        e.counts,
        "must be distinct non-empty component names",
    )
    require(
        e.weight == 0 or bool(e.counts),
        "rewards.efficiency.counts",
        e.counts,
        "must name at least one count component when rewards.efficiency.weight > 0",
    )
    require(bool(e.success), "rewards.efficiency.success", e.success, "must name the success component")
    require(
        e.success not in e.counts,
        "rewards.efficiency.success",
        e.success,
        "must not be one of rewards.efficiency.counts",
    )


def _validate_combine(c: CombineConfig) -> None:
    for name, bounds in c.clip.items():
        require(
            isinstance(bounds, (list, tuple))
            and len(bounds) == 2
            and all(isinstance(b, (int, float)) for b in bounds)
            and bounds[0] <= bounds[1],
            f"rewards.combine.clip.{name}",
            bounds,
            "must be [low, high] with low <= high",
        )
    for name, gate in c.gates.items():
        require(
            isinstance(gate, str) and bool(gate) and gate != name,
            f"rewards.combine.gates.{name}",
            gate,
            "must name another component (the one that must be > 0 for this one to count)",
        )


def _validate_shadow(sh: ShadowConfig, env_id: str) -> None:
    if not sh.functions:
        return
    require(0 < sh.sample <= 1, "rewards.shadow.sample", sh.sample, "must be in (0, 1]")
    for i, fn in enumerate(sh.functions):
        require(bool(fn.name), f"rewards.shadow.functions[{i}].name", fn.name, "must name a reward function")
    require(bool(sh.component), "rewards.shadow.component", sh.component, "must name the shadow's verdict component")
    require(bool(sh.train_component), "rewards.shadow.train_component", sh.train_component, "must name a component")
    require(
        not env_id,
        "rewards.shadow.functions",
        [f.name for f in sh.functions],
        f"runs on single-turn completions for now ({env_id} is set: the episodes give the rewards)",
    )


def _validate_process(p: ProcessConfig, env_id: str, step_credit: str) -> None:
    try:
        kind, _ = parse_split(p.split)
    except ValueError as exc:  # "split 'x': must be ...": the reason after the colon
        raise ConfigError(f"rewards.process.split = {p.split!r} is not valid: {str(exc).split(': ', 1)[1]}") from None
    require(p.outcome_spans in OUTCOME_SPANS, "rewards.process.outcome_spans", p.outcome_spans, _one_of(OUTCOME_SPANS))
    require(p.process_spans in PROCESS_SPANS, "rewards.process.process_spans", p.process_spans, _one_of(PROCESS_SPANS))
    require(
        (p.outcome_spans, p.process_spans) != ("none", "none"),
        "rewards.process.process_spans",
        p.process_spans,
        "must not be 'none' when rewards.process.outcome_spans is 'none' too (no span would get an advantage)",
    )
    require(
        kind == "none" or not env_id,
        "rewards.process.split",
        p.split,
        f"must be 'none' with {env_id}: an episode's steps are the agent's turns",
    )
    for path, value, default in (
        ("rewards.process.split", p.split, "none"),
        ("rewards.process.outcome_spans", p.outcome_spans, "all"),
        ("rewards.process.process_spans", p.process_spans, "all"),
    ):
        require(
            value == default or step_credit != "none",
            path,
            value,
            "acts through per-step advantages: set grpo.step_credit (step_mix; gigpo with a text env)",
        )


def _one_of(names: tuple[str, ...]) -> str:
    return f"must be one of {', '.join(names)}"


def validate_reward_model(r: RewardModelConfig) -> None:
    require(r.kind in ("classifier", "judge"), "reward_model.kind", r.kind, "must be classifier or judge")
    for path, value in (
        ("reward_model.num_pairs", r.num_pairs),
        ("reward_model.num_eval", r.num_eval),
        ("reward_model.steps", r.steps),
        ("reward_model.batch_size", r.batch_size),
        ("reward_model.eval_every", r.eval_every),
    ):
        require(isinstance(value, int) and value >= 1, path, value, "must be an integer >= 1")
    require(isinstance(r.lm_steps, int) and r.lm_steps >= 0, "reward_model.lm_steps", r.lm_steps, "must be >= 0")
    for path, value in (("reward_model.num_layers", r.num_layers), ("reward_model.hidden_size", r.hidden_size)):
        require(value is None or (isinstance(value, int) and value >= 1), path, value, "must be null or >= 1")
    positive("reward_model.lr", r.lr)
    require(
        bool(r.heads) and all(isinstance(h, str) and h for h in r.heads) and len(set(r.heads)) == len(r.heads),
        "reward_model.heads",
        r.heads,
        "must be distinct non-empty names, one per output of the model",
    )
