"""Ray actors, one role per file. Installed as ``rlfabric.actors``."""
