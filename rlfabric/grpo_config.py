"""Typed configuration for LLM post-training (``algo: grpo``): model, data, generators, rewards, the GRPO family.

Built and validated by ``rlfabric.config.load_config`` with the rules of ``rlfabric.config_base``, like the PPO
config: unknown keys, wrong types and out-of-range values are one-line ``ConfigError``s naming the field, before
any actor starts.
"""

from __future__ import annotations

import dataclasses
import string
from dataclasses import dataclass, field
from typing import Any, Literal

from rlfabric.config_base import ConfigError, RayConfig, check_placement, positive, require
from rlfabric.objectives import STATE_KEYED_STEP_CREDITS, TABLES, check_step_credit
from rlfabric.reward_config import RewardModelConfig, RewardsConfig, validate_reward_model, validate_rewards

# The builtin character tokenizer's alphabets by name (model.builtin.alphabet), kept here so that validating a
# config never imports torch; rlfabric.models.hf builds the tokenizer from one.
DEFAULT_ALPHABET = string.digits + "+-*/=()., :?<>\n" + string.ascii_letters  # arithmetic, countdown, short English
TOOL_ALPHABET = DEFAULT_ALPHABET + "{}[]\"'_\\"  # and Hermes JSON tool calls (and JSON's error messages)
BUILTIN_ALPHABETS = {"default": DEFAULT_ALPHABET, "tool": TOOL_ALPHABET}
_TEMPLATE_CHARACTERS = "systemuserassistant: \n"  # what the character chat template writes around the texts

GRPO_ROLES = ("generator", "learner", "rewards")  # the roles ray.placement may name (the rollout worker has none)


@dataclass
class BuiltinModelConfig:
    # Size of the small Qwen2-style model built when model.path is "builtin" (character tokenizer).
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 2
    max_positions: int = 64
    # The tokenizer's characters: a name in BUILTIN_ALPHABETS ("default"; "tool": with {}[]"'_\ for JSON tool
    # calls) or the characters themselves.
    alphabet: str = "default"


def builtin_alphabet(value: str, field_name: str = "model.builtin.alphabet") -> str:
    """The characters ``value`` names (a key of ``BUILTIN_ALPHABETS``) or is; a one-line ConfigError naming
    ``field_name`` if they cannot make a tokenizer for the character chat template."""
    chars = BUILTIN_ALPHABETS.get(value, value)
    missing = "".join(sorted(set(_TEMPLATE_CHARACTERS) - set(chars)))
    if missing:
        names = ", ".join(BUILTIN_ALPHABETS)
        raise ConfigError(
            f"{field_name} = {value!r} is not valid: lacks {missing!r}, which the chat template writes; allowed: "
            f"a name ({names}) or a string of characters that includes {_TEMPLATE_CHARACTERS!r}"
        )
    return chars


@dataclass
class LLMModelConfig:
    # A local Hugging Face model folder or hub id, or "builtin": build the small character-level model locally.
    path: str = "builtin"
    builtin: BuiltinModelConfig = field(default_factory=BuiltinModelConfig)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Recompute activations in the backward pass (large models on small memory).
    gradient_checkpointing: bool = False


@dataclass
class DataConfig:
    # "task:<name>[?k=v&...]" for a built-in generated task, or a .jsonl/.json/.parquet file of prompts.
    train: str = "task:arithmetic?max_operand=49&ops=+&teacher_error=0.6"
    # Held-out prompts for eval_accuracy ("" : the train task's held-out split, for built-in tasks).
    eval: str = ""
    # Column holding the prompt text; every other column is per-sample metadata for the reward functions.
    prompt_key: str = "prompt"
    # Format prompts with the tokenizer's chat template (instruct models).
    chat_template: bool = False
    # Rows generated for a built-in train task / read at most from a file (null: all of a file).
    num_train: int | None = 2_000
    # Held-out rows evaluated (null: every held-out row of a file).
    num_eval: int | None = 200


