"""The kernel of canonical (fragment) plans and of strided plans (SPEC 10).

One kernel serves both: it walks group -> ref -> kept block -> item, where a
ref's items are its fragments (flat plans, one (src, dst, size) descriptor
each) or its runs (strided plans, one 2-D descriptor each). A direct layout
is a canonical one whose refs have a single whole-page item and one writer,
so its strided plan comes from the same loop. Ids are checked and blocks
mapped to chunks by plan.py's check_ids and map_chunks; statuses are those of
common.py: the wrapper turns them into the errors of direct plans.

canonical_plan_kernel checks the outputs and the ids (check_inputs), maps
each group's blocks to their chunks and walks its refs: writer_blocks keeps
the blocks of a store's writer, fill_one_item and fill_items write one ref's
descriptors.
A merged flat plan merges each ref's descriptors in place right after
writing them (coalesce.append_merged), unless the table proves they never
merge (first_merges).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._config import inline_helper, kernel
from .coalesce import append_merged, continues
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
    overlaps,
    rows_of,
)
from .plan import check_ids, group_chunks, map_chunks

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

    Device block k of a group (j = skip + k) pairs its page with sub-block
    ``j % bpc`` of the group's chunk ``j // bpc``, as in plan_kernel. Each
    block a ref keeps (all in a load, a writer's in a store: writer_blocks)
    adds one descriptor per item of the ref, at the item's offsets.

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
    outputs = (src, dst, width, height, src_pitch, dst_pitch)
    bpc = np.uint64(blocks_per_chunk)
    tables = (ref_table, offloaded_refs)
    id_arrays = (block_ids, offloaded_ids)
    status = check_inputs(outputs, id_arrays, tables, group_ref_start, groups, bpc)
    if status < 0:
        return status
    # The device side goes to src on a store and to dst on a load.
    if store:
        columns = ((src, dst, src_pitch, dst_pitch), width, height, strided)
    else:
        columns = ((dst, src, dst_pitch, src_pitch), width, height, strided)
    flat = (src, dst, width)
    merge_column = STORE_MAY_MERGE if store else LOAD_MAY_MERGE
    chunk_of, sub_block_of, kept = scratch[0], scratch[1], scratch[2]
    cap = np.uint64(np.int64(max_run_bytes))  # NO_CAP (-1) becomes 2**64 - 1
    written, num_bytes = ZERO, np.int64(0)
    first_id = first_chunk = ZERO
    for group in range(groups.shape[1]):
        n_blocks = np.uint64(groups[0, group])  # its size, then its block index
        if n_blocks == ZERO:
            continue
        skip, n_chunks = group_chunks(n_blocks, groups[1, group], bpc)
        ids = block_ids[first_id : first_id + n_blocks]
        chunks = offloaded_ids[first_chunk : first_chunk + n_chunks]
        first_id += n_blocks
        first_chunk += n_chunks
        map_chunks(chunks, skip, bpc, (ids, chunk_of, sub_block_of))
        blocks = (ids, chunk_of, sub_block_of, kept)
        kept_for, n_kept = (np.int64(0), np.int64(0)), ZERO  # writers of `kept`
        for ref in range(group_ref_start[group], group_ref_start[group + 1]):
            span = items_of(ref_items, ref)
            if span[1] == ZERO:
                continue  # a ref without fragments adds nothing
            writers = writers_of(ref_items, ref, store)
            if writers != kept_for:  # the refs of a group usually share them
                kept_for, n_kept = writers, writer_blocks(blocks, bpc, writers)
            num_bytes += np.int64(n_kept) * ref_items[ref, BLOCK_BYTES]
            rows = rows_of(tables, ref)
            if span[1] == ONE:  # a run, or a whole page: the fields hoisted
                end = fill_one_item(columns, written, rows, items, span, blocks, n_kept)
            else:
                end = fill_items(columns, written, rows, items, span, blocks, n_kept)
            may_merge = ref_items[ref, merge_column]  # merged in place, if at all
            if merge and written < end and first_merges(flat, written, may_merge, cap):
                written = append_merged(flat, (written, end), flat, written, cap)
            else:
                written = end
    totals[0] = num_bytes
    return np.int64(written)


@inline_helper
def check_inputs(
    outputs: Any,
    ids: Any,
    tables: Any,
    group_ref_start: IntArray,
    groups: IntArray,
    bpc: np.uint64,
) -> Any:
    """OVERLAPPING_BUFFERS where an output shares a byte with another output
    or with the (block ids, offloaded ids), else plan.check_ids's status."""
    block_ids, offloaded_ids = ids
    for i in range(len(outputs)):
        if overlaps(outputs[i], block_ids) | overlaps(outputs[i], offloaded_ids):
            return OVERLAPPING_BUFFERS
        for j in range(i + 1, len(outputs)):
            if overlaps(outputs[i], outputs[j]):
                return OVERLAPPING_BUFFERS
    return check_ids(tables, group_ref_start, groups, block_ids, offloaded_ids, bpc)


