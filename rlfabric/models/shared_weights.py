"""Published weights through node-local shared memory: the fast way when a learner and its readers share a node.

``ray.put`` copies every version into the object store (about 10 ms for the 17 MB benchmark model on two cores),
and handing the ObjectRef on costs ownership round trips. On one node the learner can instead pack its weights
straight into a file in ``/dev/shm`` that every reader maps once and reads in place (one copy, no store). A CPU
learner goes one step further: its parameters live in the file (``SharedWeightsWriter.adopt``), so its optimizer
step writes the next version in place and a publication writes only the stamp (2-4 ms a step less on the
benchmark model).

The file holds one version at a time, stamped with its number. The driver publishes the next version only after
every reader has loaded the last one (``WeightPublisher.finish`` waits for them); a reader checks the stamp before and
after its copy, so a version overwritten mid-read is an error, never a silent mix of two versions. When the node
has no ``/dev/shm`` or too little room in it, ``SharedWeightsWriter.create`` says why and the learner publishes
through the object store instead.
"""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rlfabric.models.weights import PublishedWeights, WeightEntry, dtype_name, layout, pack_into, tensor_from_bytes

SHM_DIR = Path("/dev/shm")
FILE_PREFIX = "rlfabric-weights-"
HEADER_BYTES = 64  # the version stamp (int64), padded so the tensors after it stay cache-line aligned
WRITING = -1  # the stamp while a version is being written
SPARE_BYTES = 256 * 2**20  # left free in /dev/shm for everything else on the node (Ray's store may live there)