@dataclass
class VerifiersConfig:
    # An environment written with the `verifiers` library (SingleTurnEnv, MultiTurnEnv, ToolEnv and their Rubric) as
    # the run's env, unchanged (docs/agents.md): a name vf.load_environment finds (an installed module), or
    # "package.module:function" returning one. Its dataset is the run's data (data.train: env); its rubric's
    # functions are the reward components. "" (the default): none.
    id: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    # Python packages its actor runs with, a Ray runtime env on top of rlfabric's (the library pins mcp < 2): the
    # library and the environment's own package.
    pip: list[str] = field(default_factory=lambda: ["verifiers==0.3.1"])
    # The rubric function whose positive value makes an episode correct (held-out eval_accuracy); "": the first
    # function with a nonzero weight.
    accuracy: str = ""


@dataclass
class OpenEnvConfig:
    # An OpenEnv environment server as the run's text env (docs/agents.md): a command line that serves it, started
    # by the run in its OpenEnv actor ({port}, {host} and {python}, that actor's interpreter, filled in), or the
    # URL of one that runs elsewhere. "" and "" (the default): none. The task rows of data.train are reset's fields.
    command: str = ""
    url: str = ""
    # Python packages the actor runs with, a Ray runtime env on top of rlfabric's (the library pins mcp < 2): the
    # library and the environment's own package.
    pip: list[str] = field(default_factory=lambda: ["openenv==0.10.0"])
    # The action field the model's turn goes into, and the observation field the model is shown.
    action_key: str = "text"
    observation_key: str = "text"
    # The reward component the environment's scalar reward is logged as, and the metadata entries also taken as
    # components (numbers only).
    reward_component: str = "reward"
    components: list[str] = field(default_factory=list)
    # How long the started server has to answer /health (the actor's packages installed first are not counted).
    start_timeout_s: float = 60.0
    # A started server is checked every health_interval_s: one that exited, or whose /health does not answer within
    # ping_timeout_s, is killed and started again (the episodes on it fail; counted as openenv_server_restarts).
    health_interval_s: float = 2.0
    ping_timeout_s: float = 10.0
    # The environment serves MCP tools (an OpenEnv MCPEnvironment): they are listed into the system message and the
    # model's tool calls (env.tool_parser) are run on the server; a turn without a call is the step's action.
    tools: bool = False


@dataclass
class LLMEnvConfig:
    # A text env (rlfabric.text_env) the policy plays over several turns, one episode per task row of data.train:
    # a registered name, an entry point (rlfabric/GuessNumber-v0) or "package.module:factory". "" (the default):
    # single-turn completions of data.train's prompts, scored by rewards.functions.
    id: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 8
    # Prompt plus every turn; a turn starts only if sampling.max_new_tokens more fit (null: the model's context).
    max_episode_tokens: int | None = None
    # Deadline of each reset and step of the env.
    step_timeout_s: float = 30.0
    # A step that raises or misses its deadline: "fail" ends the episode as failed (never trained on), "observe"
    # shows the error to the agent as its observation.
    on_env_error: Literal["fail", "observe"] = "fail"
    # MCP servers the run starts and supervises, one Ray actor each (health checks, restarts; docs/agents.md): a
    # list of shipped task servers' names ([notes, bank]), or a mapping of names to command lines: one that serves
    # streamable HTTP on {port} ({mine: "my-mcp-server --port {port}"}), or a stdio server ({mine: "my-mcp-server"}),
    # run behind the stdio gateway, a process per session. The env's factory gets them as tool_servers={name: actor}.
    tool_servers: list[str] | dict[str, str] = field(default_factory=list)
    # An outside agent instead of a text env (rlfabric.agents, docs/agents.md): an async function run(task, client)
    # written against an OpenAI client, returning its reward components; group_size episodes per task row of
    # data.train, each with a client on the run's endpoint. A name given to register_agent or "package.module:function".
    agent: str = ""
    # Deadline of a whole agent episode (env.agent): an agent still running then is a failed episode.
    agent_timeout_s: float = 120.0
    # How the endpoint reads tool calls from the model's text for its replies (a parser in rlfabric.tools).
    tool_parser: str = "hermes"
    verifiers: VerifiersConfig = field(default_factory=VerifiersConfig)
    openenv: OpenEnvConfig = field(default_factory=OpenEnvConfig)


