"""Kernels of ptrres.nixl: the arrays NIXL takes (SPEC 14).

descriptor_rows_kernel writes one side of a transfer as NIXL's Nx3 rows
``(addr, len, devId)`` (``get_xfer_descs``); prepped_indices_kernel turns a
transfer's block ids into indices into a prepared descriptor list of one
strided row per ref (``prep_xfer_dlist``, ``make_prepped_xfer``): ref-major,
``first index of the ref + block id``, every id checked against its own
ref's block count, so that no index lands in another ref's descriptors.
desc_ids_kernel does the same in vLLM's NixlConnector's index space (one
region per layer, ``ptrres.vllm._nixl``).
"""

from __future__ import annotations

import numpy as np

from .._config import kernel
from .common import (
    BAD_BLOCK_ID,
    BASE_PTR,
    NUM_BLOCKS,
    OVERLAPPING_BUFFERS,
    TABLE,
    ZERO,
    IntArray,
    UIntArray,
    overlaps,
)

# Columns of a row of NIXL's transfer descriptors.
ADDR, LEN, DEV_ID = 0, 1, 2


@kernel("int64(uint64[::1], uint64[::1], uint64[::1], uint64[:, ::1])")
def descriptor_rows_kernel(
    addrs: UIntArray, sizes: UIntArray, devices: UIntArray, rows: UIntArray
) -> int:
    """Fill ``rows[i] = (addrs[i], sizes[i], devId)`` for every descriptor.

    Args:
        addrs, sizes: one side's addresses and the descriptors' bytes, of one
            length (checked by the wrapper).
        devices: the devId of every row (one entry), or of each row (as many
            as addrs): a file's descriptor for FILE rows.
        rows: (at least len(addrs), 3), the output.

    Returns:
        The number of rows written, or OVERLAPPING_BUFFERS (nothing written).
    """
    if overlaps(rows, addrs) | overlaps(rows, sizes) | overlaps(rows, devices):
        return OVERLAPPING_BUFFERS
    n = addrs.shape[0]
    if devices.shape[0] == 1:
        device = devices[0]
        for i in range(n):
            rows[i, ADDR] = addrs[i]
            rows[i, LEN] = sizes[i]
            rows[i, DEV_ID] = device
    else:
        for i in range(n):
            rows[i, ADDR] = addrs[i]
            rows[i, LEN] = sizes[i]
            rows[i, DEV_ID] = devices[i]
    return np.int64(n)


_IDS = ("int32[::1]", "int64[::1]")


@kernel(*(f"int64({TABLE}, {ids}, int64[::1], int32[::1])" for ids in _IDS))
def prepped_indices_kernel(
    index_table: IntArray,
    group_ref_start: IntArray,
    block_ids: IntArray,
    group_sizes: IntArray,
    indices: IntArray,
) -> int:
    """Fill the index of every (group, ref, block), in that order: the ref's
    first index (BASE_PTR of ``index_table``) plus the block id.

    Args:
        index_table: a ref table whose BASE_PTR column holds each ref's first
            index in the prepared list and NUM_BLOCKS its block count (the
            whole list fits in int32: checked by the wrapper).
        group_ref_start, block_ids, group_sizes: as resolve_kernel.
        indices: the output, at least as long as the number of ops.

    Returns:
        The number of indices written, BAD_BLOCK_ID or OVERLAPPING_BUFFERS.
    """
    if overlaps(indices, block_ids):
        return OVERLAPPING_BUFFERS
    op = ZERO
    first_id = ZERO
    for group in range(group_sizes.shape[0]):
        n_blocks = np.uint64(group_sizes[group])
        for ref in range(group_ref_start[group], group_ref_start[group + 1]):
            first_index = np.int32(index_table[ref, BASE_PTR])
            num_blocks = np.uint64(index_table[ref, NUM_BLOCKS])
            # As in resolve_kernel: the check accumulates without a branch, so
            # that the loop vectorises, and a bad id counts as block 0.
            out_of_range = False
            for k in range(n_blocks):
                block_id = np.int64(block_ids[first_id + k])
                bad = np.uint64(block_id) >= num_blocks
                out_of_range |= bad
                indices[op + k] = first_index + np.int32(0 if bad else block_id)
            if out_of_range:
                return BAD_BLOCK_ID
            op += n_blocks
        first_id += n_blocks
    return np.int64(op)


# Columns of a row of desc_ids_kernel's segments.
SEGMENT_GROUP = 0  # the group whose ids it indexes, or ALL_GROUPS
SEGMENT_FIRST = 1  # the first descriptor of its region
SEGMENT_COUNT = 2  # the region's descriptors: an id must be 0 <= id < this
SEGMENT_COLUMNS = 3
# SEGMENT_GROUP of a segment that indexes every group's ids, concatenated.
ALL_GROUPS = -1


@kernel("int64(int64[::1], int64[::1], int64[:, ::1], int64[::1])")
def desc_ids_kernel(
    block_ids: IntArray, group_starts: IntArray, segments: IntArray, desc_ids: IntArray
) -> int:
    """Fill vLLM's NixlConnector descriptor ids: for each segment in turn, the
    ids of its group (or of every group), each plus its region's first
    descriptor, every id checked against the region's count.

    Args:
        block_ids: every group's ids, concatenated.
        group_starts: group g's ids are block_ids[group_starts[g]:
            group_starts[g + 1]] (one entry more than groups).
        segments: (n, SEGMENT_COLUMNS), in the order of the output.
        desc_ids: the output, at least as long as the segments' ids.

    Returns:
        The number of ids written, BAD_BLOCK_ID (an id outside its region)
        or OVERLAPPING_BUFFERS.
    """
    if overlaps(desc_ids, block_ids):
        return OVERLAPPING_BUFFERS
    written = 0
    for segment in range(segments.shape[0]):
        group = segments[segment, SEGMENT_GROUP]
        start, stop = 0, block_ids.shape[0]
        if group != ALL_GROUPS:
            start, stop = group_starts[group], group_starts[group + 1]
        first = segments[segment, SEGMENT_FIRST]
        count = np.uint64(segments[segment, SEGMENT_COUNT])
        # Both sides as views indexed from 0 by the loop's counter: an index
        # that may be negative (written - start + k) makes Numba wrap it
        # around, a select per element that keeps the stores from
        # vectorising (0.7 ns an index against 0.2, a numpy fill's speed).
        ids = block_ids[start:stop]
        out = desc_ids[written : written + (stop - start)]
        # As in resolve_kernel: the check accumulates without a branch, so that
        # the loop vectorises, and a bad id counts as 0.
        out_of_range = False
        for k in range(stop - start):
            block_id = ids[k]
            bad = np.uint64(block_id) >= count
            out_of_range |= bad
            out[k] = first + (0 if bad else block_id)
        if out_of_range:
            return BAD_BLOCK_ID
        written += stop - start
    return np.int64(written)