@inline_helper
def items_of(ref_items: IntArray, ref: Any) -> Any:
    """(first, count) of a ref's items, as uint64."""
    first = np.uint64(ref_items[ref, FIRST_ITEM])
    return first, np.uint64(ref_items[ref, END_ITEM]) - first


@inline_helper
def writers_of(ref_items: IntArray, ref: Any, store: bool) -> Any:
    """(num_writers, writer_index) of the blocks a ref keeps: a store keeps
    those whose canonical page is this rank's, a load every block, which
    (1, 0) stands for."""
    if store and ref_items[ref, NUM_WRITERS] > 1:
        return ref_items[ref, NUM_WRITERS], ref_items[ref, WRITER_INDEX]
    return np.int64(1), np.int64(0)


@inline_helper
def writer_blocks(blocks: Any, bpc: np.uint64, writers: Any) -> Any:
    """The blocks whose canonical page id ``chunk * bpc + sub`` is
    ``writer_index`` modulo ``num_writers`` (every block for one writer),
    into blocks' kept; returns their count.

    Computed modulo num_writers throughout, so that no product overflows.

    Args:
        blocks: as fill_one_item.
        writers: (num_writers, writer_index).
    """
    ids, chunk_of, sub_block_of, kept = blocks
    n_blocks = np.uint64(ids.shape[0])
    n_writers = np.uint64(writers[0])
    if n_writers == ONE:  # one writer: every block
        for k in range(n_blocks):
            kept[k] = k
        return n_blocks
    writer = np.uint64(writers[1])
    bpc_mod = bpc % n_writers
    n_kept = ZERO
    for k in range(n_blocks):
        chunk = np.uint64(chunk_of[k])
        page = (chunk % n_writers * bpc_mod + np.uint64(sub_block_of[k])) % n_writers
        if page == writer:
            kept[n_kept] = k
            n_kept += ONE
    return n_kept


# fill_one_item and fill_items write each output column in its own pass over
# the kept blocks: simple loops that vectorise (1.5x faster than one
# interleaved pass).


