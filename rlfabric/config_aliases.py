"""Other libraries' names for rlfabric's config keys (Hugging Face TRL's ``GRPOConfig``, CleanRL's PPO arguments,
verl's Hydra config), so that an unknown key a user brought along is answered with the key rlfabric uses. The one
table: the unknown-key error reads it, and docs/migrating.md lists every row (tests/test_docs.py checks both ways).

TRL's and CleanRL's names are single arguments; verl's are dotted paths of its config (``actor_rollout_ref.rollout.n``),
matched against an unknown key's whole dotted path, and a path may name a section (``critic``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Alias:
    name: str  # the other library's argument (verl: its dotted config path)
    library: str  # "TRL", "CleanRL" or "verl"
    algo: str  # the rlfabric schema it maps into: "grpo" (TRL, verl) or "ppo" (CleanRL)
    target: str  # rlfabric's key, dotted
    how: str = ""  # how they relate when it is not one key for one key ("": the same setting)

    def hint(self, cite: bool = True) -> str:
        """What the unknown-key error says about this name (``cite``: with the pointer to docs/migrating.md, which
        an error naming several such keys gives once)."""
        said = f"rlfabric's is {self.target!r}" if not self.how else f"in rlfabric {self.how}"
        return f"{self.library}'s name; {said}" + (", see docs/migrating.md" if cite else "")


_ACTOR = "actor_rollout_ref.actor"
_ROLLOUT = "actor_rollout_ref.rollout"
VERL_ALIASES = (
    Alias("actor_rollout_ref.model.path", "verl", "grpo", "model.path"),
    Alias("actor_rollout_ref.model.enable_gradient_checkpointing", "verl", "grpo", "model.gradient_checkpointing"),
    Alias("data.train_files", "verl", "grpo", "data.train", "it is 'data.train': one file"),
    Alias("data.val_files", "verl", "grpo", "data.eval", "it is 'data.eval': one file"),
    Alias("data.train_batch_size", "verl", "grpo", "grpo.prompts_per_step"),
    Alias("data.max_response_length", "verl", "grpo", "sampling.max_new_tokens"),
    Alias(
        "data.max_prompt_length",
        "verl",
        "grpo",
        "generator.vllm.max_model_len",
        "prompts are not cut; with vLLM 'generator.vllm.max_model_len' bounds prompt + completion",
    ),
    Alias(f"{_ROLLOUT}.n", "verl", "grpo", "grpo.group_size"),
    Alias(f"{_ROLLOUT}.name", "verl", "grpo", "generator.backend", "it is 'generator.backend': torch or vllm"),
    Alias(f"{_ROLLOUT}.temperature", "verl", "grpo", "sampling.temperature"),
    Alias(f"{_ROLLOUT}.top_p", "verl", "grpo", "sampling.top_p"),
    Alias(f"{_ROLLOUT}.top_k", "verl", "grpo", "sampling.top_k"),
    Alias(f"{_ROLLOUT}.gpu_memory_utilization", "verl", "grpo", "generator.vllm.gpu_memory_utilization"),
    Alias(f"{_ROLLOUT}.tensor_model_parallel_size", "verl", "grpo", "generator.vllm.tensor_parallel_size"),
    Alias(f"{_ACTOR}.optim.lr", "verl", "grpo", "grpo.lr"),
    Alias(f"{_ACTOR}.optim.lr_warmup_steps", "verl", "grpo", "grpo.warmup_steps"),
    Alias(f"{_ACTOR}.optim.weight_decay", "verl", "grpo", "grpo.weight_decay"),
    Alias(f"{_ACTOR}.grad_clip", "verl", "grpo", "grpo.max_grad_norm"),
    Alias(f"{_ACTOR}.use_kl_loss", "verl", "grpo", "grpo.kl_coef", "the KL loss is on when 'grpo.kl_coef' > 0"),
    Alias(f"{_ACTOR}.kl_loss_coef", "verl", "grpo", "grpo.kl_coef"),
    Alias(
        f"{_ACTOR}.kl_loss_type",
        "verl",
        "grpo",
        "grpo.kl_estimator",
        "it is 'grpo.kl_estimator': low_var_kl is k3, kl is k1",
    ),
    Alias(
        f"{_ACTOR}.loss_agg_mode",
        "verl",
        "grpo",
        "grpo.loss_aggregation",
        "it is 'grpo.loss_aggregation', with _ for - (token_mean)",
    ),
    Alias(f"{_ACTOR}.clip_ratio", "verl", "grpo", "grpo.clip_low", "it is 'grpo.clip_low' and 'grpo.clip_high'"),
    Alias(f"{_ACTOR}.clip_ratio_low", "verl", "grpo", "grpo.clip_low"),
    Alias(f"{_ACTOR}.clip_ratio_high", "verl", "grpo", "grpo.clip_high"),
    Alias(
        f"{_ACTOR}.clip_ratio_c",
        "verl",
        "grpo",
        "grpo.policy_loss",
        "it is 'grpo.policy_loss: dual_clip' (c = 3, verl's default)",
    ),
    Alias(f"{_ACTOR}.entropy_coeff", "verl", "grpo", "grpo.entropy_coef"),
    Alias(f"{_ACTOR}.ppo_micro_batch_size_per_gpu", "verl", "grpo", "grpo.micro_batch_size"),
    Alias(
        f"{_ACTOR}.ppo_mini_batch_size",
        "verl",
        "grpo",
        "grpo.mini_batches",
        "it is 'grpo.mini_batches': optimizer steps per epoch, data.train_batch_size / ppo_mini_batch_size",
    ),
    Alias(f"{_ACTOR}.ppo_epochs", "verl", "grpo", "grpo.epochs"),
    Alias(
        "algorithm.adv_estimator",
        "verl",
        "grpo",
        "grpo.advantage",
        "it is 'grpo.advantage': grpo, rloo, reinforce_pp (reinforce_plus_plus), reinforce_pp_baseline",
    ),
    Alias("algorithm.norm_adv_by_std_in_grpo", "verl", "grpo", "grpo.scale_by_std"),
    Alias(
        "algorithm.kl_ctrl",
        "verl",
        "grpo",
        "grpo.kl_target",
        "it is 'grpo.kl_target' (type adaptive's target_kl; horizon is 'grpo.kl_horizon', kl_coef 'grpo.kl_coef'), "
        "on the KL loss term",
    ),
    Alias(
        "algorithm.filter_groups",
        "verl",
        "grpo",
        "grpo.dynamic_sampling",
        "it is 'grpo.dynamic_sampling: true'; max_num_gen_batches is 'grpo.max_sampling_rounds'",
    ),
    Alias("trainer.total_training_steps", "verl", "grpo", "training.total_steps"),
    Alias(
        "trainer.total_epochs",
        "verl",
        "grpo",
        "training.total_steps",
        "a run is 'training.total_steps' long: epochs x rows / 'grpo.prompts_per_step'",
    ),
    Alias("trainer.save_freq", "verl", "grpo", "training.checkpoint_every"),
    Alias("trainer.test_freq", "verl", "grpo", "training.eval_every"),
    Alias("trainer.max_actor_ckpt_to_keep", "verl", "grpo", "training.keep_checkpoints"),
    *(
        Alias(
            f"custom_reward_function.{name}",
            "verl",
            "grpo",
            "rewards.functions",
            "it is 'rewards.functions: [{name: \"module:compute_score\"}]', your function unchanged",
        )
        for name in ("path", "name")
    ),
    Alias(
        "reward_model.enable",
        "verl",
        "grpo",
        "rewards.functions",
        "a reward model is a {name: reward_model} entry of 'rewards.functions'; the reward_model section trains one",
    ),
    Alias(
        "critic",
        "verl",
        "grpo",
        "grpo.advantage",
        "GRPO-family runs have no critic: the advantage comes from each group, see 'grpo.advantage'",
    ),
)

ALIASES = (
    Alias("num_generations", "TRL", "grpo", "grpo.group_size"),
    Alias("max_completion_length", "TRL", "grpo", "sampling.max_new_tokens"),
    Alias("beta", "TRL", "grpo", "grpo.kl_coef"),
    Alias("learning_rate", "TRL", "grpo", "grpo.lr"),
    Alias("loss_type", "TRL", "grpo", "grpo.loss_aggregation"),
    Alias("scale_rewards", "TRL", "grpo", "grpo.scale_by_std"),
    Alias("epsilon", "TRL", "grpo", "grpo.clip_low"),
    Alias("epsilon_high", "TRL", "grpo", "grpo.clip_high"),
    Alias("num_iterations", "TRL", "grpo", "grpo.epochs"),
    Alias(
        "steps_per_generation",
        "TRL",
        "grpo",
        "grpo.mini_batches",
        "it is 'grpo.mini_batches' = steps_per_generation / gradient_accumulation_steps (optimizer steps per batch)",
    ),
    Alias("mask_truncated_completions", "TRL", "grpo", "grpo.overlong_filter"),
    Alias("reward_weights", "TRL", "grpo", "rewards.weights"),
    Alias("max_steps", "TRL", "grpo", "training.total_steps"),
    Alias("save_steps", "TRL", "grpo", "training.checkpoint_every"),
    Alias("save_total_limit", "TRL", "grpo", "training.keep_checkpoints"),
    Alias("eval_steps", "TRL", "grpo", "training.eval_every"),
    Alias("lr_scheduler_type", "TRL", "grpo", "grpo.lr_schedule"),
    Alias("importance_sampling_level", "TRL", "grpo", "grpo.ratio_level"),
    Alias("model_name_or_path", "TRL", "grpo", "model.path"),
    Alias("dataset_name", "TRL", "grpo", "data.train"),
    Alias("temperature", "TRL", "grpo", "sampling.temperature"),
    Alias("top_p", "TRL", "grpo", "sampling.top_p"),
    Alias("top_k", "TRL", "grpo", "sampling.top_k"),
    Alias("max_grad_norm", "TRL", "grpo", "grpo.max_grad_norm"),
    Alias("warmup_steps", "TRL", "grpo", "grpo.warmup_steps"),
    Alias("weight_decay", "TRL", "grpo", "grpo.weight_decay"),
    Alias("seed", "TRL", "grpo", "training.seed"),
    *VERL_ALIASES,
    Alias("learning_rate", "CleanRL", "ppo", "ppo.lr"),
    Alias("update_epochs", "CleanRL", "ppo", "ppo.num_epochs"),
    Alias("norm_adv", "CleanRL", "ppo", "ppo.normalize_advantages"),
    Alias("clip_vloss", "CleanRL", "ppo", "ppo.clip_value_loss"),
    Alias("total_timesteps", "CleanRL", "ppo", "training.total_env_steps"),
    *(
        Alias(name, "CleanRL", "ppo", f"ppo.{name}")  # the same names, in the ppo section
        for name in ("anneal_lr", "gamma", "gae_lambda", "clip_coef", "ent_coef", "vf_coef", "max_grad_norm")
    ),
    Alias("target_kl", "CleanRL", "ppo", "ppo.target_kl"),
    Alias("seed", "CleanRL", "ppo", "training.seed"),
    Alias("env_id", "CleanRL", "ppo", "env.id", "it is 'env.id' with a 'gym:' prefix (gym:HalfCheetah-v5)"),
    Alias(
        "num_envs",
        "CleanRL",
        "ppo",
        "runners.envs_per_runner",
        "it is 'runners.num_runners' x 'runners.envs_per_runner'",
    ),
    Alias(
        "num_steps",
        "CleanRL",
        "ppo",
        "ppo.train_batch_size",
        "it is 'ppo.train_batch_size' / (runners.num_runners x runners.envs_per_runner)",
    ),
    Alias(
        "num_minibatches",
        "CleanRL",
        "ppo",
        "ppo.minibatch_size",
        "it is 'ppo.train_batch_size' / 'ppo.minibatch_size'",
    ),
)


def alias_for(name: str, algo: str) -> Alias | None:
    """The row for another library's argument ``name`` (verl's: a dotted path) in a config of ``algo``, or None."""
    return next((a for a in ALIASES if a.name == name and a.algo == algo), None)


def aliases_under(path: str, algo: str) -> bool:
    """Whether some row of ``algo`` names a key under the dotted ``path`` (verl's ``actor_rollout_ref``)."""
    return any(a.name.startswith(f"{path}.") and a.algo == algo for a in ALIASES)
