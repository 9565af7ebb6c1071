"""Reward functions: the group contract, the registry, math answer checking and the built-in rewards.

Importing this package registers the built-ins (``math``, ``arithmetic``, ``countdown``, ``length``).
"""

from rlfabric.rewards import builtin  # noqa: F401 - registers the built-in rewards
from rlfabric.rewards.math_verify import answers_match, extract_answer, normalize_answer
from rlfabric.rewards.registry import (
    RewardFn,
    RewardInput,
    RewardNotFoundError,
    RewardResult,
    RewardSpec,
    list_rewards,
    load_snapshot,
    register_reward,
    resolve_reward,
    snapshot,
)

__all__ = [
    "RewardFn",
    "RewardInput",
    "RewardNotFoundError",
    "RewardResult",
    "RewardSpec",
    "answers_match",
    "extract_answer",
    "list_rewards",
    "load_snapshot",
    "normalize_answer",
    "register_reward",
    "resolve_reward",
    "snapshot",
]