@inline_helper
def fill_one_item(
    columns: Any,
    written: Any,
    rows: Any,
    items: IntArray,
    span: Any,
    blocks: Any,
    n_rows: np.uint64,
) -> Any:
    """Append one descriptor per kept block, for a ref of one item (a run,
    or a whole page): its fields hoisted out of the loops.

    Args:
        columns: (the device-side and offloaded-side outputs and their
            pitches, width, height, strided): the outputs, and whether the
            last three (height and the pitches) are written.
        rows: the ref's rows (common.rows_of).
        span: (first, count) of the ref's items: (its item, 1).
        blocks: the group's (ids, chunk of each, sub-block of each, kept
            ones), as map_chunks and writer_blocks fill them; the first
            n_rows kept ones are written.

    Returns:
        The new number of descriptors.
    """
    (dev_out, off_out, dev_pitch, off_pitch), width, height, strided = columns
    ids, chunk_of, sub_block_of, kept = blocks
    ref_row, off_row = rows
    item = span[0]
    row_stride = ref_row[ROW_STRIDE]
    off_row_stride, sub_bytes = off_row[OFF_ROW_STRIDE], off_row[OFF_SUB_BYTES]
    local = ref_row[BASE_PTR] + items[LOCAL_OFFSET, item]
    canonical = off_row[OFF_BASE_PTR] + items[CANONICAL_OFFSET, item]
    for row in range(n_rows):
        dev_out[written + row] = local + np.int64(ids[kept[row]]) * row_stride
    for row in range(n_rows):
        k = kept[row]
        off_out[written + row] = (
            canonical + chunk_of[k] * off_row_stride + sub_block_of[k] * sub_bytes
        )
    end = written + n_rows
    width[written:end] = items[WIDTH, item]
    if strided:
        height[written:end] = items[HEIGHT, item]
        dev_pitch[written:end] = items[LOCAL_STRIDE, item]
        off_pitch[written:end] = items[CANONICAL_STRIDE, item]
    return end


@inline_helper
def fill_items(
    columns: Any,
    written: Any,
    rows: Any,
    items: IntArray,
    span: Any,
    blocks: Any,
    n_rows: np.uint64,
) -> Any:
    """Append one descriptor per (kept block, item) for a ref of several
    items, ordered block -> item.

    Args:
        columns, rows, blocks, n_rows: as fill_one_item.
        span: (first, count) of the ref's items.

    Returns:
        The new number of descriptors.
    """
    (dev_out, off_out, dev_pitch, off_pitch), width, height, strided = columns
    ids, chunk_of, sub_block_of, kept = blocks
    ref_row, off_row = rows
    first_item, n_items = span
    local_offsets, canonical_offsets = items[LOCAL_OFFSET], items[CANONICAL_OFFSET]
    base_ptr, row_stride = ref_row[BASE_PTR], ref_row[ROW_STRIDE]
    off_base_ptr = off_row[OFF_BASE_PTR]
    off_row_stride, sub_bytes = off_row[OFF_ROW_STRIDE], off_row[OFF_SUB_BYTES]
    for row in range(n_rows):
        op = written + row * n_items
        dev_ptr = base_ptr + np.int64(ids[kept[row]]) * row_stride
        for i in range(n_items):
            dev_out[op + i] = dev_ptr + local_offsets[first_item + i]
    for row in range(n_rows):
        op = written + row * n_items
        k = kept[row]
        off_ptr = (
            off_base_ptr + chunk_of[k] * off_row_stride + sub_block_of[k] * sub_bytes
        )
        for i in range(n_items):
            off_out[op + i] = off_ptr + canonical_offsets[first_item + i]
    widths = items[WIDTH]
    for row in range(n_rows):
        op = written + row * n_items
        for i in range(n_items):
            width[op + i] = widths[first_item + i]
    if strided:
        heights, local_strides = items[HEIGHT], items[LOCAL_STRIDE]
        canonical_strides = items[CANONICAL_STRIDE]
        for row in range(n_rows):
            op = written + row * n_items
            for i in range(n_items):
                item = first_item + i
                height[op + i] = heights[item]
                dev_pitch[op + i] = local_strides[item]
                off_pitch[op + i] = canonical_strides[item]
    return written + n_rows * n_items


@inline_helper
def first_merges(flat: Any, written: Any, may_merge: Any, cap: np.uint64) -> bool:
    """Whether a ref's descriptors, from ``written`` on, need merging in
    place: unless the table proves none continues another (may_merge 0),
    only where the first continues the last ref's last.

    Args:
        flat: the (src, dst, width) outputs.
        cap: max_run_bytes as uint64.
    """
    if may_merge:
        return True
    if written == ZERO:
        return False
    src, dst, width = flat
    last = (src[written - ONE], dst[written - ONE], width[written - ONE])
    return continues(last, (src[written], dst[written], width[written]), cap)
