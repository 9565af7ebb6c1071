"""Models: the MLP actor-critic (torch, ``rlfabric.models.mlp``), its numpy actor for runners
(``rlfabric.models.numpy_policy``), and the Hugging Face language models (``rlfabric.models.hf``)."""

from typing import Any

from rlfabric.models.numpy_policy import ActionSpec, NumpyPolicy

__all__ = ["ActionSpec", "ActorCritic", "NumpyPolicy"]


def __getattr__(name: str) -> Any:
    # ActorCritic needs torch: imported on first use, so processes that only act (env runners) never load torch.
    if name == "ActorCritic":
        from rlfabric.models.mlp import ActorCritic

        return ActorCritic
    raise AttributeError(f"module 'rlfabric.models' has no attribute {name!r}")
