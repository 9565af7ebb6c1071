"""Anchor benchmark: TRL's ``GRPOTrainer`` on CPU, seconds per GRPO step.

This is the TRL side of the CPU GRPO comparison. rlfabric's GRPO runs on the same model, the same batch and the same
reward, and the ratio of the two step times is the figure the issue asks for (target: rlfabric at least 3x faster).
``run_trl_grpo`` is importable so a side-by-side script can time both in one run.

What one "GRPO step" is here (asserted while it runs, not just configured):

* 8 prompts x 8 generations = 64 completions, up to 32 new tokens each, sampled with ``model.generate`` at
  temperature 1 (no vLLM, no continuous batching), all 64 in one ``generate`` call;
* one reward call on those 64 completions (our group-level reward, weighted sum of its components);
* group-relative advantages, one policy forward + backward over the 64 sequences, one optimizer step.

In TRL 1.16 ``per_device_train_batch_size`` counts *completions*, not prompts, so the settings that give exactly that
are ``per_device_train_batch_size = 64``, ``gradient_accumulation_steps = 1``, ``steps_per_generation = 1`` (then
``generation_batch_size = 64`` and the sampler draws 64 / ``num_generations`` = 8 distinct prompts, each repeated 8
times), ``num_iterations = 1``. With generation and optimizer steps aligned like this TRL skips the extra no-grad pass
for old log-probs (the ratio is 1 at the single update), and with ``beta = 0`` it loads no reference model.

TRL defaults that are changed because they would slow or skew a CPU run of a 4M-parameter fp32 model:
``gradient_checkpointing`` (TRL default True), ``bf16`` (TRL default True when fp16 is off; ``bf16=True`` restores
it, and the side-by-side script runs both), the linear LR decay
(constant here), logging / saving / tqdm / reporting (off). Prompts are plain strings, so TRL takes its
non-conversational path: no chat template; prompts are tokenized as-is (the char tokenizer adds no BOS) and
left-padded with ``<pad>``; generation stops per sequence at ``<eos>`` (TRL adds the tokenizer's eos to the model's eos
ids and masks everything after the first eos); completions are decoded with ``skip_special_tokens=True``. TRL 1.16
has no ``max_prompt_length``: prompts are never truncated.

Timing: a ``TrainerCallback`` takes ``time.perf_counter()`` at ``on_step_begin`` and ``on_step_end`` (one optimizer
step, which contains generation, reward, loss, backward and the optimizer update); the first ``warmup_steps`` are
dropped. Within each step the time spent in ``_generate_and_score_completions`` (generation + reward + advantages) is
also recorded, so the report splits rollout from update.

Usage::

    python benchmarks/anchor_trl_grpo.py --steps 10 --warmup-steps 2 --threads 2
"""

from __future__ import annotations

import os

# Nothing may download: set before transformers / trl / datasets are imported (they read these at import time).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

# How the arithmetic reward's named components combine into the scalar GRPO reward (same weights as our config).
DEFAULT_REWARD_WEIGHTS: dict[str, float] = {"correct": 1.0, "format": 0.1}

# Keyword arguments TRL adds to every reward-function call that are not dataset columns.
_TRL_REWARD_KWARGS = {"trainer_state", "log_extra", "log_metric", "environments", "completion_ids"}


