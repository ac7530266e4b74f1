"""Merging while a direct plan fills: a group's runs of blocks (SPEC 6).

plan_kernel merges while it fills, with exactly coalesce_kernel's result
(told where allocations change). find_runs splits a group's blocks into runs
contiguous on both sides, once for every ref whose steps (steps_of: row
stride, page size, offloaded row stride, sub-block bytes) are the same, and
gives each run its offsets and bytes; fill_runs then writes each ref's runs
as additions, one descriptor per run, growing the last descriptor where a
ref's first run continues it. Runs go either way and carry coalesce.py's run
states (FRESH, SINGLE, UP, DOWN); block_pointers is a block's two pointers,
for the refs that plan_kernel appends page by page instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._config import inline_helper
from .coalesce import DOWN, FRESH, SINGLE, UP, joined, same_allocations
from .common import (
    BASE_PTR,
    OFF_BASE_PTR,
    OFF_ROW_STRIDE,
    OFF_SUB_BYTES,
    ONE,
    PAGE_SIZE,
    ROW_STRIDE,
    ZERO,
    greater,
    lesser,
    rows_of,
)

# Rows of find_runs's table of runs.
RUN_STARTS, RUN_DEVICE, RUN_OFFLOADED, RUN_BYTES = 0, 1, 2, 3


@inline_helper
def block_pointers(rows: Any, blocks: Any, k: Any) -> tuple[np.uint64, np.uint64]:
    """The device and offloaded pointers of block k of a group, for one ref.

    Args:
        rows: (the ref's ref_table row, its offloaded_refs row).
        blocks: (the group's block ids, then the chunk and the sub-block of
            each, in arrays at least as long).
    """
    ref_row, off_row = rows
    ids, chunk_of, sub_block_of = blocks
    dev_ptr = ref_row[BASE_PTR] + np.int64(ids[k]) * ref_row[ROW_STRIDE]
    off_ptr = (
        off_row[OFF_BASE_PTR]
        + chunk_of[k] * off_row[OFF_ROW_STRIDE]
        + sub_block_of[k] * off_row[OFF_SUB_BYTES]
    )
    return np.uint64(dev_ptr), np.uint64(off_ptr)


@inline_helper
def step_way(before: Any, block: Any, steps: Any) -> Any:
    """How a block continues the block before it, for a ref: UP when its
    page starts where the other's ends on both sides, DOWN when it ends where
    the other's starts on both sides (pages of a byte or more), FRESH
    otherwise. Plain values, not the arrays: a helper taking arrays costs
    reference counting on every call.

    Args:
        before, block: (id, chunk, sub-block) of the two blocks.
        steps: the ref's (row stride, page size, offloaded row stride,
            sub-block bytes).
    """
    row_stride, page_size, off_row_stride, sub_bytes = steps
    device_step = (np.int64(block[0]) - np.int64(before[0])) * row_stride
    offloaded_step = (block[1] - before[1]) * off_row_stride + (
        block[2] - before[2]
    ) * sub_bytes
    if (device_step == page_size) & (offloaded_step == page_size):
        return UP
    if (device_step == -page_size) & (offloaded_step == -page_size) & (page_size > 0):
        return DOWN
    return FRESH


@inline_helper
def find_runs(blocks: Any, steps: Any, runs: Any) -> Any:
    """Split a group's blocks into runs contiguous on both sides, for refs of
    these steps (step_way), and give each run its offsets and bytes.

    A run is ascending or descending; it ends where the next block continues
    it neither way, or the other way. A run's pointers, for a ref of these
    steps, are the ref's base pointers plus the offsets of its lowest block
    (its first, or its last when it descends): id * row stride on the device
    side, chunk * offloaded row stride + sub-block * sub-block bytes on the
    other. They are computed here, once for every ref that shares the steps,
    so that fill_runs only adds (which also vectorises better than
    multiplies). The loop stores block k where the next run would go, and
    counts a run only where one starts.

    Args:
        blocks: as block_pointers.
        steps: as step_way.
        runs: (4, m) with m > the group's size, filled as rows RUN_STARTS
            (run r is blocks runs[RUN_STARTS, r:r + 2]), RUN_DEVICE,
            RUN_OFFLOADED and RUN_BYTES.

    Returns:
        (the number of runs, the blocks of the longest, the states of the
        first and of the last run: SINGLE, UP or DOWN).
    """
    ids, chunk_of, sub_block_of = blocks
    row_stride, page_size, off_row_stride, sub_bytes = steps
    n_blocks = np.uint64(ids.shape[0])
    starts, device = runs[RUN_STARTS], runs[RUN_DEVICE]
    offloaded, run_bytes = runs[RUN_OFFLOADED], runs[RUN_BYTES]
    # The lowest block of each run, in the device row until its offsets.
    lowest = device
    starts[0] = lowest[0] = 0
    n_runs = longest = ONE
    run_start = ZERO
    state = first_state = SINGLE
    for k in range(ONE, n_blocks):
        starts[n_runs] = lowest[n_runs] = k
        before = (ids[k - ONE], chunk_of[k - ONE], sub_block_of[k - ONE])
        block = (ids[k], chunk_of[k], sub_block_of[k])
        way = step_way(before, block, steps)
        begins = (way == FRESH) | ((state != SINGLE) & (way != state))
        if begins and n_runs == ONE:
            first_state = state
        n_runs += np.uint64(begins)
        if way == DOWN and not begins:
            lowest[n_runs - ONE] = k
        state = SINGLE if begins else way
        run_start = k if begins else run_start
        longest = greater(longest, k + ONE - run_start)
    if n_runs == ONE:
        first_state = state
    starts[n_runs] = n_blocks
    # Each output in its own loop: they vectorise. The offloaded offsets
    # first: the device row holds each run's lowest block until then.
    for run in range(n_runs):
        k = lowest[run]
        offloaded[run] = chunk_of[k] * off_row_stride + sub_block_of[k] * sub_bytes
    for run in range(n_runs):
        device[run] = np.int64(ids[lowest[run]]) * row_stride
    for run in range(n_runs):
        run_bytes[run] = (starts[run + ONE] - starts[run]) * page_size
    return n_runs, longest, first_state, state


@inline_helper
def fill_runs(
    out: Any,
    written: Any,
    tables: Any,
    refs: Any,
    runs: Any,
    found: Any,
    cap: Any,
    last: Any,
) -> Any:
    """Append the runs of pages of refs that share their steps (find_runs's),
    one descriptor per run, as coalesce_kernel would merge their pages: for
    runs that each fit the cap (max_run_bytes). All the refs in one call:
    they share the runs, and the last descriptor stays in registers from one
    ref to the next.

    A ref's first run may first grow the last descriptor, while its first
    page continues it, the refs' tensors are views of the same
    allocations (same_allocations) and the run stays within the cap; no
    other run continues the run before it, as find_runs split them there.
    The first run may grow it the way the run goes (either, for one page).
    The call stops at a ref whose first page would grow the last descriptor
    the other way: how its pages then merge is not find_runs's split, and
    the caller appends it page by page (append_pages).

    Args:
        out, written, cap: as append_pages.
        tables: (ref_table, offloaded_refs).
        refs: (first, one past the last) of the refs.
        runs: find_runs's table; found: the rest of what it returned.
        last: (the ref of the last descriptor written, its run's state).

    Returns:
        (the new number of descriptors, the ref it stopped at (refs' end when
        it did all), (the ref of the last descriptor, its run's state)).
    """
    dev_out, off_out, sizes = out
    n_runs, _, first_state, last_state = found
    prev_ref, state = last
    starts, device = runs[RUN_STARTS], runs[RUN_DEVICE]
    offloaded, run_bytes = runs[RUN_OFFLOADED], runs[RUN_BYTES]
    n_pages = np.uint64(starts[1])  # of the first run
    # The last descriptor, kept in registers: read back from the outputs
    # right after a vector store, it would stall each ref.
    run = (ZERO, ZERO, ZERO)
    if written > ZERO:
        run = (dev_out[written - ONE], off_out[written - ONE], sizes[written - ONE])
    ref, end = refs
    while ref < end:
        ref_row, off_row = rows_of(tables, ref)
        base_ptr, off_base_ptr = ref_row[BASE_PTR], off_row[OFF_BASE_PTR]
        page = np.uint64(ref_row[PAGE_SIZE])
        first_run = ZERO
        if (
            written > ZERO
            and state != FRESH
            and same_allocations(tables, ref, prev_ref)
        ):
            dev_ptr = np.uint64(base_ptr + device[0])
            off_ptr = np.uint64(off_base_ptr + offloaded[0])
            if first_state == DOWN:  # its first page is its highest
                dev_ptr += (n_pages - ONE) * page
                off_ptr += (n_pages - ONE) * page
            way = joined(run, state, (dev_ptr, off_ptr, page), cap)
            if (way != FRESH) & (first_state != SINGLE) & (way != first_state):
                return written, ref, (prev_ref, state)
            if way != FRESH:
                joined_pages = n_pages
                if page > ZERO:
                    joined_pages = lesser(n_pages, (cap - run[2]) // page)
                grown_bytes = joined_pages * page
                # Where the rest of the first run starts, if the cap leaves one.
                rest_ptrs = (dev_ptr + grown_bytes, off_ptr + grown_bytes)
                if way == DOWN:  # the joined pages are the run's highest
                    low = grown_bytes - page
                    run = (dev_ptr - low, off_ptr - low, run[2] + grown_bytes)
                    dev_out[written - ONE], off_out[written - ONE] = run[0], run[1]
                    rest_ptrs = (
                        np.uint64(base_ptr + device[0]),
                        np.uint64(off_base_ptr + offloaded[0]),
                    )
                else:
                    run = (run[0], run[1], run[2] + grown_bytes)
                sizes[written - ONE] = run[2]
                state = way
                first_run = ONE
                if joined_pages < n_pages:  # the rest of the run: within the cap
                    rest = n_pages - joined_pages
                    run = (rest_ptrs[0], rest_ptrs[1], rest * page)
                    dev_out[written], off_out[written], sizes[written] = run
                    written += ONE
                    state = SINGLE if rest == ONE else way
        # One output per loop: each vectorises (one loop writing all three
        # does not: too many arrays to check for overlap).
        shift = written - first_run
        for r in range(first_run, n_runs):
            dev_out[shift + r] = base_ptr + device[r]
        for r in range(first_run, n_runs):
            off_out[shift + r] = off_base_ptr + offloaded[r]
        for r in range(first_run, n_runs):
            sizes[shift + r] = run_bytes[r]
        if n_runs > first_run:
            final = n_runs - ONE
            run = (
                np.uint64(base_ptr + device[final]),
                np.uint64(off_base_ptr + offloaded[final]),
                np.uint64(run_bytes[final]),
            )
            state = last_state
        written += n_runs - first_run
        prev_ref = ref
        ref += 1
    return written, ref, (prev_ref, state)


@inline_helper
def steps_of(rows: Any) -> Any:
    """A ref's (row stride, page size, offloaded row stride, sub-block
    bytes): what decides where its runs break (step_way)."""
    ref_row, off_row = rows
    return (
        ref_row[ROW_STRIDE],
        ref_row[PAGE_SIZE],
        off_row[OFF_ROW_STRIDE],
        off_row[OFF_SUB_BYTES],
    )
