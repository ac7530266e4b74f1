"""NIXL's transfer descriptors of ptrres's plans (SPEC 14): the two
C-contiguous Nx3 uint64 arrays ``(addr, len, devId)`` that
``get_xfer_descs`` and ``initialize_xfer`` take, one per side, in the plan's
order, each written by one kernel."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import _kernels
from .._args import as_int, as_list, descriptor_array
from .._diagnose import overlap_error
from .._errors import InputTypeError, OutBufferError, SpecError
from .._posix import checked_file_starts
from .._results import FilePlan, PeerTransferPlan, TransferPlan
from ._memory import Memory, MemoryLike, memory_of

# NIXL's transfer operations: READ moves the remote side into the local one,
# WRITE the local side into the remote one.
OPS = ("READ", "WRITE")
# The file side of a FilePlan: each row's devId is its file's descriptor.
_FILES = Memory("FILE", 0)


@dataclass(eq=False)
class XferDescs:
    """The two descriptor lists of one NIXL transfer: row i of ``local`` goes
    with row i of ``remote`` (``initialize_xfer``)."""

    # (n, 3) uint64, C-contiguous: (addr, len, devId) of this process's side,
    # for agent.get_xfer_descs(local, local_mem_type).
    local: npt.NDArray[np.uint64]
    # (n, 3) uint64, C-contiguous: the remote (or loopback) side's rows.
    remote: npt.NDArray[np.uint64]
    # NIXL's memory type of each side: "DRAM", "VRAM" or "FILE".
    local_mem_type: str
    remote_mem_type: str
    # Bytes the transfer moves.
    num_bytes: int

    def __len__(self) -> int:
        return len(self.local)

    def dlists(self, agent: Any) -> tuple[Any, Any]:
        """The two ``nixlXferDList``s (``agent.get_xfer_descs``).

        Raises:
            SpecError: an empty transfer (NIXL takes no empty list).
        """
        if not len(self.local):
            raise SpecError("the transfer has no descriptor: NIXL takes no empty list")
        return (
            agent.get_xfer_descs(self.local, self.local_mem_type),
            agent.get_xfer_descs(self.remote, self.remote_mem_type),
        )

    def initialize_xfer(
        self,
        agent: Any,
        op: str,
        remote_agent: str,
        notif_msg: bytes = b"",
        backends: Iterable[str] = (),
    ) -> Any:
        """``agent.initialize_xfer(op, *self.dlists(agent), remote_agent,
        notif_msg)``: the transfer's handle, to post with
        ``agent.transfer()``."""
        local, remote = self.dlists(agent)
        return agent.initialize_xfer(
            _op(op), local, remote, remote_agent, notif_msg, list(backends)
        )


def xfer_descs(
    plan: TransferPlan,
    op: str,
    *,
    src: MemoryLike,
    dst: MemoryLike,
    out: tuple[Any, Any] | None = None,
) -> XferDescs:
    """NIXL's descriptor lists of a TransferPlan (plain or coalesced), both
    sides in this process (a loopback transfer): the bytes go from ``src``
    to ``dst`` either way, and ``op`` says which side NIXL holds as local:
    WRITE the source, READ the destination.

    Args:
        plan: a TransferPlan (any object with src, dst and sizes).
        op: "READ" or "WRITE".
        src, dst: the memory of each side (a Memory, or the PointerTable,
            OffloadedLayout or PeerLayout the side lies in).
        out: optional (local rows, remote rows) buffers, each (at least n, 3)
            uint64 and C-contiguous; the result's arrays are then views.
    """
    addresses, sizes = _plan_fields(plan, ("src", "dst"))
    src_memory, dst_memory = memory_of(src), memory_of(dst)
    sides = [(addresses[0], src_memory), (addresses[1], dst_memory)]
    if _op(op) == "READ":
        sides.reverse()
    return _descs(sides, sizes, out)


def peer_xfer_descs(
    plan: PeerTransferPlan,
    *,
    local: MemoryLike,
    remote: MemoryLike,
    out: tuple[Any, Any] | None = None,
) -> XferDescs:
    """NIXL's descriptor lists of a PeerTransferPlan (plain or coalesced):
    the local one of ``plan.local``, the remote one of ``plan.remote``. READ
    moves the peer's blocks into this engine's, WRITE this engine's into the
    peer's.

    Args:
        plan: a PeerTransferPlan (any object with local, remote and sizes).
        local: this engine's memory (a Memory, or its PointerTable).
        remote: the peer's (a Memory, or its PeerLayout).
        out: as for xfer_descs().
    """
    addresses, sizes = _plan_fields(plan, ("local", "remote"))
    sides = [(addresses[0], memory_of(local)), (addresses[1], memory_of(remote))]
    return _descs(sides, sizes, out)


def file_xfer_descs(
    plan: FilePlan,
    fds: Sequence[int],
    *,
    memory: MemoryLike,
    out: tuple[Any, Any] | None = None,
) -> XferDescs:
    """NIXL's descriptor lists of a FilePlan: the local side the memory
    ``(dev_ptr, len, devId)``, the remote side FILE rows ``(file_offset, len,
    fd)``, op by op in the plan's order. WRITE stores (memory to files), READ
    loads; the remote agent is the agent itself (POSIX, GDS).

    Args:
        plan: a FilePlan.
        fds: the open descriptor of each of the plan's files, in order.
        memory: the memory the plan's pointers lie in (a Memory, or the
            PointerTable or OffloadedLayout).
        out: as for xfer_descs().
    """
    try:
        raw = (plan.dev_ptrs, plan.file_offsets, plan.sizes, plan.file_starts)
    except AttributeError:
        raise InputTypeError(
            "plan must be a FilePlan (dev_ptrs, file_offsets, sizes, "
            f"file_starts), got {type(plan).__name__}"
        ) from None
    dev_ptrs = descriptor_array(raw[0], "plan.dev_ptrs")
    offsets = descriptor_array(raw[1], "plan.file_offsets")
    sizes = descriptor_array(raw[2], "plan.sizes")
    if not len(dev_ptrs) == len(offsets) == len(sizes):
        raise SpecError(
            f"plan has {len(dev_ptrs)} dev_ptrs, {len(offsets)} file_offsets and "
            f"{len(sizes)} sizes"
        )
    starts = checked_file_starts(raw[3], len(sizes))
    descriptors = [as_int(fd, "fds[{}]", i) for i, fd in enumerate(as_list(fds, "fds"))]
    if min(descriptors, default=0) < 0:
        raise SpecError(f"fds must be open file descriptors, got {descriptors}")
    if len(starts) != len(descriptors) + 1:
        raise SpecError(
            f"the plan has {len(starts) - 1} files but {len(descriptors)} fds "
            "were given"
        )
    fd_of_op = np.repeat(np.array(descriptors, np.uint64), np.diff(starts))
    sides = [(dev_ptrs, memory_of(memory)), (offsets, _FILES)]
    return _descs(sides, sizes, out, remote_devices=fd_of_op)


def _op(op: str) -> str:
    if op not in OPS:
        raise InputTypeError(f"op must be one of {OPS}, got {op!r}")
    return op


def _plan_fields(
    plan: Any, sides: tuple[str, str]
) -> tuple[tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]], npt.NDArray[Any]]:
    """A plan's two address arrays and its sizes, checked to be of one length."""
    try:
        raw = (getattr(plan, sides[0]), getattr(plan, sides[1]), plan.sizes)
    except AttributeError:
        raise InputTypeError(
            f"plan must have the attributes {sides[0]}, {sides[1]} and sizes; "
            f"{type(plan).__name__} has not"
        ) from None
    first = descriptor_array(raw[0], f"plan.{sides[0]}")
    second = descriptor_array(raw[1], f"plan.{sides[1]}")
    sizes = descriptor_array(raw[2], "plan.sizes")
    if not len(first) == len(second) == len(sizes):
        raise SpecError(
            f"plan.{sides[0]}, plan.{sides[1]} and plan.sizes have {len(first)}, "
            f"{len(second)} and {len(sizes)} entries"
        )
    return (first, second), sizes


