"""The LLM post-training driver: prompts -> generators -> reward services -> learners -> weights -> generators.

A single controller, like the PPO driver: it samples prompts, moves ObjectRefs between actors, and keeps the
counters. Per step:

1. prompts (``grpo.prompts_per_step``, each repeated ``grpo.group_size`` times) go to the generators, which
   return completions tagged with the policy version that made them;
2. the reward services score whole groups and return named components; the configured weights sum them;
3. groups without signal are dropped and refilled (dynamic sampling), advantages are computed per group;
4. the learners update on one packed batch (read from the object store) and the new weights go back to every
   generator (``rlfabric.weight_publisher``: through a shared-memory file on one node, else one ``ray.put``).

``training.max_policy_lag`` = k > 0 keeps k batches generating while the learner updates (bounded async).

What a run does once before its first step (model, data, Ray, actors) is ``rlfabric.llm_setup``.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import ray

from rlfabric import rewards
from rlfabric.actor_slots import ActorSlots, PlacementError, RunAbortedError, error_summary, lost_object
from rlfabric.actors.llm_learner_metrics import ADDITIVE_LEARNER_METRICS, LEARNER_METRICS
from rlfabric.actors.llm_rollout import RolloutRequest
from rlfabric.algorithms.grpo import adaptive_kl_coef
from rlfabric.algorithms.lr_schedules import scheduled_lr
from rlfabric.compact import payload_bytes
from rlfabric.grpo_config import LLMConfig, plays_episodes
from rlfabric.grpo_report import NO_ACCURACY_NOTE, eval_row, run_summary, step_row
from rlfabric.likelihood_scorers import LikelihoodScorers
from rlfabric.llm_actors import reward_weights, stop_actors
from rlfabric.llm_episode_sources import EpisodeSources
from rlfabric.llm_resources import SETUP_TIMEOUT_S
from rlfabric.llm_run_state import (
    FINAL_MODEL_DIR,
    REFERENCE_MODEL_DIR,
    SAMPLES_FILE,
    TRAINER_STATE_FILE,
    Counters,
    checkpoints,
    reference_entry,
    reference_path,
    resume_point,
    saved_reward_weights,
    weights_saved_before_declarations,
)
from rlfabric.llm_setup import GRPOSetup
from rlfabric.llm_sft import DemonstrationPool, sft_batch
from rlfabric.llm_text_env import Demonstrations, stop_tool_servers, tool_server_restarts
from rlfabric.models.hf import check_model_source
from rlfabric.models.packed_batch import pad_rows_for_learners
from rlfabric.objectives import LR_SCHEDULES
from rlfabric.placement import RoleGroups
from rlfabric.policies.served import PendingWeights
from rlfabric.reward_model_stage import point_at_run_reward_model
from rlfabric.reward_names import check_references_declared
from rlfabric.reward_watch import RewardWatch, failing_part
from rlfabric.rollout_scheduler import RolloutScheduler, StepBatch
from rlfabric.run.checkpoints import CHECKPOINT_DIR
from rlfabric.run.interrupts import stop_requests
from rlfabric.run.log import RunLog, read_metrics, write_summary
from rlfabric.run.plots import plot_llm_curves
from rlfabric.run.progress import PhaseProgressLine
from rlfabric.run.resume import refuse_run_over
from rlfabric.weight_publisher import WeightPublisher

MAX_GENERATION_RETRIES = 3
STOP_NOTICE = "rlfabric: stopping after this step, with a checkpoint when checkpointing is on (Ctrl-C again: at once)"


class GRPOTrainer(GRPOSetup):
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
        self._said_no_accuracy = False  # the note that held-out accuracy is n/a (no correct component)
        checkpoints = self.run_dir / CHECKPOINT_DIR
        if resume_from is None:
            refuse_run_over(self.run_dir, checkpoints.exists() and any(checkpoints.iterdir()))
        # A reward_model spec without a path serves the reward model this run trains first (reward_model.pairs).
        self.trained_reward_specs = point_at_run_reward_model(cfg, self.run_dir)
        functions = {  # unknown reward names fail before any actor starts
            f"rewards.functions[{i}]": rewards.resolve_reward(dataclasses.asdict(spec), f"rewards.functions[{i}]")
            for i, spec in enumerate(cfg.rewards.functions)
            if i not in self.trained_reward_specs  # checked once the run has trained its reward model
        }
        declared = rewards.components_of(functions)  # two functions giving one component: one line now
        if resume_from is not None and cfg.rewards.weights == saved_reward_weights(self.run_dir):
            cfg.rewards.weights = weights_saved_before_declarations(
                cfg.rewards.weights,
                {n: w for fn in functions.values() for n, w in rewards.declared_weights(fn).items()},
            )
        # The components the reward config names, as the user wrote them (the defaults the functions declare, and
        # those an env adds, left out), checked against those the rewards give: at the first scored step for
        # misspellings, at the end for names never given
        self._component_references = cfg.rewards.component_references()
        if declared is not None and not self.trained_reward_specs and not plays_episodes(cfg):  # nothing else gives
            named = [(f, n) for f, n in self._component_references if f != "rewards.efficiency.counts"]  # env counts
            check_references_declared(named, declared)
        cfg.rewards.weights = rewards.weights_with_defaults(cfg.rewards.weights, functions)
        shadow = [dataclasses.asdict(spec) for spec in cfg.rewards.shadow.functions]
        rewards.components_of(rewards.resolve_rewards(shadow, "rewards.shadow.functions"))  # one pool, as above
        check_model_source(cfg.model.path)  # a missing folder or unknown hub id: one line, before anything starts
        self.counters = Counters()
        self.version = 0
        self.kl_coef = cfg.grpo.kl_coef  # the KL term's coefficient now: adapted after each update with kl_target
        self.rng = np.random.default_rng(cfg.training.seed)
        self.generators: ActorSlots | None = None
        self.rollout_workers: ActorSlots | None = None
        self.learners: list[Any] = []
        self.reference: Any = None
        # what the rollout workers play beyond single-turn completions, and the warm-up's demonstrations on it
        self.episodes = EpisodeSources()
        self.tool_servers: dict[str, Any] = {}  # supervised MCP servers by name (env.tool_servers)
        self.role_groups: RoleGroups | None = None  # ray.placement: a placement group per role
        self.parts: bytes | None = None  # the user's additions to rlfabric.objectives, shipped to the actors
        self.log: RunLog | None = None
        self._elapsed_before = 0.0  # wall clock of the sessions before a resume
        self._restarts_before: dict[str, int] = {}  # supervised actors' restarts in the sessions before a resume
        # The weights the KL penalty anchors to: the initial model, or the policy after the SFT warm-up (saved
        # for --resume only when there is a KL term and checkpoints; None: not saved).
        self.reference_dir: str | None = None
        self._start = time.monotonic()
        self._step_timings: dict[str, float] = {}  # where the current step's wall-clock time went
        self.rollouts = RolloutScheduler(
            cfg,
            self.counters,
            self.rng,
            fetch=self._fetch,
            add_to_step=self._add_to_step,
            note=self._note,
            replace_generator=self._replace_generator,
            version=lambda: self.version,
        )
        self.weights = WeightPublisher(
            cfg.learner.weight_transport,
            cfg.generator.timeout_s,
            self._fetch,
            self._note,
            self._replace_generator,
            self._replace_scorer,
        )
        # The likelihood scorer (a policy likelihood reward): a named actor the reward services find by name.
        self.scorers = LikelihoodScorers(cfg, self.weights, self._note)
        self.reward_watch = RewardWatch(cfg, self._component_references, self._note, reward_weights(cfg))
        # a generator lost with its node during a step's weight load that could not be replaced: raised once that
        # step (which the learners did train) is counted and logged
        self._unplaced: PlacementError | None = None
        self._saved_step = 0  # the step of the latest checkpoint (of this session or the one resumed)
        self._last_shown: list[dict[str, Any]] = []  # the last evaluation's sample completions
        self._progress_line = PhaseProgressLine(cfg)  # a row's terminal line, with its phase's total and ETA

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
        cfg, checkpoint = resume_point(run_dir, overrides)
        return cls(cfg, run_dir, quiet=quiet, resume_from=checkpoint)

    def _fetch(self, refs: Any, timeout: float | None = None) -> Any:
        """``ray.get`` for the step loop, counting the bytes the driver receives (``driver_received_bytes``)."""
        value = ray.get(refs, timeout=timeout)
        self._add_to_step("driver_received_bytes", payload_bytes(value))
        return value

    def _lost_record(self, steps: list[ray.ObjectRef], step: StepBatch) -> str | None:
        """Wait for the learners' update; the hex id of the record of ``step`` that every learner failed to read
        because it was lost with its node (they then trained on nothing), else None."""
        lost = []
        for ref in steps:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:
                lost.append(lost_object(exc))
        records = {ref.hex() for ref in step.refs}
        return lost[0] if len(lost) == len(steps) and all(hex_id in records for hex_id in lost) else None

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

    def _replace_generator(self, slot: int, generation: int, reason: str) -> None:
        if not self.generators.replace(slot, generation, reason):
            return  # already replaced: a late report about the actor that is gone
        self.counters.generator_restarts += 1
        self._note(f"generator {slot} replaced ({reason})")
        if self.version > 0:
            self.weights.choose_transport()  # the new one may run on another node
            self.version = self.weights.publish([slot], timeout=SETUP_TIMEOUT_S, scorer_slots=[])

    def _replace_scorer(self, slot: int, generation: int, reason: str) -> None:
        version = self.scorers.replace(slot, generation, reason)  # the version published to the new one, if any
        self.version = self.version if version is None else version

    def _lr(self) -> float:
        g = self.cfg.grpo
        shape = LR_SCHEDULES.resolve(g.lr_schedule)
        return scheduled_lr(shape, g.lr, self.counters.step, self.cfg.training.total_steps, g.warmup_steps)

    def _update(self, step: StepBatch, lr: float, send_next: bool = False) -> dict[str, float]:
        """One learner update on the chosen groups: the learners (and a reference actor) read the records by
        ref and pack the batch themselves; the driver sends refs and group ids and gets the metrics back.

        ``send_next`` (sync mode, another step to come): the next step's rollout goes out as soon as the update
        and the weights' loads are queued, holding in the generators until they have loaded the new version
        (``PendingWeights``), so generation starts when the weights land instead of a driver round trip later.

        A record lost with its rollout worker's node after it arrived fails every learner before it trains: it
        is collected again (``RolloutScheduler.recollect``) and the update asked again. (A rollout sent ahead
        then waits for the retry's weights, within its generation deadline.)"""
        next_version = self.version + 1  # each update makes one policy version
        while True:
            groups = [gid for gid, _, _ in step.groups]
            ref_logprobs = None
            if self.reference is not None:  # an ObjectRef the learners resolve: never fetched here
                ref_logprobs = self.reference.logprobs_of.remote(step.refs, groups)
            with self._timed("update_time_s"):
                steps = [ln.train_on.remote(step.refs, groups, lr, ref_logprobs, self.kl_coef) for ln in self.learners]
                publishing = self.weights.start()  # every generator and scorer, queued behind the step
                if send_next:
                    loads = [load for *_, load in (*publishing.loads, *publishing.scorer_loads)]
                    self.rollouts.fill(after=PendingWeights(next_version, loads))
                lost = self._lost_record(steps, step)
                if lost is None:
                    metrics = [LEARNER_METRICS.unpack(m) for m in self._from_learners(steps, "its update")]
                    break
            self.weights.finish(publishing)  # the unchanged weights: loaded before anything is published again
            self.rollouts.recollect(step, lost)
            if not step.groups:
                return {}
        with self._timed("weight_sync_time_s"):
            try:
                self.version = self.weights.finish(publishing)
            except PlacementError as exc:  # the learners did train: the step counts before the run stops
                self.version, self._unplaced = int(self._fetch(publishing.version)), exc
            except ray.exceptions.RayError as exc:  # generators' failures are handled inside: learner 0's publish
                step = self.counters.step
                raise RunAbortedError(
                    f"learner 0 failed during the weight publication at step {step}: {error_summary(exc)}"
                ) from None
        self.rollouts.weights_landed()
        # Some metrics are each rank's share of the whole batch's value (one shared denominator, or counts): they add.
        combined = {
            k: float((np.sum if k in ADDITIVE_LEARNER_METRICS else np.mean)([m[k] for m in metrics]))
            for k in metrics[0]
        }
        g = self.cfg.grpo
        if g.kl_coef > 0:
            combined["kl_coef"] = self.kl_coef  # the coefficient this update used
        if g.kl_target is not None:
            trained = sum(n for _, n, _ in step.groups)
            self.kl_coef = adaptive_kl_coef(self.kl_coef, combined["kl"], g.kl_target, trained, g.kl_horizon)
        return combined

    # -- SFT warm-up and evaluation ---------------------------------------------------------------------------

    def _sft(self) -> None:
        s = self.cfg.sft
        if s.steps == 0:
            return

        started = [time.perf_counter()]  # when the step being finished began (its batch was sent)

        def finish(step: int, pending: list[Any]) -> None:
            metrics = self._from_learners(pending, "an SFT step")
            now = time.perf_counter()
            row = {
                "phase": "sft",
                "sft_step": step,
                "sft_loss": float(np.mean([m["sft_loss"] for m in metrics])),
                "sft_grad_norm": float(metrics[0]["grad_norm"]),  # every rank's (all-reduced) gradient
                "sft_tokens": int(metrics[0]["tokens"]),  # the response tokens the loss averages over
                "sft_lr": s.lr,
                "sft_step_time_s": now - started[0],
            }
            started[0] = now
            self._log(row, show=step % 20 == 0 or step == s.steps)

        assert self.log is not None
        if isinstance(self.episodes.demonstrations, Demonstrations):  # its failed episodes and calls, as they happen
            self.episodes.demonstrations.report.note = self.log.note
        pool = self._demonstration_pool()
        pending: list[Any] = []
        for step in range(1, s.steps + 1):
            # The next batch is built (a text env's demonstrations played) while the learners train on this one.
            if pool is not None:
                batch = pool.batch(s.batch_size)
            else:
                indices = self.rollouts.sample_rows(s.batch_size)
                batch = sft_batch(
                    self.cfg,
                    self.tokenizer,
                    self.train_rows,
                    self.train_ids,
                    indices,
                    self.rng,
                    self.episodes.demonstrations,
                )
            ref = ray.put(pad_rows_for_learners(batch, self.cfg.learner.num_learners))
            if pending:
                finish(step - 1, pending)
            pending = [ln.sft_step.remote([ref]) for ln in self.learners]
        finish(s.steps, pending)
        self.version = self.weights.publish()
        self.reference_dir = None  # the warmed-up policy now; saved below where a resumed run needs it
        if self.cfg.grpo.kl_coef > 0:  # the KL anchors GRPO to the warmed-up policy, not the untrained one
            ray.get([ln.reset_reference.remote() for ln in self.learners])
            if self.reference is not None:
                ray.get(self.reference.set_weights.remote(self.weights.published))
            if self.cfg.training.checkpoint_every:
                path = self.run_dir / REFERENCE_MODEL_DIR
                self.reference_dir = ray.get(self.learners[0].save.remote(str(path), False))

    def _demonstration_pool(self) -> DemonstrationPool | None:
        """``sft.demonstrations`` of the player's episodes, played before the warm-up's first step (or None)."""
        count, demonstrations = self.cfg.sft.demonstrations, self.episodes.demonstrations
        if not count or demonstrations is None:
            return None
        tasks = [self.train_rows[i] for i in self.rollouts.sample_rows(count)]
        pad_id = self.tokenizer.pad_token_id
        return DemonstrationPool.play(demonstrations, tasks, self.cfg.sft.batch_size, pad_id, self.rng, self.log.note)

    def evaluate(self, label: str) -> dict[str, Any]:
        """Greedy completions of the held-out prompts, scored by the reward services (on the rollout side)."""
        request = RolloutRequest(
            "eval",
            list(range(len(self.eval_rows))),
            1,
            self.rollouts.sampling_params(True),
            first_group=0,
            generators=[],
            timeout_s=self.cfg.generator.timeout_s,
            keep_samples=self.cfg.training.show_samples,
        )
        meta, _ = self.rollouts.receive(self.rollouts.send(request))
        for error in meta.get("errors", []):
            self.rollouts.note_reward_error(error)
        row = eval_row(meta, label)
        if row["eval_accuracy"] is None and meta["samples"] > meta.get("failed", 0) and not self._said_no_accuracy:
            self._said_no_accuracy = True  # once a run: every evaluation after it would say the same
            self._note(NO_ACCURACY_NOTE)
        if row["eval_failed"] == meta["samples"] > 0 and meta.get("errors"):
            raise RunAbortedError(f"every held-out sample failed {failing_part(self.cfg)}: {meta['errors'][0]}")
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
        row = step_row(step.scored, step.groups, self.counters, self.version, time.monotonic() - started)
        return {**row, "flat_groups": step.flat_groups, **self._restarts(), **self._step_timings, **metrics}

    def _restarts(self) -> dict[str, int | None]:
        """The restarts the run's supervised actors have counted (a likelihood scorer, tool servers, an OpenEnv
        server), each of the run's sessions included: the actors count only since they started."""
        servers = {"tool_server_restarts": tool_server_restarts(self.tool_servers)} if self.tool_servers else {}
        now = {**self.scorers.metrics(), **self.episodes.metrics(), **servers}
        return {k: v if v is None else v + self._restarts_before.get(k, 0) for k, v in now.items()}  # None: no answer

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
            try:
                self._grpo_steps(stop)
            except PlacementError:  # what was trained is kept: resume where the cluster has room again
                self._checkpoint_unless_saved()
                raise
        self.rollouts.cancel_in_flight()  # generated ahead for steps that will not run
        if self.counters.trained_samples == 0:
            raise RunAbortedError(
                f"trained on no sample in {self.counters.step} steps ({self.counters.failed_samples} failed, "
                f"{self.counters.stale_samples} stale, {self.counters.filtered_groups} groups filtered)"
            )
        self.reward_watch.at_end()
        final = self.evaluate("final")
        return self._finish(initial, final)

    def _grpo_steps(self, stop: threading.Event) -> None:
        """GRPO steps up to ``training.total_steps``. Ctrl-C (``stop``) is honoured between steps, after a
        checkpoint of the steps done (with checkpointing on), so an interrupted run resumes where it stopped."""
        t = self.cfg.training
        while self.counters.step < t.total_steps:
            self._stop_if_asked(stop)
            started = time.monotonic()
            self._step_timings = {}
            failed_before = self.counters.failed_samples
            self.rollouts.fill()
            step = self.rollouts.gather_batch()
            if self.counters.failed_samples > failed_before:  # a scorer that died or hangs: replaced now
                for slot, generation, reason in self.scorers.unanswered():
                    self._replace_scorer(slot, generation, reason)
            metrics: dict[str, float] = {"lr": self._lr()}
            if step.groups:
                send_next = t.max_policy_lag == 0 and self.counters.step + 1 < t.total_steps and not stop.is_set()
                metrics |= self._update(step, metrics["lr"], send_next)
            self.counters.step += 1
            self.counters.trained_samples += sum(n for _, n, _ in step.groups)
            if self.counters.step < t.total_steps and self._unplaced is None and not stop.is_set():
                self.rollouts.fill()  # the next rollout generates on the new weights while this step is logged
            self._log(self._step_row(step, metrics, started))
            if self._unplaced is not None:
                raise self._unplaced
            self.reward_watch.after_step(step.scored, self.rollouts.errors_seen)
            if t.eval_every and self.counters.step % t.eval_every == 0 and self.counters.step < t.total_steps:
                self.evaluate(f"step_{self.counters.step}")
            if t.checkpoint_every and self.counters.step % t.checkpoint_every == 0:
                self.save_checkpoint()
        # The last step's checkpoint (a longer run continues from it, redoing no step), while Ctrl-C still waits
        # for it and the rollouts generated ahead are in flight (their prompts go back into the order it saves).
        # A run that trained nothing stops with its error instead.
        if self.counters.trained_samples:
            self._checkpoint_unless_saved()
        self._stop_if_asked(stop)  # asked during the last step: the final evaluation is not waited for either

    def _stop_if_asked(self, stop: threading.Event) -> None:
        if not stop.is_set():
            return
        self._checkpoint_unless_saved()
        raise KeyboardInterrupt

    def _checkpoint_unless_saved(self) -> None:
        """A checkpoint of the steps done, when checkpointing is on and none holds them yet."""
        if self.cfg.training.checkpoint_every and self._saved_step != self.counters.step:
            self.save_checkpoint()

    # -- outputs ----------------------------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        store = checkpoints(self.run_dir)
        path = store.path(self.counters.step)
        self._from_learners([self.learners[0].save.remote(str(path))], "the checkpoint save")  # a death is named
        state = json.dumps(self._state())  # written last, atomically: the state file marks a complete checkpoint
        store.write_atomically(path / TRAINER_STATE_FILE, lambda tmp: tmp.write_text(state))
        store.prune(self.cfg.training.keep_checkpoints)
        self._saved_step = self.counters.step
        return path

    def _state(self) -> dict[str, Any]:
        """What a resumed run needs besides the learner's weights and optimizer (see ``_restore``)."""
        reference = reference_entry(self.reference_dir, self.run_dir)
        # Prompts of batches generating ahead were taken from the order but not trained on: a resumed run takes
        # them again first (pop() takes from the end).
        ahead = self.rollouts.prompts_ahead()
        return {
            "counters": dataclasses.asdict(self.counters),
            "version": self.version,
            "rng": self.rng.bit_generator.state,
            "order": [int(i) for i in [*self.rollouts.order, *ahead]],
            "group_counter": self.rollouts.group_counter,
            "reference_model": reference,
            "kl_coef": self.kl_coef,  # adaptive KL's coefficient (grpo.kl_target), carried on
            "elapsed_s": time.monotonic() - self._start,  # wall clock of every session so far
            # a count whose actors did not answer keeps at least the earlier sessions' (None would not resume)
            "restarts": {k: self._restarts_before.get(k, 0) if v is None else v for k, v in self._restarts().items()},
        }

    def _restore(self, state: dict[str, Any]) -> None:
        for key, value in state["counters"].items():  # in place: the rollout scheduler counts into it too
            setattr(self.counters, key, value)
        self._saved_step = self.counters.step
        self.version = int(state["version"])
        self.rng.bit_generator.state = state["rng"]
        self.rollouts.order = [int(i) for i in state["order"]]
        self.rollouts.group_counter = int(state["group_counter"])
        self.reference_dir = reference_path(state.get("reference_model"), self.run_dir)
        if self.cfg.grpo.kl_target is not None:  # else the config's coefficient, as a resumed run may change it
            self.kl_coef = float(state.get("kl_coef", self.cfg.grpo.kl_coef))
        self._elapsed_before = float(state.get("elapsed_s", 0.0))
        self._restarts_before = {k: int(v) for k, v in state.get("restarts", {}).items()}

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
        after_sft_row = next((r for r in rows if r.get("label") == "after_sft"), {})
        after_sft = after_sft_row.get("eval_accuracy")
        plot = plot_llm_curves(self.run_dir, f"GRPO on {self.cfg.data.train}")
        extra = {
            "tool_server_restarts": None,  # the run has no tool servers
            **self._restarts(),
            "weight_transport": self.weights.weights_via,
            "final_model": str(model_path),
            "plot": str(plot) if plot else None,
            "sample_completions": shown,
        }
        evals = {"initial": initial["eval_accuracy"], "after_sft": after_sft, "final": final["eval_accuracy"]}
        by_label = {"initial": initial, "after_sft": after_sft_row, "final": final}
        failed = {label: int(row.get("eval_failed") or 0) for label, row in by_label.items()}
        elapsed = time.monotonic() - self._start
        summary = run_summary(self.cfg.data.train, self.counters, self.version, evals, elapsed, extra, failed)
        write_summary(self.run_dir, {k: v for k, v in summary.items() if k != "sample_completions"})
        return summary

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
        if not ray.is_initialized():  # setup stopped before Ray started: no actors to stop
            return
        self.rollouts.cancel_in_flight()
        stop_actors(
            self.generators.handles if self.generators else [],
            self.rollout_workers.handles if self.rollout_workers else [],
            self.learners,
            self.reference,
            self.weights.shared_files,
        )
        self.scorers.close()
        self.weights.abandon()  # once its loaders are stopped: a publication the run stopped before finishing
        if self.role_groups is not None:
            self.role_groups.remove()
        self.generators, self.rollout_workers, self.learners, self.reference = None, None, [], None
        stop_tool_servers(self.tool_servers)
        self.episodes.close()
        self.tool_servers = {}


def train_llm(cfg: LLMConfig, run_dir: str | Path, quiet: bool = False) -> dict[str, Any]:
    """Train to the end and clean up the actors; return the summary."""
    trainer = GRPOTrainer(cfg, run_dir, quiet=quiet)
    try:
        return trainer.train()
    finally:
        trainer.close()
