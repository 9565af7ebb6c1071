"""Environments shipped with rlfabric. Installed as ``rlfabric.envs``."""
