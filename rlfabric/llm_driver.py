"""The LLM post-training driver: prompts -> generators -> reward services -> learners -> weights -> generators.

A single controller, like the PPO driver: it samples prompts, moves ObjectRefs between actors, and keeps the
counters. Per step:

1. prompts (``grpo.prompts_per_step``, each repeated ``grpo.group_size`` times) go to the generators, which
   return completions tagged with the policy version that made them;
2. the reward services score whole groups and return named components; the configured weights sum them;
3. groups without signal are dropped and refilled (dynamic sampling), advantages are computed per group;
4. the learners update on one packed batch (read from the object store) and the new weights go back to every
   generator with one ``ray.put``.

``training.max_policy_lag`` = k > 0 keeps k batches generating while the learner updates (bounded async).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from rlfabric import rewards
from rlfabric.algorithms.grpo import compute_advantages, group_has_signal
from rlfabric.config import ConfigError
from rlfabric.data import load_heldout, load_prompts, row_metadata
from rlfabric.driver import ensure_ray, resumed_config
from rlfabric.grpo_config import LLMConfig
from rlfabric.interrupts import stop_requests
from rlfabric.models.sequences import is_row_column, pack_sequences
from rlfabric.models.shared_weights import SharedFlatWeights, remove_stale
from rlfabric.reward_pool import RewardPool
from rlfabric.rewards import RewardInput, RewardResult
from rlfabric.run_log import CONFIG_FILE, RunLog, read_metrics, write_summary
from rlfabric.runner_pool import RunAbortedError, error_summary

CHECKPOINT_DIR = "checkpoints"
TRAINER_STATE_FILE = "trainer_state.json"  # written last: a checkpoint without it is incomplete
REFERENCE_MODEL_DIR = "reference_model"  # the KL reference after an SFT warm-up, kept for --resume
FINAL_MODEL_DIR = "final_model"
INITIAL_MODEL_DIR = "initial_model"  # the builtin model, as built for the run
# What a checkpoint's weights and the data order depend on: a resumed run may not change these.
FIXED_ON_RESUME = (
    "algo",
    "model.path",
    "model.builtin",
    "model.dtype",
    "data.train",
    "data.num_train",
    "data.prompt_key",
    "data.chat_template",
    "training.seed",
)
SAMPLES_FILE = "samples.jsonl"
PLOT_FILE = "learning_curve.png"
SETUP_TIMEOUT_S = 300.0
MAX_GENERATION_RETRIES = 3
STOP_NOTICE = "rlfabric: stopping after this step, with a checkpoint when checkpointing is on (Ctrl-C again: at once)"


@dataclass
class Rollout:
    """One generation request in flight: prompts (rows) repeated group_size times, sent to the generators."""

    indices: list[int]  # the train prompts, once each (put back in the order when a checkpoint is taken)
    rows: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    refs: list[tuple[int, ray.ObjectRef, slice]]  # (generator index, completions ref, rows it covers)


@dataclass
class Counters:
    step: int = 0  # GRPO optimizer steps (the policy version counts SFT steps too)
    samples: int = 0
    tokens_generated: int = 0
    failed_samples: int = 0
    stale_samples: int = 0
    filtered_groups: int = 0
    generator_restarts: int = 0


def combine_rewards(components: dict[str, float], weights: dict[str, float]) -> float:
    """The scalar reward: each named component times its weight (weight 1 when not listed)."""
    return float(sum(weights.get(name, 1.0) * value for name, value in components.items()))


def wanted_cpus(cfg: LLMConfig) -> float:
    """CPUs every actor of this config asks for, plus one for the driver."""
    return (
        cfg.generator.num_generators * cfg.generator.num_cpus
        + cfg.learner.num_learners * cfg.learner.num_cpus
        + cfg.rewards.num_workers * cfg.rewards.num_cpus
        + 1
    )


def concurrent_actors(cfg: LLMConfig, role: str) -> int:
    """How many generator/learner/reference actors compute at the same time as one of ``role``.

    In sync mode the generators run together, then the reference, then the learners together, so each phase can
    have every core; with ``max_policy_lag`` > 0 generators and learners run at once and must split them. (Two
    OpenMP teams that each spin on every core slow each other down several times over.)
    """
    g, lc = cfg.generator, cfg.learner
    if cfg.training.max_policy_lag > 0:
        return g.num_generators + lc.num_learners
    by_role = {"generator": g.num_generators, "learner": lc.num_learners, "reference": 1}
    if role not in by_role:
        raise ValueError(f"concurrent_actors: role {role!r} is not one of {sorted(by_role)}")
    return by_role[role]


def progress_line(row: dict[str, Any]) -> str:
    if row.get("phase") == "sft":
        return f"sft  {row['sft_step']:>5} | loss {row['sft_loss']:.3f} | {row['time_s']:6.0f}s"
    if row.get("phase") == "eval":
        return f"eval step {row['step']:>5} | held-out accuracy {row['eval_accuracy']:.3f} | {row['time_s']:6.0f}s"
    return (
        f"step {row['step']:>5} | reward {row['reward_mean']:6.3f} | acc {row.get('accuracy', float('nan')):5.3f} | "
        f"v{row['policy_version']} | {row['samples_per_s']:6.1f} samples/s | failed {row['failed_samples']} | "
        f"{row['time_s']:6.0f}s"
    )


def _not_final(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row kept by a resumed run: its earlier session's "final" evaluation is an evaluation at that
    step now (the resumed run ends with its own "final")."""
    return {**row, "label": f"step_{row['step']}"} if row.get("label") == "final" else row


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint folder of a GRPO run (None when there is none)."""
    found = sorted(p for p in (run_dir / CHECKPOINT_DIR).glob("step_*") if (p / TRAINER_STATE_FILE).is_file())
    return found[-1] if found else None


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / TRAINER_STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--resume: {str(path)!r} cannot be read ({exc}); delete that checkpoint folder") from None
    if not isinstance(state, dict) or "step" not in state.get("counters", {}):
        raise ConfigError(
            f"--resume: {str(checkpoint)!r} has no driver state (an older rlfabric wrote it); start a new run from "
            f"its weights with model.path={checkpoint}"
        )
    return state


class GRPOTrainer:
    """Runs one LLM post-training job (``algo: grpo``) described by a validated LLMConfig."""

    def __init__(
        self, cfg: LLMConfig, run_dir: str | Path, quiet: bool = False, resume_from: Path | None = None
    ) -> None:
        """A new run in ``run_dir``, or (``resume_from``: one of its checkpoints; see ``from_run_dir``) the
        continuation of the run there."""
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.quiet = quiet
        self.resume_from = resume_from
        checkpoints = self.run_dir / CHECKPOINT_DIR
        if resume_from is None and checkpoints.exists() and any(checkpoints.iterdir()):
            raise ConfigError(
                f"--run-dir {str(self.run_dir)!r} already holds a run: continue it with --resume "
                f"{str(self.run_dir)!r}, or choose another directory"
            )
        for i, spec in enumerate(cfg.rewards.functions):  # unknown reward names fail before any actor starts
            rewards.resolve_reward(dataclasses.asdict(spec), f"rewards.functions[{i}]")
        self.counters = Counters()
        self.version = 0
        self.rng = np.random.default_rng(cfg.training.seed)
        self.generators: list[Any] = []
        self.learners: list[Any] = []
        self.reference: Any = None
        self.pool: RewardPool | None = None
        self.log: RunLog | None = None
        self._order: list[int] = []
        self._group_counter = 0
        self._in_flight: deque[Rollout] = deque()  # rollouts generating ahead (max_policy_lag > 0)
        self._elapsed_before = 0.0  # wall clock of the sessions before a resume
        # The weights the KL penalty anchors to: the initial model, or the policy after the SFT warm-up (saved
        # for --resume only when there is a KL term and checkpoints; None: not saved).
        self.reference_dir: str | None = None
        self._start = time.monotonic()
        self._step_timings: dict[str, float] = {}  # where the current step's wall-clock time went
        self._transport = "object_store"  # learner.weight_transport for where the actors run (set up in setup)
        self._published: Any = None  # the latest published weights' handle
        self._shared_files: set[str] = set()  # shared-memory files learners wrote (removed at close)
        self.weights_via: str | None = None  # how the last publication reached the generators

    @contextmanager
    def _timed(self, key: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self._step_timings[key] = self._step_timings.get(key, 0.0) + time.monotonic() - started

    @classmethod
    def from_run_dir(cls, run_dir: str | Path, overrides: list[str] | None = None, quiet: bool = False) -> GRPOTrainer:
        """A trainer that continues the GRPO run in ``run_dir`` from its latest checkpoint: weights, optimizer,
        policy version, counters and the prompt order; metrics logged after the checkpoint are dropped (those
        steps run again). ``overrides`` change the saved config (``training.total_steps=500`` to train longer),
        except the fields in ``FIXED_ON_RESUME``.
        """
        run_dir = Path(run_dir)
        if not (run_dir / CONFIG_FILE).is_file():
            raise ConfigError(f"--resume {str(run_dir)!r}: not a run directory (no {CONFIG_FILE})")
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is None:
            raise ConfigError(
                f"--resume {str(run_dir)!r}: no checkpoint found under {CHECKPOINT_DIR}/ "
                "(runs save them every training.checkpoint_every steps)"
            )
        cfg = resumed_config(run_dir, overrides, FIXED_ON_RESUME)
        state = read_trainer_state(checkpoint)
        needed = [run_dir / INITIAL_MODEL_DIR] if cfg.model.path == "builtin" else []
        reference = state.get("reference_model")
        if reference and reference["in_run"]:
            needed.append(run_dir / reference["path"])
        for folder in needed:
            if not folder.is_dir():
                raise ConfigError(f"--resume {str(run_dir)!r}: {folder.name}/ is missing from the run directory")
        step = state["counters"]["step"]
        if step >= cfg.training.total_steps:
            raise ConfigError(
                f"training.total_steps = {cfg.training.total_steps} is not valid with --resume: the latest "
                f"checkpoint ({checkpoint.name}) is at step {step} already; pass training.total_steps=N with N > {step}"
            )
        if cfg.grpo.kl_coef > 0 and reference is None:
            raise ConfigError(
                f"grpo.kl_coef = {cfg.grpo.kl_coef} is not valid with --resume: this run saved no KL reference model "
                "(it trained without a KL term after an SFT warm-up)"
            )
        return cls(cfg, run_dir, quiet=quiet, resume_from=checkpoint)

    # -- setup ------------------------------------------------------------------------------------------------

    def _model_dir(self, build: bool = True) -> str:
        """The model the run starts from: ``model.path``, or the builtin model (built here when ``build``)."""
        m = self.cfg.model
        if m.path != "builtin":
            return m.path
        from rlfabric.models.hf import build_small_model_dir

        b = m.builtin
        path = self.run_dir / INITIAL_MODEL_DIR
        if not build:
            return str(path)
        build_small_model_dir(
            path,
            seed=self.cfg.training.seed,
            num_layers=b.num_layers,
            hidden_size=b.hidden_size,
            num_heads=b.num_heads,
            max_positions=b.max_positions,
        )
        return str(path)

    def _encode(self, text: str) -> list[int]:
        if self.cfg.data.chat_template:
            return list(
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
                )
            )
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def _load_data(self) -> None:
        d, seed = self.cfg.data, self.cfg.training.seed
        self.train_rows = load_prompts(d.train, num_rows=d.num_train, seed=seed, prompt_key=d.prompt_key)
        if not self.train_rows:
            raise ConfigError(f"data.train = {d.train!r}: holds no prompts")
        eval_spec = d.eval or d.train
        self.eval_rows = load_heldout(
            eval_spec, train_rows=self.train_rows, num_rows=d.num_eval, seed=seed, prompt_key=d.prompt_key
        )
        self.train_ids = [self._encode(r[d.prompt_key]) for r in self.train_rows]
        self.eval_ids = [self._encode(r[d.prompt_key]) for r in self.eval_rows]

    def _threads(self, role: str) -> int:
        """Torch threads for one actor of ``role``: this node's cores shared by the actors computing at once."""
        return max(1, (os.cpu_count() or 1) // concurrent_actors(self.cfg, role))

    def _sampling_seed(self) -> int:
        """The generators' sampling seed: the run's, moved on by the policy version, so a resumed run does not
        replay the random draws its first session began with."""
        return self.cfg.training.seed + self.version

    def _start_generator(self) -> Any:
        from rlfabric.actors.generator import Generator

        g = self.cfg.generator
        options: dict[str, Any]
        if g.backend == "torch":
            device = "cuda" if g.num_gpus > 0 else "cpu"
            options = {
                "max_batch_size": g.max_batch_size,
                "device": device,
                "seed": self._sampling_seed(),
                "matmul_dtype": g.matmul_dtype,
            }
        else:
            options = {**dataclasses.asdict(g.vllm), "seed": self._sampling_seed()}
        return Generator.options(num_cpus=g.num_cpus, num_gpus=g.num_gpus, resources=g.resources).remote(
            g.backend, self.base_model_dir, options, num_threads=self._threads("generator")
        )

    def _start_learners(self) -> None:
        from rlfabric.actors.llm_learner import LLMLearner

        c, lc = self.cfg, self.cfg.learner
        device = lc.device if lc.device != "auto" else ("cuda" if lc.num_gpus > 0 else "cpu")
        grpo = {**dataclasses.asdict(c.grpo), "norm_length": c.sampling.max_new_tokens}
        self.learners = [
            LLMLearner.options(num_cpus=lc.num_cpus, num_gpus=lc.num_gpus, resources=lc.resources).remote(
                model_dir=self.model_dir,
                grpo=grpo,
                sft=dataclasses.asdict(c.sft),
                temperature=c.sampling.temperature,
                dtype=c.model.dtype,
                device=device,
                rank=rank,
                world_size=lc.num_learners,
                seed=c.training.seed,
                gradient_checkpointing=c.model.gradient_checkpointing,
                reference_in_learner=c.grpo.kl_coef > 0 and c.grpo.reference == "learner",
                reference_dir=self.reference_dir,
                num_threads=self._threads("learner"),
                matmul_dtype=lc.matmul_dtype,
            )
            for rank in range(lc.num_learners)
        ]
        if lc.num_learners > 1:
            address = ray.get(self.learners[0].node_address.remote(), timeout=SETUP_TIMEOUT_S)
            port = ray.get(self.learners[0].free_port.remote(), timeout=SETUP_TIMEOUT_S)
            backend = "nccl" if device == "cuda" else "gloo"
            ray.get([ln.init_process_group.remote(address, port, backend) for ln in self.learners])

    def setup(self) -> None:
        from rlfabric.models.hf import load_tokenizer

        self.run_dir.mkdir(parents=True, exist_ok=True)
        state = read_trainer_state(self.resume_from) if self.resume_from else None
        self.log = RunLog(
            self.run_dir,
            self.cfg,
            resume_at=state["counters"]["step"] if state else None,
            quiet=self.quiet,
            step_key="step",
            progress_line=progress_line,
            relabel=_not_final,
        )
        # Generators start from the run's first model and then take published weights; a resumed run's learners
        # start from the checkpoint (a Hugging Face model folder), which may be pruned later.
        self.base_model_dir = self._model_dir(build=state is None)
        if state:
            self.model_dir = str(self.resume_from)
            self._restore(state)
        else:
            self.model_dir = self.base_model_dir
            self.reference_dir = self.model_dir
        self.tokenizer = load_tokenizer(self.model_dir)
        self._load_data()
        ensure_ray(self.cfg.ray, wanted_cpus(self.cfg), openmp_env())
        self.generators = [self._start_generator() for _ in range(self.cfg.generator.num_generators)]
        self._start_learners()
        if self.cfg.grpo.kl_coef > 0 and self.cfg.grpo.reference == "actor":
            from rlfabric.actors.reference import Reference

            lc = self.cfg.learner
            self.reference = Reference.options(num_cpus=lc.num_cpus, num_gpus=lc.num_gpus).remote(
                self.reference_dir,
                self.cfg.sampling.temperature,
                self.cfg.grpo.micro_batch_size,
                dtype=self.cfg.model.dtype,
                device="cuda" if lc.num_gpus > 0 else "cpu",
                num_threads=self._threads("reference"),
                matmul_dtype=lc.matmul_dtype,
            )
        r = self.cfg.rewards
        self.pool = RewardPool(
            [dataclasses.asdict(f) for f in r.functions], r.num_workers, r.timeout_s, num_cpus_per_worker=r.num_cpus
        )
        try:  # every actor answers before the clock starts, or setup names the one that did not
            ray.get([g.version.remote() for g in self.generators], timeout=SETUP_TIMEOUT_S)
            ray.get([ln.get_version.remote() for ln in self.learners], timeout=SETUP_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RunAbortedError(
                f"actors did not start within {SETUP_TIMEOUT_S:.0f}s: the cluster may lack the CPUs/GPUs asked "
                "for (generator.num_cpus/num_gpus, learner.num_cpus/num_gpus)"
            ) from None
        self._transport = self._weight_transport()
        self._note_slow_attention()
        if state:
            assert self.resume_from is not None
            ray.get([ln.load_optimizer.remote(str(self.resume_from)) for ln in self.learners])
            self._publish()  # the generators take the checkpoint's policy version
            self.log.note(f"resumed from {self.resume_from.name} (step {self.counters.step}, v{self.version})")
        self._start = time.monotonic() - self._elapsed_before  # times and rates count every session

    def _note_slow_attention(self) -> None:
        """Say so when CPU generators decode without the native attention kernel (no compiler, say): slower."""
        g = self.cfg.generator
        if g.backend != "torch" or g.num_gpus > 0:
            return
        attention = ray.get(self.generators[0].attention.remote())
        if attention and not attention.startswith("native"):
            self.log.note(f"generators decode with {attention}")

    # -- generation -------------------------------------------------------------------------------------------

    def _sample_rows(self, k: int) -> list[int]:
        """k train prompt indices: passes over a shuffled order, reshuffled each pass."""
        out = []
        while len(out) < k:
            if not self._order:
                self._order = list(self.rng.permutation(len(self.train_rows)))
            out.append(int(self._order.pop()))
        return out

    def _params(self, greedy: bool) -> dict[str, Any]:
        s = self.cfg.sampling
        if greedy:
            return {"max_new_tokens": s.max_new_tokens, "temperature": 0.0}
        return {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}

    def _dispatch(self, prompt_ids: list[list[int]], params: dict[str, Any], unit: int) -> list[tuple]:
        """Split prompts across generators in whole units (a group stays on one generator)."""
        n_units = len(prompt_ids) // unit
        per = math.ceil(n_units / len(self.generators))
        refs = []
        for i, gen in enumerate(self.generators):
            rows = slice(i * per * unit, min((i + 1) * per * unit, len(prompt_ids)))
            if rows.start < rows.stop:
                refs.append((i, gen.generate.remote(prompt_ids[rows], params), rows))
        return refs

    def _submit_rollout(self, num_prompts: int) -> Rollout:
        g = self.cfg.grpo.group_size
        indices = self._sample_rows(num_prompts)
        rows = [self.train_rows[i] for i in indices for _ in range(g)]
        prompt_ids = [self.train_ids[i] for i in indices for _ in range(g)]
        return Rollout(indices, rows, prompt_ids, self._dispatch(prompt_ids, self._params(False), g))

    def _replace_generator(self, index: int, reason: str) -> None:
        self.counters.generator_restarts += 1
        if self.log:
            self.log.note(f"generator {index} replaced ({reason})")
        ray.kill(self.generators[index], no_restart=True)
        self.generators[index] = self._start_generator()
        if self.version > 0:
            self._transport = self._weight_transport()  # the new one may run on another node
            self._publish([self.generators[index]], timeout=SETUP_TIMEOUT_S)

    def _collect(self, prompt_ids: list[list[int]], refs: list[tuple], params: dict[str, Any]) -> list[dict]:
        """Completions for every prompt, in order; a generator that fails or misses its deadline is replaced
        and its share generated again."""
        out: list[dict | None] = [None] * len(prompt_ids)
        pending = list(refs)
        for _attempt in range(MAX_GENERATION_RETRIES + 1):
            retry = []
            for index, ref, rows in pending:
                try:
                    out[rows] = ray.get(ref, timeout=self.cfg.generator.timeout_s)
                except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as exc:
                    reason = "timed out" if isinstance(exc, ray.exceptions.GetTimeoutError) else error_summary(exc)
                    self._replace_generator(index, reason)
                    retry.append((index, self.generators[index].generate.remote(prompt_ids[rows], params), rows))
            if not retry:
                return out  # type: ignore[return-value]
            pending = retry
        raise RunAbortedError(f"generation failed {MAX_GENERATION_RETRIES + 1} times in a row; see the notes above")

    # -- scoring ----------------------------------------------------------------------------------------------

    def _reward_inputs(self, rows: list[dict], completions: list[dict]) -> list[RewardInput]:
        key = self.cfg.data.prompt_key
        return [
            RewardInput(
                prompt=row[key],
                completion=c["text"],
                metadata=row_metadata(row, key),
                finish_reason=c["finish_reason"],
                num_tokens=len(c["token_ids"]),
            )
            for row, c in zip(rows, completions, strict=False)
        ]

    def _score(self, rows: list[dict], completions: list[dict], group: int) -> list[RewardResult]:
        inputs = self._reward_inputs(rows, completions)
        groups = [inputs[i : i + group] for i in range(0, len(inputs), group)]
        assert self.pool is not None
        return [r for g in self.pool.score(groups) for r in g]

    # -- one training step ------------------------------------------------------------------------------------

    def _rollout_samples(self, rollout: Rollout) -> list[dict[str, Any]]:
        """Generate (collect), score and label one rollout's samples; failed and too-stale samples are dropped."""
        with self._timed("generate_time_s"):
            completions = self._collect(rollout.prompt_ids, rollout.refs, self._params(False))
        with self._timed("reward_time_s"):
            results = self._score(rollout.rows, completions, self.cfg.grpo.group_size)
        samples = []
        lag = self.cfg.training.max_policy_lag
        first_group = self._group_counter
        for i, (_row, ids, c, res) in enumerate(
            zip(rollout.rows, rollout.prompt_ids, completions, results, strict=False)
        ):
            self.counters.samples += 1
            self.counters.tokens_generated += len(c["token_ids"])
            if res.error is not None:
                self.counters.failed_samples += 1
                continue
            if self.version - c["version"] > lag:
                self.counters.stale_samples += 1
                continue
            samples.append(
                {
                    "group": first_group + i // self.cfg.grpo.group_size,
                    "prompt_ids": ids,
                    "completion": c,
                    "components": res.components,
                    "reward": combine_rewards(res.components, self.cfg.rewards.weights),
                }
            )
        self._group_counter += len(rollout.rows) // self.cfg.grpo.group_size
        return samples

    def _with_signal(self, samples: list[dict]) -> list[dict]:
        if not samples:
            return samples
        rewards_t = torch.tensor([s["reward"] for s in samples])
        groups_t = torch.tensor([s["group"] for s in samples])
        keep = group_has_signal(rewards_t, groups_t).tolist()
        kept = [s for s, k in zip(samples, keep, strict=False) if k]
        self.counters.filtered_groups += len({s["group"] for s in samples}) - len({s["group"] for s in kept})
        return kept

    def _gather_batch(self, in_flight: deque[Rollout]) -> tuple[list[dict], list[dict]]:
        """(samples to train on, every scored sample) for one step, refilling groups dropped by dynamic sampling."""
        g = self.cfg.grpo
        samples = self._rollout_samples(in_flight.popleft())
        scored = list(samples)
        if not g.dynamic_sampling:
            return samples, scored
        samples = self._with_signal(samples)
        for _round in range(g.max_sampling_rounds - 1):
            missing = g.prompts_per_step - len({s["group"] for s in samples})
            if missing <= 0:
                break
            extra = self._rollout_samples(self._submit_rollout(missing))
            scored += extra
            samples += self._with_signal(extra)
        groups = sorted({s["group"] for s in samples})[: g.prompts_per_step]
        return [s for s in samples if s["group"] in set(groups)], scored

    def _pack(self, samples: list[dict]) -> dict[str, np.ndarray]:
        g = self.cfg.grpo
        rewards_t = torch.tensor([s["reward"] for s in samples], dtype=torch.float32)
        groups_t = torch.tensor([s["group"] for s in samples])
        advantages = compute_advantages(g.advantage, rewards_t, groups_t, scale_by_std=g.scale_by_std)
        responses = [s["completion"]["token_ids"] for s in samples]
        batch = pack_sequences([s["prompt_ids"] for s in samples], responses, self.tokenizer.pad_token_id)
        behaviour = np.zeros_like(batch["response_mask"])
        for i, s in enumerate(samples):
            lp = s["completion"]["logprobs"]
            behaviour[i, : len(lp)] = lp
        if g.overlong_filter:
            truncated = np.array([s["completion"]["finish_reason"] == "length" for s in samples])
            batch["response_mask"][truncated] = 0.0
        batch["advantages"] = advantages.numpy().astype(np.float32)
        batch["behaviour_logprobs"] = behaviour
        return self._pad_for_learners(batch)

    def _pad_for_learners(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Repeat rows with a zero loss mask until every data-parallel learner gets the same number."""
        world = self.cfg.learner.num_learners
        n = len(batch["input_ids"])
        extra = (-n) % world
        if extra == 0:
            return batch
        for key, value in batch.items():
            if is_row_column(value, n):
                pad = value[:extra].copy()
                if key == "response_mask":
                    pad[:] = 0.0
                batch[key] = np.concatenate([value, pad])
        return batch

    def _lr(self) -> float:
        g = self.cfg.grpo
        if g.warmup_steps and self.counters.step < g.warmup_steps:
            return g.lr * (self.counters.step + 1) / g.warmup_steps
        return g.lr

    def _update(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        if self.reference is not None:
            batch["ref_logprobs"] = ray.get(self.reference.logprobs.remote([ray.put(batch)]))
        batch_ref = ray.put(batch)
        with self._timed("update_time_s"):
            steps = [ln.train_step.remote([batch_ref], self._lr()) for ln in self.learners]
            publishing = self._start_publish(self.generators)  # queued behind the step: no round trip between
            metrics = ray.get(steps)
        with self._timed("weight_sync_time_s"):
            self._finish_publish(publishing)
        # Some metrics are each rank's share of the whole batch's value (one shared denominator, or counts): they add.
        return {
            k: float((np.sum if k in ADDITIVE_LEARNER_METRICS else np.mean)([m[k] for m in metrics]))
            for k in metrics[0]
        }

    def _publish(self, generators: list[Any] | None = None, timeout: float | None = None) -> None:
        """Learner 0's current weights to the generators (all by default), each of which has loaded them when
        this returns: a shared-memory file is rewritten only after that (see rlfabric.models.shared_weights)."""
        self._finish_publish(self._start_publish(self.generators if generators is None else generators), timeout)

    def _start_publish(self, generators: list[Any]) -> tuple[ray.ObjectRef, ray.ObjectRef, list[ray.ObjectRef]]:
        """Queue the publication and the generators' loads; Ray hands the weights' handle from learner 0 to the
        generators without the driver in between."""
        handle, version = self.learners[0].publish.remote(self._transport)
        return handle, version, [gen.update_weights.remote(handle, version) for gen in generators]

    def _finish_publish(
        self, publishing: tuple[ray.ObjectRef, ray.ObjectRef, list[ray.ObjectRef]], timeout: float | None = None
    ) -> None:
        handle, version, loads = publishing
        self._published, self.version = ray.get([handle, version])
        shared = isinstance(self._published, SharedFlatWeights)
        if shared:
            self._shared_files.add(self._published.path)
        ray.get(loads, timeout=timeout)
        used = "shared_memory" if shared else "object_store"
        if used != self.weights_via and self.log is not None:  # the first time, and after any change
            self.log.note(self._transport_note(used))
        self.weights_via = used

    def _transport_note(self, used: str) -> str:
        note = f"weights reach the generators through {used.replace('_', ' ')}"
        if used == "shared_memory" or self.cfg.learner.weight_transport == "object_store":
            return note
        if self._transport == "object_store":
            return note + " (generator/reference actors run on other nodes than learner 0)"
        reason = ray.get(self.learners[0].shared_unavailable.remote())  # no room in /dev/shm, or none
        return note + (f" ({reason})" if reason else "")

    def _weight_transport(self) -> str:
        """``learner.weight_transport`` made concrete for where the actors run: shared memory needs every reader
        of the weights (generators, a reference actor) on learner 0's node."""
        wanted = self.cfg.learner.weight_transport
        if wanted == "object_store":
            return wanted
        readers = [*self.generators, *([self.reference] if self.reference is not None else [])]
        learner_node = ray.get(self.learners[0].node_id.remote())
        elsewhere = sum(node != learner_node for node in ray.get([a.node_id.remote() for a in readers]))
        if not elsewhere:
            return wanted
        if wanted == "shared_memory":
            raise ConfigError(
                f"learner.weight_transport = 'shared_memory': {elsewhere} generator/reference actor(s) run on "
                "another node than learner 0; use 'auto' or 'object_store'"
            )
        return "object_store"

    # -- SFT warm-up and evaluation ---------------------------------------------------------------------------

    def _sft(self) -> None:
        s = self.cfg.sft
        if s.steps == 0:
            return
        for step in range(1, s.steps + 1):
            indices = self._sample_rows(s.batch_size)
            answers = []
            for i in indices:
                if s.answer_key not in self.train_rows[i]:
                    raise ConfigError(f"sft.answer_key = {s.answer_key!r}: train row {i} has no such column")
                answers.append(self._encode_answer(self._demonstration(self.train_rows[i][s.answer_key])))
            batch = pack_sequences([self.train_ids[i] for i in indices], answers, self.tokenizer.pad_token_id)
            batch = self._pad_for_learners(batch)
            ref = ray.put(batch)
            metrics = ray.get([ln.sft_step.remote([ref]) for ln in self.learners])
            row = {"phase": "sft", "sft_step": step, "sft_loss": float(np.mean([m["sft_loss"] for m in metrics]))}
            self._log(row, show=step % 20 == 0 or step == s.steps)
        self._publish()
        self.reference_dir = None  # the warmed-up policy now; saved below where a resumed run needs it
        if self.cfg.grpo.kl_coef > 0:  # the KL anchors GRPO to the warmed-up policy, not the untrained one
            ray.get([ln.reset_reference.remote() for ln in self.learners])
            if self.reference is not None:
                ray.get(self.reference.set_weights.remote(self._published))
            if self.cfg.training.checkpoint_every:
                path = self.run_dir / REFERENCE_MODEL_DIR
                self.reference_dir = ray.get(self.learners[0].save.remote(str(path), False))

    def _demonstration(self, value: Any) -> str:
        """A row's target completion; a list holds several demonstrations, one picked at random per use."""
        if isinstance(value, (list, tuple, np.ndarray)) and len(value) > 0:
            return str(value[int(self.rng.integers(len(value)))])
        return str(value)

    def _encode_answer(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) + [self.tokenizer.eos_token_id]

    def evaluate(self, label: str) -> dict[str, Any]:
        """Greedy completions of the held-out prompts, scored by the reward services."""
        params = self._params(True)
        completions = self._collect(self.eval_ids, self._dispatch(self.eval_ids, params, 1), params)
        results = self._score(self.eval_rows, completions, 1)
        correct = [r.components.get("correct", 0.0) if r.error is None else 0.0 for r in results]
        reward = [combine_rewards(r.components, self.cfg.rewards.weights) for r in results if r.error is None]
        row = {
            "phase": "eval",
            "label": label,
            "eval_accuracy": float(np.mean(correct)),
            "eval_reward_mean": float(np.mean(reward)) if reward else None,
            "eval_failed": sum(r.error is not None for r in results),
        }
        self._log(row)
        self._last_eval = (completions, results)
        return row

    # -- the loop ---------------------------------------------------------------------------------------------

    def _log(self, row: dict[str, Any], show: bool = True) -> None:
        assert self.log is not None
        full = {"iteration": self.counters.step, "step": self.counters.step, "policy_version": self.version}
        full.update(row)
        full["time_s"] = round(time.monotonic() - self._start, 2)
        if row.get("phase") == "eval":  # evaluations get their own line, never throttled or overwritten
            self.log.log(full, show=False)
            self.log.note(progress_line(full))
        else:
            self.log.log(full, show=show)

    def _step_row(self, samples: list[dict], scored: list[dict], metrics: dict, started: float) -> dict:
        c = self.counters
        comps: dict[str, list[float]] = {}
        for s in scored:
            for name, value in s["components"].items():
                comps.setdefault(name, []).append(value)
        elapsed = max(time.monotonic() - started, 1e-9)
        lengths = [len(s["completion"]["token_ids"]) for s in scored]
        row = {
            "phase": "grpo",
            "reward_mean": float(np.mean([s["reward"] for s in scored])) if scored else float("nan"),
            **{f"reward_{name}": float(np.mean(v)) for name, v in comps.items()},
            "accuracy": float(np.mean(comps["correct"])) if "correct" in comps else None,
            "trained_samples": len(samples),
            "response_length_mean": float(np.mean(lengths)) if lengths else 0.0,
            "samples_per_s": len(scored) / elapsed,
            "tokens_generated": c.tokens_generated,
            "policy_lag_mean": float(np.mean([self.version - 1 - s["completion"]["version"] for s in samples]))
            if samples
            else 0.0,
            "failed_samples": c.failed_samples,
            "stale_samples": c.stale_samples,
            "filtered_groups": c.filtered_groups,
            "reward_worker_restarts": self.pool.worker_restarts if self.pool else 0,
            "generator_restarts": c.generator_restarts,
            "step_time_s": elapsed,
            **self._step_timings,
            **metrics,
        }
        return row

    def train(self) -> dict[str, Any]:
        if self.log is None:
            self.setup()
        if self.resume_from is None:
            initial = self.evaluate("initial")
            if self.cfg.sft.steps:
                self._sft()
                self.evaluate("after_sft")
        else:  # the first session evaluated before training
            logged = [r for r in read_metrics(self.run_dir) if r.get("label") == "initial"]
            initial = logged[0] if logged else {"eval_accuracy": None}
        with stop_requests(STOP_NOTICE) as stop:
            self._grpo_steps(stop)
        for rollout in self._in_flight:  # generated ahead for steps that will not run
            for _, ref, _ in rollout.refs:
                ray.cancel(ref, force=False)
        final = self.evaluate("final")
        return self._finish(initial, final)

    def _grpo_steps(self, stop: threading.Event) -> None:
        """GRPO steps up to ``training.total_steps``. Ctrl-C (``stop``) is honoured between steps, after a
        checkpoint of the steps done (with checkpointing on), so an interrupted run resumes where it stopped."""
        t, in_flight = self.cfg.training, self._in_flight
        while self.counters.step < t.total_steps:
            self._stop_if_asked(stop)
            started = time.monotonic()
            self._step_timings = {}
            while len(in_flight) < 1 + t.max_policy_lag:  # keep the pipeline as deep as the lag allows
                in_flight.append(self._submit_rollout(self.cfg.grpo.prompts_per_step))
            samples, scored = self._gather_batch(in_flight)
            metrics: dict[str, float] = {}
            if samples:
                metrics = self._update(self._pack(samples))
            self.counters.step += 1
            self._log(self._step_row(samples, scored, metrics, started))
            if t.eval_every and self.counters.step % t.eval_every == 0 and self.counters.step < t.total_steps:
                self.evaluate(f"step_{self.counters.step}")
            if t.checkpoint_every and self.counters.step % t.checkpoint_every == 0:
                self.save_checkpoint()
        self._stop_if_asked(stop)  # asked during the last step: the final evaluation is not waited for either

    def _stop_if_asked(self, stop: threading.Event) -> None:
        if not stop.is_set():
            return
        every = self.cfg.training.checkpoint_every
        if every and self.counters.step % every:  # else the step just saved one
            self.save_checkpoint()
        raise KeyboardInterrupt

    # -- outputs ----------------------------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        path = self.run_dir / CHECKPOINT_DIR / f"step_{self.counters.step:06d}"
        ray.get(self.learners[0].save.remote(str(path)))
        partial = path / (TRAINER_STATE_FILE + ".tmp")
        partial.write_text(json.dumps(self._state()))
        os.replace(partial, path / TRAINER_STATE_FILE)  # atomic: the state file marks a complete checkpoint
        folders = sorted((self.run_dir / CHECKPOINT_DIR).glob("step_*"))
        complete = [p for p in folders if (p / TRAINER_STATE_FILE).is_file()]
        keep = self.cfg.training.keep_checkpoints
        stale = complete[: max(0, len(complete) - keep)] if keep else []
        for old in [*stale, *(p for p in folders if p not in complete)]:  # incomplete ones: left by a crash
            shutil.rmtree(old, ignore_errors=True)
        return path

    def _state(self) -> dict[str, Any]:
        """What a resumed run needs besides the learner's weights and optimizer (see ``_restore``)."""
        reference = None
        if self.reference_dir is not None:
            path = Path(self.reference_dir)
            local = path.exists()  # else a hub id, stored as given
            resolved, run_dir = (path.resolve() if local else path), self.run_dir.resolve()
            inside = local and resolved.is_relative_to(run_dir)
            # Inside the run directory: relative to it, since run folders can move.
            reference = {"path": str(resolved.relative_to(run_dir) if inside else resolved), "in_run": inside}
        # Prompts of batches generating ahead were taken from the order but not trained on: a resumed run takes
        # them again first (pop() takes from the end).
        ahead = [i for rollout in reversed(self._in_flight) for i in reversed(rollout.indices)]
        return {
            "counters": dataclasses.asdict(self.counters),
            "version": self.version,
            "rng": self.rng.bit_generator.state,
            "order": [int(i) for i in [*self._order, *ahead]],
            "group_counter": self._group_counter,
            "reference_model": reference,
            "elapsed_s": time.monotonic() - self._start,  # wall clock of every session so far
        }

    def _restore(self, state: dict[str, Any]) -> None:
        self.counters = Counters(**state["counters"])
        self.version = int(state["version"])
        self.rng.bit_generator.state = state["rng"]
        self._order = [int(i) for i in state["order"]]
        self._group_counter = int(state["group_counter"])
        reference = state.get("reference_model")
        if reference is None:
            self.reference_dir = None
        else:
            self.reference_dir = str(self.run_dir / reference["path"]) if reference["in_run"] else reference["path"]
        self._elapsed_before = float(state.get("elapsed_s", 0.0))

    def _write_samples(self) -> list[dict[str, Any]]:
        completions, results = self._last_eval
        shown = []
        key = self.cfg.data.prompt_key
        for row, c, r in list(zip(self.eval_rows, completions, results, strict=False))[
            : self.cfg.training.show_samples
        ]:
            shown.append(
                {
                    "prompt": row[key],
                    "completion": c["text"],
                    "metadata": row_metadata(row, key),
                    "components": r.components,
                    "error": r.error,
                }
            )
        with open(self.run_dir / SAMPLES_FILE, "w") as f:
            for s in shown:
                f.write(json.dumps(s) + "\n")
        return shown

    def _finish(self, initial: dict[str, Any], final: dict[str, Any]) -> dict[str, Any]:
        model_path = self.run_dir / FINAL_MODEL_DIR
        ray.get(self.learners[0].save.remote(str(model_path)))
        shown = self._write_samples()
        rows = read_metrics(self.run_dir)
        after_sft = next((r["eval_accuracy"] for r in rows if r.get("label") == "after_sft"), None)
        plot = plot_llm_curves(self.run_dir, f"GRPO on {self.cfg.data.train}")
        c = self.counters
        elapsed = time.monotonic() - self._start
        summary = {
            "algo": "grpo",
            "task": self.cfg.data.train,
            "steps": c.step,
            "samples": c.samples,
            "eval_accuracy_initial": initial["eval_accuracy"],
            "eval_accuracy_after_sft": after_sft,
            "eval_accuracy_final": final["eval_accuracy"],
            "time_total_s": elapsed,
            "samples_per_s": c.samples / max(elapsed, 1e-9),
            "failed_samples": c.failed_samples,
            "stale_samples": c.stale_samples,
            "filtered_groups": c.filtered_groups,
            "generator_restarts": c.generator_restarts,
            "reward_worker_restarts": self.pool.worker_restarts if self.pool else 0,
            "weight_transport": self.weights_via,
            "final_model": str(model_path),
            "plot": str(plot) if plot else None,
            "sample_completions": shown,
        }
        write_summary(self.run_dir, {k: v for k, v in summary.items() if k != "sample_completions"})
        return summary

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
        if self.pool is not None:
            self.pool.shutdown()
        try:  # let engines stop their schedulers cleanly before the processes go
            ray.get([g.shutdown.remote() for g in self.generators], timeout=10)
        except Exception:  # a dead or stuck generator is killed below either way
            pass
        try:
            ray.get([ln.close.remote() for ln in self.learners], timeout=10)
        except Exception:  # a dead learner cannot remove its shared-memory file: done below where it is ours
            pass
        remove_stale(sorted(self._shared_files))  # a no-op for files on other nodes (not here) or already gone
        for actor in [*self.generators, *self.learners, self.reference]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        self.generators, self.learners, self.reference, self.pool = [], [], None, None


ADDITIVE_LEARNER_METRICS = frozenset({"pg_loss", "kl", "entropy", "trained_rows", "skipped_rows"})

# OpenMP threads spin this many times waiting for more work before they sleep (libgomp's GOMP_SPINCOUNT):
# long enough to bridge the gaps between one actor's kernels, short enough (well under a millisecond) not to
# steal the cores from the actor whose turn comes next. Generators and learners take turns on the same cores.
# Sleeping at once (OMP_WAIT_POLICY=PASSIVE) makes every small kernel pay a thread wake-up: 1.3x slower steps.
OPENMP_SPIN_COUNT = "100000"


def openmp_env() -> dict[str, str]:
    """OpenMP settings for the actors: the user's own when set, else a bounded spin-wait."""
    mine = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    return mine or {"GOMP_SPINCOUNT": OPENMP_SPIN_COUNT}


def plot_llm_curves(run_dir: Path, title: str) -> Path | None:
    """Train reward / accuracy per step and held-out accuracy at each evaluation, as one PNG."""
    rows = read_metrics(run_dir)
    train = [r for r in rows if r.get("phase") == "grpo"]
    evals = [r for r in rows if r.get("phase") == "eval"]
    if not train and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot([r["step"] for r in train], [r["reward_mean"] for r in train], lw=1, alpha=0.6, label="train reward")
        if train[0].get("accuracy") is not None:
            ax.plot([r["step"] for r in train], [r["accuracy"] for r in train], lw=1, alpha=0.6, label="train accuracy")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_accuracy"] for r in evals], "o-", lw=2, label="held-out accuracy")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = run_dir / PLOT_FILE
    fig.savefig(path)
    plt.close(fig)
    return path


def train_llm(cfg: LLMConfig, run_dir: str | Path, quiet: bool = False) -> dict[str, Any]:
    """Train to the end and clean up the actors; return the summary."""
    trainer = GRPOTrainer(cfg, run_dir, quiet=quiet)
    try:
        return trainer.train()
    finally:
        trainer.close()
