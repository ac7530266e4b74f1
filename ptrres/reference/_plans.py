"""plan_transfer: the copy descriptors of a store or a load (SPEC 5)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import InputTypeError, OffloadedIdError
from .._results import TransferPlan
from ._input import as_ids, as_int, offloaded_of_refs, read_kv_caches, read_offloaded
from ._resolve import iter_pointer_groups, resolve_device_pointers


def plan_transfer(
    device_spec: Any,
    kv_caches: Any,
    offloaded_tensors: Any,
    blocks_per_chunk: int,
    offloaded_ids: Any,
    *,
    store: bool,
) -> TransferPlan:
    """Copy descriptors of a store or a load (SPEC 5), shaped like vLLM's fill.

    Resolve the device side, walk the groups with iter_pointer_groups, and fill
    each ref's offloaded pointers and both sides with one vectorised
    expression each.
    """
    if type(store) is not bool:
        raise InputTypeError(f"store must be True or False, got {store!r}")
    layout = read_kv_caches(kv_caches)
    offloaded = offloaded_of_refs(
        layout, read_offloaded(offloaded_tensors, blocks_per_chunk)
    )
    # A numpy uint64 would turn int64 // uint64 into float64: use a Python int.
    blocks_per_chunk = as_int(blocks_per_chunk, "blocks_per_chunk")
    chunk_ids = as_ids(offloaded_ids, "offloaded_ids")
    device_ptrs = resolve_device_pointers(device_spec, kv_caches)
    groups = list(iter_pointer_groups(device_ptrs, blocks_per_chunk))
    chunks_per_group = [0] * len(layout)
    for info in groups:
        chunks_per_group[info.group_idx] = info.n_chunks
    if len(chunk_ids) != sum(chunks_per_group):
        raise OffloadedIdError(
            f"there are {len(chunk_ids)} offloaded ids, but the groups span "
            f"{chunks_per_group} chunks (blocks_per_chunk={blocks_per_chunk}): "
            f"{sum(chunks_per_group)} in all"
        )

    n_ops = len(device_ptrs.ptrs)
    src = np.empty(n_ops, dtype=np.uint64)
    dst = np.empty(n_ops, dtype=np.uint64)
    sizes = device_ptrs.sizes.copy()
    first_ref_of_group = np.cumsum([0] + [len(refs) for refs in layout])
    first_chunk = 0
    for info in groups:
        group_chunks = chunk_ids[first_chunk : first_chunk + info.n_chunks]
        first_chunk += info.n_chunks
        j = info.skip + np.arange(info.group_size)
        chunk = group_chunks[j // blocks_per_chunk].astype(np.uint64)
        sub_block = (j % blocks_per_chunk).astype(np.uint64)
        for d in range(info.n_data_refs):
            geometry = offloaded[first_ref_of_group[info.group_idx] + d]
            out_of_range = (group_chunks < 0) | (group_chunks >= geometry.num_chunks)
            if out_of_range.any():
                position = int(np.argmax(out_of_range))
                value = int(group_chunks[position])
                tensor_idx = layout[info.group_idx][d].tensor_idx
                raise OffloadedIdError(
                    f"group {info.group_idx}, position {position}: offloaded id "
                    f"{value} is out of range for ref {d}, whose offloaded tensor "
                    f"{tensor_idx} has {geometry.num_chunks} chunks",
                    group=info.group_idx,
                    position=position,
                    value=value,
                )
            off_ptrs = (
                np.uint64(geometry.base_ptr)
                + chunk * np.uint64(geometry.row_stride_bytes)
                + sub_block * np.uint64(geometry.sub_bytes)
            )
            first_op = info.dev_ptr_offset + d * info.group_size
            ops = slice(first_op, first_op + info.group_size)
            dev_ptrs = device_ptrs.ptrs[ops]
            src[ops], dst[ops] = (dev_ptrs, off_ptrs) if store else (off_ptrs, dev_ptrs)
    return TransferPlan(src, dst, sizes, int(sizes.sum(dtype=np.uint64)))