@dataclass
class SamplingConfig:
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # A completion (a turn, with a text env) also ends once its text holds one of these, e.g. "</tool_call>".
    stop: list[str] = field(default_factory=list)


@dataclass
class VLLMConfig:
    gpu_memory_utilization: float = 0.5
    max_model_len: int | None = None
    enforce_eager: bool = False
    dtype: str = "auto"
    tensor_parallel_size: int = 1


@dataclass
class GeneratorConfig:
    backend: Literal["torch", "vllm"] = "torch"
    num_generators: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    # Deadline for one generation call; a generator that misses it is replaced and its prompts resampled.
    timeout_s: float = 300.0
    max_batch_size: int = 256
    # Torch engine: dtype of the decoder's matrix multiplications ("bfloat16": about 1.4x faster decoding on CPUs
    # with AVX-512 BF16; attention, KV cache and logprobs stay float32). vLLM uses generator.vllm.dtype.
    matmul_dtype: Literal["float32", "bfloat16"] = "float32"
    # Torch engine: memory for multi-turn episodes' KV between their turns (session continuation; 0 turns it off:
    # every turn prefills the whole conversation). vLLM's prefix caching does the same by content.
    session_cache_mb: float = 1024.0
    vllm: VLLMConfig = field(default_factory=VLLMConfig)


@dataclass
class GRPOConfig:
    prompts_per_step: int = 32
    group_size: int = 8
    # The names of advantage, ratio_level, policy_loss, loss_aggregation and kl_estimator are rlfabric.objectives'
    # tables.
    # "grpo" (group mean/std), "rloo" (leave-one-out), "reinforce_pp" (batch-normalised), "reinforce_pp_baseline".
    advantage: str = "grpo"
    # Divide by the group std (GRPO); false is Dr. GRPO.
    scale_by_std: bool = True
    clip_low: float = 0.2
    # Upper clip range; > clip_low is DAPO's clip-higher.
    clip_high: float = 0.2
    # "token" (PPO/GRPO) or "sequence" (GSPO's sequence-level ratio).
    ratio_level: str = "token"
    # "clip" (PPO's clipped surrogate) or "cispo" (REINFORCE with clipped, detached importance weights).
    policy_loss: str = "clip"
    # "token_mean" (DAPO), "seq_mean_token_mean" (GRPO), "seq_mean_token_sum_norm" (Dr. GRPO).
    loss_aggregation: str = "token_mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    # Adaptive KL (Ziegler et al. 2019): the measured KL this coefficient steers toward (null: kl_coef stays fixed),
    # the update's logged `kl` (its loss aggregation's mean of the per-token estimate). kl_coef is then the starting
    # coefficient, multiplied after each update by 1 + clip(kl / kl_target - 1, -0.2, 0.2) * samples / kl_horizon.
    kl_target: float | None = None
    kl_horizon: int = 10000
    # Where the frozen reference model's logprobs are computed: in the learner or in a reference actor.
    reference: Literal["learner", "actor"] = "learner"
    entropy_coef: float = 0.0
    # Drop groups whose rewards are all equal (no signal) and sample more prompts to refill the batch (DAPO).
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3
    # Learner: skip the forward/backward of zero-advantage rows when kl_coef and entropy_coef are 0 (their
    # gradient is exactly zero); false runs every row (diagnostics such as entropy then cover the whole batch).
    skip_zero_advantage_rows: bool = True
    # Give no loss to completions cut off at max_new_tokens (DAPO's overlong filtering).
    overlong_filter: bool = False
    # Step-level credit of multi-turn episodes (rlfabric.algorithms.step_credit): "none" (one advantage per row),
    # "gigpo" (GiGPO: plus a step advantage among the group's steps from the same env state; needs an env with
    # state_key()), "step_mix" (plus the step's discounted return normalised over all the group's steps).
    step_credit: str = "none"
    # omega: the weight of the step term.
    step_credit_weight: float = 1.0
    # gamma: the discount of the step returns.
    step_gamma: float = 0.95
    # Trace check, logprob half: a row sampled by the learner's current weights whose recomputed logprobs differ
    # from the behaviour ones by more than this (mean |gap| per sampled token, nats) is rejected and counted as
    # drifted (null: no check). Float32 engines agree to ~1e-5; bfloat16 matmuls to a few hundredths.
    max_logprob_gap: float | None = 0.5
    # Passes over each batch; > 1 makes the clip matter (the first pass is on-policy).
    epochs: int = 1
    # Optimizer steps per pass: each learner's rows split into this many contiguous mini-batches, each its own step
    # (verl's train_batch_size / ppo_mini_batch_size, TRL's steps_per_generation / gradient_accumulation_steps).
    # From the second on the policy has moved, so the ratio and the clip act even with one epoch.
    mini_batches: int = 1
    # Sequences per forward/backward; gradients accumulate over a mini-batch before its optimizer step.
    micro_batch_size: int = 64
    lr: float = 5e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    # After the warm-up: linear (decay to 0 at training.total_steps, as Hugging Face and TRL default to), cosine
    # or constant.
    lr_schedule: str = "linear"


