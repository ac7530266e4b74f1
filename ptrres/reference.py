"""Plain-numpy reference: what ptrres computes, written for clarity.

This module is the oracle of the test suite and the baseline of the
benchmarks. It follows vLLM's numpy resolver in shape (one vectorised
expression per group and ref), adds the checks of SPEC section 7, and reads
every tensor's geometry on every call, as vLLM does. It accepts and rejects
exactly the input the compiled path does, because both read their input with
the same helpers (``ptrres._args``, ``ptrres._geometry``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from ._args import (
    GROUP_FIELDS,
    SPEC_FIELDS,
    as_block_ids,
    as_block_indices,
    as_group_sizes,
    as_int,
    as_list,
    attributes,
    descriptor_array,
)
from ._diagnose import block_id_error
from ._errors import BlockIdError, InputTypeError, OffloadedIdError, SpecError
from ._geometry import RefRow, offloaded_rows, read_layout, read_offloaded
from ._results import DevicePointerGroupInfo, DevicePointers, TransferPlan

__all__ = [
    "coalesce",
    "iter_pointer_groups",
    "plan_transfer",
    "resolve_device_pointers",
]


def resolve_device_pointers(device_spec: Any, kv_caches: Any) -> DevicePointers:
    """ptr = base + block_id * row_stride_bytes, for every group, ref and block."""
    layout = read_layout(kv_caches)
    raw_ids, raw_sizes, raw_indices = attributes(
        device_spec, SPEC_FIELDS, "device_spec"
    )
    block_ids = as_block_ids(raw_ids)
    group_sizes = as_group_sizes(raw_sizes, len(layout), len(block_ids))
    block_indices = as_block_indices(raw_indices, len(layout))

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
    return block_id_error(group, position, int(group_ids[position]), d, ref)


def iter_pointer_groups(
    device_ptrs: Any, blocks_per_chunk: int
) -> Iterator[DevicePointerGroupInfo]:
    """One DevicePointerGroupInfo per non-empty group (eager list, as an iterator)."""
    blocks_per_chunk = as_int(blocks_per_chunk, "blocks_per_chunk")
    if blocks_per_chunk < 1:
        raise SpecError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
    fields = attributes(device_ptrs, GROUP_FIELDS, "device_ptrs")
    counts = [as_list(values, name) for values, name in zip(fields, GROUP_FIELDS)]
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
    layout = read_layout(kv_caches)
    offloaded = offloaded_rows(
        layout, read_offloaded(offloaded_tensors, blocks_per_chunk)
    )
    # A numpy uint64 would turn int64 // uint64 into float64: use a Python int.
    blocks_per_chunk = as_int(blocks_per_chunk, "blocks_per_chunk")
    device_ptrs = resolve_device_pointers(device_spec, kv_caches)
    chunk_ids = as_block_ids(offloaded_ids, "offloaded_ids")
    groups = list(iter_pointer_groups(device_ptrs, blocks_per_chunk))
    if len(chunk_ids) != sum(info.n_chunks for info in groups):
        raise OffloadedIdError(
            f"there are {len(chunk_ids)} offloaded ids, but the groups span "
            f"{sum(info.n_chunks for info in groups)} chunks"
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
                raise OffloadedIdError(
                    f"group {info.group_idx}, position {position}: offloaded id "
                    f"{value} is out of range for ref {d}",
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


def coalesce(
    src: Any, dst: Any, sizes: Any, *, max_run_bytes: int | None = None
) -> TransferPlan:
    """Merge descriptors that continue each other on both sides (SPEC 6).

    Without a cap, runs are found with one vectorised comparison; with one,
    each descriptor is placed greedily, in order, in plain Python. A merged
    size must fit in uint64: no cap means a cap of 2**64 - 1.
    """
    src = descriptor_array(src, "src")
    dst = descriptor_array(dst, "dst")
    sizes = descriptor_array(sizes, "sizes")
    if not len(src) == len(dst) == len(sizes):
        raise SpecError("src, dst and sizes differ in length")
    num_bytes = int(sizes.sum(dtype=np.uint64))
    cap = None if max_run_bytes is None else as_int(max_run_bytes, "max_run_bytes")
    if cap is not None and cap < 1:
        raise SpecError(f"max_run_bytes must be >= 1, got {cap}")
    if cap is None and sizes.sum(dtype=np.float64) >= 2.0**62:
        cap = 2**64 - 1  # a run could wrap the vectorised sum: merge greedily
    if cap is not None:
        cap = min(cap, 2**64 - 1)
    if len(sizes) == 0:
        return TransferPlan(src.copy(), dst.copy(), sizes.copy(), num_bytes)
    # i + 1 continues i when both ends meet, without wrapping around 2**64.
    src_end = src[:-1] + sizes[:-1]
    dst_end = dst[:-1] + sizes[:-1]
    continues = (src_end == src[1:]) & (dst_end == dst[1:])
    continues &= (src_end >= sizes[:-1]) & (dst_end >= sizes[:-1])
    if cap is None:
        starts = np.flatnonzero(np.concatenate(([True], ~continues)))
        return TransferPlan(
            src[starts], dst[starts], np.add.reduceat(sizes, starts), num_bytes
        )
    out_src, out_dst, out_sizes = [int(src[0])], [int(dst[0])], [int(sizes[0])]
    for i in range(1, len(sizes)):
        size = int(sizes[i])
        if continues[i - 1] and out_sizes[-1] + size <= cap:
            out_sizes[-1] += size
        else:
            out_src.append(int(src[i]))
            out_dst.append(int(dst[i]))
            out_sizes.append(size)
    return TransferPlan(
        np.array(out_src, np.uint64),
        np.array(out_dst, np.uint64),
        np.array(out_sizes, np.uint64),
        num_bytes,
    )
