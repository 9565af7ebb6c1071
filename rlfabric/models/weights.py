"""Model weights as one flat byte buffer: the form in which a learner publishes a version through the object store.

Ray serialises a dict of torch tensors tensor by tensor through pickle: about 34 ms to put the 17 MB, 51-tensor
state dict of the benchmark model on a 2-core CPU, and 6 ms to get it back. One numpy array goes out of band
instead: a single copy into the store (about 3.5 ms, after the 3 ms it takes to pack) and a zero-copy read on the
other side. So the learner packs its state dict into one buffer, every generator reads that same buffer, and
``FlatWeights.state_dict()`` gives the tensors back as read-only views of it (the engines copy them in place).
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

ALIGNMENT = 64  # bytes: every tensor starts on a cache line, so any dtype can view its slice of the buffer


class WeightEntry(NamedTuple):
    name: str
    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]
    offset: int  # bytes into the buffer
    nbytes: int


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_from_bytes(data: np.ndarray | bytes, dtype: str, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    """A CPU tensor reading ``data`` in place (no copy). Read-only when ``data`` is: nothing may write to it."""
    torch_dtype = getattr(torch, dtype)
    if len(data) == 0:
        return torch.empty(tuple(shape), dtype=torch_dtype)
    with warnings.catch_warnings():  # torch warns that read-only memory could be written through the tensor
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(data, dtype=torch.uint8)
    return raw.view(torch_dtype).view(tuple(shape))


class PublishedWeights(abc.ABC):
    """A published version of a state dict packed into one flat buffer; ``state_dict()`` gives its tensors.

    ``FlatWeights`` (below) holds the buffer itself, for the object store; ``SharedFlatWeights``
    (``rlfabric.models.shared_weights``, which builds on this module) names a shared-memory file holding it.
    """

    @abc.abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Name -> CPU tensor viewing the buffer (read-only: copy it, do not write to it)."""


@dataclass(frozen=True)
class FlatWeights(PublishedWeights):
    """A state dict packed into one uint8 buffer; ``entries`` say where each tensor lies in it."""

    buffer: np.ndarray
    entries: tuple[WeightEntry, ...]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Name -> CPU tensor viewing the buffer (read-only when the buffer came from the object store)."""
        return {
            e.name: tensor_from_bytes(self.buffer[e.offset : e.offset + e.nbytes], e.dtype, e.shape)
            for e in self.entries
        }


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def layout(state: Mapping[str, torch.Tensor]) -> tuple[tuple[WeightEntry, ...], int]:
    """Where each tensor of ``state`` goes in a flat buffer (cache-line aligned), and the buffer's size."""
    entries, offset = [], 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(WeightEntry(name, dtype_name(tensor.dtype), tuple(tensor.shape), offset, nbytes))
        offset += _aligned(nbytes)
    return tuple(entries), offset


def pack_into(buffer: torch.Tensor, entries: tuple[WeightEntry, ...], state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state``'s tensors into ``buffer`` (uint8, CPU) where ``entries`` (its ``layout``) puts them; a tensor
    that already lives there (``SharedWeightsWriter.adopt``) is left as it is."""
    for entry, tensor in zip(entries, state.values(), strict=True):
        if entry.nbytes:
            target = buffer[entry.offset : entry.offset + entry.nbytes].view(tensor.dtype).view(entry.shape)
            if target.data_ptr() != tensor.data_ptr():
                target.copy_(tensor.detach())


def flatten_state_dict(state: Mapping[str, torch.Tensor]) -> FlatWeights:
    """Pack ``state`` (tensors on any device, any dtypes) into one CPU buffer: one copy per tensor, no pickling."""
    entries, nbytes = layout(state)
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    pack_into(buffer, entries, state)
    return FlatWeights(buffer.numpy(), entries)


def as_state_dict(weights: Any) -> dict[str, torch.Tensor]:
    """The tensors of published weights: any ``PublishedWeights`` (``FlatWeights``, ``SharedFlatWeights``) unpacked
    (views), or a plain state dict as it is."""
    if isinstance(weights, PublishedWeights):
        return weights.state_dict()
    if isinstance(weights, Mapping):
        return dict(weights)
    kind = type(weights).__name__
    raise TypeError(
        f"published weights must be FlatWeights, SharedFlatWeights or a state dict (name -> tensor), not {kind}"
    )
