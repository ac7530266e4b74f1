"""Plain-numpy reference: what ptrres computes, written for clarity.

This module is the oracle of the test suite and the baseline of the
benchmarks. It follows vLLM's numpy resolver in shape (one vectorised
expression per group and ref), adds the checks of SPEC section 7, and reads
every tensor's geometry on every call, as vLLM does. It accepts and rejects
exactly the input the compiled path does, because both read their input with
the same helpers (``ptrres._layout``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from ._errors import BlockIdError, SpecError
from ._layout import (
    RefRow,
    as_block_ids,
    as_block_indices,
    as_group_sizes,
    as_int,
    read_layout,
)
from ._types import DevicePointerGroupInfo, DevicePointers

__all__ = ["iter_pointer_groups", "resolve_device_pointers"]


def resolve_device_pointers(device_spec: Any, kv_caches: Any) -> DevicePointers:
    """ptr = base + block_id * row_stride_bytes, for every group, ref and block."""
    layout = read_layout(kv_caches)
    block_ids = as_block_ids(device_spec.block_ids)
    group_sizes = as_group_sizes(device_spec.group_sizes, len(layout), len(block_ids))
    block_indices = as_block_indices(device_spec.block_indices, len(layout))

    num_ops = sum(int(n) * len(refs) for n, refs in zip(group_sizes, layout))
    ptrs = np.empty(num_ops, dtype=np.uint64)
    sizes = np.empty(num_ops, dtype=np.uint64)
    op = 0
    first_id = 0
    for group, (n_blocks, refs) in enumerate(zip(group_sizes.tolist(), layout)):
        group_ids = block_ids[first_id : first_id + n_blocks]
        lowest, highest = (group_ids.min(), group_ids.max()) if n_blocks else (0, -1)
        for d, ref in enumerate(refs):
            if lowest < 0 or highest >= ref.num_blocks:
                raise _block_id_error(group_ids, ref, group, d)
            ptrs[op : op + n_blocks] = np.uint64(ref.base_ptr) + group_ids.astype(
                np.uint64
            ) * np.uint64(ref.row_stride_bytes)
            sizes[op : op + n_blocks] = ref.page_size_bytes
            op += n_blocks
        first_id += n_blocks

    return DevicePointers(
        ptrs=ptrs,
        sizes=sizes,
        group_block_counts=tuple(group_sizes.tolist()),
        group_data_ref_counts=tuple(len(refs) for refs in layout),
        block_indices=block_indices,
    )


def _block_id_error(
    group_ids: npt.NDArray[Any], ref: RefRow, group: int, d: int
) -> BlockIdError:
    """The error for the first of a group's ids outside its ref's tensor."""
    position = int(np.flatnonzero((group_ids < 0) | (group_ids >= ref.num_blocks))[0])
    value = int(group_ids[position])
    return BlockIdError(
        f"group {group}, position {position}: block id {value} is out of range "
        f"for ref {d}, whose tensor {ref.tensor_idx} has {ref.num_blocks} blocks",
        group=group,
        position=position,
        value=value,
    )


def iter_pointer_groups(
    device_ptrs: Any, blocks_per_chunk: int
) -> Iterator[DevicePointerGroupInfo]:
    """One DevicePointerGroupInfo per non-empty group (eager list, as an iterator)."""
    if as_int(blocks_per_chunk, "blocks_per_chunk") < 1:
        raise SpecError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
    counts = [tuple(device_ptrs.group_block_counts)]
    counts += [tuple(device_ptrs.group_data_ref_counts)]
    counts += [tuple(device_ptrs.block_indices)]
    if len({len(c) for c in counts}) != 1:
        raise SpecError(
            "group_block_counts, group_data_ref_counts, block_indices differ in length"
        )
    infos = []
    dev_ptr_offset = 0
    for group_idx, (group_size, n_data_refs, block_index) in enumerate(zip(*counts)):
        group_size = as_int(group_size, "group size")
        n_data_refs = as_int(n_data_refs, "n_data_refs")
        block_index = as_int(block_index, "block index")
        if min(group_size, n_data_refs, block_index) < 0:
            raise SpecError(f"group {group_idx}: negative count or index")
        if group_size == 0:
            continue
        skip = block_index % blocks_per_chunk
        n_chunks = (group_size + skip + blocks_per_chunk - 1) // blocks_per_chunk
        infos.append(
            DevicePointerGroupInfo(
                group_idx, group_size, n_data_refs, skip, n_chunks, dev_ptr_offset
            )
        )
        dev_ptr_offset += group_size * n_data_refs
    return iter(infos)
