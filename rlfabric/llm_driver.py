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
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray

from rlfabric import rewards
from rlfabric.actor_slots import ActorSlots, RunAbortedError, error_summary
from rlfabric.actors.llm_learner import LEARNER_METRICS
from rlfabric.actors.llm_rollout import PromptSet, RolloutRequest, decode_meta
from rlfabric.compact import payload_bytes
from rlfabric.config import ConfigError
from rlfabric.data import check_prompt_lengths, load_heldout, load_prompts
from rlfabric.driver import ensure_ray
from rlfabric.grpo_config import LLMConfig
from rlfabric.llm_resources import SETUP_TIMEOUT_S, openmp_env, torch_threads, wanted_cpus
from rlfabric.llm_run_state import (
    FINAL_MODEL_DIR,
    FIXED_ON_RESUME,
    INITIAL_MODEL_DIR,
    REFERENCE_MODEL_DIR,
    SAMPLES_FILE,
    TRAINER_STATE_FILE,
    Counters,
    checkpoints,
    latest_checkpoint,
    not_final,
    read_trainer_state,
    reference_entry,
    reference_path,
)
from rlfabric.models.hf import check_model_source, model_max_positions
from rlfabric.models.llm_batch import pad_rows_for_learners
from rlfabric.models.sequences import pack_sequences
from rlfabric.models.shared_weights import remove_stale
from rlfabric.placement import ActorRequest, check_fits
from rlfabric.run.checkpoints import CHECKPOINT_DIR
from rlfabric.run.interrupts import stop_requests
from rlfabric.run.log import CONFIG_FILE, RunLog, read_metrics, write_summary
from rlfabric.run.plots import plot_llm_curves
from rlfabric.run.progress import grpo_progress_line, tensorboard_view
from rlfabric.run.resume import resumed_config
from rlfabric.weight_publisher import WeightPublisher

MAX_GENERATION_RETRIES = 3
REWARD_GRACE_S = 30.0  # the reward pool's slack per call, for starting a replacement service and transfers
MAX_STEPS_WITHOUT_SCORES = 3  # steps in a row in which every sample failed its reward: the run stops
STOP_NOTICE = "rlfabric: stopping after this step, with a checkpoint when checkpointing is on (Ctrl-C again: at once)"


@dataclass
class Pending:
    """A rollout request in flight on a rollout worker."""

    request: RolloutRequest  # its indices are put back in the prompt order when a checkpoint is taken
    meta_ref: ray.ObjectRef
    data_ref: ray.ObjectRef
    attempt: int  # 0, or 1 for the one retry after a generator or rollout worker failed
    worker_slot: int
    worker_generation: int
    deadline: float  # time.monotonic() by which the worker must have answered


