"""CUDA check of the PPO learner on game fragments, without Ray or PettingZoo (a bare CUDA torch image):

1. one PPO update on the same multi-agent fragment (rows of different lengths, action masks, a centralized critic,
   value normalization) on CUDA and on the CPU, from the same weights and seed: the losses agree;
2. masked actions keep probability 0 on CUDA;
3. update time on CUDA and on the CPU at a larger batch (16,384 agent steps, 4 epochs, 256 x 256 MLP).

    python scripts/gpu_game_learner_check.py      # exit 0 when 1 and 2 hold

On an image without Ray, Gymnasium or PyYAML's friends, put stand-ins on PYTHONPATH first (nothing here uses them):
a ``gymnasium`` package holding ``class Env``, ``registry = {}`` and a ``spaces`` module with ``Box``, ``Discrete``
and ``Space`` classes, and a ``ray`` package with ``remote`` (returning its class), ``ObjectRef`` and
``method`` (returning an identity decorator): ``bash scripts/gpu_check_stubs.sh DIR`` writes them.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlfabric.actors.learner import LearnerCore  # noqa: E402
from rlfabric.config import ppo_config_from_dict  # noqa: E402
from rlfabric.models import ActionSpec  # noqa: E402
from rlfabric.normalization import RunningStats  # noqa: E402
from rlfabric.trajectory import NO_GROUP, Trajectories  # noqa: E402

OBS, ACTIONS, CRITIC = 18, 9, 24


def fragment(rows: int, width: int, seed: int) -> Trajectories:
    """A game-shaped fragment: random lengths, masks with a few legal moves, actions among them, critic inputs."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, width + 1, rows).astype(np.int32)
    valid = np.arange(width)[None, :] < lengths[:, None]
    masks = rng.random((rows, width, ACTIONS)) < 0.5
    masks[..., 0] = True
    actions = np.array([[rng.choice(np.flatnonzero(m)) for m in row] for row in masks], np.int64)
    terminated = np.zeros((rows, width), bool)
    terminated[np.arange(rows), lengths - 1] = rng.random(rows) < 0.5
    obs = rng.standard_normal((rows, width, OBS)).astype(np.float32)
    return Trajectories(
        episode_id=np.arange(rows, dtype=np.int64),
        group_id=np.full(rows, NO_GROUP, np.int64),
        agent_id=np.array([f"player_{i % 2}" for i in range(rows)], dtype=object),
        policy_id=np.full(rows, "main", dtype=object),
        length=lengths,
        loss_mask=valid.astype(np.float32),
        policy_version=np.where(valid, 0, -1).astype(np.int32),
        logprobs=np.where(valid, -1.0, 0.0).astype(np.float32),
        terminated=terminated,
        truncated=np.zeros((rows, width), bool),
        obs=obs,
        actions=actions,
        bootstrap_obs=rng.standard_normal((rows, OBS)).astype(np.float32),
        truncation_index=np.zeros((0, 2), np.int64),
        truncation_obs=np.zeros((0, OBS), np.float32),
        action_mask=masks,
        critic_obs=rng.standard_normal((rows, width, CRITIC)).astype(np.float32),
        bootstrap_critic_obs=rng.standard_normal((rows, CRITIC)).astype(np.float32),
        truncation_critic_obs=np.zeros((0, CRITIC), np.float32),
        rewards={"env": (rng.standard_normal((rows, width)) * valid).astype(np.float32)},
        extras={"obs_stats": RunningStats.of(obs[valid]).to_dict(), "return_stats": RunningStats.empty((1,)).to_dict()},
    )


def learner(device: str, hidden: list[int], batch: int, epochs: int) -> LearnerCore:
    cfg = ppo_config_from_dict(
        {
            "model": {"hidden_sizes": hidden},
            "learner": {"device": device, "num_gpus": 1 if device == "cuda" else 0},
            "ppo": {"train_batch_size": batch, "minibatch_size": batch // 4, "num_epochs": epochs,
                    "normalize_values": True, "anneal_lr": False},
            "runners": {"num_runners": 1, "envs_per_runner": 1},
        }
    )  # fmt: skip
    return LearnerCore(cfg.to_dict(), OBS, ActionSpec("discrete", ACTIONS), critic_dim=CRITIC)


def check_same_update() -> bool:
    frag = fragment(64, 9, seed=0)
    cpu = learner("cpu", [64, 64], 512, 2)
    gpu = learner("cuda", [64, 64], 512, 2)
    gpu.model.load_state_dict(copy.deepcopy(cpu.model.state_dict()))
    gpu.optimizer.load_state_dict(cpu.optimizer.state_dict())
    gpu.rng = np.random.default_rng(0)
    cpu.rng = np.random.default_rng(0)
    a, b = cpu.update([frag]), gpu.update([frag])
    keys = ("policy_loss", "value_loss", "entropy", "approx_kl")
    ok = all(abs(a[k] - b[k]) <= 1e-4 + 1e-3 * abs(a[k]) for k in keys)
    print("1. one update, CPU vs CUDA:", {k: (round(a[k], 6), round(b[k], 6)) for k in keys}, "agree:", ok)
    return ok


def check_masked_probability() -> bool:
    gpu = learner("cuda", [64, 64], 512, 1)
    obs = torch.randn(256, OBS, device="cuda")
    mask = torch.rand(256, ACTIONS, device="cuda") < 0.5
    mask[:, 0] = True
    with torch.no_grad():
        logits = gpu.model.actor(obs)
        from rlfabric.models.mlp import masked_logits

        probs = torch.softmax(masked_logits(logits, mask), dim=-1)
    ok = bool((probs[~mask] == 0).all()) and bool(torch.allclose(probs.sum(-1), torch.ones(256, device="cuda")))
    print(f"2. masked actions have probability 0 on CUDA: {ok}")
    return ok


def time_updates() -> None:
    frag = fragment(2048, 8, seed=1)  # about 9,200 agent steps
    steps = int(frag.length.sum())
    for device in ("cpu", "cuda"):
        core = learner(device, [256, 256], 16_384, 4)
        core.update([frag])  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            core.update([frag])
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / 3
        print(f"3. {device}: one update (4 epochs, 4 minibatches) of {steps} agent steps: {seconds * 1000:.0f} ms")


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    print("torch", torch.__version__, "|", torch.cuda.get_device_name())
    ok = check_same_update() and check_masked_probability()
    time_updates()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
