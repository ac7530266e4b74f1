"""The kernel of canonical (fragment) plans and of strided plans (SPEC 10).

One kernel serves both: it walks group -> ref -> kept block -> item, where a
ref's items are its fragments (flat plans, one (src, dst, size) descriptor
each) or its runs (strided plans, one 2-D descriptor each). A direct layout
is a canonical one whose refs have a single whole-page item and one writer,
so its strided plan comes from the same loop. Statuses are those of
_kernels: the wrapper turns them into the errors of direct plans.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._config import inline_helper, kernel
from ._kernels import (
    BAD_BLOCK_ID,
    BAD_OFFLOADED_ID,
    BASE_PTR,
    NUM_BLOCKS,
    OFF_BASE_PTR,
    OFF_NUM_CHUNKS,
    OFF_ROW_STRIDE,
    OFF_SUB_BYTES,
    ONE,
    OVERLAPPING_BUFFERS,
    ROW_STRIDE,
    ZERO,
    IntArray,
    UIntArray,
    id_range,
)

# Columns of the items table: one row per fragment (flat) or run (strided),
# ref by ref, in copy order. A fragment is a run of one row.
LOCAL_OFFSET = 0  # offset of row 0 in the worker's page
CANONICAL_OFFSET = 1  # offset of row 0 in the canonical page (sub-block)
WIDTH = 2  # bytes per row: the fragment size
HEIGHT = 3  # rows: the run's num_fragments (1 for a fragment)
LOCAL_STRIDE = 4  # bytes between two rows in the worker's page
CANONICAL_STRIDE = 5  # bytes between two rows in the canonical page
ITEM_COLUMNS = 6

# Columns of the per-ref table (same rows as PointerTable.ref_table).
FIRST_ITEM = 0  # the ref's items are rows FIRST_ITEM:END_ITEM of the items
END_ITEM = 1
NUM_WRITERS = 2  # the mapping's num_writers (1 for direct layouts)
WRITER_INDEX = 3  # the mapping's writer_index
BLOCK_BYTES = 4  # bytes the ref copies per kept block: sum of width * height
REF_ITEM_COLUMNS = 5


@inline_helper
def apart(a: Any, b: Any) -> bool:
    """Whether two arrays share no byte (an empty one shares none)."""
    a0, b0 = a.ctypes.data, b.ctypes.data
    a1, b1 = a0 + np.uint64(a.nbytes), b0 + np.uint64(b.nbytes)
    return bool((a0 == a1) | (b0 == b1) | (a1 <= b0) | (b1 <= a0))


@kernel(
    "int64(int64[:, ::1], int64[::1], int64[:, ::1], int64[:, ::1],"
    " int64[:, ::1], int64[::1], int64[:, ::1], int64[::1], int64, boolean,"
    " boolean, uint64[::1], uint64[::1], uint64[::1], uint64[::1], uint64[::1],"
    " uint64[::1], int64[::1])"
)
def canonical_plan_kernel(
    ref_table: IntArray,
    group_ref_start: IntArray,
    offloaded_refs: IntArray,
    ref_items: IntArray,
    items: IntArray,
    block_ids: IntArray,
    groups: IntArray,
    offloaded_ids: IntArray,
    blocks_per_chunk: int,
    store: bool,
    strided: bool,
    src: UIntArray,
    dst: UIntArray,
    width: UIntArray,
    height: UIntArray,
    src_pitch: UIntArray,
    dst_pitch: UIntArray,
    totals: IntArray,
) -> int:
    """Fill the descriptors of a canonical (or strided) store or load.

    Device block k of group g (j = skip + k) has its page at ``base + id *
    row_stride`` and its canonical page at sub-block ``j % bpc`` of chunk
    ``offloaded_ids_of_g[j // bpc]``. A store keeps a block only when its
    canonical page id ``chunk * bpc + j % bpc`` is this rank's (``% num_writers
    == writer_index``); a load keeps every block. Each kept block adds one
    descriptor per item of the ref, at the item's offsets on either side.

    Args:
        ref_table, group_ref_start, block_ids, groups, offloaded_ids,
            blocks_per_chunk, store: as _kernels.plan_kernel.
        offloaded_refs: (n_refs, OFF_COLUMNS), the offloaded tensor of each ref.
        ref_items: (n_refs, REF_ITEM_COLUMNS): each ref's items and writers.
        items: (n_items, ITEM_COLUMNS), every ref's items.
        strided: write height and the pitches too (else they may be empty).
        src, dst, width: outputs, at least as long as the number of
            descriptors without writer filtering.
        height, src_pitch, dst_pitch: outputs when strided.
        totals: totals[0] is set to the bytes the descriptors copy.

    Returns:
        The number of descriptors written, BAD_OFFLOADED_ID (also for a wrong
        number of offloaded ids), BAD_BLOCK_ID or OVERLAPPING_BUFFERS.
    """
    if not (
        apart(src, dst) & apart(src, width) & apart(dst, width)
        & apart(height, src) & apart(height, dst) & apart(height, width)
        & apart(src_pitch, src) & apart(src_pitch, dst) & apart(src_pitch, width)
        & apart(src_pitch, height)
        & apart(dst_pitch, src) & apart(dst_pitch, dst) & apart(dst_pitch, width)
        & apart(dst_pitch, height) & apart(dst_pitch, src_pitch)
        & apart(src, block_ids) & apart(dst, block_ids) & apart(width, block_ids)
        & apart(height, block_ids) & apart(src_pitch, block_ids)
        & apart(dst_pitch, block_ids)
        & apart(src, offloaded_ids) & apart(dst, offloaded_ids)
        & apart(width, offloaded_ids) & apart(height, offloaded_ids)
        & apart(src_pitch, offloaded_ids) & apart(dst_pitch, offloaded_ids)
    ):  # fmt: skip
        return OVERLAPPING_BUFFERS
    bpc = np.uint64(blocks_per_chunk)
    group_sizes, block_indices = groups[0], groups[1]
    n_groups = group_sizes.shape[0]

    # Check every id before writing, as plan_kernel does.
    n_offloaded_ids = np.uint64(offloaded_ids.shape[0])
    first_id = first_chunk = ZERO
    for group in range(n_groups):
        n_blocks = np.uint64(group_sizes[group])
        if n_blocks == ZERO:
            continue
        n_chunks = (n_blocks + np.uint64(block_indices[group]) % bpc + bpc - ONE) // bpc
        if first_chunk + n_chunks > n_offloaded_ids:
            return BAD_OFFLOADED_ID
        lowest_id, highest_id = id_range(block_ids[first_id : first_id + n_blocks])
        lowest_chunk, highest_chunk = id_range(
            offloaded_ids[first_chunk : first_chunk + n_chunks]
        )
        for ref in range(group_ref_start[group], group_ref_start[group + 1]):
            if lowest_id < 0 or highest_id >= ref_table[ref, NUM_BLOCKS]:
                return BAD_BLOCK_ID
            if lowest_chunk < 0 or highest_chunk >= offloaded_refs[ref, OFF_NUM_CHUNKS]:
                return BAD_OFFLOADED_ID
        first_id += n_blocks
        first_chunk += n_chunks
    if first_chunk != n_offloaded_ids:
        return BAD_OFFLOADED_ID

    # The device side goes to src on a store and to dst on a load.
    if store:
        dev_out, off_out, dev_pitch, off_pitch = src, dst, src_pitch, dst_pitch
    else:
        dev_out, off_out, dev_pitch, off_pitch = dst, src, dst_pitch, src_pitch
    written = ZERO
    num_bytes = np.int64(0)
    first_id = first_chunk = ZERO
    for group in range(n_groups):
        n_blocks = np.uint64(group_sizes[group])
        if n_blocks == ZERO:
            continue
        skip = np.uint64(block_indices[group]) % bpc
        for ref in range(group_ref_start[group], group_ref_start[group + 1]):
            first_item, end_item = ref_items[ref, FIRST_ITEM], ref_items[ref, END_ITEM]
            if first_item == end_item:
                continue  # a ref without fragments adds nothing
            n_writers = np.uint64(ref_items[ref, NUM_WRITERS])
            writer = np.uint64(ref_items[ref, WRITER_INDEX])
            rotate = store and n_writers > ONE
            # (chunk * bpc + sub) % n_writers without overflowing.
            bpc_mod = bpc % n_writers
            base_ptr = ref_table[ref, BASE_PTR]
            row_stride = ref_table[ref, ROW_STRIDE]
            off_base_ptr = offloaded_refs[ref, OFF_BASE_PTR]
            off_row_stride = offloaded_refs[ref, OFF_ROW_STRIDE]
            sub_bytes = offloaded_refs[ref, OFF_SUB_BYTES]
            block_bytes = ref_items[ref, BLOCK_BYTES]
            chunk_pos = first_chunk
            sub = skip
            for k in range(n_blocks):
                chunk = offloaded_ids[chunk_pos]
                keep = not rotate or (
                    (np.uint64(chunk) % n_writers * bpc_mod + sub) % n_writers == writer
                )
                if keep:
                    dev_ptr = base_ptr + block_ids[first_id + k] * row_stride
                    off_ptr = (
                        off_base_ptr
                        + chunk * off_row_stride
                        + np.int64(sub) * sub_bytes
                    )
                    for item in range(first_item, end_item):
                        dev_out[written] = dev_ptr + items[item, LOCAL_OFFSET]
                        off_out[written] = off_ptr + items[item, CANONICAL_OFFSET]
                        width[written] = items[item, WIDTH]
                        if strided:
                            height[written] = items[item, HEIGHT]
                            dev_pitch[written] = items[item, LOCAL_STRIDE]
                            off_pitch[written] = items[item, CANONICAL_STRIDE]
                        written += ONE
                    num_bytes += block_bytes
                sub += ONE
                if sub == bpc:
                    sub = ZERO
                    chunk_pos += ONE
        first_id += n_blocks
        first_chunk += (n_blocks + skip + bpc - ONE) // bpc
    totals[0] = num_bytes
    return np.int64(written)
