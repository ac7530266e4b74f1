"""What went wrong, once a kernel has said that something did.

Kernels report a failure as a status (a bad id somewhere, buffers that share
memory); these functions find the first bad id, in the order the reference
checks them, and build the error that names its group, position and value.
Every message of a failed call is written here. They raise, never assert:
``python -O`` must not change what a caller sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ._errors import (
    BlockIdError,
    DevicePointerError,
    OffloadedIdError,
    OutBufferError,
    RemoteBlockIdError,
    SpecError,
)
from ._geometry import Groups, RefRow, num_chunks
from ._kernels import OVERLAPPING_BUFFERS
from ._offloaded import OffloadedLayout
from ._results import DevicePointerGroupInfo

# A bad id found: (group, ref, position in the group, value).
BadId = tuple[int, int, int, int]


def block_id_error(
    group: int, position: int, value: int, d: int, ref: RefRow
) -> BlockIdError:
    """The error for block id ``value``, outside the tensor of ref ``d``."""
    return BlockIdError(
        f"group {group}, position {position}: block id {value} is out of range "
        f"for ref {d}, whose tensor {ref.tensor_idx} has {ref.num_blocks} blocks",
        group=group,
        position=position,
        value=value,
    )


def overlap_error(buffers: str) -> OutBufferError:
    """The error for out= buffers that share memory with each other or an input."""
    return OutBufferError(
        f"{buffers} share memory: each out= buffer must be an array of its own, "
        "apart from the input"
    )


def first_out_of_range(
    ids: npt.NDArray[Any], group_sizes: tuple[int, ...], limits: list[list[int]]
) -> BadId | None:
    """The first (group, ref, position, id) with an id outside [0, limit).

    ``ids`` are consumed group by group (group_sizes[g] each) and checked
    against limits[g][d] for each ref d, in op order.
    """
    first = 0
    for group, (n, group_limits) in enumerate(zip(group_sizes, limits)):
        group_ids = ids[first : first + n]
        for d, limit in enumerate(group_limits):
            bad = np.flatnonzero((group_ids < 0) | (group_ids >= limit))
            if len(bad):
                position = int(bad[0])
                return group, d, position, int(group_ids[position])
        first += n
    return None


def bad_block_id(
    groups: Groups, block_ids: npt.NDArray[Any], group_sizes: tuple[int, ...]
) -> BadId | None:
    """The first out-of-range (group, ref, position, block id), in op order."""
    return first_out_of_range(
        block_ids, group_sizes, [[ref.num_blocks for ref in group] for group in groups]
    )


def resolve_error(
    groups: Groups, block_ids: npt.NDArray[Any], group_sizes: tuple[int, ...]
) -> BlockIdError:
    """The error of a resolve whose kernel found a block id out of range."""
    bad = bad_block_id(groups, block_ids, group_sizes)
    if bad is None:  # pragma: no cover (the kernel and this check disagree)
        raise _disagreement("a block id out of range")
    group, d, position, value = bad
    return block_id_error(group, position, value, d, groups[group][d])


def chunk_count_error(
    chunk_ids: npt.NDArray[Any],
    group_sizes: tuple[int, ...],
    block_indices: tuple[int, ...],
    blocks_per_chunk: int,
) -> OffloadedIdError | None:
    """The error for offloaded ids that are not as many as the groups' chunks."""
    chunks_per_group = [
        num_chunks(n, i, blocks_per_chunk) for n, i in zip(group_sizes, block_indices)
    ]
    if len(chunk_ids) == sum(chunks_per_group):
        return None
    return OffloadedIdError(
        f"there are {len(chunk_ids)} offloaded ids, but the groups span "
        f"{chunks_per_group} chunks (blocks_per_chunk={blocks_per_chunk}): "
        f"{sum(chunks_per_group)} in all"
    )


def failed_plan_error(
    status: int,
    outputs: tuple[npt.NDArray[np.uint64], ...],
    buffers: str,
    groups: Groups,
    block_ids: npt.NDArray[Any],
    group_sizes: tuple[int, ...],
    block_indices: tuple[int, ...],
    chunk_ids: npt.NDArray[np.int64],
    offloaded: OffloadedLayout,
) -> BlockIdError | OffloadedIdError | OutBufferError:
    """The error of a plan kernel's negative status (direct, canonical or
    strided plans alike).

    OVERLAPPING_BUFFERS: overlap_error() naming ``buffers`` (the kernel wrote
    nothing). Else zero what the kernel wrote into its outputs (it is never
    returned), and return plan_error()'s error for its ids.
    """
    if status == OVERLAPPING_BUFFERS:
        return overlap_error(buffers)
    for output in outputs:
        output[:] = 0
    return plan_error(
        groups, block_ids, group_sizes, block_indices, chunk_ids, offloaded
    )


