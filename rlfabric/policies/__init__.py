"""Policies behind one interface (``Policy.act``): see rlfabric/policies/base.py.

``ServedLLMPolicy`` (generator actors) lives in ``rlfabric.policies.served``, a layer up: it calls Ray actors.
"""

from rlfabric.policies.base import LocalPolicy, Policy, PolicyOutput, ScriptedPolicy
from rlfabric.policies.batching import ActBatcher
from rlfabric.policies.neural import NeuralNetPolicy

__all__ = ["ActBatcher", "LocalPolicy", "NeuralNetPolicy", "Policy", "PolicyOutput", "ScriptedPolicy"]