@dataclass
class StepBatch:
    """What one step trains on: record refs and the chosen groups, plus every scored rollout's metadata."""

    refs: list[ray.ObjectRef] = field(default_factory=list)
    groups: list[tuple[int, int, int]] = field(default_factory=list)  # (group id, rows, oldest policy version)
    scored: list[dict[str, Any]] = field(default_factory=list)


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
        check_model_source(cfg.model.path)  # a missing folder or unknown hub id: one line, before anything starts
        self.counters = Counters()
        self.version = 0
        self.rng = np.random.default_rng(cfg.training.seed)
        self.generators: ActorSlots | None = None
        self.rollout_workers: ActorSlots | None = None
        self.learners: list[Any] = []
        self.reference: Any = None
        self.log: RunLog | None = None
        self._order: list[int] = []
        self._group_counter = 0
        self._in_flight: deque[Pending] = deque()  # rollouts generating ahead (max_policy_lag > 0)
        self._elapsed_before = 0.0  # wall clock of the sessions before a resume
        # The weights the KL penalty anchors to: the initial model, or the policy after the SFT warm-up (saved
        # for --resume only when there is a KL term and checkpoints; None: not saved).
        self.reference_dir: str | None = None
        self._start = time.monotonic()
        self._step_timings: dict[str, float] = {}  # where the current step's wall-clock time went
        self.weights = WeightPublisher(
            cfg.learner.weight_transport, cfg.generator.timeout_s, self._fetch, self._note, self._replace_generator
        )
        self._errors_seen: set[str] = set()  # reward errors already printed (the first of each kind is)
        self._steps_without_scores = 0
        self._last_shown: list[dict[str, Any]] = []  # the last evaluation's sample completions
        self._prompt_refs: dict[str, ray.ObjectRef] = {}
        self._phase_start: dict[Any, tuple[float, int]] = {}  # when each phase's progress began, for its ETA

    @contextmanager
    def _timed(self, key: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self._add_to_step(key, time.monotonic() - started)

    def _add_to_step(self, key: str, amount: float) -> None:
        """Add to one of the current step's measures (time parts, bytes), logged with its metrics row."""
        self._step_timings[key] = self._step_timings.get(key, 0) + amount

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
        check_prompt_lengths(  # prompts that cannot fit the model's context fail here, not in a generator
            {"data.train": self.train_ids, "data.eval": self.eval_ids},
            max_new_tokens=self.cfg.sampling.max_new_tokens,
            max_positions=model_max_positions(self.model_dir),
            model=self.cfg.model.path,
        )

    def _threads(self, role: str) -> int:
        return torch_threads(self.cfg, role)

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
                batch_spec=self._batch_spec(),
                sequence_packing=lc.sequence_packing,
            )
            for rank in range(lc.num_learners)
        ]
        if lc.num_learners > 1:
            asked = f"{lc.num_learners} learners x (num_cpus={lc.num_cpus:g}, num_gpus={lc.num_gpus:g})"
            try:
                address = ray.get(self.learners[0].node_address.remote(), timeout=SETUP_TIMEOUT_S)
                port = ray.get(self.learners[0].free_port.remote(), timeout=SETUP_TIMEOUT_S)
                backend = "nccl" if device == "cuda" else "gloo"
                ray.get(
                    [ln.init_process_group.remote(address, port, backend) for ln in self.learners],
                    timeout=SETUP_TIMEOUT_S,
                )
            except ray.exceptions.GetTimeoutError:
                raise RunAbortedError(
                    f"the data-parallel learners' process group did not form within {SETUP_TIMEOUT_S:g}s ({asked}); "
                    "the cluster may not be able to place them all at once"
                ) from None

    def _actor_requests(self) -> list[ActorRequest]:
        """What every actor of the run asks Ray for, by the config section that sets it."""
        g, lc, r = self.cfg.generator, self.cfg.learner, self.cfg.rewards
        reference = int(self.cfg.grpo.kl_coef > 0 and self.cfg.grpo.reference == "actor")
        return [
            ActorRequest("generator", g.num_generators, {"CPU": g.num_cpus, "GPU": g.num_gpus, **g.resources}),
            ActorRequest(
                "learner", lc.num_learners + reference, {"CPU": lc.num_cpus, "GPU": lc.num_gpus, **lc.resources}
            ),
            ActorRequest("rewards", r.num_workers, {"CPU": r.num_cpus}),
        ]

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
            progress_line=self._progress_line,
            relabel=not_final,
            tensorboard_view=tensorboard_view,
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
        check_fits(self._actor_requests(), [n["Resources"] for n in ray.nodes() if n.get("Alive")])
        self.generators = ActorSlots(
            "generator", lambda slot, generation: self._start_generator(), self.cfg.generator.num_generators
        )
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
                batch_spec=self._batch_spec(),
                pad_id=self.tokenizer.pad_token_id,
                sequence_packing=lc.sequence_packing,
            )
        self._prompt_refs = {
            "train": ray.put(PromptSet(self.train_rows, self.train_ids)),
            "eval": ray.put(PromptSet(self.eval_rows, self.eval_ids)),
        }
        self.rollout_workers = ActorSlots("rollout worker", lambda slot, generation: self._start_rollout_worker(), 1)
        try:  # every actor answers before the clock starts, or setup names the one that did not
            ray.get([g.version.remote() for g in self.generators.handles], timeout=SETUP_TIMEOUT_S)
            ray.get([w.pid.remote() for w in self.rollout_workers.handles], timeout=SETUP_TIMEOUT_S)
            ray.get([ln.get_version.remote() for ln in self.learners], timeout=SETUP_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RunAbortedError(
                f"actors did not start within {SETUP_TIMEOUT_S:.0f}s: the cluster may lack the CPUs/GPUs asked "
                "for (generator.num_cpus/num_gpus, learner.num_cpus/num_gpus)"
            ) from None
        self.weights.attach(self.learners[0], self.generators, self.reference)
        self.weights.choose_transport()
        self._note_slow_attention()
        if state:
            assert self.resume_from is not None
            ray.get([ln.load_optimizer.remote(str(self.resume_from)) for ln in self.learners])
            self.version = self.weights.publish()  # the generators take the checkpoint's policy version
            self.log.note(f"resumed from {self.resume_from.name} (step {self.counters.step}, v{self.version})")
        self._start = time.monotonic() - self._elapsed_before  # times and rates count every session

    def _start_rollout_worker(self) -> Any:
        from rlfabric.actors.llm_rollout import LLMRolloutWorker

        r = self.cfg.rewards
        worker = LLMRolloutWorker.options(num_cpus=0).remote(
            reward_functions=[dataclasses.asdict(f) for f in r.functions],
            reward_weights=dict(r.weights),
            num_reward_workers=r.num_workers,
            reward_timeout_s=r.timeout_s,
            reward_cpus=r.num_cpus,
            reward_registry=rewards.snapshot(),
            prompt_key=self.cfg.data.prompt_key,
        )
        self._load_prompts_into(worker)
        return worker

    def _load_prompts_into(self, worker: Any) -> None:
        for name, ref in self._prompt_refs.items():
            worker.set_prompts.remote(name, ref)  # queued before any rollout the worker is sent

    def _fetch(self, refs: Any, timeout: float | None = None) -> Any:
        """``ray.get`` for the step loop, counting the bytes the driver receives (``driver_received_bytes``)."""
        value = ray.get(refs, timeout=timeout)
        self._add_to_step("driver_received_bytes", payload_bytes(value))
        return value

    def _from_learners(self, refs: list[ray.ObjectRef], doing: str) -> list[Any]:
        """Every learner's answer; a learner that died or raised stops the run with its rank named (the latest
        checkpoint is what is left: a data-parallel group cannot go on without one of its ranks)."""
        try:
            return self._fetch(refs)
        except ray.exceptions.RayError as exc:
            failure: tuple[int, BaseException] = (0, exc)
        for rank, ref in enumerate(refs):  # which one: the first whose answer is an error
            try:
                ray.get(ref, timeout=5)
            except ray.exceptions.RayError as exc:
                failure = (rank, exc)
                break
        rank, exc = failure
        step = self.counters.step
        raise RunAbortedError(f"learner {rank} failed during {doing} at step {step}: {error_summary(exc)}")

    def _note(self, message: str) -> None:
        if self.log is not None:
            self.log.note(message)

    def _note_slow_attention(self) -> None:
        """Say so when CPU generators decode without the native attention kernel (no compiler, say): slower."""
        g = self.cfg.generator
        if g.backend != "torch" or g.num_gpus > 0:
            return
        attention = ray.get(self.generators.handles[0].attention.remote())
        if attention and not attention.startswith("native"):
            self.log.note(f"generators decode with {attention}")

    # -- rollouts ---------------------------------------------------------------------------------------------

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

    def _rollout_deadline(self, request: RolloutRequest) -> float:
        """The backstop for a rollout worker's answer: generation, then scoring every group, plus slack."""
        groups = len(request.indices)
        return request.timeout_s + self.cfg.rewards.timeout_s * groups + 2 * REWARD_GRACE_S

    def _send(self, request: RolloutRequest, attempt: int = 0) -> Pending:
        slot, generation, worker = self.rollout_workers.entries()[0]
        request.generators = self.generators.entries()
        meta_ref, data_ref = worker.rollout.remote(request)
        deadline = time.monotonic() + self._rollout_deadline(request)
        return Pending(request, meta_ref, data_ref, attempt, slot, generation, deadline)

    def _submit_rollout(self, num_prompts: int) -> Pending:
        indices = self._sample_rows(num_prompts)
        request = RolloutRequest(
            "train",
            indices,
            self.cfg.grpo.group_size,
            self._params(False),
            first_group=self._group_counter,
            generators=[],
            timeout_s=self.cfg.generator.timeout_s,
        )
        self._group_counter += len(indices)
        return self._send(request)

    def _replace_generator(self, slot: int, generation: int, reason: str) -> None:
        if not self.generators.replace(slot, generation, reason):
            return  # already replaced: a late report about the actor that is gone
        self.counters.generator_restarts += 1
        self._note(f"generator {slot} replaced ({reason})")
        if self.version > 0:
            self.weights.choose_transport()  # the new one may run on another node
            self.version = self.weights.publish([slot], timeout=SETUP_TIMEOUT_S)

    def _replace_rollout_worker(self, slot: int, generation: int, reason: str) -> None:
        if self.rollout_workers.replace(slot, generation, reason):
            self._note(f"rollout worker {slot} replaced ({reason})")
            self._load_prompts_into(self.rollout_workers.handles[slot])

    def _receive(self, pending: Pending) -> tuple[dict[str, Any], ray.ObjectRef | None]:
        """A rollout's metadata and record ref. A failed generator or rollout worker is replaced and the rollout
        asked again, once; when that fails too, its samples are recorded as failed (empty metadata)."""
        request = pending.request
        try:
            meta = decode_meta(self._fetch(pending.meta_ref, timeout=max(0.0, pending.deadline - time.monotonic())))
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as exc:
            reason = "missed its deadline" if isinstance(exc, ray.exceptions.GetTimeoutError) else error_summary(exc)
            self._replace_rollout_worker(pending.worker_slot, pending.worker_generation, reason)
            meta = {"samples": len(request.indices) * request.group_size, "worker_failure": reason}
        else:
            self.rollout_workers.succeeded(pending.worker_slot, pending.worker_generation)
        for slot, generation, reason in meta.get("generator_failures", []):
            self._replace_generator(slot, generation, reason)
        if "generator_failures" not in meta and "worker_failure" not in meta:
            for slot, generation, _ in request.generators:
                self.generators.succeeded(slot, generation)
            return meta, pending.data_ref
        if pending.attempt == 0:  # requeued exactly once, with the same prompts and group ids
            return self._receive(self._send(request, attempt=1))
        lost = len(request.indices) * request.group_size
        self.counters.failed_samples += lost
        self._note(f"{lost} samples lost: their rollout failed twice")
        return {"samples": lost, "rows": 0, "failed": lost, "tokens": 0}, None

    # -- one training step ------------------------------------------------------------------------------------

    def _accept(self, meta: dict[str, Any], ref: ray.ObjectRef | None, step: StepBatch) -> None:
        """Count one rollout's samples and choose its groups to train on from its per-group statistics."""
        c, lag = self.counters, self.cfg.training.max_policy_lag
        c.samples += meta["samples"]
        c.tokens_generated += meta.get("tokens", 0)
        self._add_to_step("trajectory_bytes", meta.get("record_bytes", 0))
        c.failed_samples += meta.get("failed", 0) if "group_stats" in meta else 0
        for key in ("generate_time_s", "reward_time_s"):
            self._add_to_step(key, meta.get(key, 0.0))
        c.reward_worker_restarts += meta.get("reward_restarts", 0)
        for error in meta.get("errors", []):
            self._note_reward_error(error)
        stats = meta.get("group_stats")
        if stats is None or not len(stats):
            return
        step.scored.append(meta)
        chosen = []
        for gid, _mean, signal, rows, oldest in stats:
            if rows == 0:
                continue
            if self.version - oldest > lag:
                c.stale_samples += int(rows)
                continue
            if self.cfg.grpo.dynamic_sampling and not signal:
                c.filtered_groups += 1
                continue
            chosen.append((int(gid), int(rows), int(oldest)))
        if chosen and ref is not None:
            step.refs.append(ref)
            step.groups += chosen

    def _note_reward_error(self, error: str) -> None:
        """The first error of each kind, as it happens (later ones of that kind are counted, not printed)."""
        if error not in self._errors_seen:
            self._errors_seen.add(error)
            self._note(f"reward failed: {error} ({self.counters.failed_samples} failed samples so far)")

    def _gather_batch(self, in_flight: deque[Pending]) -> StepBatch:
        """The groups to train on for one step, refilling groups dropped by dynamic sampling."""
        g = self.cfg.grpo
        step = StepBatch()
        pending = in_flight.popleft()
        self._accept(*self._receive(pending), step)
        for _round in range(g.max_sampling_rounds - 1 if g.dynamic_sampling else 0):
            missing = g.prompts_per_step - len(step.groups)
            if missing <= 0:
                break
            self._accept(*self._receive(self._submit_rollout(missing)), step)
        if len(step.groups) > g.prompts_per_step:
            step.groups = sorted(step.groups)[: g.prompts_per_step]
        return step

    def _lr(self) -> float:
        g = self.cfg.grpo
        if g.warmup_steps and self.counters.step < g.warmup_steps:
            return g.lr * (self.counters.step + 1) / g.warmup_steps
        return g.lr

    def _update(self, step: StepBatch) -> dict[str, float]:
        """One learner update on the chosen groups: the learners (and a reference actor) read the records by
        ref and pack the batch themselves; the driver sends refs and group ids and gets the metrics back."""
        groups = [gid for gid, _, _ in step.groups]
        ref_logprobs = None
        if self.reference is not None:  # an ObjectRef the learners resolve: never fetched here
            ref_logprobs = self.reference.logprobs_of.remote(step.refs, groups)
        with self._timed("update_time_s"):
            steps = [ln.train_on.remote(step.refs, groups, self._lr(), ref_logprobs) for ln in self.learners]
            publishing = self.weights.start(range(len(self.generators)))  # queued behind the step
            metrics = [LEARNER_METRICS.unpack(m) for m in self._from_learners(steps, "its update")]
        with self._timed("weight_sync_time_s"):
            self.version = self.weights.finish(publishing)
        # Some metrics are each rank's share of the whole batch's value (one shared denominator, or counts): they add.
        return {
            k: float((np.sum if k in ADDITIVE_LEARNER_METRICS else np.mean)([m[k] for m in metrics]))
            for k in metrics[0]
        }

    def _batch_spec(self) -> dict[str, Any]:
        """How learners and the reference actor turn records into the packed batch (``grpo_batch``'s options)."""
        g = self.cfg.grpo
        return {
            "reward_weights": dict(self.cfg.rewards.weights),
            "advantage": g.advantage,
            "scale_by_std": g.scale_by_std,
            "overlong_filter": g.overlong_filter,
            "world_size": self.cfg.learner.num_learners,
        }

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
            batch = pad_rows_for_learners(batch, self.cfg.learner.num_learners)
            ref = ray.put(batch)
            metrics = self._from_learners([ln.sft_step.remote([ref]) for ln in self.learners], "an SFT step")
            row = {"phase": "sft", "sft_step": step, "sft_loss": float(np.mean([m["sft_loss"] for m in metrics]))}
            self._log(row, show=step % 20 == 0 or step == s.steps)
        self.version = self.weights.publish()
        self.reference_dir = None  # the warmed-up policy now; saved below where a resumed run needs it
        if self.cfg.grpo.kl_coef > 0:  # the KL anchors GRPO to the warmed-up policy, not the untrained one
            ray.get([ln.reset_reference.remote() for ln in self.learners])
            if self.reference is not None:
                ray.get(self.reference.set_weights.remote(self.weights.published))
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
        """Greedy completions of the held-out prompts, scored by the reward services (on the rollout side)."""
        request = RolloutRequest(
            "eval",
            list(range(len(self.eval_rows))),
            1,
            self._params(True),
            first_group=0,
            generators=[],
            timeout_s=self.cfg.generator.timeout_s,
            keep_samples=self.cfg.training.show_samples,
        )
        meta, _ = self._receive(self._send(request))
        n, failed = meta["samples"], meta.get("failed", meta["samples"])
        for error in meta.get("errors", []):
            self._note_reward_error(error)
        if n and failed == n and meta.get("errors"):
            raise RunAbortedError(f"every held-out sample failed its reward: {meta['errors'][0]}")
        row = {
            "phase": "eval",
            "label": label,
            "eval_accuracy": meta.get("correct_sum", 0.0) / max(n, 1),
            "eval_reward_mean": meta["reward_sum"] / (n - failed) if n > failed else None,
            "eval_failed": failed,
        }
        self._log(row)
        self._last_shown = meta.get("shown", [])
        return row

    # -- the loop ---------------------------------------------------------------------------------------------

    def _log(self, row: dict[str, Any], show: bool = True) -> None:
        assert self.log is not None
        full = {"iteration": self.counters.step, "step": self.counters.step, "policy_version": self.version}
        full.update(row)
        full["time_s"] = round(time.monotonic() - self._start, 2)
        if row.get("phase") == "eval":  # evaluations get their own line, never throttled or overwritten
            self.log.log(full, show=False)
            self.log.note(self._progress_line(full))
        else:
            self.log.log(full, show=show)

    def _step_row(self, step: StepBatch, metrics: dict, started: float) -> dict:
        c = self.counters
        scored = step.scored
        rows = sum(m["rows"] for m in scored)
        samples = sum(m["samples"] for m in scored)
        comps: dict[str, float] = {}
        for m in scored:
            for name, value in m["component_means"].items():
                comps[name] = comps.get(name, 0.0) + value * m["rows"] / max(rows, 1)
        reward_sum = sum(float(np.nansum(m["group_stats"][:, 1] * m["group_stats"][:, 3])) for m in scored)
        elapsed = max(time.monotonic() - started, 1e-9)
        trained = sum(n for _, n, _ in step.groups)
        return {
            "phase": "grpo",
            "reward_mean": reward_sum / rows if rows else float("nan"),
            **{f"reward_{name}": value for name, value in comps.items()},
            "accuracy": comps.get("correct"),
            "trained_samples": trained,
            "response_length_mean": sum(m["response_length_mean"] * m["samples"] for m in scored) / max(samples, 1),
            "samples_per_s": rows / elapsed,
            "tokens_generated": c.tokens_generated,
            "policy_lag_mean": sum(n * (self.version - 1 - v) for _, n, v in step.groups) / trained if trained else 0.0,
            "failed_samples": c.failed_samples,
            "stale_samples": c.stale_samples,
            "filtered_groups": c.filtered_groups,
            "reward_worker_restarts": c.reward_worker_restarts,
            "generator_restarts": c.generator_restarts,
            "step_time_s": elapsed,
            **self._step_timings,
            **metrics,
        }

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
        for pending in self._in_flight:  # generated ahead for steps that will not run
            ray.cancel(pending.meta_ref, force=False)
        self._in_flight.clear()
        if self.counters.trained_samples == 0:
            raise RunAbortedError(
                f"trained on no sample in {self.counters.step} steps ({self.counters.failed_samples} failed, "
                f"{self.counters.stale_samples} stale, {self.counters.filtered_groups} groups filtered)"
            )
        final = self.evaluate("final")
        return self._finish(initial, final)

    def _progress_line(self, row: dict[str, Any]) -> str:
        """``progress_line`` with the phase's total and the time left at the phase's rate so far."""
        phase = row.get("phase")
        total = self.cfg.sft.steps if phase == "sft" else self.cfg.training.total_steps
        done = row.get("sft_step", 0) if phase == "sft" else row.get("step", 0)
        started, first = self._phase_start.setdefault(phase, (time.monotonic(), done))
        rate = (done - first) / max(time.monotonic() - started, 1e-9)
        eta = (total - done) / rate if rate > 0 else None
        return grpo_progress_line(row, total, eta)

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
            step = self._gather_batch(in_flight)
            metrics: dict[str, float] = {}
            if step.groups:
                metrics = self._update(step)
            self.counters.step += 1
            self.counters.trained_samples += sum(n for _, n, _ in step.groups)
            self._log(self._step_row(step, metrics, started))
            self._check_scoring(step)
            if t.eval_every and self.counters.step % t.eval_every == 0 and self.counters.step < t.total_steps:
                self.evaluate(f"step_{self.counters.step}")
            if t.checkpoint_every and self.counters.step % t.checkpoint_every == 0:
                self.save_checkpoint()
        self._stop_if_asked(stop)  # asked during the last step: the final evaluation is not waited for either

    def _check_scoring(self, step: StepBatch) -> None:
        """Stop a run whose rewards fail on every sample, step after step, instead of training on nothing."""
        if any(m["rows"] for m in step.scored) or not self._errors_seen:
            self._steps_without_scores = 0
            return
        self._steps_without_scores += 1
        if self._steps_without_scores >= MAX_STEPS_WITHOUT_SCORES:
            first = next(iter(self._errors_seen))
            raise RunAbortedError(
                f"every sample of the last {MAX_STEPS_WITHOUT_SCORES} steps failed its reward; first error: {first}"
            )

    def _stop_if_asked(self, stop: threading.Event) -> None:
        if not stop.is_set():
            return
        every = self.cfg.training.checkpoint_every
        if every and self.counters.step % every:  # else the step just saved one
            self.save_checkpoint()
        raise KeyboardInterrupt

    # -- outputs ----------------------------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        store = checkpoints(self.run_dir)
        path = store.path(self.counters.step)
        ray.get(self.learners[0].save.remote(str(path)))
        state = json.dumps(self._state())  # written last, atomically: the state file marks a complete checkpoint
        store.write_atomically(path / TRAINER_STATE_FILE, lambda tmp: tmp.write_text(state))
        store.prune(self.cfg.training.keep_checkpoints)
        return path

    def _state(self) -> dict[str, Any]:
        """What a resumed run needs besides the learner's weights and optimizer (see ``_restore``)."""
        reference = reference_entry(self.reference_dir, self.run_dir)
        # Prompts of batches generating ahead were taken from the order but not trained on: a resumed run takes
        # them again first (pop() takes from the end).
        ahead = [i for pending in reversed(self._in_flight) for i in reversed(pending.request.indices)]
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
        self.reference_dir = reference_path(state.get("reference_model"), self.run_dir)
        self._elapsed_before = float(state.get("elapsed_s", 0.0))

    def _write_samples(self) -> list[dict[str, Any]]:
        shown = self._last_shown[: self.cfg.training.show_samples]
        with open(self.run_dir / SAMPLES_FILE, "w") as f:
            for sample in shown:
                f.write(json.dumps(sample) + "\n")
        return shown

    def _finish(self, initial: dict[str, Any], final: dict[str, Any]) -> dict[str, Any]:
        model_path = self.run_dir / FINAL_MODEL_DIR
        ray.get(self.learners[0].save.remote(str(model_path), False))  # the model only: optimizers live in checkpoints
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
            "policy_version": self.version,
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
            "reward_worker_restarts": c.reward_worker_restarts,
            "trained_samples": c.trained_samples,
            "weight_transport": self.weights.weights_via,
            "final_model": str(model_path),
            "plot": str(plot) if plot else None,
            "sample_completions": shown,
        }
        write_summary(self.run_dir, {k: v for k, v in summary.items() if k != "sample_completions"})
        return summary

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
        if not ray.is_initialized():  # setup stopped before Ray started: no actors to stop
            return
        for pending in self._in_flight:
            ray.cancel(pending.meta_ref, force=False)
        generators = self.generators.handles if self.generators else []
        workers = self.rollout_workers.handles if self.rollout_workers else []
        try:  # let engines stop their schedulers and workers their reward services before the processes go
            ray.get([g.shutdown.remote() for g in [*generators, *workers]], timeout=10)
        except Exception:  # a dead or stuck actor is killed below either way
            pass
        try:
            ray.get([ln.close.remote() for ln in self.learners], timeout=10)
        except Exception:  # a dead learner cannot remove its shared-memory file: done below where it is ours
            pass
        remove_stale(sorted(self.weights.shared_files))  # a no-op for files on other nodes (not here) or already gone
        for actor in [*generators, *workers, *self.learners, self.reference]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        self.generators, self.rollout_workers, self.learners, self.reference = None, None, [], None
        self._in_flight.clear()


ADDITIVE_LEARNER_METRICS = frozenset(
    {
        "pg_loss",
        "kl",
        "entropy",
        "trained_rows",
        "skipped_rows",
        "trained_tokens",
        "trained_sequences",
        "trained_positions",
        "trained_head_positions",
    }
)


def train_llm(cfg: LLMConfig, run_dir: str | Path, quiet: bool = False) -> dict[str, Any]:
    """Train to the end and clean up the actors; return the summary."""
    trainer = GRPOTrainer(cfg, run_dir, quiet=quiet)
    try:
        return trainer.train()
    finally:
        trainer.close()
