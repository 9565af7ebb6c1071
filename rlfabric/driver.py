"""The single-controller driver: builds actors from the config and moves ObjectRefs between them.

The loop follows the data path: runners sample fragments -> the driver checks each fragment's policy version
against ``max_policy_lag`` -> the learner pulls a train batch by ref and updates -> one ``ray.put`` of the new
weights -> every runner reads it. The driver reads only fragment metadata (version, step and episode counts).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from rlfabric import registry
from rlfabric.actor_slots import error_kind, evaluation_failure, lost_object
from rlfabric.actors.env_runner import EnvRunner
from rlfabric.actors.learner import Learner
from rlfabric.config import Config, ConfigError
from rlfabric.placement import RoleGroups, check_fits, record_plan
from rlfabric.ppo_config import PPO_ROLES
from rlfabric.ppo_init import read_init_state
from rlfabric.ppo_placement import SETUP_TIMEOUT_S, ActorPlacement
from rlfabric.ray_connect import ensure_ray
from rlfabric.reward_shaping import MissingRewardComponent, component_metric, components_read
from rlfabric.run.checkpoints import CHECKPOINT_DIR, CheckpointStore
from rlfabric.run.interrupts import stop_requests
from rlfabric.run.log import CONFIG_FILE, RunLog, write_summary
from rlfabric.run.plots import plot_learning_curve
from rlfabric.run.progress import EtaClock, ppo_progress_line
from rlfabric.run.resume import finished_summary, no_checkpoint_error, refuse_run_over, resumed_config
from rlfabric.runner_pool import Completed, RunAbortedError, RunnerPool, error_summary

# What a checkpoint's weights and statistics depend on: a resumed run may not change these. The reward weights are
# the reward the critic and the return statistics learned (as env.kwargs may be: a MuJoCo env's ctrl_cost_weight);
# env.reward_components only adds what is logged and recorded, so it may change.
FIXED_ON_RESUME = ("algo", "env.id", "env.kwargs", "env.reward_weights", "model", "ppo.normalize_obs")
# episode_return_mean is over the most recent episodes, as in Stable-Baselines3's ep_rew_mean.
RETURN_WINDOW = 100
# Updates in a row the learner may skip (a loss, gradient or statistic not finite: actors/learner.py) before the run
# stops: one is a blip, a row of them a run that cannot go on.
MAX_SKIPPED_UPDATES = 3


@dataclass
class Progress:
    """Driver counters; saved with every checkpoint so a resumed run continues them."""

    iteration: int = 0
    env_steps: int = 0  # steps the learner trained on
    env_steps_sampled: int = 0  # including fragments dropped as too stale (not those lost with a runner or node)
    episodes: int = 0
    dropped_fragments: int = 0
    runner_restarts: int = 0
    lost_fragments: int = 0
    runners_started: int = 0  # every runner of the run, replacements and resumed sessions' included: id ranges
    skipped_updates: int = 0  # updates the learner did not apply (not finite)
    elapsed_s: float = 0.0
    recent_returns: list[float] = field(default_factory=list)
    recent_lengths: list[int] = field(default_factory=list)


EPISODE_IDS_PER_RUNNER = 2**32  # runner k of a run numbers its rows from k * 2**32: episode ids unique in the run


def next_episode_id_range(progress: Progress) -> int:
    """The first episode id of the next runner started, counted in ``progress`` (which checkpoints keep)."""
    progress.runners_started += 1
    return (progress.runners_started - 1) * EPISODE_IDS_PER_RUNNER


def checkpoints(run_dir: Path) -> CheckpointStore:
    """A PPO run's checkpoints: one file per iteration, written atomically."""
    return CheckpointStore(run_dir, "iter", ".pt")


def latest_checkpoint(run_dir: Path) -> Path | None:
    return checkpoints(Path(run_dir)).latest()