@dataclass
class SFTConfig:
    # Supervised warm-up on the task's reference answers before RL (0: none). Built-in tasks provide answers.
    steps: int = 1000
    batch_size: int = 64
    lr: float = 1e-3
    # Dataset column with the target completion (a list: several demonstrations, one picked at random per use).
    answer_key: str = "teacher"
    # With a text env (env.id): the scripted player whose episodes are the demonstrations, "package.module:function"
    # taking (task, chat messages so far) and returning the next action's text.
    player: str = ""
    # With sft.player: play this many episodes once, on train rows drawn at random, and draw every warm-up batch
    # from them (0: the player plays a fresh batch of episodes for every step).
    demonstrations: int = 0


@dataclass
class LLMLearnerConfig:
    # Data-parallel learner actors (gloo on CPU, nccl on GPU); each takes an equal share of every batch.
    num_learners: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Dtype of the forward/backward matmuls under autocast ("bfloat16": mixed precision; weights, optimizer state,
    # LM head and logprobs stay in model.dtype). Also used by the reference model.
    matmul_dtype: Literal["float32", "bfloat16"] = "float32"
    # How a batch's rows go through the model: "shared_prefix" (the rows that share a prompt in one block behind
    # one copy of it, blocks end to end in rows of up to hidden_size tokens; needs sdpa or eager attention),
    # "padded" (one row each, padded to the longest prompt and response), or "auto": whichever costs fewer
    # FLOPs, per micro-batch. Same logprobs and gradients; also the reference model's.
    sequence_packing: Literal["auto", "shared_prefix", "padded"] = "auto"
    # How published weights reach the generators (and a reference actor): "auto" (a shared-memory file when they
    # all run on learner 0's node and its /dev/shm has room beside Ray's object store, else the object store),
    # "shared_memory" (that, or an error), or "object_store".
    weight_transport: Literal["auto", "shared_memory", "object_store"] = "auto"


@dataclass
class LLMTrainingConfig:
    total_steps: int = 100
    # 0: synchronous. k > 0: generation of the next batches overlaps the update; samples made by weights more
    # than k versions old are dropped and counted.
    max_policy_lag: int = 0
    seed: int = 0
    # Evaluate held-out accuracy (greedy) every this many steps, before the first and after the last.
    eval_every: int = 25
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    # Completions printed (and saved to samples.jsonl) at the end.
    show_samples: int = 8


@dataclass
class LLMConfig:
    algo: Literal["grpo"] = "grpo"
    model: LLMModelConfig = field(default_factory=LLMModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    env: LLMEnvConfig = field(default_factory=LLMEnvConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    learner: LLMLearnerConfig = field(default_factory=LLMLearnerConfig)
    training: LLMTrainingConfig = field(default_factory=LLMTrainingConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    @property
    def batch_size(self) -> int:
        """Completions per training step."""
        return self.grpo.prompts_per_step * self.grpo.group_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _validate_num_eval(cfg: LLMConfig) -> None:
    """``data.num_eval``: at least 1, or null for every held-out row of a file (a generated task and a verifiers
    environment's dataset need a number)."""
    d = cfg.data
    if d.num_eval is not None:
        require(d.num_eval >= 1, "data.num_eval", d.num_eval, "must be at least 1, or null for every held-out row")
        return
    spec, setting = (d.eval, "data.eval") if d.eval else (d.train, "data.train")
    require(
        not spec.startswith("task:") and not cfg.env.verifiers.id,
        "data.num_eval",
        None,
        f"null (every held-out row) takes held-out rows from a file, and {setting} = {spec!r} is "
        f"{'the environment' if cfg.env.verifiers.id else 'a generated task'}: give a number of rows",
    )


def validate_llm(cfg: LLMConfig) -> LLMConfig:
    """Range and cross-field checks for ``algo: grpo``; return the config unchanged."""
    check_placement(cfg.ray.placement, GRPO_ROLES)
    g, s, t = cfg.grpo, cfg.sampling, cfg.training
    for path, value in (
        ("grpo.prompts_per_step", g.prompts_per_step),
        ("grpo.epochs", g.epochs),
        ("grpo.mini_batches", g.mini_batches),
        ("grpo.kl_horizon", g.kl_horizon),
        ("grpo.micro_batch_size", g.micro_batch_size),
        ("grpo.max_sampling_rounds", g.max_sampling_rounds),
        ("sampling.max_new_tokens", s.max_new_tokens),
        ("generator.num_generators", cfg.generator.num_generators),
        ("generator.max_batch_size", cfg.generator.max_batch_size),
        ("rewards.num_workers", cfg.rewards.num_workers),
        ("learner.num_learners", cfg.learner.num_learners),
        ("training.total_steps", t.total_steps),
        ("sft.batch_size", cfg.sft.batch_size),
    ):
        require(value >= 1, path, value, "must be at least 1")
    _validate_num_eval(cfg)
    require(g.group_size >= 2, "grpo.group_size", g.group_size, "must be at least 2 (advantages compare a group)")
    for table in TABLES:  # advantage, ratio_level, policy_loss, ..., lr_schedule: registered names
        table.check(getattr(g, table.field.removeprefix("grpo.")))
    for path, value in (
        ("grpo.lr", g.lr),
        ("grpo.clip_low", g.clip_low),
        ("grpo.clip_high", g.clip_high),
        ("grpo.max_grad_norm", g.max_grad_norm),
        ("sft.lr", cfg.sft.lr),
        ("generator.timeout_s", cfg.generator.timeout_s),
        ("rewards.timeout_s", cfg.rewards.timeout_s),
    ):
        positive(path, value)
    require(g.clip_low < 1, "grpo.clip_low", g.clip_low, "must be < 1 (the ratio's lower bound is 1 - clip_low)")
    require(
        g.lr_schedule == "constant" or g.warmup_steps < t.total_steps,
        "grpo.warmup_steps",
        g.warmup_steps,
        f"must be < training.total_steps ({t.total_steps}) for grpo.lr_schedule {g.lr_schedule!r} to decay",
    )
    for path, value in (
        ("grpo.kl_coef", g.kl_coef),
        ("grpo.entropy_coef", g.entropy_coef),
        ("grpo.weight_decay", g.weight_decay),
        ("grpo.warmup_steps", g.warmup_steps),
        ("sft.steps", cfg.sft.steps),
        ("sft.demonstrations", cfg.sft.demonstrations),
        ("sampling.temperature", s.temperature),
        ("sampling.top_k", s.top_k),
        ("grpo.max_logprob_gap", 0.0 if g.max_logprob_gap is None else g.max_logprob_gap),
        ("grpo.kl_target", 0.0 if g.kl_target is None else g.kl_target),
        ("training.max_policy_lag", t.max_policy_lag),
        ("training.eval_every", t.eval_every),
        ("training.checkpoint_every", t.checkpoint_every),
        ("training.keep_checkpoints", t.keep_checkpoints),
        ("training.show_samples", t.show_samples),
        ("generator.num_cpus", cfg.generator.num_cpus),
        ("generator.num_gpus", cfg.generator.num_gpus),
        ("generator.session_cache_mb", cfg.generator.session_cache_mb),
        ("rewards.num_cpus", cfg.rewards.num_cpus),
        ("rewards.num_gpus", cfg.rewards.num_gpus),
        ("learner.num_cpus", cfg.learner.num_cpus),
        ("learner.num_gpus", cfg.learner.num_gpus),
    ):
        positive(path, value, allow_zero=True)
    for name, amount in cfg.rewards.resources.items():
        require(
            name not in ("CPU", "GPU", "memory"),
            f"rewards.resources.{name}",
            amount,
            "CPU, GPU and memory are set by rewards.num_cpus / num_gpus, not resources",
        )
    require(s.temperature > 0, "sampling.temperature", s.temperature, "must be > 0 for training (exploration)")
    require(0 < s.top_p <= 1, "sampling.top_p", s.top_p, "must be in (0, 1]")
    require(
        all(isinstance(stop, str) and stop for stop in s.stop), "sampling.stop", s.stop, "must be non-empty strings"
    )
    require(0 <= t.seed < 2**32, "training.seed", t.seed, "must be in [0, 2**32)")
    require(
        cfg.batch_size % cfg.learner.num_learners == 0,
        "learner.num_learners",
        cfg.learner.num_learners,
        f"must divide the batch (grpo.prompts_per_step * grpo.group_size = {cfg.batch_size})",
    )
    require(
        g.kl_target is None or (g.kl_target > 0 and g.kl_coef > 0),
        "grpo.kl_target",
        g.kl_target,
        "must be > 0, with grpo.kl_coef > 0 as the starting coefficient (the KL term and its reference model)",
    )
    require(
        g.kl_target is None or g.kl_horizon >= cfg.batch_size,
        "grpo.kl_horizon",
        g.kl_horizon,
        f"must be at least the samples of a step (grpo.prompts_per_step * grpo.group_size = {cfg.batch_size}) with "
        "grpo.kl_target, so one update moves the coefficient by at most 20%",
    )
    rows_per_learner = cfg.batch_size // cfg.learner.num_learners
    require(
        g.mini_batches <= rows_per_learner,
        "grpo.mini_batches",
        g.mini_batches,
        f"must be at most the rows each learner trains (grpo.prompts_per_step * grpo.group_size / "
        f"learner.num_learners = {rows_per_learner})",
    )
    require(
        cfg.generator.backend != "vllm" or cfg.generator.num_gpus > 0,
        "generator.backend",
        cfg.generator.backend,
        "'vllm' needs generator.num_gpus > 0 (vLLM runs on GPUs; use 'torch' on CPU)",
    )
    require(
        cfg.learner.device != "cuda" or cfg.learner.num_gpus > 0,
        "learner.device",
        cfg.learner.device,
        "'cuda' needs learner.num_gpus > 0 (Ray hides GPUs from actors that did not ask for one)",
    )
    if cfg.model.path == "builtin":
        builtin_alphabet(cfg.model.builtin.alphabet)
    _validate_step_credit(cfg)
    validate_rewards(cfg.rewards, episode_source(cfg), cfg.grpo.step_credit)
    if cfg.reward_model.pairs:
        validate_reward_model(cfg.reward_model)
    require(
        (cfg.data.train == "env") == bool(cfg.env.verifiers.id),
        "data.train",
        cfg.data.train,
        "must be 'env' with env.verifiers.id (the environment's own dataset), and only then",
    )
    require(
        not (cfg.env.verifiers.id and cfg.data.eval),
        "data.eval",
        cfg.data.eval,
        "must be '' with env.verifiers.id: the environment's eval_dataset is the held-out set",
    )
    require(
        cfg.sft.demonstrations == 0 or (plays_episodes(cfg) and cfg.sft.demonstrations >= cfg.sft.batch_size),
        "sft.demonstrations",
        cfg.sft.demonstrations,
        f"must be 0, or at least sft.batch_size ({cfg.sft.batch_size}) with an sft.player on a text env or agent",
    )
    if plays_episodes(cfg):
        _validate_env(cfg)
    elif not cfg.rewards.functions:
        raise ConfigError("rewards.functions = [] is not valid: list at least one reward function")
    return cfg


def episode_source(cfg: LLMConfig) -> str:
    """The field that names where the run's episodes come from (``env.id``, ``env.agent``, ``env.verifiers.id``,
    ``env.openenv.command`` or ``env.openenv.url``), or "" when it completes prompts scored by reward functions."""
    return next((field_name for field_name, value in episode_source_fields(cfg) if value), "")


def episode_source_fields(cfg: LLMConfig) -> list[tuple[str, str]]:
    """(field, value) of each field that can name where a run's episodes come from (``episode_source``)."""
    e = cfg.env
    return [
        ("env.id", e.id),
        ("env.agent", e.agent),
        ("env.verifiers.id", e.verifiers.id),
        ("env.openenv.command", e.openenv.command),
        ("env.openenv.url", e.openenv.url),
    ]


def plays_episodes(cfg: LLMConfig) -> bool:
    """Whether the run plays episodes (a text env, an agent, a verifiers environment, an OpenEnv server) rather
    than completing prompts scored by reward functions."""
    return bool(episode_source(cfg))


def _validate_env(cfg: LLMConfig) -> None:
    """Checks for training on a text env (``env.id`` set) or an outside agent (``env.agent``)."""
    e = cfg.env
    o = e.openenv
    named = (
        ("env.id", e.id),
        ("env.agent", e.agent),
        ("env.verifiers.id", e.verifiers.id),
        ("env.openenv.command", o.command),
        ("env.openenv.url", o.url),
    )
    chosen = [(k, v) for k, v in named if v]
    what = chosen[0][0]
    require(
        len(chosen) == 1,
        chosen[-1][0],
        chosen[-1][1],
        f"is exclusive with {what} ({chosen[0][1]!r}): a run plays a text env, an agent, a verifiers environment "
        "or an OpenEnv server",
    )
    positive("env.openenv.start_timeout_s", o.start_timeout_s)
    positive("env.openenv.health_interval_s", o.health_interval_s)
    positive("env.openenv.ping_timeout_s", o.ping_timeout_s)
    positive("env.agent_timeout_s", e.agent_timeout_s)
    require(e.max_turns >= 1, "env.max_turns", e.max_turns, "must be at least 1")
    positive("env.step_timeout_s", e.step_timeout_s)
    if e.max_episode_tokens is not None:
        require(
            e.max_episode_tokens > cfg.sampling.max_new_tokens,
            "env.max_episode_tokens",
            e.max_episode_tokens,
            f"must exceed sampling.max_new_tokens ({cfg.sampling.max_new_tokens}) to leave room for the prompt",
        )
    require(
        cfg.sft.steps == 0 or bool(cfg.sft.player),
        "sft.steps",
        cfg.sft.steps,
        f"needs sft.player with {what} (a scripted player whose episodes are the demonstrations), or 0",
    )
    require(
        not e.tool_servers or bool(e.id),
        "env.tool_servers",
        e.tool_servers,
        "needs env.id: the servers are handed to a text env's factory; an agent runs its own tools",
    )
    servers = e.tool_servers
    entries = servers.items() if isinstance(servers, dict) else [(name, "") for name in servers]
    require(
        isinstance(servers, (list, dict)) and all(isinstance(n, str) and n and isinstance(c, str) for n, c in entries),
        "env.tool_servers",
        servers,
        "must be a list of task server names, or a mapping of names to command lines (stdio, or HTTP on {port})",
    )


def _validate_step_credit(cfg: LLMConfig) -> None:
    g = cfg.grpo
    check_step_credit(g.step_credit)
    positive("grpo.step_credit_weight", g.step_credit_weight, allow_zero=True)
    require(0 <= g.step_gamma <= 1, "grpo.step_gamma", g.step_gamma, "must be in [0, 1]")
    if g.step_credit == "none":
        return
    require(
        g.advantage == "grpo",
        "grpo.step_credit",
        g.step_credit,
        f"needs grpo.advantage 'grpo' (its episode term is GRPO's group advantage), not {g.advantage!r}",
    )
    require(
        g.step_credit not in STATE_KEYED_STEP_CREDITS or bool(cfg.env.id),
        "grpo.step_credit",
        g.step_credit,
        "needs a multi-turn text env (env.id) whose state_key() keys the steps; "
        + (
            f"{episode_source(cfg)}'s episodes have no env states to key"
            if episode_source(cfg)
            else "single-turn completions have none"
        ),
    )