@dataclass(frozen=True)
class SharedFlatWeights(PublishedWeights):
    """One published version in a shared-memory file on node ``node_id``: what a reader needs to map it."""

    path: str
    node_id: str
    entries: tuple[WeightEntry, ...]
    version: int

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Name -> read-only CPU tensor viewing the file. Copy them (as the engines do), then ``check_intact``.

        The views of a file's layout are made once per reader (about a millisecond for the benchmark model's 50
        tensors): every version is written in place into the same file."""
        self.check_intact()
        key = (self.path, self.entries)
        if key not in _VIEWS:
            tensors = _mapped(self.path)[HEADER_BYTES:]
            _VIEWS[key] = {
                e.name: tensor_from_bytes(tensors[e.offset : e.offset + e.nbytes], e.dtype, e.shape)
                for e in self.entries
            }
        return dict(_VIEWS[key])

    def check_intact(self) -> None:
        """Raise if the file no longer holds this version (a newer one was published while this was being read)."""
        stamp = int(_mapped(self.path)[:8].view(np.int64)[0])
        if stamp != self.version:
            found = "a version being written" if stamp == WRITING else f"version {stamp}"
            raise RuntimeError(
                f"shared weights {self.path} hold {found}, not version {self.version}: a newer version was "
                "published before every reader had loaded this one"
            )


_MAPPINGS: dict[str, np.ndarray] = {}  # path -> the reader's mapping, made once per process
_VIEWS: dict[tuple[str, tuple[WeightEntry, ...]], dict[str, torch.Tensor]] = {}  # (path, layout) -> its tensors


def _mapped(path: str) -> np.ndarray:
    if path not in _MAPPINGS:
        try:
            with open(path, "rb") as file:
                _MAPPINGS[path] = np.frombuffer(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ), np.uint8)
        except FileNotFoundError:
            raise RuntimeError(
                f"shared weights {path} are gone: the learner that published them has stopped, or this reader "
                "runs on another node (weight_transport 'shared_memory' needs every reader on the learner's node)"
            ) from None
    return _MAPPINGS[path]


class SharedWeightsWriter:
    """The learner's side: one ``/dev/shm`` file sized for its state dict, rewritten in place at every version."""

    def __init__(self, path: Path, entries: tuple[WeightEntry, ...], nbytes: int, node_id: str) -> None:
        self.path, self.entries, self.node_id = path, entries, node_id
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserve the pages now: a full tmpfs then fails here with ENOSPC instead of killing the process
            # with SIGBUS at the first write past its room.
            os.posix_fallocate(fd, 0, HEADER_BYTES + nbytes)
            self._map = mmap.mmap(fd, HEADER_BYTES + nbytes)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self._buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        self._stamp = self._buffer[:8].view(torch.int64)
        self._stamp.fill_(WRITING)

    @classmethod
    def create(
        cls, state: Mapping[str, torch.Tensor], node_id: str, reserved_bytes: int = 0
    ) -> tuple[SharedWeightsWriter | None, str]:
        """A writer for ``state``'s layout, or None and why not (no /dev/shm, too little room in it).

        ``reserved_bytes`` stay free for others that may still fill /dev/shm: Ray's object store lives there on
        Linux and grows into its capacity as it is used, so the learner passes that capacity.
        """
        entries, nbytes = layout(state)
        if not SHM_DIR.is_dir() or not hasattr(os, "posix_fallocate"):
            return None, f"{SHM_DIR} does not exist on this node"
        remove_orphans()
        stats = os.statvfs(SHM_DIR)
        free = stats.f_bavail * stats.f_frsize
        if free < HEADER_BYTES + nbytes + reserved_bytes + SPARE_BYTES:
            return None, (
                f"{SHM_DIR} has {free / 2**20:.0f} MiB free; the weights need {nbytes / 2**20:.0f} MiB, plus "
                f"{(reserved_bytes + SPARE_BYTES) / 2**20:.0f} MiB kept for Ray's object store and spare"
            )
        path = SHM_DIR / f"{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            return cls(path, entries, nbytes, node_id), ""
        except OSError as error:
            return None, f"could not reserve {path}: {error}"

    def adopt(self, parameters: Mapping[str, torch.Tensor]) -> int:
        """Move the named CPU parameters of this file's layout into the file: each one's data becomes a view of its
        slot (its values copied in once, its own storage), so ``publish`` has nothing to copy for it. The owner
        calls ``updating`` before it changes them in place (an optimizer step), and publishes only after every
        reader has loaded the last version, as for a copy. Returns how many moved.

        A name missing from ``parameters`` (a tied weight's second name, a buffer) is copied at every publish as
        before."""
        moved = 0
        for e in self.entries:
            p = parameters.get(e.name)
            if p is None or not e.nbytes or p.device.type != "cpu" or dtype_name(p.dtype) != e.dtype:
                continue
            slot = torch.frombuffer(self._map, dtype=p.dtype, count=p.numel(), offset=HEADER_BYTES + e.offset)
            slot = slot.view(e.shape)
            slot.copy_(p.detach())
            p.data = slot
            moved += 1
        return moved

    def updating(self) -> None:
        """The adopted parameters are about to change: a reader still copying the last version now fails its
        ``check_intact`` instead of reading a mix."""
        self._stamp.fill_(WRITING)

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> SharedFlatWeights:
        """Write ``state`` as ``version`` and return its handle (small: it travels by value)."""
        entries, _ = layout(state)
        if entries != self.entries:
            raise ValueError(f"SharedWeightsWriter.publish: the state dict's layout changed since {self.path} was made")
        self._stamp.fill_(WRITING)
        pack_into(self._buffer[HEADER_BYTES:], entries, state)
        self._stamp.fill_(version)
        return SharedFlatWeights(str(self.path), self.node_id, entries, version)

    def close(self) -> None:
        """Remove the file (readers that mapped it keep their mapping until they exit)."""
        self.path.unlink(missing_ok=True)


def remove_stale(paths: list[str]) -> None:
    """Remove shared-weight files that may be left by learners killed without closing (call on their node)."""
    for path in paths:
        if Path(path).name.startswith(FILE_PREFIX):
            Path(path).unlink(missing_ok=True)


def remove_orphans() -> None:
    """Remove this node's shared-weight files whose writer process is gone (a learner killed before it closed)."""
    for path in SHM_DIR.glob(f"{FILE_PREFIX}*"):
        pid = path.name.removeprefix(FILE_PREFIX).split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
