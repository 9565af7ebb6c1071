"""Other libraries' names for rlfabric's config keys (Hugging Face TRL's ``GRPOConfig``, CleanRL's PPO arguments),
so that an unknown key a user brought along is answered with the key rlfabric uses. The one table: the
unknown-key error reads it, and docs/migrating.md lists every row (tests/test_docs.py checks both ways)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Alias:
    name: str  # the other library's argument
    library: str  # "TRL" or "CleanRL"
    algo: str  # the rlfabric schema it maps into: "grpo" (TRL) or "ppo" (CleanRL)
    target: str  # rlfabric's key, dotted
    how: str = ""  # how they relate when it is not one key for one key ("": the same setting)

    def hint(self) -> str:
        """What the unknown-key error says about this name."""
        said = f"rlfabric's is {self.target!r}" if not self.how else f"in rlfabric {self.how}"
        return f"{self.library}'s name; {said}, see docs/migrating.md"


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
    """The row for another library's argument ``name`` in a config of ``algo``, or None."""
    return next((a for a in ALIASES if a.name == name and a.algo == algo), None)
