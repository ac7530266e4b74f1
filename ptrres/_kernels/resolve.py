"""Kernels of resolve(): block ids to device pointers, and back."""

from __future__ import annotations

import numpy as np

from .._config import kernel
from .common import (
    BAD_BLOCK_ID,
    BASE_PTR,
    NUM_BLOCKS,
    OVERLAPPING_BUFFERS,
    PAGE_SIZE,
    ROW_STRIDE,
    TABLE,
    ZERO,
    IntArray,
    UIntArray,
    overlaps,
)

_IDS = ("int32[::1]", "int64[::1]")


@kernel(
    *(f"int64({TABLE}, {ids}, int64[::1], uint64[::1], uint64[::1])" for ids in _IDS),
)
def resolve_kernel(
    ref_table: IntArray,
    group_ref_start: IntArray,
    block_ids: IntArray,
    group_sizes: IntArray,
    ptrs: UIntArray,
    sizes: UIntArray,
) -> int:
    """Fill ptrs and sizes for every (group, ref, block), in that order.

    Args:
        ref_table: (n_refs, REF_COLUMNS), rows ordered by group then ref.
        group_ref_start: the refs of group g are rows
            group_ref_start[g]:group_ref_start[g + 1] of ref_table.
        block_ids: the spec's ids, group by group.
        group_sizes: ids per group, checked to sum to len(block_ids).
        ptrs, sizes: outputs, at least as long as the number of ops.

    Returns:
        The number of ops written, BAD_BLOCK_ID or OVERLAPPING_BUFFERS.
    """
    # No output may share a byte with the other or with the ids.
    if overlaps(ptrs, sizes) | overlaps(ptrs, block_ids) | overlaps(sizes, block_ids):
        return OVERLAPPING_BUFFERS
    op = ZERO
    first_id = ZERO
    for group in range(group_sizes.shape[0]):
        n_blocks = np.uint64(group_sizes[group])
        for ref in range(group_ref_start[group], group_ref_start[group + 1]):
            base_ptr = ref_table[ref, BASE_PTR]
            row_stride = ref_table[ref, ROW_STRIDE]
            page_size = ref_table[ref, PAGE_SIZE]
            num_blocks = np.uint64(ref_table[ref, NUM_BLOCKS])
            # The range check is accumulated without a branch, so that the
            # loop vectorises; meanwhile a bad id counts as block 0, so that
            # no product overflows (the pointers are zeroed anyway).
            out_of_range = False
            for k in range(n_blocks):
                block_id = np.int64(block_ids[first_id + k])
                bad = np.uint64(block_id) >= num_blocks
                out_of_range |= bad
                ptrs[op + k] = base_ptr + (0 if bad else block_id) * row_stride
                sizes[op + k] = page_size
            if out_of_range:
                return BAD_BLOCK_ID
            op += n_blocks
        first_id += n_blocks
    return np.int64(op)


@kernel(f"int64({TABLE}, int64[::1], uint64[::1], uint64[::1], int64[::1])")
def block_ids_from_pointers(
    ref_table: IntArray,
    group_ref_start: IntArray,
    group_sizes: IntArray,
    ptrs: UIntArray,
    sizes: UIntArray,
    block_ids: IntArray,
) -> int:
    """Recover the block ids behind resolved device pointers, checking them.

    Every op must be ``base + id * row_stride`` of its ref's tensor, with
    ``0 <= id < num_blocks``, the same id for every ref of its group, and the
    ref's page as its size. Ids of a group without refs cannot be recovered
    and are set to 0 (no op uses them).

    Returns:
        -1 when every op checks out, else the index of the first op that does
        not.
    """
    op = 0
    first_id = 0
    for group in range(group_sizes.shape[0]):
        n_blocks = group_sizes[group]
        first_ref = group_ref_start[group]
        for k in range(n_blocks):
            block_ids[first_id + k] = 0
        for ref in range(first_ref, group_ref_start[group + 1]):
            base_ptr = np.uint64(ref_table[ref, BASE_PTR])
            row_stride = np.uint64(ref_table[ref, ROW_STRIDE])
            page_size = np.uint64(ref_table[ref, PAGE_SIZE])
            num_blocks = np.uint64(ref_table[ref, NUM_BLOCKS])
            for k in range(n_blocks):
                ptr = ptrs[op + k]
                if ref == first_ref and ptr >= base_ptr and row_stride > 0:
                    block_ids[first_id + k] = np.int64((ptr - base_ptr) // row_stride)
                block_id = np.uint64(block_ids[first_id + k])
                if (
                    block_id >= num_blocks
                    or ptr != base_ptr + block_id * row_stride
                    or sizes[op + k] != page_size
                ):
                    return op + k
            op += n_blocks
        first_id += n_blocks
    return -1
