"""Learner: the torch actor-critic, its optimizer and the global normalizer statistics.

It pulls fragments from the object store by ref, computes values, GAE and PPO updates, and publishes each new
policy version with a single ``ray.put`` that every runner reads.
"""

from __future__ import annotations

import copy
import math
import random
import time
from typing import Any

import numpy as np
import ray
import torch

from rlfabric.algorithms import ppo
from rlfabric.allocator import retain_freed_memory
from rlfabric.config import Config, config_from_dict
from rlfabric.models import ActionSpec, ActorCritic
from rlfabric.normalization import Normalizer, RunningStats, scale_rewards
from rlfabric.reward_shaping import shaped_reward
from rlfabric.trajectory import Trajectories, time_major

# The per-update loss statistics, averaged over the update's minibatches (NaN for an update that was skipped).
LOSS_STATS = ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction")


class NonFiniteUpdate(ArithmeticError):
    """Something an update would train on or apply is NaN or infinite; the message says what, on one line."""


def check_finite_statistics(stats: dict[str, RunningStats | None]) -> None:
    """Raise NonFiniteUpdate naming the first of the merged normalizer statistics (by name) that is not finite."""
    for name, s in stats.items():
        if s is not None and not (np.isfinite(s.mean).all() and np.isfinite(s.m2).all()):
            raise NonFiniteUpdate(f"the {name} statistics merged from the batch's fragments are not finite")


def check_finite_batch(flat: dict[str, np.ndarray]) -> None:
    """Raise NonFiniteUpdate naming the first column of a flat batch (one row per step) that is not finite, with
    how many of its steps are not."""
    for key in ("obs", "critic_obs", "logp", "values", "advantages", "returns"):
        if key not in flat:
            continue
        column = flat[key].reshape(len(flat[key]), -1)
        finite = np.isfinite(column).all(axis=1)
        if not finite.all():
            bad = int((~finite).sum())
            raise NonFiniteUpdate(f"the batch's {key} are not finite at {bad} of its {len(finite)} steps")


def step_problem(
    policy_loss: float, value_loss: float, entropy: float, loss: float, grad_norm: float, epoch: int, minibatch: int
) -> str:
    """What was not finite at a gradient step, e.g. "the loss is nan (policy_loss nan, value_loss 0.31, entropy
    1.4) at epoch 1, minibatch 3"."""
    where = f"at epoch {epoch + 1}, minibatch {minibatch + 1}"
    if not math.isfinite(loss):
        terms = f"policy_loss {policy_loss:.3g}, value_loss {value_loss:.3g}, entropy {entropy:.3g}"
        return f"the loss is {loss} ({terms}) {where}"
    return f"the gradient norm is {grad_norm} {where}"