def plan_error(
    groups: Groups,
    block_ids: npt.NDArray[Any],
    group_sizes: tuple[int, ...],
    block_indices: tuple[int, ...],
    chunk_ids: npt.NDArray[np.int64],
    offloaded: OffloadedLayout,
) -> BlockIdError | OffloadedIdError:
    """The error of a failed plan, checked in the reference's order."""
    bad = bad_block_id(groups, block_ids, group_sizes)
    if bad is not None:
        group, d, position, value = bad
        return block_id_error(group, position, value, d, groups[group][d])
    count_error = chunk_count_error(
        chunk_ids, group_sizes, block_indices, offloaded.blocks_per_chunk
    )
    if count_error is not None:
        return count_error
    chunks_per_group = [
        num_chunks(n, i, offloaded.blocks_per_chunk)
        for n, i in zip(group_sizes, block_indices)
    ]
    off_limits = [
        [offloaded.geometries[ref.tensor_idx].num_chunks for ref in group]
        for group in groups
    ]
    bad = first_out_of_range(chunk_ids, tuple(chunks_per_group), off_limits)
    if bad is None:  # pragma: no cover (the kernel and this check disagree)
        raise _disagreement("an id out of range")
    group, d, position, value = bad
    tensor_idx = groups[group][d].tensor_idx
    return OffloadedIdError(
        f"group {group}, position {position}: offloaded id {value} is out of "
        f"range for ref {d}, whose offloaded tensor {tensor_idx} has "
        f"{off_limits[group][d]} chunks",
        group=group,
        position=position,
        value=value,
    )


def failed_peer_plan_error(
    status: int,
    outputs: tuple[npt.NDArray[np.uint64], ...],
    groups: Groups,
    block_ids: npt.NDArray[Any],
    group_sizes: tuple[int, ...],
    remote_ids: npt.NDArray[np.int64],
    peer_groups: Sequence[Sequence[Any]],
) -> BlockIdError | OutBufferError:
    """The error of a peer plan's negative status (SPEC 14): buffers that
    share memory (nothing was written), else, with what was written zeroed,
    the first local block id out of its ref's tensor, then the first remote
    id out of its peer ref's blocks, in op order.

    Args:
        peer_groups: the peer's refs, group by group (each with num_blocks).
    """
    if status == OVERLAPPING_BUFFERS:
        return overlap_error("out's local, remote and sizes, and the ids")
    for output in outputs:
        output[:] = 0
    bad = bad_block_id(groups, block_ids, group_sizes)
    if bad is not None:
        group, d, position, value = bad
        return block_id_error(group, position, value, d, groups[group][d])
    return remote_ids_error(peer_groups, remote_ids, group_sizes)


def remote_ids_error(
    peer_groups: Sequence[Sequence[Any]],
    remote_ids: npt.NDArray[Any],
    group_sizes: tuple[int, ...],
) -> RemoteBlockIdError:
    """The error of the first remote id, in op order, outside its peer ref
    (each of ``peer_groups``' refs has a num_blocks)."""
    limits = [[ref.num_blocks for ref in group] for group in peer_groups]
    bad = first_out_of_range(remote_ids, group_sizes, limits)
    if bad is None:  # pragma: no cover (the kernel and this check disagree)
        raise _disagreement("a remote block id out of range")
    group, d, position, value = bad
    num_blocks = limits[group][d]
    return RemoteBlockIdError(
        f"group {group}, position {position}: remote block id {value} is out of "
        f"range for ref {d}, whose peer tensor has {num_blocks} blocks",
        group=group,
        position=position,
        value=value,
    )


def pointer_error(
    groups: Groups, op: int, ptrs: npt.NDArray[np.uint64], group_sizes: tuple[int, ...]
) -> DevicePointerError:
    """The error for device pointer ``op``, which is not a block of its ref."""
    value = int(ptrs[op])
    group = 0
    while op >= group_sizes[group] * len(groups[group]):
        op -= group_sizes[group] * len(groups[group])
        group += 1
    d, position = divmod(op, group_sizes[group])
    ref = groups[group][d]
    return DevicePointerError(
        f"group {group}, position {position}: device pointer 0x{value:x} "
        f"with its size is not a block of ref {d} (tensor "
        f"{ref.tensor_idx} at 0x{ref.base_ptr:x}, row stride "
        f"{ref.row_stride_bytes} B, {ref.num_blocks} blocks, page "
        f"{ref.page_size_bytes} B), or not the same block as ref 0's",
        group=group,
        position=position,
        value=value,
    )


def file_plan_error(
    infos: Sequence[DevicePointerGroupInfo],
    sizes: npt.NDArray[np.uint64],
    blocks_per_chunk: int,
) -> SpecError:
    """The error of a failed file plan (SPEC 11), in the reference's order: an
    op whose size is not its ref's page, else a file beyond 2**63 - 1 bytes."""
    for info in infos:
        pages = []
        for d in range(info.n_data_refs):
            first = info.dev_ptr_offset + d * info.group_size
            ref_sizes = sizes[first : first + info.group_size]
            bad = np.flatnonzero(ref_sizes != ref_sizes[0])
            if len(bad):
                position = int(bad[0])
                return SpecError(
                    f"group {info.group_idx}, ref {d}, position {position}: size "
                    f"{int(ref_sizes[position])} differs from the ref's first size "
                    f"{int(ref_sizes[0])}; every op of one ref of one group has "
                    "the ref's page as its size"
                )
            pages.append(int(ref_sizes[0]))
        if blocks_per_chunk * sum(pages) > 2**63 - 1:
            return SpecError(
                f"group {info.group_idx}: a file of blocks_per_chunk * sum(pages) "
                f"= {blocks_per_chunk} * {sum(pages)} bytes has offsets beyond "
                "2**63 - 1"
            )
    raise _disagreement("an op size or a file size out of range")  # pragma: no cover


def _disagreement(what: str) -> RuntimeError:  # pragma: no cover
    """A kernel reported a failure that the checks here cannot find."""
    return RuntimeError(
        f"ptrres internal error: a kernel reported {what}, but none is: "
        "please report this with the call that raised it"
    )
