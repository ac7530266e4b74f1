"""The kernel of canonical (fragment) plans and of strided plans (SPEC 10).

One kernel serves both: it walks group -> ref -> kept block -> item, where a
ref's items are its fragments (flat plans, one (src, dst, size) descriptor
each) or its runs (strided plans, one 2-D descriptor each). A direct layout
is a canonical one whose refs have a single whole-page item and one writer,
so its strided plan comes from the same loop. Ids are checked and blocks
mapped to chunks by plan.py's check_ids and map_chunks; statuses are those of
common.py: the wrapper turns them into the errors of direct plans. A merged
flat plan merges each ref's descriptors in place right after writing them
(coalesce.append_merged), unless the table proves they never merge.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._config import inline_helper, kernel
from .coalesce import FRESH, SINGLE, append_merged, joined, same_allocations
from .common import (
    BASE_PTR,
    OFF_BASE_PTR,
    OFF_ROW_STRIDE,
    OFF_SUB_BYTES,
    ONE,
    OVERLAPPING_BUFFERS,
    ROW_STRIDE,
    TABLE,
    ZERO,
    IntArray,
    UIntArray,
    chunk_slot,
    overlaps,
)
from .plan import check_ids, map_chunks

# Rows of the items table, (ITEM_COLUMNS, n_items): one column per fragment
# (flat plans) or run (strided plans), ref by ref, in copy order, so that each
# field of a ref's items is contiguous. A fragment is a run of one row.
LOCAL_OFFSET = 0  # offset of row 0 in the worker's page
CANONICAL_OFFSET = 1  # offset of row 0 in the canonical page (sub-block)
WIDTH = 2  # bytes per row: the fragment size
HEIGHT = 3  # rows: the run's num_fragments (1 for a fragment)
LOCAL_STRIDE = 4  # bytes between two rows in the worker's page
CANONICAL_STRIDE = 5  # bytes between two rows in the canonical page
ITEM_COLUMNS = 6

# Columns of the per-ref table (same rows as PointerTable.ref_table).
FIRST_ITEM = 0  # the ref's items are columns FIRST_ITEM:END_ITEM of the items
END_ITEM = 1
NUM_WRITERS = 2  # the mapping's num_writers (1 for direct layouts)
WRITER_INDEX = 3  # the mapping's writer_index
BLOCK_BYTES = 4  # bytes the ref copies per kept block: sum of width * height
# 0 when no two of the ref's descriptors can ever continue each other, for
# any block ids (_mappings.may_merge): in a load, and in a store (which keeps
# only a writer's blocks). Merging then only looks at the ref's first.
LOAD_MAY_MERGE = 5
STORE_MAY_MERGE = 6
REF_ITEM_COLUMNS = 7


@kernel(
    f"int64({TABLE}, int64[:, ::1], int64[:, ::1], int64[:, ::1], int64[::1],"
    " int64[:, ::1], int64[::1], int64, boolean, boolean, boolean, int64,"
    " int64[:, ::1],"
    " uint64[::1], uint64[::1], uint64[::1], uint64[::1], uint64[::1],"
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
    merge: bool,
    max_run_bytes: int,
    scratch: IntArray,
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
            blocks_per_chunk, store: as plan_kernel.
        offloaded_refs: (n_refs, OFF_COLUMNS), the offloaded tensor of each ref.
        ref_items: (n_refs, REF_ITEM_COLUMNS): each ref's items and writers.
        items: (ITEM_COLUMNS, n_items), every ref's items.
        strided: write height and the pitches too (else they may be empty).
        merge, max_run_bytes: as plan_kernel (flat plans only): each ref's
            descriptors are merged as they are written, while in cache.
        scratch: (3, m) with m >= the largest group size: room for the chunk,
            the sub-block and the kept index of each block of a group.
        src, dst, width: outputs, at least as long as the number of
            descriptors without writer filtering.
        height, src_pitch, dst_pitch: outputs when strided.
        totals: totals[0] is set to the bytes the descriptors copy.

    Returns:
        The number of descriptors written, BAD_OFFLOADED_ID (also for a wrong
        number of offloaded ids), BAD_BLOCK_ID or OVERLAPPING_BUFFERS.
    """
    # No output may share a byte with another or with the ids.
    outputs = (src, dst, width, height, src_pitch, dst_pitch)
    for i in range(len(outputs)):
        if overlaps(outputs[i], block_ids) | overlaps(outputs[i], offloaded_ids):
            return OVERLAPPING_BUFFERS
        for j in range(i + 1, len(outputs)):
            if overlaps(outputs[i], outputs[j]):
                return OVERLAPPING_BUFFERS
    bpc = np.uint64(blocks_per_chunk)
    tables = (ref_table, offloaded_refs)
    status = check_ids(tables, group_ref_start, groups, block_ids, offloaded_ids, bpc)
    if status < 0:
        return status

    # The device side goes to src on a store and to dst on a load.
    if store:
        dev_out, off_out, dev_pitch, off_pitch = src, dst, src_pitch, dst_pitch
    else:
        dev_out, off_out, dev_pitch, off_pitch = dst, src, dst_pitch, src_pitch
    local_offsets, canonical_offsets = items[LOCAL_OFFSET], items[CANONICAL_OFFSET]
    widths, heights = items[WIDTH], items[HEIGHT]
    local_strides, canonical_strides = items[LOCAL_STRIDE], items[CANONICAL_STRIDE]
    chunk_of, sub_block_of, kept = scratch[0], scratch[1], scratch[2]
    group_sizes, block_indices = groups[0], groups[1]
    cap = np.uint64(np.int64(max_run_bytes))  # NO_CAP (-1) becomes 2**64 - 1
    flat = (src, dst, width)
    written = ZERO
    prev_ref, state = np.int64(0), FRESH  # of the last descriptor written
    num_bytes = np.int64(0)
    first_id = first_chunk = ZERO
    for group in range(group_sizes.shape[0]):
        n_blocks = np.uint64(group_sizes[group])
        if n_blocks == ZERO:
            continue
        ids = block_ids[first_id : first_id + n_blocks]
        first_id += n_blocks
        skip = np.uint64(block_indices[group]) % bpc
        n_chunks = chunk_slot(n_blocks - ONE, skip, bpc)[0] + ONE  # last's, + 1
        map_chunks(
            offloaded_ids[first_chunk : first_chunk + n_chunks], skip, bpc,
            (ids, chunk_of, sub_block_of),
        )  # fmt: skip
        first_chunk += n_chunks

        kept_for = (np.int64(0), np.int64(0))  # the writers of `kept` (none yet)
        n_kept = ZERO
        for ref in range(group_ref_start[group], group_ref_start[group + 1]):
            first_item = np.uint64(ref_items[ref, FIRST_ITEM])
            n_items = np.uint64(ref_items[ref, END_ITEM]) - first_item
            if n_items == ZERO:
                continue  # a ref without fragments adds nothing
            # Stores keep the blocks whose canonical page is this rank's; the
            # refs of a group usually share their writers: find them once.
            # Writers (1, 0) stand for every block.
            writers = (np.int64(1), np.int64(0))
            if store and ref_items[ref, NUM_WRITERS] > 1:
                writers = (ref_items[ref, NUM_WRITERS], ref_items[ref, WRITER_INDEX])
            if writers != kept_for:
                kept_for = writers
                n_kept = writer_blocks(
                    chunk_of, sub_block_of, n_blocks, bpc, writers[0], writers[1],
                    kept,
                )  # fmt: skip
            n_rows = n_kept
            base_ptr = ref_table[ref, BASE_PTR]
            row_stride = ref_table[ref, ROW_STRIDE]
            off_base_ptr = offloaded_refs[ref, OFF_BASE_PTR]
            off_row_stride = offloaded_refs[ref, OFF_ROW_STRIDE]
            sub_bytes = offloaded_refs[ref, OFF_SUB_BYTES]
            num_bytes += np.int64(n_rows) * ref_items[ref, BLOCK_BYTES]
            # Each output column in its own pass over the kept blocks: simple
            # loops that vectorise (1.5x faster than one interleaved pass).
            # Written out: calling a helper costs ~30 ns per ref and array.
            if n_items == ONE:  # a run, or a whole page: the fields hoisted
                local = base_ptr + local_offsets[first_item]
                canonical = off_base_ptr + canonical_offsets[first_item]
                for row in range(n_rows):
                    dev_out[written + row] = (
                        local + np.int64(ids[kept[row]]) * row_stride
                    )
                for row in range(n_rows):
                    k = kept[row]
                    off_out[written + row] = (
                        canonical
                        + chunk_of[k] * off_row_stride
                        + sub_block_of[k] * sub_bytes
                    )
                width[written : written + n_rows] = widths[first_item]
                if strided:
                    height[written : written + n_rows] = heights[first_item]
                    dev_pitch[written : written + n_rows] = local_strides[first_item]
                    off_pitch[written : written + n_rows] = canonical_strides[
                        first_item
                    ]
            else:
                for row in range(n_rows):
                    op = written + row * n_items
                    dev_ptr = base_ptr + np.int64(ids[kept[row]]) * row_stride
                    for i in range(n_items):
                        dev_out[op + i] = dev_ptr + local_offsets[first_item + i]
                for row in range(n_rows):
                    op = written + row * n_items
                    k = kept[row]
                    off_ptr = (
                        off_base_ptr
                        + chunk_of[k] * off_row_stride
                        + sub_block_of[k] * sub_bytes
                    )
                    for i in range(n_items):
                        off_out[op + i] = off_ptr + canonical_offsets[first_item + i]
                for row in range(n_rows):
                    op = written + row * n_items
                    for i in range(n_items):
                        width[op + i] = widths[first_item + i]
                if strided:
                    for row in range(n_rows):
                        op = written + row * n_items
                        for i in range(n_items):
                            item = first_item + i
                            height[op + i] = heights[item]
                            dev_pitch[op + i] = local_strides[item]
                            off_pitch[op + i] = canonical_strides[item]
            end = written + n_rows * n_items
            if merge and written < end:  # the ref's descriptors, merged in place
                if written > ZERO and not same_allocations(tables, ref, prev_ref):
                    state = FRESH  # no run passes into other allocations
                first = (src[written], dst[written], width[written])
                if ref_items[ref, STORE_MAY_MERGE if store else LOAD_MAY_MERGE] or (
                    written > ZERO
                    and joined(
                        (src[written - ONE], dst[written - ONE], width[written - ONE]),
                        state,
                        first,
                        cap,
                    )
                    != FRESH
                ):
                    written, state = append_merged(
                        flat, (written, end), flat, written, cap, state
                    )
                else:  # none merges, nor the first into the last ref's last
                    written, state = end, SINGLE
                prev_ref = ref
            else:
                written = end
    totals[0] = num_bytes
    return np.int64(written)


@inline_helper
def writer_blocks(
    chunk_of: IntArray,
    sub_block_of: IntArray,
    n_blocks: np.uint64,
    bpc: np.uint64,
    num_writers: int,
    writer_index: int,
    kept: IntArray,
) -> Any:
    """The blocks whose canonical page id ``chunk * bpc + sub`` is
    ``writer_index`` modulo ``num_writers`` (every block for one writer),
    into kept; returns their count.

    Computed modulo num_writers throughout, so that no product overflows.
    """
    n_writers = np.uint64(num_writers)
    if n_writers == ONE:  # one writer: every block
        for k in range(n_blocks):
            kept[k] = k
        return n_blocks
    writer = np.uint64(writer_index)
    bpc_mod = bpc % n_writers
    n_kept = ZERO
    for k in range(n_blocks):
        chunk = np.uint64(chunk_of[k])
        page = (chunk % n_writers * bpc_mod + np.uint64(sub_block_of[k])) % n_writers
        if page == writer:
            kept[n_kept] = k
            n_kept += ONE
    return n_kept
