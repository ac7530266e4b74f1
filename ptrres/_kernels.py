"""The compiled kernels. They only compute into arrays they are given.

A kernel never sees a Python object and never raises: it returns -1 when all
went well, or the index of the first op whose block id is out of range, and
the wrapper turns that into an error that names the group, position and value.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ._config import inline_helper, kernel

# Columns of PointerTable.ref_table: one row per (group, ref), in copy order.
BASE_PTR = 0  # data pointer of the ref's tensor
ROW_STRIDE = 1  # bytes between two blocks of that tensor
PAGE_SIZE = 2  # bytes to copy per block (the ref's page_size_bytes)
NUM_BLOCKS = 3  # blocks in the tensor: valid ids are 0 <= id < NUM_BLOCKS
TENSOR_IDX = 4  # index of the tensor in CanonicalKVCaches.tensors
REF_COLUMNS = 5

IntArray = npt.NDArray[Any]
UIntArray = npt.NDArray[np.uint64]

_TABLE = "int64[:, ::1], int64[::1]"
_OUT = "uint64[::1], uint64[::1]"


@kernel(
    f"int64({_TABLE}, int32[::1], int64[::1], {_OUT})",
    f"int64({_TABLE}, int64[::1], int64[::1], {_OUT})",
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
        ref_table: (n_refs, REF_COLUMNS) int64, rows ordered by group then ref.
        group_ref_start: the refs of group g are rows
            group_ref_start[g]:group_ref_start[g + 1] of ref_table.
        block_ids: the spec's ids, group by group.
        group_sizes: ids per group, checked to sum to len(block_ids).
        ptrs, sizes: outputs, exactly as long as the number of ops.

    Returns:
        -1, or the op index of the first block id out of its tensor's range.
    """
    # Indices are unsigned: Numba then adds no negative-index wraparound,
    # and the inner loop vectorises.
    op = np.uint64(0)
    first_id = np.uint64(0)
    for group in range(group_sizes.shape[0]):
        n_blocks = np.uint64(group_sizes[group])
        for ref in range(group_ref_start[group], group_ref_start[group + 1]):
            base_ptr = ref_table[ref, BASE_PTR]
            row_stride = ref_table[ref, ROW_STRIDE]
            page_size = ref_table[ref, PAGE_SIZE]
            num_blocks = np.uint64(ref_table[ref, NUM_BLOCKS])
            # The range check is accumulated without a branch so that the loop
            # vectorises; a negative id becomes a huge unsigned one. A pointer
            # written for a bad id is never returned: the wrapper raises and
            # zeroes the outputs.
            out_of_range = False
            for k in range(n_blocks):
                block_id = block_ids[first_id + k]
                out_of_range |= np.uint64(block_id) >= num_blocks
                ptrs[op + k] = base_ptr + np.int64(block_id) * row_stride
                sizes[op + k] = page_size
            if out_of_range:
                group_ids = block_ids[first_id : first_id + n_blocks]
                return int(op) + first_out_of_range(group_ids, num_blocks)
            op += n_blocks
        first_id += n_blocks
    return -1


@inline_helper
def first_out_of_range(block_ids: IntArray, num_blocks: np.uint64) -> int:
    """Index of the first id outside 0 <= id < num_blocks (uint64), or -1."""
    for k in range(block_ids.shape[0]):
        if np.uint64(block_ids[k]) >= num_blocks:
            return k
    return -1
