"""A transfer's groups: its counts checked against a layout, their kernel
arrays, and vLLM's per-group metadata of resolved pointers.

PointerTable checks a spec's group sizes and block indices here
(check_groups) and hands the planners the result, a GroupCounts, with the
int64 arrays kernels take of it (sizes_array, groups_array: memoised per
table). The file tier walks resolved pointers group by group with
iter_pointer_groups, which _pointer_utils re-exports as vLLM's drop-in.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ._args import (
    GROUP_FIELDS,
    as_block_indices,
    as_group_sizes,
    as_int,
    as_list,
    attributes,
)
from ._errors import SpecError
from ._geometry import num_chunks
from ._results import DevicePointerGroupInfo

_LIST_OR_TUPLE = (list, tuple)


class GroupCounts(NamedTuple):
    """A spec's groups, checked against a layout (check_groups)."""

    # Copy ops: each group's size times its refs, summed.
    n_ops: int
    # Bytes they copy.
    num_bytes: int
    # The spec's group sizes and block indices, as tuples of Python ints.
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]


# GroupCounts(...) without the Python frame of its __new__: a fifth of a
# microsecond less on every resolve and plan.
_new_tuple = tuple.__new__


def check_groups(
    group_sizes: Any,
    block_indices: Any,
    n_block_ids: int,
    ref_counts: tuple[int, ...],
    page_bytes: tuple[int, ...],
) -> GroupCounts:
    """Check a spec's group sizes and block indices against a layout.

    The common case (lists or tuples of Python ints, as vLLM passes) is
    checked in a plain loop; anything else goes through the thorough
    checks, which also produce the error messages. (A set or a dict would
    pass the loop, in no meaningful order: the thorough checks refuse it.)

    Args:
        n_block_ids: how many block ids the spec holds.
        ref_counts, page_bytes: the layout's refs per group, and the bytes
            one block of each group copies over all its refs.
    """
    n_groups = len(ref_counts)
    if (
        type(group_sizes) in _LIST_OR_TUPLE
        and type(block_indices) in _LIST_OR_TUPLE
        and len(group_sizes) == len(block_indices) == n_groups
    ):
        n_ops = n_ids = num_bytes = 0
        for size, refs, group_bytes, index in zip(
            group_sizes, ref_counts, page_bytes, block_indices
        ):
            if type(size) is not int or type(index) is not int:
                break
            if size < 0 or index >> 63:  # index < 0 or >= 2**63
                break
            n_ids += size
            n_ops += size * refs
            num_bytes += size * group_bytes
        else:
            if n_ids == n_block_ids:
                counts = (n_ops, num_bytes, tuple(group_sizes), tuple(block_indices))
                result: GroupCounts = _new_tuple(GroupCounts, counts)
                return result
    sizes = tuple(as_group_sizes(group_sizes, n_groups, n_block_ids).tolist())
    indices = as_block_indices(block_indices, n_groups)
    n_ops = sum(n * r for n, r in zip(sizes, ref_counts))
    num_bytes = sum(n * b for n, b in zip(sizes, page_bytes))
    return GroupCounts(n_ops, num_bytes, sizes, indices)


# The int64 arrays kernels take of a spec's groups, by the tuples they hold:
# (group sizes,) or (group sizes, block indices). Kept by each table.
GroupArrays = dict[tuple[tuple[int, ...], ...], npt.NDArray[np.int64]]
MAX_GROUP_ARRAYS = 256


def sizes_array(
    arrays: GroupArrays, group_sizes: tuple[int, ...]
) -> npt.NDArray[np.int64]:
    """Checked group sizes as the 1-D int64 array a kernel takes, memoised.

    Transfers repeat their group sizes (one block per step, say), and
    building a small array costs a third of a microsecond. Kernels never
    write these arrays, so threads may share them.
    """
    key = (group_sizes,)
    array = arrays.get(key)
    if array is None:
        array = np.array(group_sizes, dtype=np.int64)
        _memoise(arrays, key, array)
    return array


def groups_array(
    arrays: GroupArrays, group_sizes: tuple[int, ...], block_indices: tuple[int, ...]
) -> npt.NDArray[np.int64]:
    """The (2, n_groups) int64 array of group sizes, then block indices,
    that plan kernels take; memoised as sizes_array()."""
    key = (group_sizes, block_indices)
    array = arrays.get(key)
    if array is None:
        array = np.array(key, dtype=np.int64)
        _memoise(arrays, key, array)
    return array


def _memoise(
    arrays: GroupArrays,
    key: tuple[tuple[int, ...], ...],
    array: npt.NDArray[np.int64],
) -> None:
    """Keep a group array, and at most MAX_GROUP_ARRAYS of them."""
    if len(arrays) >= MAX_GROUP_ARRAYS:
        arrays.clear()
    arrays[key] = array


def iter_pointer_groups(
    device_ptrs: Any, blocks_per_chunk: int
) -> Iterator[DevicePointerGroupInfo]:
    """Iterate non-empty groups with pre-computed chunk/skip metadata.

    A drop-in for vLLM's function of the same name. ``blocks_per_chunk`` is the
    number of device blocks in one offloaded chunk (>= 1).
    """
    blocks_per_chunk = as_int(blocks_per_chunk, "blocks_per_chunk")
    if blocks_per_chunk < 1:
        raise SpecError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
    group_block_counts, group_data_ref_counts, block_indices = (
        tuple(as_list(values, name))
        for values, name in zip(
            attributes(device_ptrs, GROUP_FIELDS, "device_ptrs"), GROUP_FIELDS
        )
    )
    if not len(group_block_counts) == len(group_data_ref_counts) == len(block_indices):
        raise SpecError(
            "group_block_counts, group_data_ref_counts and block_indices have "
            f"{len(group_block_counts)}, {len(group_data_ref_counts)} and "
            f"{len(block_indices)} entries; they need one per group"
        )
    return _pointer_groups(
        group_block_counts, group_data_ref_counts, block_indices, blocks_per_chunk
    )


def _pointer_groups(
    group_block_counts: tuple[Any, ...],
    group_data_ref_counts: tuple[Any, ...],
    block_indices: tuple[Any, ...],
    blocks_per_chunk: int,
) -> Iterator[DevicePointerGroupInfo]:
    dev_ptr_offset = 0
    for group_idx, (group_size, n_data_refs, block_index) in enumerate(
        zip(group_block_counts, group_data_ref_counts, block_indices)
    ):
        group_size = as_int(group_size, f"group {group_idx}: group size")
        n_data_refs = as_int(n_data_refs, f"group {group_idx}: n_data_refs")
        block_index = as_int(block_index, f"group {group_idx}: block index")
        if group_size < 0 or n_data_refs < 0 or block_index < 0:
            raise SpecError(
                f"group {group_idx}: group size {group_size}, n_data_refs "
                f"{n_data_refs} and block index {block_index} must be >= 0"
            )
        if group_size == 0:
            continue
        yield DevicePointerGroupInfo(
            group_idx=group_idx,
            group_size=group_size,
            n_data_refs=n_data_refs,
            skip=block_index % blocks_per_chunk,
            n_chunks=num_chunks(group_size, block_index, blocks_per_chunk),
            dev_ptr_offset=dev_ptr_offset,
        )
        dev_ptr_offset += group_size * n_data_refs
