"""What a GRPO run asks of the machine: CPUs for Ray, torch threads per actor, OpenMP's wait policy, deadlines."""

from __future__ import annotations

import os

from rlfabric.grpo_config import LLMConfig

SETUP_TIMEOUT_S = 300.0  # for actors to start and answer, and for the questions asked of them at setup
# OpenMP threads spin this many times waiting for more work before they sleep (libgomp's GOMP_SPINCOUNT):
# long enough to bridge the gaps between one actor's kernels, short enough (well under a millisecond) not to
# steal the cores from the actor whose turn comes next. Generators and learners take turns on the same cores.
# Sleeping at once (OMP_WAIT_POLICY=PASSIVE) makes every small kernel pay a thread wake-up: 1.3x slower steps.
OPENMP_SPIN_COUNT = "100000"


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


def torch_threads(cfg: LLMConfig, role: str) -> int:
    """Torch threads for one actor of ``role``: this node's cores shared by the actors computing at once."""
    return max(1, (os.cpu_count() or 1) // concurrent_actors(cfg, role))


def openmp_env() -> dict[str, str]:
    """OpenMP settings for the actors: the user's own when set, else a bounded spin-wait."""
    mine = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    return mine or {"GOMP_SPINCOUNT": OPENMP_SPIN_COUNT}
