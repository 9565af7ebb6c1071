"""Algorithms as pure functions over arrays and tensors: no Ray, no I/O."""