def log(msg: str) -> None:
    """Print a progress line to stderr."""
    print(f"[anchor_trl_grpo {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class _RewardAdapter:
    """Turn our group-level reward (``list[RewardInput] -> list[dict[str, float]]``) into a TRL reward function.

    TRL calls ``f(prompts=..., completions=..., completion_ids=..., **columns)`` once per generation batch, with one
    entry per completion and every dataset column except ``prompt`` repeated per completion. The scalar reward is
    ``sum(weight[name] * components[name])``; a component named in the weights but missing from the reward's output is
    an error, not a silent zero. Every call is recorded so the benchmark can check the batch shape of each step.
    """

    def __init__(
        self,
        reward_fn: Callable[[list[Any]], list[dict[str, float]]],
        weights: dict[str, float],
        eos_ids: Sequence[int],
    ):
        from rlfabric.rewards import RewardInput

        self._reward_input = RewardInput
        self.reward_fn = reward_fn
        self.weights = dict(weights)
        self.eos_ids = set(eos_ids)
        self.calls: list[dict[str, Any]] = []  # one record per call: batch size, groups, tokens, rewards
        self.__name__ = "rlfabric_reward"  # TRL names reward metrics after the function

    def __call__(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kwargs: Any):
        columns = {k: v for k, v in kwargs.items() if k not in _TRL_REWARD_KWARGS}
        inputs = [
            self._reward_input(
                prompt=prompt,
                completion=completion,
                metadata={name: values[i] for name, values in columns.items()},
                finish_reason="stop" if ids and ids[-1] in self.eos_ids else "length",
                num_tokens=len(ids),  # generated tokens, the stopping <eos> included
            )
            for i, (prompt, completion, ids) in enumerate(zip(prompts, completions, completion_ids, strict=True))
        ]
        components = self.reward_fn(inputs)
        if len(components) != len(inputs):
            raise ValueError(f"reward_fn returned {len(components)} results for {len(inputs)} completions")
        rewards = [float(sum(w * comp[name] for name, w in self.weights.items())) for comp in components]
        self.calls.append(
            {
                "completions": len(inputs),
                "prompts": prompts,
                "num_tokens": [x.num_tokens for x in inputs],
                "stopped": sum(x.finish_reason == "stop" for x in inputs),
                "mean_reward": sum(rewards) / len(rewards),
            }
        )
        return rewards


def _group_count(prompts: list[str], group_size: int) -> int:
    """Number of groups if ``prompts`` is ``group_size``-long runs of one prompt each; raises otherwise."""
    if len(prompts) % group_size:
        raise AssertionError(f"{len(prompts)} completions is not a multiple of the group size {group_size}")
    groups = [prompts[i : i + group_size] for i in range(0, len(prompts), group_size)]
    for g in groups:
        if len(set(g)) != 1:
            raise AssertionError(f"a generation group mixes prompts: {sorted(set(g))}")
    return len(groups)


def run_trl_grpo(
    model_dir: str,
    prompts: list[dict],
    reward_fn: Callable[[list[Any]], list[dict[str, float]]],
    *,
    steps: int = 10,
    warmup_steps: int = 2,
    prompts_per_step: int = 8,
    generations: int = 8,
    max_new_tokens: int = 32,
    lr: float = 1e-5,
    temperature: float = 1.0,
    kl_coef: float = 0.0,
    loss_type: str = "dapo",
    scale_rewards: str = "group",
    clip_eps: float = 0.2,
    max_grad_norm: float = 1.0,
    reward_weights: dict[str, float] | None = None,
    optim: str | None = None,
    gradient_checkpointing: bool = False,
    bf16: bool = False,
    seed: int = 0,
    threads: int = 2,
    output_dir: str,
) -> dict:
    """Run ``warmup_steps + steps`` GRPO steps of TRL's ``GRPOTrainer`` on CPU and time the last ``steps``.

    ``prompts`` are dataset rows ``{"prompt": str, "answer": str, ...}`` (plain strings, not chat messages); every
    column other than ``prompt`` reaches the reward as ``RewardInput.metadata``. ``reward_fn`` is our group-level
    reward, ``list[RewardInput] -> list[dict[str, float]]``; ``reward_weights`` (default ``{"correct": 1.0,
    "format": 0.1}``) turns its components into the scalar reward; ``bf16`` turns on TRL's own mixed precision
    (its default, off unless asked for). ``kl_coef`` is TRL's ``beta`` (0: no reference
    model); ``loss_type`` and ``scale_rewards`` take TRL's values ("grpo", "dr_grpo", "dapo", "bnpo", ...;
    "group", "batch", "none").

    Each step is checked to be exactly ``prompts_per_step`` groups x ``generations`` completions seen by one reward
    call and one optimizer step; a mismatch raises. Returns the timings and the configuration that produced them.
    """
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlfabric.models.hf import load_causal_lm, load_tokenizer

    total_steps = warmup_steps + steps
    batch = prompts_per_step * generations
    if len(prompts) < prompts_per_step:
        raise ValueError(f"need at least prompts_per_step={prompts_per_step} prompts, got {len(prompts)}")
    if any(not isinstance(row.get("prompt"), str) for row in prompts):
        raise ValueError("every row needs a plain-string 'prompt' (conversational prompts would use a chat template)")

    torch.set_num_threads(threads)
    torch.manual_seed(seed)

    tokenizer = load_tokenizer(model_dir)
    tokenizer.padding_side = "left"
    model = load_causal_lm(model_dir, dtype=torch.float32, device="cpu")
    dataset = Dataset.from_list(prompts)
    checkpointing_field = (
        "activation_checkpointing"
        if "activation_checkpointing" in GRPOConfig.__dataclass_fields__
        else "gradient_checkpointing"
    )

    config = GRPOConfig(
        output_dir=output_dir,
        # device and precision
        use_cpu=True,
        bf16=bf16,  # True: TRL's default mixed precision (autocast; float32 weights)
        fp16=False,
        # TRL defaults checkpointing on; transformers 5 renamed gradient_checkpointing to activation_checkpointing
        **{checkpointing_field: gradient_checkpointing},
        # one step = prompts_per_step x generations completions, generated at once, one optimizer step
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=generations,
        num_iterations=1,
        max_steps=total_steps,
        # generation (plain transformers generate)
        max_completion_length=max_new_tokens,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        use_transformers_continuous_batching=False,
        # loss
        beta=kl_coef,
        epsilon=clip_eps,
        loss_type=loss_type,
        scale_rewards=scale_rewards,
        mask_truncated_completions=False,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=max_grad_norm,
        **({"optim": optim} if optim else {}),
        # data
        remove_unused_columns=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        shuffle_dataset=True,
        seed=seed,
        # no logging, saving, reporting or progress bars
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
    )
    # Check what the config resolved to, not what was asked for.
    assert config.generation_batch_size == batch, config.generation_batch_size
    assert config.steps_per_generation == 1 and config.gradient_accumulation_steps == 1
    assert config.generation_batch_size // config.num_generations == prompts_per_step

    reward = _RewardAdapter(reward_fn, reward_weights or DEFAULT_REWARD_WEIGHTS, [tokenizer.eos_token_id])

    class StepTimer(TrainerCallback):
        """Wall time per optimizer step, plus the batch-shape checks."""

        def __init__(self) -> None:
            self.step_seconds: list[float] = []
            self.rollout_seconds: list[float] = []
            self.optimizer_steps = 0
            self.threads_seen: set[int] = set()
            self._t0 = 0.0
            self._calls0 = 0
            self._opt0 = 0
            self._rollout_acc = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._calls0, self._opt0, self._rollout_acc = len(reward.calls), self.optimizer_steps, 0.0
            self.threads_seen.add(torch.get_num_threads())
            self._t0 = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.optimizer_steps += 1

        def on_step_end(self, args, state, control, **kwargs):
            elapsed = time.perf_counter() - self._t0
            calls = reward.calls[self._calls0 :]
            if len(calls) != 1 or calls[0]["completions"] != batch:
                raise AssertionError(
                    f"step {state.global_step}: reward calls {[c['completions'] for c in calls]}, "
                    f"expected one call of {batch} completions"
                )
            groups = _group_count(calls[0]["prompts"], generations)
            if groups != prompts_per_step:
                raise AssertionError(f"step {state.global_step}: {groups} prompt groups, expected {prompts_per_step}")
            if self.optimizer_steps - self._opt0 != 1:
                raise AssertionError(f"step {state.global_step}: {self.optimizer_steps - self._opt0} optimizer steps")
            self.step_seconds.append(elapsed)
            self.rollout_seconds.append(self._rollout_acc)

    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    assert trainer.ref_model is None or kl_coef != 0.0
    # TRL's eos ids (tokenizer eos plus any the model declares) decide where completions stop.
    reward.eos_ids = set(trainer.eos_token_ids)

    # Time generation + reward + advantages inside each step (the rest is the loss forward/backward and the update).
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate_and_score(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return generate_and_score(*a, **kw)
        finally:
            timer._rollout_acc += time.perf_counter() - t0

    trainer._generate_and_score_completions = timed_generate_and_score

    log(
        f"TRL {trl.__version__}: {total_steps} steps ({warmup_steps} warm-up), {prompts_per_step} prompts x "
        f"{generations} generations x <= {max_new_tokens} tokens, {threads} threads"
    )
    load_before = os.getloadavg()
    t_train = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - t_train
    load_after = os.getloadavg()

    if len(timer.step_seconds) != total_steps or trainer.state.global_step != total_steps:
        raise AssertionError(
            f"ran {len(timer.step_seconds)} steps (global_step {trainer.state.global_step}), expected {total_steps}"
        )
    timed = timer.step_seconds[warmup_steps:]
    timed_rollout = timer.rollout_seconds[warmup_steps:]
    timed_calls = reward.calls[warmup_steps:]
    tokens = [n for c in timed_calls for n in c["num_tokens"]]
    return {
        "framework": "trl",
        "seconds_per_step_median": statistics.median(timed),
        "seconds_per_step_mean": statistics.fmean(timed),
        "seconds_per_step_min": min(timed),
        "seconds_per_step_max": max(timed),
        "step_seconds": timed,
        "warmup_step_seconds": timer.step_seconds[:warmup_steps],
        "rollout_seconds_median": statistics.median(timed_rollout),  # generate + reward + advantages
        "update_seconds_median": statistics.median(t - r for t, r in zip(timed, timed_rollout, strict=True)),
        "train_seconds_total": train_seconds,
        "steps": len(timed),
        "warmup_steps": warmup_steps,
        "prompts_per_step": prompts_per_step,
        "generations": generations,
        "completions_per_step": batch,
        "max_new_tokens": max_new_tokens,
        "mean_completion_tokens": statistics.fmean(tokens),
        "stopped_at_eos_fraction": sum(c["stopped"] for c in timed_calls) / len(tokens),
        "mean_reward_per_step": [c["mean_reward"] for c in reward.calls],
        "threads": sorted(timer.threads_seen),
        # 1-minute load average before and after training: well above `threads` means something else shared the CPUs
        "loadavg_1min_before_after": [load_before[0], load_after[0]],
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "config": {
            "per_device_train_batch_size": config.per_device_train_batch_size,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "steps_per_generation": config.steps_per_generation,
            "generation_batch_size": config.generation_batch_size,
            "num_generations": config.num_generations,
            "num_iterations": config.num_iterations,
            "max_completion_length": config.max_completion_length,
            "temperature": config.temperature,
            "beta": config.beta,
            "epsilon": config.epsilon,
            "loss_type": config.loss_type,
            "scale_rewards": config.scale_rewards,
            "learning_rate": config.learning_rate,
            "lr_scheduler_type": getattr(config.lr_scheduler_type, "value", config.lr_scheduler_type),
            "optim": getattr(config.optim, "value", config.optim),
            "max_grad_norm": config.max_grad_norm,
            "gradient_checkpointing": config.gradient_checkpointing,
            "bf16": config.bf16,
            "use_vllm": config.use_vllm,
            "reward_weights": reward.weights,
        },
    }


def _arithmetic_rows(n: int, seed: int) -> list[dict]:
    """The benchmark's prompts: ``rlfabric.envs.text_tasks.arithmetic_rows`` ("12+35=" -> "47")."""
    from rlfabric.envs.text_tasks import arithmetic_rows

    return arithmetic_rows(n, seed=seed)


def _arithmetic_reward() -> Callable[[list[Any]], list[dict[str, float]]]:
    """The registered "arithmetic" reward (components "correct" and "format")."""
    from rlfabric.rewards import resolve_reward

    return resolve_reward("arithmetic")


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=None, help="HF model dir (default: build the 4x256 char Qwen2)")
    p.add_argument("--steps", type=int, default=10, help="timed GRPO steps")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed GRPO steps first")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--scale-rewards", default="group")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="benchmarks/results/trl_grpo_anchor.json", help="results file ('' for none)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from rlfabric.models.hf import build_small_model_dir

    with tempfile.TemporaryDirectory(prefix="anchor_trl_grpo_") as tmp:
        model_dir = args.model_dir or str(build_small_model_dir(Path(tmp) / "model", seed=args.seed))
        rows = _arithmetic_rows(args.prompts_per_step * (args.steps + args.warmup_steps), args.seed)
        result = run_trl_grpo(
            model_dir,
            rows,
            _arithmetic_reward(),
            steps=args.steps,
            warmup_steps=args.warmup_steps,
            prompts_per_step=args.prompts_per_step,
            generations=args.generations,
            max_new_tokens=args.max_new_tokens,
            lr=args.lr,
            temperature=args.temperature,
            kl_coef=args.kl_coef,
            loss_type=args.loss_type,
            scale_rewards=args.scale_rewards,
            seed=args.seed,
            threads=args.threads,
            output_dir=str(Path(tmp) / "trl_out"),
        )
    result["model"] = args.model_dir or "Qwen2 4 layers x 256 hidden, random init, char tokenizer"
    result["command"] = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    result["machine"] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "nice": os.nice(0),  # negative: run with priority over other work on a shared machine
        "autogroup": _read("/proc/self/autogroup"),  # with autogroup scheduling, its nice is what counts
    }
    log(
        f"TRL GRPO: {result['seconds_per_step_median']:.3f} s/step median, {result['seconds_per_step_mean']:.3f} mean "
        f"over {result['steps']} steps (rollout {result['rollout_seconds_median']:.3f} s, update "
        f"{result['update_seconds_median']:.3f} s), {result['mean_completion_tokens']:.1f} tokens/completion"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