def _descs(
    sides: list[tuple[npt.NDArray[np.uint64], Memory]],
    sizes: npt.NDArray[np.uint64],
    out: tuple[Any, Any] | None,
    remote_devices: npt.NDArray[np.uint64] | None = None,
) -> XferDescs:
    """The rows of both sides (local first), one kernel each; the remote
    side's devId is its memory's, or ``remote_devices`` of each row."""
    rows = _out_rows(out, len(sizes))
    (_, local_memory), (_, remote_memory) = sides
    devices = (
        np.array([local_memory.dev_id], np.uint64),
        np.array([remote_memory.dev_id], np.uint64)
        if remote_devices is None
        else remote_devices,
    )
    for (addresses, _), side_rows, side_devices in zip(sides, rows, devices):
        status = _kernels.descriptor_rows_kernel(
            addresses, sizes, side_devices, side_rows
        )
        if status < 0:
            raise overlap_error("out's local and remote rows, and the plan")
    return XferDescs(
        rows[0],
        rows[1],
        local_memory.mem_type,
        remote_memory.mem_type,
        int(sizes.sum(dtype=np.uint64)),
    )


def _out_rows(
    out: tuple[Any, Any] | None, n: int
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """Two (n, 3) uint64 outputs: new, or views of the caller's buffers."""
    if out is None:
        return np.empty((n, 3), np.uint64), np.empty((n, 3), np.uint64)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise InputTypeError("out must be a pair of (local rows, remote rows) buffers")
    views = []
    for buffer, name in zip(out, ("out[0] (local rows)", "out[1] (remote rows)")):
        if (
            not isinstance(buffer, np.ndarray)
            or buffer.ndim != 2
            or buffer.shape[1] != 3
            or buffer.dtype.kind not in "iu"
            or buffer.dtype.itemsize != 8
        ):
            raise InputTypeError(
                f"{name} must be an (n, 3) int64 or uint64 numpy array, got "
                f"{getattr(buffer, 'dtype', type(buffer).__name__)} of shape "
                f"{getattr(buffer, 'shape', '?')}"
            )
        if not buffer.flags.c_contiguous or not buffer.flags.writeable:
            raise OutBufferError(f"{name} must be C-contiguous and writable")
        if len(buffer) < n:
            raise OutBufferError(f"{name} has {len(buffer)} rows; {n} are needed")
        views.append(buffer[:n].view(np.uint64))
    if n and np.may_share_memory(views[0], views[1]):
        raise overlap_error("out's local and remote rows")
    return views[0], views[1]