class Trainer(ActorPlacement):
    """Runs one PPO training job described by a validated Config, writing to ``run_dir``."""

    def __init__(self, cfg: Config, run_dir: str | Path, resume: bool = False, quiet: bool = False) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.quiet = quiet
        # Fail on an unknown env, or on a run directory that already holds a run, before any actor starts.
        registry.resolve(cfg.env.id)
        if not resume:
            refuse_run_over(self.run_dir, latest_checkpoint(self.run_dir) is not None)
        # model.init_from: a new run's starting weights, checked before any actor starts (rlfabric.ppo_init)
        self.init_state = None if resume else read_init_state(cfg)
        self.progress = Progress()
        self.pool: RunnerPool | None = None
        self.learner: Any = None
        self.log: RunLog | None = None
        self.placement_group: Any = None
        self.role_groups: RoleGroups | None = None  # ray.placement: a group per role
        self.version = 0
        self.registry_blob = b""
        self.fragments_per_batch = cfg.runners.num_runners  # one fragment per runner per train batch
        self._update_refs: list[ray.ObjectRef] | None = None  # the learners' update in flight, if any
        self._batch: list[Completed] = []  # the fragments it trains on
        self._sampled_this_version: set[int] = set()  # sync mode: runners that sampled for this version
        self._iter_start = self._run_start = time.monotonic()
        self._start_elapsed = 0.0
        # Restart and loss counts of earlier sessions of a resumed run; the pool counts this session's.
        self._restarts_before = 0
        self._lost_before = 0
        self._skipped_in_a_row = 0
        # env.reward_components' sums over the episodes finished since the last metrics row, by info key
        self.components = components_read(cfg.env.reward_components, cfg.env.reward_weights)
        self._episode_components: dict[str, list[float]] = {k: [] for k in self.components}

    @classmethod
    def from_run_dir(cls, run_dir: str | Path, overrides: list[str] | None = None, quiet: bool = False) -> Trainer:
        """A trainer that continues the run saved in ``run_dir`` from its latest checkpoint.

        ``overrides`` change the saved config (e.g. ``training.total_env_steps=2000000`` to train longer).
        """
        run_dir = Path(run_dir)
        if not (run_dir / CONFIG_FILE).is_file():
            raise ConfigError(f"--resume {str(run_dir)!r}: not a run directory (no {CONFIG_FILE})")
        if latest_checkpoint(run_dir) is None:
            raise no_checkpoint_error(run_dir, CHECKPOINT_DIR, zero_saves_at_end=True)
        cfg = resumed_config(run_dir, overrides, FIXED_ON_RESUME)
        # A run that finished has nothing left to do at its total (one stopped in its final evaluation finishes).
        done = (finished_summary(run_dir) or {}).get("env_steps")
        if done is not None and done >= cfg.training.total_env_steps:
            raise ConfigError(
                f"--resume {str(run_dir)!r}: the run finished at {done} env steps of "
                f"{cfg.training.total_env_steps}; pass training.total_env_steps=N with N > {done} to train longer"
            )
        return cls(cfg, run_dir, resume=True, quiet=quiet)

    # -- setup (what each actor asks Ray for, and its reservations: ``ActorPlacement``) ---------------------

    def _make_runner(self, index: int, generation: int) -> Any:
        r, t = self.cfg.runners, self.cfg.training
        seed = t.seed + 10_007 * index + 1_000_003 * generation + 7_919 * self.progress.iteration
        return EnvRunner.options(**self._actor_options(r.num_cpus, 0, r.resources, "runners", index)).remote(
            self.cfg.env.id,
            self.cfg.env.kwargs,
            r.envs_per_runner,
            self.cfg.fragment_length,
            seed,
            self.cfg.ppo.gamma,
            self.cfg.ppo.obs_clip,
            self.registry_blob,
            next_episode_id_range(self.progress),
            reward_components=self.cfg.env.reward_components,
            reward_weights=self.cfg.env.reward_weights,
        )

    def setup(self) -> None:
        checkpoint = self._read_checkpoint() if self.resume else None
        r = self.cfg.runners
        ensure_ray(self.cfg.ray, self._cpus_wanted())
        # a joined cluster too small for the run: one line now, not a wait for actors that cannot start
        check_fits(self._actor_requests(), [node["Resources"] for node in ray.nodes() if node.get("Alive")])
        self.registry_blob = registry.snapshot()
        self._make_placement_group()
        self.pool = RunnerPool(
            self._make_runner,
            r.num_runners,
            r.sample_timeout_s,
            num_fragments=self._fragments_per_sample(),
            resources=self._runner_resources(),
            on_failure=self._runner_failed,
            fatal=(MissingRewardComponent,),  # an info key the config names and the env lacks fails them all
        )
        r, lc = self.cfg.runners, self.cfg.learner
        try:
            spaces = self.pool.call(0, "spaces", timeout=SETUP_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(
                f"runners.resources = {r.resources!r} / runners.num_cpus = {r.num_cpus!r}: no runner started "
                f"within {SETUP_TIMEOUT_S:g} s; the cluster may not have these resources free"
            ) from None
        except ray.exceptions.RayError as exc:
            raise ConfigError(
                f"env.id = {self.cfg.env.id!r}: building the env on a runner failed: {error_summary(exc)}"
            ) from None
        self._make_learners(spaces)
        try:
            ray.get([learner.get_version.remote() for learner in self._learners()], timeout=SETUP_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            asked = f"{self._num_learners()} x {{CPU: {lc.num_cpus:g}, GPU: {lc.num_gpus:g}, {lc.resources}}}"
            raise ConfigError(
                f"learner.num_cpus / num_gpus / resources: the learners ({asked}) did not all start within "
                f"{SETUP_TIMEOUT_S:g} s beside {r.num_runners} runners; the cluster may not have these resources free"
            ) from None
        if checkpoint is not None:
            self._load_learner_state(checkpoint)
            self._restarts_before = self.progress.runner_restarts
            self._lost_before = self.progress.lost_fragments
        elif self.init_state is not None:
            try:
                ray.get(self.learner.init_from.remote(self.init_state))
            except ray.exceptions.RayTaskError as exc:  # the env's spaces do not fit the checkpoint's weights
                raise ConfigError(str(exc.cause) if isinstance(exc.cause, ValueError) else error_summary(exc)) from None
        total, clock = self._steps_to_train(), EtaClock()
        self.log = RunLog(
            self.run_dir,
            self.cfg,
            resume_at=self.progress.iteration if self.resume else None,
            quiet=self.quiet,
            progress_line=lambda row: ppo_progress_line(row, total, clock.eta("ppo", row["env_steps"], total)),
        )
        placement = self.cfg.ray.placement or dict.fromkeys(PPO_ROLES, self.cfg.ray.placement_strategy)
        for line in record_plan(self.run_dir, {"runners": self.pool.runners, "learner": self._learners()}, placement):
            self.log.note(f"placement: {line}")
        if checkpoint is None and self.init_state is not None:
            self.log.note(f"model.init_from: weights and normalizer statistics of {self.init_state['source']}")
        if total != self.cfg.training.total_env_steps:
            batch = self.cfg.ppo.train_batch_size
            self.log.note(
                f"training.total_env_steps = {self.cfg.training.total_env_steps} is not a whole number of train "
                f"batches (ppo.train_batch_size = {batch}): the run trains {total} env steps "
                f"({total // batch} {'batch' if total == batch else 'batches'})"
            )
        self._publish()

    def _steps_to_train(self) -> int:
        """The env steps the run ends at: ``training.total_env_steps`` rounded up to whole train batches after
        the steps already trained (a resumed run's), since every update trains on a whole batch."""
        done, batch = self.progress.env_steps, self.cfg.ppo.train_batch_size
        return done + math.ceil(max(self.cfg.training.total_env_steps - done, 0) / batch) * batch

    # -- the learner (one; a game has one per trainable policy: rlfabric.game_driver) ----------------------

    def _runner_failed(self, error: Exception) -> None:
        """A runner's sample raised ``error``; the runner is replaced next (a game's driver also replaces the
        generator the error names)."""

    def _fragments_per_sample(self) -> int:
        return 1

    def _make_learners(self, spaces: dict[str, Any]) -> None:
        lc = self.cfg.learner
        options = self._actor_options(lc.num_cpus, lc.num_gpus, lc.resources, "learner", 0)
        self.learner = Learner.options(**options).remote(self.cfg.to_dict(), spaces["obs_dim"], spaces["action"])

    def _learners(self) -> list[Any]:
        return [self.learner]

    def _load_learner_state(self, checkpoint: dict[str, Any]) -> None:
        ray.get(self.learner.load_state.remote(checkpoint["learner"]))

    def _checkpoint_state(self) -> dict[str, Any]:
        return {"learner": ray.get(self.learner.state.remote())}

    def _start_update(self, batch: list[Completed]) -> list[ray.ObjectRef]:
        return [self.learner.update_from_refs.remote([c.data_ref for c in batch])]

    def _update_stats(self, results: list[dict[str, float]]) -> dict[str, float]:
        return results[0]

    def _publish(self) -> None:
        weights_ref, self.version = ray.get(self.learner.publish.remote())
        self.pool.broadcast(weights_ref)

    # -- checkpoints ------------------------------------------------------------------------------------

    def _sync_fault_counts(self) -> None:
        self.progress.runner_restarts = self.pool.restarts + self._restarts_before
        self.progress.lost_fragments = self.pool.lost_fragments + self._lost_before

    def save_checkpoint(self) -> Path:
        self._sync_fault_counts()
        state = {
            **self._checkpoint_state(),
            "progress": self.progress.__dict__,
            "config": self.cfg.to_dict(),
        }
        store = checkpoints(self.run_dir)
        path = store.write_atomically(store.path(self.progress.iteration), lambda tmp: torch.save(state, tmp))
        store.prune(self.cfg.training.keep_checkpoints)
        return path

    def _read_checkpoint(self) -> dict[str, Any]:
        """Load the latest checkpoint and restore the driver's counters from it."""
        state = torch.load(latest_checkpoint(self.run_dir), weights_only=False)
        self.progress = Progress(**state["progress"])
        return state

    # -- the loop ---------------------------------------------------------------------------------------

    def _may_sample(self, index: int, buffered: int) -> bool:
        if self.pool.busy(index):
            return False
        if self.cfg.training.max_policy_lag == 0:
            # Synchronous: one fragment per runner per policy version, none while the learner updates.
            return self._update_refs is None and index not in self._sampled_this_version
        # Async: keep sampling up to max_policy_lag batches ahead of the learner.
        in_flight = len(self.pool.in_flight)
        return buffered + in_flight < self.fragments_per_batch * self.cfg.training.max_policy_lag

    def _accept(self, done: Completed, buffer: list[Completed]) -> None:
        p = self.progress
        meta = done.meta
        p.env_steps_sampled += meta["env_steps"]
        p.episodes += len(meta["episode_returns"])
        p.recent_returns = (p.recent_returns + meta["episode_returns"])[-RETURN_WINDOW:]
        p.recent_lengths = (p.recent_lengths + meta["episode_lengths"])[-RETURN_WINDOW:]
        for key, sums in meta.get("episode_components", {}).items():
            self._episode_components[key] += sums
        if not self._drop_if_stale(done):
            buffer.append(done)

    def _drop_if_stale(self, done: Completed) -> bool:
        """Count ``done`` as dropped when its policy version is more than ``max_policy_lag`` behind the learner's."""
        if done.meta["version"] >= self.version - self.cfg.training.max_policy_lag:
            return False
        self.progress.dropped_fragments += 1
        self._sampled_this_version.discard(done.runner)  # sync mode: that runner owes a fresh one
        return True

    def _should_stop(self) -> bool:
        p, t = self.progress, self.cfg.training
        if p.env_steps >= t.total_env_steps:
            return True
        return t.stop_return is not None and bool(p.recent_returns) and np.mean(p.recent_returns) >= t.stop_return

    def train(self) -> dict[str, Any]:
        """Run until total_env_steps (or stop_return); return the summary.

        Whatever stops the run early (Ctrl-C, an env that fails every time) first checkpoints what was trained.
        """
        if self.pool is None:
            self.setup()
        try:
            with stop_requests() as stop:
                self._loop(stop)
        except (KeyboardInterrupt, RunAbortedError):
            if self._update_refs is not None:
                self._complete_update()  # an update in flight is worth keeping: it takes a second
            self.save_checkpoint()
            self.log.close()
            raise
        return self._finish()

    def _loop(self, stop: threading.Event) -> None:
        buffer: list[Completed] = []
        self._iter_start = self._run_start = time.monotonic()
        self._start_elapsed = self.progress.elapsed_s
        while not (self._should_stop() and self._update_refs is None):
            if stop.is_set():  # Ctrl-C, honoured here where no Ray call or write is half-done
                raise KeyboardInterrupt
            for i in range(len(self.pool)):
                if not self._should_stop() and self._may_sample(i, len(buffer)):
                    self.pool.submit(i)
                    self._sampled_this_version.add(i)
            update_refs = self._update_refs or []
            waiting = self.pool.pending_refs() + update_refs
            if not waiting:  # nothing in flight and nothing allowed to start: a scheduling bug, not an end
                raise RuntimeError(f"driver stalled with {len(buffer)} fragments buffered; please report this")
            ready, _ = ray.wait(waiting, num_returns=1, timeout=1.0)
            if update_refs and len(ray.wait(update_refs, num_returns=len(update_refs), timeout=0)[0]) == len(
                update_refs
            ):
                # A batch that lost a fragment is filled up again; a fragment that waited here through the update
                # may now be more than max_policy_lag versions behind.
                buffer = [done for done in (*self._complete_update(), *buffer) if not self._drop_if_stale(done)]
            completed, failed = self.pool.collect([r for r in ready if r not in update_refs])
            for k in range(len(self.pool.failures) - len(failed), len(self.pool.failures)):
                reason, text = self.pool.failures[k], self.pool.failure_texts[k]
                self.log.failure(error_kind(reason), f"{reason}; replaced it and asked again", text)
            for done in completed:
                self._accept(done, buffer)
            self._sampled_this_version.difference_update(failed)  # lost work is asked for again
            if self._update_refs is None and len(buffer) >= self.fragments_per_batch and not self._should_stop():
                batch, buffer = buffer[: self.fragments_per_batch], buffer[self.fragments_per_batch :]
                batch.sort(key=lambda c: c.runner)  # arrival order varies; a fixed order keeps seeded runs repeatable
                self._batch = batch
                self._update_refs = self._start_update(batch)
        self._tick()

    def _tick(self) -> None:
        self.progress.elapsed_s = self._start_elapsed + time.monotonic() - self._run_start

    def _complete_update(self) -> list[Completed]:
        """Take the finished update's statistics, log it, publish the new version, checkpoint when due.

        An update that could not read a fragment of its batch (the fragment was lost with its runner's node after
        the driver accepted it) trained on nothing: the lost fragment is counted in ``lost_fragments`` and its
        runner samples again; the batch's other fragments are returned, to be trained on with the new one."""
        results: list[dict[str, float]] = []
        lost: set[str] = set()
        for ref in self._update_refs:  # one per learner: a game's learners each read their policy's fragments
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayError as exc:
                if lost_object(exc) is None:
                    raise
                lost.add(lost_object(exc))
        self._update_refs = None
        if lost:
            if results:  # another learner trained on the batch: asking again would train it twice
                raise RunAbortedError(f"a fragment was lost with its node after {len(results)} learner(s) trained")
            return self._drop_lost(lost)
        skipped = [r.pop("skip_reason") for r in results if "skip_reason" in r]  # a string: not a metric
        stats = self._update_stats(results)
        self._tick()
        # Counted and logged before anything that blocks, so an interrupt never leaves a checkpoint whose
        # iteration has no metrics row.
        self._count_skipped(skipped)
        self._log_iteration([c.meta for c in self._batch], stats, time.monotonic() - self._iter_start)
        self._iter_start = time.monotonic()
        self._stop_after_skipped(skipped)
        self._publish()
        self._sampled_this_version.clear()
        every = self.cfg.training.checkpoint_every
        if every and self.progress.iteration % every == 0:
            self.save_checkpoint()
        return []

    def _count_skipped(self, reasons: list[str]) -> None:
        """Count an update the learner skipped (``reasons``: why, one per learner that skipped; [] when none
        did), and say so."""
        if not reasons:
            self._skipped_in_a_row = 0
            return
        self.progress.skipped_updates += 1
        self._skipped_in_a_row += 1
        self.log.note(f"update {self.progress.iteration + 1} skipped, its weights not applied: {'; '.join(reasons)}")

    def _stop_after_skipped(self, reasons: list[str]) -> None:
        """Stop the run once ``MAX_SKIPPED_UPDATES`` updates in a row were skipped (its weights and checkpoints
        stay those of the last update that was finite)."""
        if self._skipped_in_a_row >= MAX_SKIPPED_UPDATES:
            raise RunAbortedError(
                f"the learner skipped {self._skipped_in_a_row} updates in a row, as not finite (last: "
                f"{'; '.join(reasons)}); the weights are those of the last finite update"
            )

    def _drop_lost(self, lost: set[str]) -> list[Completed]:
        """The batch without the fragments whose objects (hex ids in ``lost``) are gone; those are counted as lost
        and their runners owe a fragment again."""
        kept = []
        for done in self._batch:
            if lost.isdisjoint(ref.hex() for ref in done.data_refs):
                kept.append(done)
                continue
            self.pool.lost_fragments += 1
            self.progress.env_steps_sampled -= done.meta["env_steps"]
            self._sampled_this_version.discard(done.runner)  # sync mode: that runner samples this version again
        self.log.note(f"{len(self._batch) - len(kept)} fragment(s) lost with their node before the learner read them")
        return kept

    def _log_iteration(self, batch: list[dict[str, Any]], stats: dict[str, float], seconds: float) -> None:
        """Count one update (trained on policy version ``self.version``, producing ``self.version + 1``)."""
        p = self.progress
        steps = sum(m["env_steps"] for m in batch)
        self._sync_fault_counts()
        row = {
            "iteration": p.iteration + 1,
            "env_steps": p.env_steps + steps,
            "env_steps_sampled": p.env_steps_sampled,
            "episodes": p.episodes,
            "episode_return_mean": float(np.mean(p.recent_returns)) if p.recent_returns else None,
            "episode_len_mean": float(np.mean(p.recent_lengths)) if p.recent_lengths else None,
            "env_steps_per_s": steps / max(seconds, 1e-9),
            "time_total_s": p.elapsed_s,
            "policy_version": self.version + 1,
            "policy_lag_mean": float(np.mean([self.version - m["version"] for m in batch])),
            "dropped_fragments": p.dropped_fragments,
            "lost_fragments": p.lost_fragments,
            "runner_restarts": p.runner_restarts,
            "skipped_updates": p.skipped_updates,
            "sample_time_s": float(np.mean([m["sample_time_s"] for m in batch])),
            **self._component_means(),
            **stats,
            **self._iteration_metrics(batch),
        }
        p.iteration, p.env_steps = row["iteration"], row["env_steps"]
        self.log.log(row)

    def _component_means(self) -> dict[str, float | None]:
        """``episode_reward_<key>``: each reward component's sum per episode, averaged over the episodes finished
        since the last row (None when none did); the sums are then cleared."""
        means = {component_metric(k): float(np.mean(v)) if v else None for k, v in self._episode_components.items()}
        for sums in self._episode_components.values():
            sums.clear()
        return means

    def _iteration_metrics(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        """Further columns of an iteration's metrics row (a game's per-policy returns, self-play ratings)."""
        return {}

    def _summary_extras(self) -> dict[str, Any]:
        """Further entries of summary.json (a game's evaluation against baselines)."""
        return {}

    def _finish(self) -> dict[str, Any]:
        ckpt = self.save_checkpoint()
        eval_returns = self._evaluate()
        p = self.progress
        summary = {
            "env": self.cfg.env.id,
            "iterations": p.iteration,
            "env_steps": p.env_steps,
            "episodes": p.episodes,
            "episode_return_mean": float(np.mean(p.recent_returns)) if p.recent_returns else None,
            "eval_return_mean": float(np.mean(eval_returns)) if eval_returns else None,
            "eval_episodes": len(eval_returns),
            "time_total_s": p.elapsed_s,
            "env_steps_per_s": p.env_steps / max(p.elapsed_s, 1e-9),
            "dropped_fragments": p.dropped_fragments,
            "lost_fragments": p.lost_fragments,
            "runner_restarts": p.runner_restarts,
            "skipped_updates": p.skipped_updates,
            "runner_failures": self.pool.failures[-10:],
            "checkpoint": str(ckpt.relative_to(self.run_dir)),
            **self._summary_extras(),
        }
        write_summary(self.run_dir, summary)
        summary["plot"] = plot_learning_curve(self.run_dir, f"PPO on {self.cfg.env.id}")
        self.log.close()
        return summary

    def _evaluate(self) -> list[float]:
        """Deterministic episodes of the final policy on runner 0; skipped (with a note) if that fails."""
        t = self.cfg.training
        if not t.eval_episodes:
            return []
        try:
            return self.pool.call(
                0, "evaluate", t.eval_episodes, t.seed + 12345, timeout=self.cfg.runners.sample_timeout_s
            )
        except ray.exceptions.RayError as exc:
            self.log.note(f"evaluation skipped: {evaluation_failure(exc, self.cfg.runners.sample_timeout_s)}")
            return []

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
        for learner in self._learners():
            if learner is not None:
                ray.kill(learner)
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
        if self.role_groups is not None:
            self.role_groups.remove()


def train(cfg: Config, run_dir: str | Path, quiet: bool = False) -> dict[str, Any]:
    """Train ``cfg`` into ``run_dir`` from Python (the CLI's ``rlfabric train``); returns the run summary."""
    trainer = Trainer(cfg, run_dir, quiet=quiet)
    try:
        return trainer.train()
    finally:
        trainer.close()