class LearnerCore:
    """PPO learner logic without Ray."""

    def __init__(
        self,
        config: dict[str, Any],
        obs_dim: int,
        action: ActionSpec,
        critic_dim: int | None = None,
        seed_offset: int = 0,
    ) -> None:
        """``critic_dim``: the input size of a centralized critic (None: it sees the observation). ``seed_offset``
        sets one learner's seeds apart from another's (one learner per trainable policy in a game)."""
        self.cfg: Config = config_from_dict(config)
        seed = self.cfg.training.seed + seed_offset
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        self.rng = np.random.default_rng(seed)
        self.device = self._device()
        m = self.cfg.model
        self.model = ActorCritic(obs_dim, action, m.hidden_sizes, m.activation, m.init_log_std, critic_dim)
        self.model.to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=self.cfg.ppo.lr, eps=1e-5, fused=True)
        self.version = 0
        self.updates_done = 0
        self.total_updates = math.ceil(self.cfg.training.total_env_steps / self.cfg.ppo.train_batch_size)
        self.obs_stats = RunningStats.empty((obs_dim,))
        self.return_stats = RunningStats.empty((1,))
        self.value_stats = RunningStats.empty((1,))  # of the value targets, when normalizing values
        # A centralized critic's inputs (a game's global state), normalized here when normalizing observations:
        # the learner sees every one of them, so it keeps their statistics itself.
        self.critic_stats = RunningStats.empty((critic_dim,)) if critic_dim else None
        self.critic_normalizer: Normalizer | None = None  # this update's, frozen while it runs

    def _device(self) -> torch.device:
        want = self.cfg.learner.device
        if want == "cuda" or (want == "auto" and torch.cuda.is_available() and self.cfg.learner.num_gpus > 0):
            return torch.device("cuda")
        torch.set_num_threads(max(1, int(self.cfg.learner.num_cpus)))
        return torch.device("cpu")

    # -- weights ----------------------------------------------------------------------------------------

    def weights(self) -> dict[str, Any]:
        """What runners need to act: actor arrays, version, and observation statistics (if normalizing)."""
        return {
            "actor": self.model.actor_arrays(),
            "version": self.version,
            "obs_stats": self.obs_stats.to_dict() if self.cfg.ppo.normalize_obs else None,
        }

    # -- update -----------------------------------------------------------------------------------------

    def _values(self, obs: np.ndarray | None) -> np.ndarray:
        """The critic's values of ``obs`` in return units (denormalized when normalizing values)."""
        if obs is None or len(obs) == 0:
            return np.zeros(0, np.float32)
        with torch.no_grad():
            # Fragments arrive read-only (zero-copy from the object store); torch wants a writable array.
            out = self.model.value(torch.as_tensor(np.array(obs), device=self.device)).cpu().numpy()
        if self.cfg.ppo.normalize_values:
            out = ppo.denormalize_values(out, float(self.value_stats.mean[0]), float(self.value_stats.var[0]))
        return out

    def _advantages(self, frag: Trajectories) -> dict[str, np.ndarray]:
        """Values, GAE advantages and returns for one fragment, flattened over its steps in time-major order.

        Rows may differ in length (a multi-agent fragment has one row per agent and env copy, each of the agent's
        own steps): padding is masked out of GAE (``ppo.row_next_values``) and of the batch. The critic sees
        ``critic_obs`` where the fragment has it (a centralized critic), else the observations.
        """
        assert frag.obs is not None and frag.actions is not None and frag.truncation_index is not None
        n, width = frag.length.shape[0], frag.width
        valid = frag.within_length
        centralized = frag.critic_obs is not None
        critic_in = self._critic_inputs(frag.critic_obs) if centralized else frag.obs
        values = np.zeros((n, width), np.float32)
        values[valid] = self._values(critic_in[valid])
        next_values = ppo.row_next_values(
            values,
            frag.length,
            self._values(self._critic_inputs(frag.bootstrap_critic_obs) if centralized else frag.bootstrap_obs),
            frag.truncation_index,
            self._values(self._critic_inputs(frag.truncation_critic_obs) if centralized else frag.truncation_obs),
        )
        p = self.cfg.ppo
        # the env's reward, reweighted by env.reward_weights (components beside it in the record)
        rewards = shaped_reward(frag.rewards["env"], frag.rewards, self.cfg.env.reward_weights)
        if p.normalize_reward:
            rewards = scale_rewards(rewards, self.return_stats, p.reward_clip)
        adv, ret = ppo.gae(
            time_major(rewards),
            time_major(values),
            time_major(next_values),
            time_major(frag.terminated | ~valid),  # padding: no bootstrap into it, zero advantage
            time_major(frag.truncated),
            p.gamma,
            p.gae_lambda,
        )
        steps = time_major(valid)
        flat = {
            "obs": time_major(frag.obs)[steps],
            "actions": time_major(frag.actions)[steps],
            "logp": time_major(frag.logprobs)[steps],
            "values": time_major(values)[steps],
            "advantages": adv[steps],
            "returns": ret[steps],
        }
        if frag.action_mask is not None:
            flat["mask"] = time_major(frag.action_mask)[steps]
        if centralized:
            flat["critic_obs"] = time_major(critic_in)[steps]
        return flat

    def _critic_inputs(self, critic_obs: np.ndarray | None) -> np.ndarray | None:
        """A centralized critic's inputs as it sees them: normalized with this update's statistics when
        normalizing observations, else as they came."""
        if critic_obs is None or self.critic_normalizer is None:
            return critic_obs
        return self.critic_normalizer(critic_obs)

    def _merge_stats(self, fragments: list[Trajectories]) -> None:
        for frag in fragments:
            self.obs_stats = self.obs_stats.merge(RunningStats.from_dict(frag.extras["obs_stats"]))
            self.return_stats = self.return_stats.merge(RunningStats.from_dict(frag.extras["return_stats"]))
            if self.critic_stats is not None and frag.critic_obs is not None:
                self.critic_stats = self.critic_stats.merge(RunningStats.of(frag.critic_obs[frag.within_length]))
        if self.critic_stats is not None and self.cfg.ppo.normalize_obs:
            self.critic_normalizer = Normalizer(self.critic_stats, self.cfg.ppo.obs_clip)

    def update(self, fragments: list[Trajectories]) -> dict[str, Any]:
        """One PPO update on a train batch; returns loss statistics. Bumps the policy version.

        The last guard against NaN: an update whose batch, merged statistics, loss or gradient norm is not finite
        is not applied. The weights, optimizer state and normalizer statistics go back to what they were before
        it (``_saved``), its losses are NaN, ``update_skipped`` is 1 and ``skip_reason`` says what was not finite
        (the driver counts it and stops the run after a few in a row). The version still counts up.
        """
        start = time.perf_counter()
        p = self.cfg.ppo
        lr = ppo.linear_lr(p.lr, self.updates_done, self.total_updates) if p.anneal_lr else p.lr
        saved = self._saved()
        try:
            out: dict[str, Any] = {**self._update(fragments, lr), "update_skipped": 0.0}
        except NonFiniteUpdate as exc:
            self._restore(saved)
            out = {**dict.fromkeys(LOSS_STATS, math.nan), "lr": lr, "epochs_run": 0.0}
            out.update(explained_variance=math.nan, update_skipped=1.0, skip_reason=str(exc))
        self.updates_done += 1
        self.version += 1
        out["learn_time_s"] = time.perf_counter() - start
        return out

    def _update(self, fragments: list[Trajectories], lr: float) -> dict[str, float]:
        """``update``'s work; raises NonFiniteUpdate (before the optimizer steps on it) at what is not finite."""
        p = self.cfg.ppo
        self._merge_stats(fragments)
        check_finite_statistics(
            {"observation": self.obs_stats, "return": self.return_stats, "critic input": self.critic_stats}
        )
        parts = [self._advantages(f) for f in fragments]
        flat = {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}
        check_finite_batch(flat)
        explained = ppo.explained_variance(flat["values"], flat["returns"])
        if p.normalize_values:  # the critic learns targets normalized with statistics that include this batch
            self.value_stats = self.value_stats.merge(RunningStats.of(flat["returns"].reshape(-1, 1)))
            mean, var = float(self.value_stats.mean[0]), float(self.value_stats.var[0])
            flat["values"] = ppo.normalize_values(flat["values"], mean, var)
            flat["returns"] = ppo.normalize_values(flat["returns"], mean, var)
        batch = {k: torch.as_tensor(v, device=self.device) for k, v in flat.items()}
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        n = len(batch["obs"])
        stats: dict[str, list[float]] = {k: [] for k in LOSS_STATS}
        epochs_run = 0
        for epoch in range(p.num_epochs):
            order = torch.as_tensor(self.rng.permutation(n), device=self.device)
            for minibatch, lo in enumerate(range(0, n, p.minibatch_size)):
                idx = order[lo : lo + p.minibatch_size]
                logp, entropy, values = self.model.evaluate(
                    batch["obs"][idx],
                    batch["actions"][idx],
                    batch["mask"][idx] if "mask" in batch else None,
                    batch["critic_obs"][idx] if "critic_obs" in batch else None,
                )
                adv = batch["advantages"][idx]
                if p.normalize_advantages:
                    adv = ppo.normalize_advantages(adv)
                pg_loss, info = ppo.clipped_surrogate_loss(logp, batch["logp"][idx], adv, p.clip_coef)
                v_loss = ppo.value_loss(
                    values,
                    batch["values"][idx],
                    batch["returns"][idx],
                    p.clip_coef if p.clip_value_loss else None,
                )
                ent = entropy.mean()
                loss = pg_loss - p.ent_coef * ent + p.vf_coef * v_loss
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), p.max_grad_norm)
                terms = torch.stack([pg_loss.detach(), v_loss.detach(), ent.detach(), loss.detach(), grad_norm])
                pg, vl, en, total, norm = terms.tolist()  # one device sync for the check and the statistics
                if not (math.isfinite(total) and math.isfinite(norm)):
                    raise NonFiniteUpdate(step_problem(pg, vl, en, total, norm, epoch, minibatch))
                self.optimizer.step()
                for key, val in zip(LOSS_STATS, (pg, vl, en, info.approx_kl, info.clip_fraction), strict=True):
                    stats[key].append(val)
            epochs_run += 1
            if (
                p.target_kl is not None
                and np.mean(stats["approx_kl"][-math.ceil(n / p.minibatch_size) :]) > p.target_kl
            ):
                break
        out = {k: float(np.mean(v)) for k, v in stats.items()}
        out.update(lr=lr, epochs_run=float(epochs_run), explained_variance=explained)
        return out

    def _saved(self) -> dict[str, Any]:
        """What an update changes, as it is now (``_restore`` puts it back when the update is skipped): the
        statistics (replaced, never changed in place, so kept by reference), weights and optimizer state (copied:
        a few hundred kB for PPO's MLPs)."""
        return {
            "stats": (self.obs_stats, self.return_stats, self.value_stats, self.critic_stats, self.critic_normalizer),
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
        }

    def _restore(self, saved: dict[str, Any]) -> None:
        self.obs_stats, self.return_stats, self.value_stats, self.critic_stats, self.critic_normalizer = saved["stats"]
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.optimizer.zero_grad(set_to_none=True)

    # -- checkpoints ------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything needed to resume: weights, optimizer, normalizer statistics, RNG states, counters."""
        return {
            "model": {k: v.cpu() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "obs_stats": self.obs_stats.to_dict(),
            "return_stats": self.return_stats.to_dict(),
            "value_stats": self.value_stats.to_dict(),
            "critic_stats": None if self.critic_stats is None else self.critic_stats.to_dict(),
            "version": self.version,
            "updates_done": self.updates_done,
            "rng": {
                "numpy": self.rng.bit_generator.state,
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
            },
        }

    def init_from(self, state: dict[str, Any]) -> int:
        """Start from another run's weights and normalizer statistics (``rlfabric.ppo_init.read_init_state``),
        keeping this run's optimizer, counters and random streams; a ValueError naming ``model.init_from`` and the
        first tensor whose shape differs (the env's observation or action size is not the checkpoint's)."""
        own = self.model.state_dict()
        for name, value in state["model"].items():
            if name not in own or own[name].shape != value.shape:
                has = "no such tensor" if name not in own else f"shape {tuple(own[name].shape)}"
                raise ValueError(
                    f"model.init_from = {state['source']!r}: its {name} has shape {tuple(value.shape)}, this run's "
                    f"{has}: the env's observation or action space is not the one the checkpoint was trained on"
                )
        self.model.load_state_dict(state["model"])
        for key in ("obs_stats", "return_stats", "value_stats"):
            if key in state:
                setattr(self, key, RunningStats.from_dict(state[key]))
        return self.version

    def load_state(self, state: dict[str, Any]) -> int:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.obs_stats = RunningStats.from_dict(state["obs_stats"])
        self.return_stats = RunningStats.from_dict(state["return_stats"])
        if "value_stats" in state:  # checkpoints from before value normalization have none
            self.value_stats = RunningStats.from_dict(state["value_stats"])
        if state.get("critic_stats") is not None:  # a centralized critic's, from a run that kept them
            self.critic_stats = RunningStats.from_dict(state["critic_stats"])
        self.version = int(state["version"])
        self.updates_done = int(state["updates_done"])
        self.rng.bit_generator.state = state["rng"]["numpy"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        return self.version


@ray.remote
class Learner(LearnerCore):
    """The Ray actor: takes fragment refs, publishes weights as one object per version."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        retain_freed_memory()
        super().__init__(*args, **kwargs)

    def publish(self) -> tuple[ray.ObjectRef, int]:
        """Put this version's weights into the object store once; (ref, version) for the driver to hand out.

        The ref sits inside a tuple, so the caller receives the ref itself rather than the weights."""
        return ray.put(self.weights()), self.version

    def update_from_refs(self, fragment_refs: list[ray.ObjectRef]) -> dict[str, Any]:
        fetch_start = time.perf_counter()
        fragments = ray.get(fragment_refs)
        fetch_time = time.perf_counter() - fetch_start
        out = self.update(fragments)
        out["fetch_time_s"] = fetch_time
        return out

    def get_version(self) -> int:
        return self.version
