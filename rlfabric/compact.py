"""What the driver receives every step, kept small and measured: named numbers as one float32 buffer, with the
names known to both sides from code, and ``payload_bytes``, the size of what was received.

Every step the driver reads a rollout's counts, timings and per-group statistics and each learner's metrics. As
pickled dicts their key strings were most of the bytes it received (about 900 B a step for 16-48 kB of
trajectories); as buffers of float32 values in an order both sides import from one ``FloatFields``, a few hundred.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any

import numpy as np
import ray


class FloatFields:
    """A fixed, ordered set of named numbers: ``pack`` to bytes (a presence bit per field, then the float32
    values), ``unpack`` back to a dict of the fields that were sent, NaN values included. float32: counts are
    exact below 2**24; everything else is a measurement."""

    def __init__(self, *names: str) -> None:
        if len(set(names)) != len(names):
            raise ValueError(f"FloatFields: repeated names in {names}")
        self.names = names
        self._index = {name: i for i, name in enumerate(names)}

    def pack(self, values: Mapping[str, float]) -> bytes:
        unknown = [name for name in values if name not in self._index]
        if unknown:
            raise ValueError(f"FloatFields.pack: {unknown} are not among the fields {list(self.names)}")
        out = np.zeros(len(self.names), np.float32)
        present = np.zeros(len(self.names), bool)
        for name, value in values.items():
            out[self._index[name]] = value
            present[self._index[name]] = True
        return np.packbits(present).tobytes() + out.tobytes()

    def unpack(self, data: bytes) -> dict[str, float]:
        flags = -(-len(self.names) // 8)  # one presence bit per field, so a NaN value (a diverged loss) stays
        present = np.unpackbits(np.frombuffer(data[:flags], np.uint8))[: len(self.names)].astype(bool)
        values = np.frombuffer(data[flags:], np.float32)
        if len(values) != len(self.names):
            raise ValueError(f"FloatFields.unpack: {len(values)} values for {len(self.names)} fields")
        return {name: float(v) for name, v, here in zip(self.names, values, present, strict=True) if here}


class _RefAsId(pickle.Pickler):
    """Pickles an ObjectRef as its id: what a handle costs on the wire, without registering a borrower."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, ray.ObjectRef):
            return bytes, (obj.binary(),)
        return NotImplemented


def payload_bytes(value: Any) -> int:
    """The pickled size of a value the driver received (ObjectRefs count as their ids)."""
    buffer = io.BytesIO()
    _RefAsId(buffer, protocol=5).dump(value)
    return buffer.tell()
