"""Reward functions: the group contract, the registry, math answer checking and the built-in rewards.

Importing this package registers the built-ins (``math``, ``arithmetic``, ``countdown``, ``length``,
``reward_model``, and the process rewards of ``rlfabric.rewards.process``: ``process_reward_model``,
``arithmetic_steps``).
"""

from rlfabric.rewards import (
    builtin,  # noqa: F401 - registers the built-in rewards
    process,  # noqa: F401 - registers the built-in process rewards
    verl_compat,  # noqa: F401 - resolve_reward takes verl's compute_score functions as they are
)
from rlfabric.rewards.math_verify import answers_match, extract_answer, normalize_answer
from rlfabric.rewards.registry import (
    RewardFn,
    RewardInput,
    RewardNotFoundError,
    RewardResult,
    RewardSpec,
    Unscored,
    check_names_given,
    components_of,
    declared_components,
    declared_weights,
    default_weights,
    describe_reward,
    gives,
    is_pointwise,
    is_process_reward,
    list_rewards,
    load_snapshot,
    pointwise,
    process_reward,
    register_reward,
    resolve_reward,
    resolve_rewards,
    snapshot,
    weights_with_defaults,
)

__all__ = [
    "RewardFn",
    "RewardInput",
    "RewardNotFoundError",
    "RewardResult",
    "RewardSpec",
    "Unscored",
    "answers_match",
    "check_names_given",
    "components_of",
    "declared_components",
    "declared_weights",
    "default_weights",
    "describe_reward",
    "extract_answer",
    "gives",
    "list_rewards",
    "is_pointwise",
    "is_process_reward",
    "load_snapshot",
    "normalize_answer",
    "pointwise",
    "process_reward",
    "register_reward",
    "resolve_reward",
    "resolve_rewards",
    "snapshot",
    "weights_with_defaults",
]
