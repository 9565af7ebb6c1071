"""The single-controller driver: builds actors from the config and moves ObjectRefs between them.

The loop follows the data path: runners sample fragments -> the driver checks each fragment's policy version
against ``max_policy_lag`` -> the learner pulls a train batch by ref and updates -> one ``ray.put`` of the new
weights -> every runner reads it. The driver reads only fragment metadata (version, step and episode counts).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from rlfabric import registry
from rlfabric.actors.env_runner import EnvRunner
from rlfabric.actors.learner import Learner
from rlfabric.config import Config, ConfigError, load_config
from rlfabric.run_log import CONFIG_FILE, RunLog, plot_learning_curve, write_summary
from rlfabric.runner_pool import Completed, RunAbortedError, RunnerPool, error_summary

CHECKPOINT_DIR = "checkpoints"
# episode_return_mean is over the most recent episodes, as in Stable-Baselines3's ep_rew_mean.
RETURN_WINDOW = 100


@dataclass
class Progress:
    """Driver counters; saved with every checkpoint so a resumed run continues them."""

    iteration: int = 0
    env_steps: int = 0  # steps the learner trained on
    env_steps_sampled: int = 0  # including dropped and lost work
    episodes: int = 0
    dropped_fragments: int = 0
    runner_restarts: int = 0
    lost_fragments: int = 0
    elapsed_s: float = 0.0
    recent_returns: list[float] = field(default_factory=list)
    recent_lengths: list[int] = field(default_factory=list)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted((run_dir / CHECKPOINT_DIR).glob("iter_*.pt"))
    return found[-1] if found else None


def ensure_ray(cfg: Config) -> None:
    """Connect to the configured cluster, or start a local Ray instance sized for this config."""
    if ray.is_initialized():
        return
    if cfg.ray.address is not None:
        ray.init(address=cfg.ray.address, log_to_driver=True)
        return
    wanted = cfg.runners.num_runners * cfg.runners.num_cpus + cfg.learner.num_cpus
    num_cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, math.ceil(wanted))
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)


class Trainer:
    """Runs one PPO training job described by a validated Config, writing to ``run_dir``."""

    def __init__(self, cfg: Config, run_dir: str | Path, resume: bool = False, quiet: bool = False) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.quiet = quiet
        # Fail on an unknown env before any actor starts.
        registry.resolve(cfg.env.id)
        self.progress = Progress()
        self.pool: RunnerPool | None = None
        self.learner: Any = None
        self.log: RunLog | None = None
        self.placement_group: Any = None
        self.version = 0
        self._update_ref: ray.ObjectRef | None = None  # the learner's update in flight, if any
        self._batch: list[Completed] = []  # the fragments it trains on
        # Restart and loss counts of earlier sessions of a resumed run; the pool counts this session's.
        self._restarts_before = 0
        self._lost_before = 0

    @classmethod
    def from_run_dir(cls, run_dir: str | Path, overrides: list[str] | None = None, quiet: bool = False) -> Trainer:
        """A trainer that continues the run saved in ``run_dir`` from its latest checkpoint.

        ``overrides`` change the saved config (e.g. ``training.total_env_steps=2000000`` to train longer).
        """
        run_dir = Path(run_dir)
        if not (run_dir / CONFIG_FILE).is_file():
            raise ConfigError(f"--resume {str(run_dir)!r}: not a run directory (no {CONFIG_FILE})")
        if latest_checkpoint(run_dir) is None:
            raise ConfigError(f"--resume {str(run_dir)!r}: no checkpoint found under {CHECKPOINT_DIR}/")
        cfg = load_config(run_dir / CONFIG_FILE, overrides)
        return cls(cfg, run_dir, resume=True, quiet=quiet)

    # -- setup ------------------------------------------------------------------------------------------

    def _actor_options(self, num_cpus: float, num_gpus: float, resources: dict[str, float]) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "resources": resources or None}
        if self.placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self.placement_group)
        return opts

    def _make_placement_group(self) -> None:
        strategy = self.cfg.ray.placement_strategy
        if strategy is None:
            return
        from ray.util.placement_group import placement_group

        r, lc = self.cfg.runners, self.cfg.learner
        learner_bundle = {"CPU": lc.num_cpus, **({"GPU": lc.num_gpus} if lc.num_gpus else {}), **lc.resources}
        runner_bundles = [{"CPU": r.num_cpus, **r.resources} for _ in range(r.num_runners)]
        pg = placement_group([learner_bundle, *runner_bundles], strategy=strategy)
        try:
            ray.get(pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(
                f"ray.placement_strategy = {strategy!r}: the cluster cannot place 1 learner and "
                f"{r.num_runners} runners with the requested resources within 120 s"
            ) from None
        self.placement_group = pg

    def _make_runner(self, index: int, generation: int) -> Any:
        r, t = self.cfg.runners, self.cfg.training
        seed = t.seed + 10_007 * index + 1_000_003 * generation + 7_919 * self.progress.iteration
        return EnvRunner.options(**self._actor_options(r.num_cpus, 0, r.resources)).remote(
            self.cfg.env.id,
            self.cfg.env.kwargs,
            r.envs_per_runner,
            self.cfg.fragment_length,
            seed,
            self.cfg.ppo.gamma,
            self.cfg.ppo.obs_clip,
            self.registry_blob,
        )

    def setup(self) -> None:
        checkpoint = self._read_checkpoint() if self.resume else None
        ensure_ray(self.cfg)
        self.registry_blob = registry.snapshot()
        self._make_placement_group()
        self.pool = RunnerPool(self._make_runner, self.cfg.runners.num_runners, self.cfg.runners.sample_timeout_s)
        try:
            spaces = self.pool.call(0, "spaces", timeout=self.cfg.runners.sample_timeout_s)
        except ray.exceptions.RayError as exc:
            raise ConfigError(
                f"env.id = {self.cfg.env.id!r}: building the env on a runner failed: {error_summary(exc)}"
            ) from None
        lc = self.cfg.learner
        self.learner = Learner.options(**self._actor_options(lc.num_cpus, lc.num_gpus, lc.resources)).remote(
            self.cfg.to_dict(), spaces["obs_dim"], spaces["action"]
        )
        if checkpoint is not None:
            ray.get(self.learner.load_state.remote(checkpoint["learner"]))
            self._restarts_before = self.progress.runner_restarts
            self._lost_before = self.progress.lost_fragments
        self.log = RunLog(
            self.run_dir, self.cfg, resume_at=self.progress.iteration if self.resume else None, quiet=self.quiet
        )
        self._publish()

    def _publish(self) -> None:
        (weights_ref,) = ray.get(self.learner.publish.remote())
        self.version = ray.get(self.learner.get_version.remote())
        self.pool.broadcast(weights_ref)

    # -- checkpoints ------------------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        state = {
            "learner": ray.get(self.learner.state.remote()),
            "progress": self.progress.__dict__,
            "config": self.cfg.to_dict(),
        }
        folder = self.run_dir / CHECKPOINT_DIR
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"iter_{self.progress.iteration:06d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(path)  # never leave a half-written checkpoint behind
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
            return self._update_ref is None and index not in self._sampled_this_version
        in_flight = len(self.pool.in_flight)
        return buffered + in_flight < self.fragments_per_batch

    def _accept(self, done: Completed, buffer: list[Completed]) -> None:
        p = self.progress
        meta = done.meta
        p.env_steps_sampled += meta["env_steps"]
        p.episodes += len(meta["episode_returns"])
        p.recent_returns = (p.recent_returns + meta["episode_returns"])[-RETURN_WINDOW:]
        p.recent_lengths = (p.recent_lengths + meta["episode_lengths"])[-RETURN_WINDOW:]
        if meta["version"] < self.version - self.cfg.training.max_policy_lag:
            p.dropped_fragments += 1
            return
        buffer.append(done)

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
            self._loop()
        except (KeyboardInterrupt, RunAbortedError):
            if self._update_ref is not None:
                self._complete_update()  # an update in flight is worth keeping: it takes a second
            self.save_checkpoint()
            self.log.close()
            raise
        return self._finish()

    def _loop(self) -> None:
        self.fragments_per_batch = self.cfg.runners.num_runners
        buffer: list[Completed] = []
        self._sampled_this_version: set[int] = set()
        self._iter_start = time.monotonic()
        self._start_elapsed, self._run_start = self.progress.elapsed_s, time.monotonic()
        while not (self._should_stop() and self._update_ref is None):
            for i in range(len(self.pool)):
                if not self._should_stop() and self._may_sample(i, len(buffer)):
                    self.pool.submit(i)
                    self._sampled_this_version.add(i)
            waiting = self.pool.pending_refs() + ([self._update_ref] if self._update_ref is not None else [])
            if not waiting:
                break
            ready, _ = ray.wait(waiting, num_returns=1, timeout=1.0)
            if self._update_ref is not None and self._update_ref in ready:
                self._complete_update()
            completed, failed = self.pool.collect([r for r in ready if r is not self._update_ref])
            for reason in self.pool.failures[len(self.pool.failures) - len(failed) :]:
                self.log.note(f"{reason}; replaced it and asked again")
            for done in completed:
                self._accept(done, buffer)
            self._sampled_this_version.difference_update(failed)  # lost work is asked for again
            if self._update_ref is None and len(buffer) >= self.fragments_per_batch and not self._should_stop():
                self._batch, buffer = buffer[: self.fragments_per_batch], buffer[self.fragments_per_batch :]
                self._update_ref = self.learner.update_from_refs.remote([c.data_ref for c in self._batch])
        self._tick()

    def _tick(self) -> None:
        self.progress.elapsed_s = self._start_elapsed + time.monotonic() - self._run_start

    def _complete_update(self) -> None:
        """Take the finished update's statistics, publish the new version, log, checkpoint when due."""
        stats = ray.get(self._update_ref)
        self._update_ref = None
        self._publish()
        self._sampled_this_version.clear()
        self._tick()
        self._log_iteration(self._batch, stats, time.monotonic() - self._iter_start)
        self._iter_start = time.monotonic()
        every = self.cfg.training.checkpoint_every
        if every and self.progress.iteration % every == 0:
            self.save_checkpoint()

    def _log_iteration(self, batch: list[Completed], stats: dict[str, float], seconds: float) -> None:
        p = self.progress
        steps = sum(c.meta["env_steps"] for c in batch)
        p.iteration += 1
        p.env_steps += steps
        p.runner_restarts = self.pool.restarts + self._restarts_before
        p.lost_fragments = self.pool.lost_fragments + self._lost_before
        lags = [self.version - 1 - c.meta["version"] for c in batch]
        row = {
            "iteration": p.iteration,
            "env_steps": p.env_steps,
            "env_steps_sampled": p.env_steps_sampled,
            "episodes": p.episodes,
            "episode_return_mean": float(np.mean(p.recent_returns)) if p.recent_returns else None,
            "episode_len_mean": float(np.mean(p.recent_lengths)) if p.recent_lengths else None,
            "env_steps_per_s": steps / max(seconds, 1e-9),
            "time_total_s": p.elapsed_s,
            "policy_version": self.version,
            "policy_lag_mean": float(np.mean(lags)),
            "dropped_fragments": p.dropped_fragments,
            "lost_fragments": p.lost_fragments,
            "runner_restarts": p.runner_restarts,
            "sample_time_s": float(np.mean([c.meta["sample_time_s"] for c in batch])),
            **stats,
        }
        self.log.log(row)

    def _finish(self) -> dict[str, Any]:
        ckpt = self.save_checkpoint()
        eval_returns: list[float] = []
        if self.cfg.training.eval_episodes:
            eval_returns = self.pool.call(
                0, "evaluate", self.cfg.training.eval_episodes, self.cfg.training.seed + 12345
            )
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
            "runner_failures": self.pool.failures[-10:],
            "checkpoint": str(ckpt.relative_to(self.run_dir)),
        }
        write_summary(self.run_dir, summary)
        summary["plot"] = plot_learning_curve(self.run_dir, f"PPO on {self.cfg.env.id}")
        self.log.close()
        return summary

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
        if self.learner is not None:
            ray.kill(self.learner)
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
