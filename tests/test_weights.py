"""Published weights as one flat buffer: exact round trips, zero-copy reads, the object store in between, and the
node-local shared-memory file that replaces the store when learner and readers share a node."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from rlfabric.models import shared_weights
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


# -- node-local shared memory --------------------------------------------------------------------------------


needs_shm = pytest.mark.skipif(not shared_weights.SHM_DIR.is_dir(), reason="no /dev/shm on this machine")


@pytest.fixture
def writer():
    made, why = shared_weights.SharedWeightsWriter.create(mixed_state_dict(), node_id="this-node")
    assert made is not None, why
    yield made
    made.close()


@needs_shm
def test_shared_weights_round_trip_exactly_and_read_only(writer):
    state = mixed_state_dict()
    handle = writer.publish(state, version=3)
    assert handle.version == 3 and handle.node_id == "this-node"
    assert pickle.loads(pickle.dumps(handle)) == handle  # travels by value: small, no buffer inside
    unpacked = as_state_dict(handle)
    assert_same(unpacked, state)
    assert not shared_weights._mapped(handle.path).flags.writeable  # readers map the file read-only
    handle.check_intact()


@needs_shm
def test_a_version_overwritten_while_read_is_an_error_not_a_mix(writer):
    state = mixed_state_dict()
    old = writer.publish(state, version=1)
    state["embed.weight"].add_(1.0)
    new = writer.publish(state, version=2)
    with pytest.raises(RuntimeError, match="hold version 2, not version 1"):
        old.check_intact()
    with pytest.raises(RuntimeError, match="not version 1"):
        old.state_dict()
    assert_same(new.state_dict(), state)


@needs_shm
def test_adopted_parameters_live_in_the_file_and_publish_as_they_stand(writer):
    state = mixed_state_dict()
    # the learner's parameters: one name of the tied pair (the other stays a copy), the bf16 one, the scalar
    params = {k: torch.nn.Parameter(state[k].clone()) for k in ("embed.weight", "half", "scalar")}
    assert writer.adopt(params) == 3
    assert all(torch.equal(params[k].detach(), state[k]) for k in params)  # values kept
    entry = next(e for e in writer.entries if e.name == "embed.weight")
    writer.updating()
    with torch.no_grad():
        params["embed.weight"].add_(1.0)  # an optimizer step, in place
    raw = np.fromfile(writer.path, dtype=np.uint8)
    start = shared_weights.HEADER_BYTES + entry.offset
    in_file = torch.from_numpy(raw[start : start + entry.nbytes].copy()).view(torch.float32).view(6, 4)
    assert torch.equal(in_file, params["embed.weight"].detach())  # the step wrote the file itself
    published = {**state, **{k: p.detach() for k, p in params.items()}}
    published["lm_head.weight"] = published["embed.weight"]  # tied: its copy is written at publication
    assert_same(as_state_dict(writer.publish(published, version=2)), published)


@needs_shm
def test_shared_writer_refuses_another_layout(writer):
    state = mixed_state_dict()
    state["extra"] = torch.zeros(2)
    with pytest.raises(ValueError, match="layout changed"):
        writer.publish(state, version=1)


@needs_shm
def test_shared_weights_need_room_in_dev_shm_beyond_what_is_reserved():
    # Reserving more than any /dev/shm has free (as Ray's object store capacity would be) leaves no room.
    made, why = shared_weights.SharedWeightsWriter.create(mixed_state_dict(), node_id="n", reserved_bytes=2**60)
    assert made is None
    assert "MiB free" in why and "/dev/shm" in why and "object store" in why


@needs_shm
def test_closed_or_orphaned_files_are_removed_and_a_reader_says_so():
    made, _ = shared_weights.SharedWeightsWriter.create({"w": torch.ones(3)}, node_id="n")
    handle = made.publish({"w": torch.ones(3)}, version=1)
    made.close()
    assert not Path(handle.path).exists()
    with pytest.raises(RuntimeError, match="are gone"):
        handle.state_dict()  # never mapped by this process before the file went
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid now names no process
    orphan = shared_weights.SHM_DIR / f"{shared_weights.FILE_PREFIX}{dead.pid}-deadbeef"
    mine = shared_weights.SHM_DIR / f"{shared_weights.FILE_PREFIX}{os.getpid()}-cafef00d"
    orphan.write_bytes(b"x")
    mine.write_bytes(b"x")
    try:
        shared_weights.remove_orphans()
        assert not orphan.exists() and mine.exists()
    finally:
        orphan.unlink(missing_ok=True)
        mine.unlink(missing_ok=True)
