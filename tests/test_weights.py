"""Published weights as one flat buffer: exact round trips, zero-copy reads, and the object store in between."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch

from rlfabric.models.weights import ALIGNMENT, FlatWeights, as_state_dict, flatten_state_dict


def mixed_state_dict() -> dict[str, torch.Tensor]:
    shared = torch.randn(6, 4)
    return {
        "embed.weight": shared,
        "lm_head.weight": shared,  # tied weights: two names, one storage
        "transposed": torch.randn(3, 5).t(),  # not contiguous
        "half": torch.randn(7, dtype=torch.bfloat16),  # 14 bytes: the next tensor must still start aligned
        "index": torch.arange(5),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }


def assert_same(unpacked: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    assert list(unpacked) == list(state)
    for name, tensor in state.items():
        assert unpacked[name].dtype == tensor.dtype, name
        assert unpacked[name].shape == tensor.shape, name
        assert torch.equal(unpacked[name], tensor), name


def test_flatten_and_unpack_give_back_every_tensor_exactly():
    state = mixed_state_dict()
    flat = flatten_state_dict(state)
    assert flat.buffer.dtype == np.uint8 and flat.buffer.ndim == 1
    assert all(entry.offset % ALIGNMENT == 0 for entry in flat.entries)
    assert_same(flat.state_dict(), state)


def test_unpacked_tensors_view_the_buffer_without_copying():
    flat = flatten_state_dict({"w": torch.randn(4, 4), "b": torch.randn(4)})
    unpacked = flat.state_dict()
    start = flat.buffer.ctypes.data
    for entry in flat.entries:
        assert unpacked[entry.name].data_ptr() == start + entry.offset
    flat.buffer[flat.entries[0].offset : flat.entries[0].offset + 4] = 0  # a write to the buffer shows through
    assert unpacked["w"].view(-1)[0] == 0


def test_flattening_copies_so_later_updates_do_not_leak_into_a_published_version():
    weight = torch.zeros(3)
    flat = flatten_state_dict({"w": weight})
    weight += 1.0  # the learner's next optimizer step
    assert torch.equal(flat.state_dict()["w"], torch.zeros(3))


def test_as_state_dict_takes_flat_weights_or_a_plain_state_dict_and_names_anything_else():
    state = {"w": torch.randn(2, 2)}
    assert_same(as_state_dict(flatten_state_dict(state)), state)
    assert as_state_dict(state)["w"] is state["w"]
    with pytest.raises(TypeError, match="FlatWeights or a state dict.*list"):
        as_state_dict([state["w"]])


def test_flat_weights_cross_the_object_store_as_one_read_only_buffer(local_ray):
    state = mixed_state_dict()
    ref = ray.put(flatten_state_dict(state))
    back = ray.get(ref)
    assert isinstance(back, FlatWeights)
    assert not back.buffer.flags.writeable  # read in place from the store, not copied out of it
    assert_same(as_state_dict(back), state)
    model = torch.nn.Linear(4, 6)  # load_state_dict copies out of the read-only views
    weights = {"weight": torch.randn(6, 4), "bias": torch.randn(6)}
    model.load_state_dict(as_state_dict(ray.get(ray.put(flatten_state_dict(weights)))))
    assert torch.equal(model.weight.detach(), weights["weight"]) and torch.equal(model.bias.detach(), weights["bias"])
