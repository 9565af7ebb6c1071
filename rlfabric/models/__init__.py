from rlfabric.models.mlp import ActionSpec, ActorCritic, NumpyPolicy

__all__ = ["ActionSpec", "ActorCritic", "NumpyPolicy"]
