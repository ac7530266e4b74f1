"""resolve_device_pointers and iter_pointer_groups, in vLLM's numpy shape.

One vectorised expression per group and ref, as vLLM's resolver; every
tensor's geometry is read on every call, as vLLM does, and every id checked.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import BlockIdError, SpecError
from .._results import DevicePointerGroupInfo, DevicePointers
from ._input import Ref, as_int, as_list, attributes, read_kv_caches, read_spec


def resolve_device_pointers(device_spec: Any, kv_caches: Any) -> DevicePointers:
    """ptr = base + block_id * row_stride_bytes, for every group, ref and block."""
    layout = read_kv_caches(kv_caches)
    block_ids, group_sizes, block_indices = read_spec(device_spec, len(layout))

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
    group_ids: npt.NDArray[Any], ref: Ref, group: int, d: int
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
    blocks_per_chunk = as_int(blocks_per_chunk, "blocks_per_chunk")
    if blocks_per_chunk < 1:
        raise SpecError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
    names = ("group_block_counts", "group_data_ref_counts", "block_indices")
    fields = attributes(device_ptrs, names, "device_ptrs")
    counts = [as_list(values, name) for values, name in zip(fields, names)]
    if len({len(c) for c in counts}) != 1:
        raise SpecError(
            "group_block_counts, group_data_ref_counts and block_indices have "
            f"{len(counts[0])}, {len(counts[1])} and {len(counts[2])} entries; "
            "they need one per group"
        )
    infos = []
    dev_ptr_offset = 0
    for group_idx, (group_size, n_data_refs, block_index) in enumerate(zip(*counts)):
        group_size = as_int(group_size, f"group {group_idx}: group size")
        n_data_refs = as_int(n_data_refs, f"group {group_idx}: n_data_refs")
        block_index = as_int(block_index, f"group {group_idx}: block index")
        if min(group_size, n_data_refs, block_index) < 0:
            raise SpecError(
                f"group {group_idx}: group size {group_size}, n_data_refs "
                f"{n_data_refs} and block index {block_index} must be >= 0"
            )
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
