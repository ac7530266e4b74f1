"""The kernel of transfer plans: (src, dst, size) descriptors of a store or load.

plan_kernel checks every id first (check_ids), then per group maps each block
to its offloaded chunk and sub-block (map_chunks) and fills the descriptors of
each ref, one per block (fill_blocks) or merged into runs (fill_merged).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._config import inline_helper, kernel
from .coalesce import FRESH, SINGLE, append_merged, grown, joined, same_allocations
from .common import (
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
    PAGE_SIZE,
    ROW_STRIDE,
    TABLE,
    ZERO,
    IntArray,
    UIntArray,
    chunk_slot,
    greater,
    id_range,
    overlaps,
    rows_of,
)
from .plan_runs import block_pointers, fill_runs, find_runs, steps_of


# One signature: the wrappers widen int32 ids (a copy that costs little next
# to a plan), since each signature of this kernel takes a second to compile.
@kernel(
    f"int64({TABLE}, int64[:, ::1], int64[::1], int64[:, ::1], int64[::1],"
    " int64, boolean, boolean, int64, int64[:, ::1],"
    " uint64[::1], uint64[::1], uint64[::1])"
)
def plan_kernel(
    ref_table: IntArray,
    group_ref_start: IntArray,
    offloaded_refs: IntArray,
    block_ids: IntArray,
    groups: IntArray,
    offloaded_ids: IntArray,
    blocks_per_chunk: int,
    store: bool,
    merge: bool,
    max_run_bytes: int,
    scratch: IntArray,
    src: UIntArray,
    dst: UIntArray,
    sizes: UIntArray,
) -> int:
    """Fill the (src, dst, size) descriptors of a store or a load (SPEC 5).

    Args:
        ref_table, group_ref_start, block_ids: as resolve_kernel.
        offloaded_refs: (n_refs, OFF_COLUMNS), the offloaded tensor of each ref.
        groups: (2, n_groups): each group's size (block ids), then its index
            inside the request of its first block.
        offloaded_ids: chunk ids, group by group.
        blocks_per_chunk: device blocks per offloaded chunk (>= 1).
        store: device -> offloaded if True, offloaded -> device if False.
        merge: coalesce descriptors that continue each other (SPEC 6), with
            exactly the result of coalesce_kernel on the unmerged plan.
        max_run_bytes: the largest merged descriptor (>= 1), or NO_CAP.
        scratch: (6, m) with m > the largest group size: room for the chunk
            and sub-block of each block of a group, and for its runs
            (plan_runs.find_runs).
        src, dst, sizes: outputs, at least as long as the number of ops.

    Returns:
        The number of descriptors written, BAD_OFFLOADED_ID (also for a wrong
        number of offloaded ids), BAD_BLOCK_ID or OVERLAPPING_BUFFERS.
    """
    # No output may share a byte with another or with the ids.
    if (
        overlaps(src, dst)
        | overlaps(src, sizes)
        | overlaps(dst, sizes)
        | overlaps(src, block_ids)
        | overlaps(dst, block_ids)
        | overlaps(sizes, block_ids)
        | overlaps(src, offloaded_ids)
        | overlaps(dst, offloaded_ids)
        | overlaps(sizes, offloaded_ids)
    ):
        return OVERLAPPING_BUFFERS
    bpc = np.uint64(blocks_per_chunk)
    tables = (ref_table, offloaded_refs)
    status = check_ids(tables, group_ref_start, groups, block_ids, offloaded_ids, bpc)
    if status < 0:
        return status
    cap = np.uint64(np.int64(max_run_bytes))  # NO_CAP (-1) becomes 2**64 - 1
    # Device pointers go to src on a store and to dst on a load; contiguity is
    # the same condition in either direction.
    out = (src, dst, sizes) if store else (dst, src, sizes)
    chunk_of, sub_block_of = scratch[0], scratch[1]
    runs = scratch[2:]
    group_sizes, block_indices = groups[0], groups[1]
    written = ZERO
    last = (np.int64(0), FRESH)  # the ref of the last descriptor, its run's state
    first_id = first_chunk = ZERO
    for group in range(group_sizes.shape[0]):
        n_blocks = np.uint64(group_sizes[group])
        if n_blocks == ZERO:
            continue
        skip, n_chunks = group_chunks(n_blocks, block_indices[group], bpc)
        ids = block_ids[first_id : first_id + n_blocks]
        chunks = offloaded_ids[first_chunk : first_chunk + n_chunks]
        first_id += n_blocks
        first_chunk += n_chunks
        blocks = (ids, chunk_of, sub_block_of)  # not sliced: views cost
        map_chunks(chunks, skip, bpc, blocks)
        refs = (group_ref_start[group], group_ref_start[group + 1])
        if merge:
            written, last = fill_merged(
                out, written, tables, refs, blocks, runs, cap, last
            )
        else:
            written = fill_blocks(out, written, tables, blocks, refs, ZERO)
    return np.int64(written)


@inline_helper
def group_chunks(n_blocks: np.uint64, block_index: Any, bpc: np.uint64) -> Any:
    """(skip, n_chunks) of a non-empty group: the sub-block of its first
    chunk that its first block goes to, and the chunks it spans."""
    skip = np.uint64(block_index) % bpc
    return skip, chunk_slot(n_blocks - ONE, skip, bpc)[0] + ONE  # last's, + 1


@inline_helper
def check_ids(
    tables: Any,
    group_ref_start: IntArray,
    groups: IntArray,
    block_ids: IntArray,
    offloaded_ids: IntArray,
    bpc: np.uint64,
) -> Any:
    """Check every id before anything is written: each group's smallest and
    largest device and offloaded ids against each of its refs' tensors, and
    that the offloaded ids are as many as the groups' chunks.

    Args:
        tables: (ref_table, offloaded_refs).

    Returns:
        0, BAD_BLOCK_ID or BAD_OFFLOADED_ID.
    """
    ref_table, offloaded_refs = tables
    group_sizes, block_indices = groups[0], groups[1]
    n_offloaded_ids = np.uint64(offloaded_ids.shape[0])
    first_id = first_chunk = ZERO
    for group in range(group_sizes.shape[0]):
        n_blocks = np.uint64(group_sizes[group])
        if n_blocks == ZERO:
            continue
        skip = np.uint64(block_indices[group]) % bpc
        n_chunks = chunk_slot(n_blocks - ONE, skip, bpc)[0] + ONE  # last's, + 1
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
    return np.int64(0)


@inline_helper
def map_chunks(chunks: IntArray, skip: np.uint64, bpc: np.uint64, blocks: Any) -> None:
    """Fill the chunk id and sub-block of each block of a group.

    Block k goes to sub-block (skip + k) % bpc of the group's chunk
    (skip + k) // bpc (common.chunk_slot), here stepped from one block to the
    next instead of divided.

    Args:
        chunks: the group's offloaded ids, one per chunk it spans.
        blocks: (block ids, chunk of each block, sub-block of each block): the
            last two are filled, as far as there are ids.
    """
    _, chunk_of, sub_block_of = blocks
    chunk = ZERO
    sub = skip
    for k in range(blocks[0].shape[0]):
        chunk_of[k] = chunks[chunk]
        sub_block_of[k] = np.int64(sub)
        sub += ONE
        if sub == bpc:
            sub = ZERO
            chunk += ONE


@inline_helper
def fill_blocks(
    out: Any, written: np.uint64, tables: Any, blocks: Any, refs: Any, first_k: Any
) -> Any:
    """Append one descriptor per block of a group, from block first_k on, for
    each ref of ``refs`` (first, one past the last): one branch-free loop per
    output, so that each vectorises. (One loop writing all three vectorised
    too, behind more overlap checks, and ran 1.5-2x slower from 256 blocks
    on.) The refs loop here, not in the caller: a call per ref passing arrays
    costs Numba's reference counting of each, about 25 ns a ref.

    Args:
        out, written, blocks: as append_pages.
        tables: (ref_table, offloaded_refs).

    Returns:
        The new number of descriptors.
    """
    dev_out, off_out, sizes = out
    ids, chunk_of, sub_block_of = blocks
    ref_table, offloaded_refs = tables
    n_blocks = np.uint64(ids.shape[0])
    for ref in range(refs[0], refs[1]):
        # Locals, read once: the outputs might alias the tables as far as the
        # compiler knows, and loads in the loop would keep it from vectorising.
        base_ptr, row_stride = ref_table[ref, BASE_PTR], ref_table[ref, ROW_STRIDE]
        page_size = ref_table[ref, PAGE_SIZE]
        off_base_ptr = offloaded_refs[ref, OFF_BASE_PTR]
        off_row_stride = offloaded_refs[ref, OFF_ROW_STRIDE]
        sub_bytes = offloaded_refs[ref, OFF_SUB_BYTES]
        shift = written - first_k
        for k in range(first_k, n_blocks):
            dev_out[shift + k] = base_ptr + np.int64(ids[k]) * row_stride
        for k in range(first_k, n_blocks):
            off_out[shift + k] = (
                off_base_ptr
                + chunk_of[k] * off_row_stride
                + sub_block_of[k] * sub_bytes
            )
        for k in range(first_k, n_blocks):
            sizes[shift + k] = page_size
        written += n_blocks - first_k
    return written


@inline_helper
def fill_merged(
    out: Any,
    written: np.uint64,
    tables: Any,
    refs: Any,
    blocks: Any,
    runs: Any,
    cap: np.uint64,
    last: Any,
) -> Any:
    """Append a group's descriptors, ref by ref, merged as coalesce_kernel
    would merge them, where a run never passes from one ref into another
    unless both refs' tensors are views of the same allocations.

    Args:
        tables: (ref_table, offloaded_refs).
        refs: the group's rows of them, (first, one past the last).
        runs: room for find_runs.
        out, written, blocks, cap: as append_pages.
        last: (the ref of the last descriptor written, its run's state).

    Returns:
        (the new number of descriptors, the new ``last``).
    """
    # Refs of one group usually share their steps, and with them their runs:
    # find them once per group and steps.
    runs_of = (-1, -1, -1, -1)
    found = (ZERO, ZERO, SINGLE, SINGLE)
    ref, end = refs
    while ref < end:
        rows = rows_of(tables, ref)
        page = np.uint64(rows[0][PAGE_SIZE])
        if unmergeable(rows):
            # This ref and the next unmergeable ones, in one call.
            same = ref + 1
            while same < end and unmergeable(rows_of(tables, same)):
                same += 1
            written, last = fill_unmergeable(
                out, written, tables, blocks, (ref, same), cap, last
            )
            ref = same
            continue
        steps = steps_of(rows)
        if steps != runs_of:
            runs_of = steps
            found = find_runs(blocks, steps, runs)
        longest = found[1]
        stopped = ref
        if page == ZERO or longest <= cap // page:
            # This ref and the next ones of the same steps, in one call.
            same = ref + 1
            while same < end and steps_of(rows_of(tables, same)) == steps:
                same += 1
            written, stopped, last = fill_runs(
                out, written, tables, (ref, same), runs, found, cap, last
            )
            ref = stopped
            if stopped == same:
                continue
        # Runs the cap splits, or a first page that merges another way than
        # the ref's own runs go: page by page.
        written, last = append_pages(out, written, tables, blocks, ref, cap, last)
        ref += 1
    return written, last


@inline_helper
def append_pages(
    out: Any,
    written: np.uint64,
    tables: Any,
    blocks: Any,
    ref: Any,
    cap: np.uint64,
    last: Any,
) -> Any:
    """Append one ref's pages as coalesce_kernel would merge them: written
    one per block, then merged in place (coalesce.append_merged).

    Args:
        out: (device-side, offloaded-side, sizes) outputs; ``written`` of
            them are filled.
        blocks: as plan_runs.block_pointers.
        cap: max_run_bytes as uint64.
        last: (the ref of the last descriptor written, its run's state).

    Returns:
        (the new number of descriptors, the new ``last``).
    """
    prev_ref, state = last
    if written > ZERO and not same_allocations(tables, ref, prev_ref):
        state = FRESH
    end = fill_blocks(out, written, tables, blocks, (ref, ref + 1), ZERO)
    written, state = append_merged(out, (written, end), out, written, cap, state)
    return written, (ref, state)


@inline_helper
def unmergeable(rows: Any) -> bool:
    """Whether no page of a ref can continue another on the device side: its
    page is not a whole number of rows (pages shorter than their rows, as in
    hybrid layouts' smaller groups), and device steps are whole rows."""
    page, row_stride = rows[0][PAGE_SIZE], rows[0][ROW_STRIDE]
    divisor = greater(row_stride, np.int64(1))
    return bool((page != 0) & (row_stride > 0) & (page % divisor != 0))


@inline_helper
def fill_unmergeable(
    out: Any,
    written: np.uint64,
    tables: Any,
    blocks: Any,
    refs: Any,
    cap: Any,
    last: Any,
) -> Any:
    """Append the pages of unmergeable refs, one descriptor each, as
    coalesce_kernel would merge them: only a ref's first page may grow the
    last descriptor (either way, within one allocation on each side).

    Args:
        out, written, blocks, cap: as append_pages.
        tables: (ref_table, offloaded_refs).
        refs: (first, one past the last) of the refs.
        last: (the ref of the last descriptor written, its run's state).

    Returns:
        (the new number of descriptors, the new ``last``).
    """
    dev_out, off_out, sizes = out
    n_blocks = np.uint64(blocks[0].shape[0])
    prev_ref, state = last
    # The last descriptor, kept in registers (as in plan_runs.fill_runs).
    run = (ZERO, ZERO, ZERO)
    if written > ZERO:
        run = (dev_out[written - ONE], off_out[written - ONE], sizes[written - ONE])
    for ref in range(refs[0], refs[1]):
        rows = rows_of(tables, ref)
        page = np.uint64(rows[0][PAGE_SIZE])
        first_k = ZERO
        if written > ZERO and same_allocations(tables, ref, prev_ref):
            first = block_pointers(rows, blocks, ZERO)
            way = joined(run, state, (first[0], first[1], page), cap)
            if way != FRESH:
                run = grown(run, way, (first[0], first[1], page))
                dev_out[written - ONE], off_out[written - ONE] = run[0], run[1]
                sizes[written - ONE] = run[2]
                state = way
                first_k = ONE
        written = fill_blocks(out, written, tables, blocks, (ref, ref + 1), first_k)
        if n_blocks > first_k:
            dev_ptr, off_ptr = block_pointers(rows, blocks, n_blocks - ONE)
            run = (dev_ptr, off_ptr, page)
            state = SINGLE
        prev_ref = ref
    return written, (prev_ref, state)
