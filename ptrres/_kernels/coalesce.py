"""Coalescing: merging descriptors that continue each other on both sides.

A run of descriptors is ascending (each starts where the one before ends, on
both sides) or descending (each ends where the one before starts, on both
sides); a run is one or the other, and a direction change ends it (SPEC 6).
Merged, a run is one descriptor from its lowest address on each side.

coalesce_kernel merges a finished plan, as append_merged does, which the
canonical kernel also runs on each ref it fills; find_runs and fill_runs let
plan_kernel merge while it fills, with exactly coalesce_kernel's result (told
where allocations change).

Where the last descriptor written stands, kernels carry a run state: FRESH
(nothing to continue: no descriptor yet, or the next lies in other
allocations), SINGLE (a descriptor that may still grow either way), UP or
DOWN (a run of two or more, growing only its way).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._config import inline_helper, kernel
from .common import (
    ALLOCATION,
    BASE_PTR,
    OFF_ALLOCATION,
    OFF_BASE_PTR,
    OFF_ROW_STRIDE,
    OFF_SUB_BYTES,
    ONE,
    OVERLAPPING_BUFFERS,
    PAGE_SIZE,
    ROW_STRIDE,
    ZERO,
    IntArray,
    UIntArray,
    greater,
    lesser,
    overlaps,
    rows_of,
    trailing_zeros,
)

# A descriptor or a run of them: (src or device ptr, dst or offloaded ptr, size).
Descriptor = tuple[np.uint64, np.uint64, np.uint64]

# Run states (see the module's docstring).
FRESH = np.uint64(0)
SINGLE = np.uint64(1)
UP = np.uint64(2)
DOWN = np.uint64(3)

# Rows of find_runs's table of runs.
RUN_STARTS, RUN_DEVICE, RUN_OFFLOADED, RUN_BYTES = 0, 1, 2, 3


@inline_helper
def joined(run: Descriptor, state: Any, descriptor: Descriptor, cap: Any) -> Any:
    """The state of ``run`` grown by ``descriptor`` (both (a, b, size)): UP
    when it starts where the run ends on both sides, DOWN when it ends where
    the run starts on both sides, FRESH when it does not continue the run.

    A run grows only its own way (a SINGLE one either), and stays within
    max_run_bytes ``cap``. Computed without wrapping (a - run_a only where
    a >= run_a): without the JIT, numpy warns of every overflow. A zero-byte
    descriptor never continues a descending run (it would, both ways).
    """
    run_a, run_b, run_size = run
    a, b, size = descriptor
    # `&`, not `and`: one branch on the result instead of eight.
    fits = (run_size <= cap) & (size <= cap - lesser(run_size, cap))
    ascends = (
        (a >= run_a)
        & (b >= run_b)
        & (a - lesser(a, run_a) == run_size)
        & (b - lesser(b, run_b) == run_size)
    )
    descends = (
        (run_a > a)
        & (run_b > b)
        & (run_a - lesser(run_a, a) == size)
        & (run_b - lesser(run_b, b) == size)
    )
    if fits & ascends & ((state == SINGLE) | (state == UP)):
        return UP
    if fits & descends & ((state == SINGLE) | (state == DOWN)):
        return DOWN
    return FRESH


@inline_helper
def grown(run: Descriptor, way: Any, descriptor: Descriptor) -> Descriptor:
    """``run`` grown by ``descriptor`` the way joined() found (UP or DOWN):
    a descending run starts where its newest descriptor does."""
    if way == DOWN:
        return descriptor[0], descriptor[1], run[2] + descriptor[2]
    return run[0], run[1], run[2] + descriptor[2]


@inline_helper
def ascends(run: Descriptor, descriptor: Descriptor, cap: Any) -> bool:
    """Whether ``descriptor`` grows ``run`` upwards within ``cap``: joined()
    for a run that may grow up, where nothing can descend (a ref's file ops,
    whose offsets only grow)."""
    run_a, run_b, run_size = run
    a, b, size = descriptor
    return bool(
        (a >= run_a)
        & (b >= run_b)
        & (a - lesser(a, run_a) == run_size)
        & (b - lesser(b, run_b) == run_size)
        & (run_size <= cap)
        & (size <= cap - lesser(run_size, cap))
    )


@inline_helper
def same_allocations(tables: Any, ref: Any, other: Any) -> bool:
    """Whether two refs' tensors are views of one allocation on each side: a
    run may pass from one ref's descriptors into the other's only then."""
    ref_table, offloaded_refs = tables
    return bool(
        (ref_table[ref, ALLOCATION] == ref_table[other, ALLOCATION])
        & (offloaded_refs[ref, OFF_ALLOCATION] == offloaded_refs[other, OFF_ALLOCATION])
    )


@kernel(
    "int64(uint64[::1], uint64[::1], uint64[::1], int64, int64[::1],"
    " uint64[::1], uint64[::1], uint64[::1])"
)
def coalesce_kernel(
    src: UIntArray,
    dst: UIntArray,
    sizes: UIntArray,
    max_run_bytes: int,
    breaks: IntArray,
    out_src: UIntArray,
    out_dst: UIntArray,
    out_sizes: UIntArray,
) -> int:
    """Merge descriptors that continue each other on both sides (SPEC 6).

    The outputs may be the inputs themselves: a descriptor is read before any
    write reaches its position. Otherwise no output may share memory with
    another output or an input.

    Args:
        breaks: increasing positions (each in 1..n - 1) where a new run must
            start: the first descriptor of another pair of allocations.

    Returns:
        The number of descriptors written, or OVERLAPPING_BUFFERS.
    """
    # No output may share a byte with another output or another input, and
    # one that overlaps its own input must be it (in place). All six arrays
    # are empty or none is.
    if sizes.size and (
        overlaps(out_src, out_dst)
        | overlaps(out_src, out_sizes)
        | overlaps(out_dst, out_sizes)
        | overlaps(out_src, dst)
        | overlaps(out_src, sizes)
        | overlaps(out_dst, src)
        | overlaps(out_dst, sizes)
        | overlaps(out_sizes, src)
        | overlaps(out_sizes, dst)
        | overlaps(out_src, src) & (out_src.ctypes.data != src.ctypes.data)
        | overlaps(out_dst, dst) & (out_dst.ctypes.data != dst.ctypes.data)
        | overlaps(out_sizes, sizes) & (out_sizes.ctypes.data != sizes.ctypes.data)
    ):
        return OVERLAPPING_BUFFERS
    cap = np.uint64(np.int64(max_run_bytes))  # NO_CAP (-1) becomes 2**64 - 1
    inputs, outputs = (src, dst, sizes), (out_src, out_dst, out_sizes)
    written = start = ZERO
    for s in range(breaks.shape[0] + 1):  # each break starts a run afresh
        end = np.uint64(sizes.shape[0])
        if s < breaks.shape[0]:
            end = np.uint64(breaks[s])
        written = append_merged(inputs, (start, end), outputs, written, cap, FRESH)[0]
        start = end
    return np.int64(written)


# Descriptors append_merged classifies at a time: the bits of a uint64.
SPAN = 64
TOP = np.uint64(2**64 - 1)  # the last address, and NO_CAP read as uint64


@inline_helper
def append_merged(
    inputs: Any, span: Any, out: Any, written: Any, cap: Any, state: Any
) -> Any:
    """Append descriptors ``span`` (first, one past the last) of ``inputs`` to
    the ``written`` descriptors of ``out``, merged as coalesce_kernel merges,
    the last of them in run ``state`` (FRESH: the first starts a run).

    ``out`` may be ``inputs`` itself when written <= span's first: a
    descriptor is read before any write reaches its position.

    Descriptors go SPAN at a time. One pass over a span sets the bit of each
    descriptor that does not start where the one before it ends on both
    sides: only those start runs. Then, unless an end passes the last address,
    runs are capped, or a descriptor ends where the one before starts (a
    descending run: then joined() decides, descriptor by descriptor), only the
    marked descriptors are visited (trailing_zeros), each starting a run that
    the next mark ends: a merge-heavy span costs its pass. A span where every
    descriptor is marked is copied as it is; when the buffers differ and the
    span before was such a span too, before the pass, while the span is in
    cache: a plan that merges little costs about a copy.

    Args:
        inputs, out: (src, dst, sizes) arrays.
        cap: max_run_bytes as uint64.

    Returns:
        (the new number of descriptors, the state of the last one's run).
    """
    src, dst, sizes = inputs
    out_src, out_dst, out_sizes = out
    i, end = span
    if (written == ZERO or state == FRESH) and i < end:  # the first starts a run
        out_src[written], out_dst[written] = src[i], dst[i]
        out_sizes[written] = sizes[i]
        written, i, state = written + ONE, i + ONE, SINGLE
    separate = out_src.ctypes.data != src.ctypes.data
    copy_ahead = separate
    while i < end:
        n = lesser(np.uint64(SPAN), end - i)
        last = written - ONE
        run = (out_src[last], out_dst[last], out_sizes[last])
        # The marks: bit k for descriptor i + k, the first against the run.
        # Written out, here and in the loop: the test as a helper was not
        # inlined in the loop, and made it three times slower.
        a0, b0, z0 = run
        a, b, z = src[i], dst[i], sizes[i]
        marks = np.uint64(
            (a < a0) | (b < b0) | (a - lesser(a, a0) != z0) | (b - lesser(b, b0) != z0)
        )
        n_marks = marks
        wraps = (z0 > TOP - a0) | (z0 > TOP - b0) | (z > TOP - a) | (z > TOP - b)
        # Descriptors that end where the one before starts, the first against
        # the run: a descending run, which only joined() follows.
        # (Also set by zero-byte descriptors at or after the one before: the
        # checked path then merges them as it should, a little slower.)
        descends = (a0 - lesser(a0, a) == z) & (b0 - lesser(b0, b) == z)
        if copy_ahead:  # one array per loop: each vectorises
            for k in range(ONE, n):
                out_src[written + k] = src[i + k]
            for k in range(ONE, n):
                out_dst[written + k] = dst[i + k]
            for k in range(ONE, n):
                out_sizes[written + k] = sizes[i + k]
        for k in range(ONE, n):
            p = i + k
            a0, b0, z0 = src[p - ONE], dst[p - ONE], sizes[p - ONE]
            a, b, z = src[p], dst[p], sizes[p]
            mark = np.uint64(
                (a < a0)
                | (b < b0)
                | (a - lesser(a, a0) != z0)
                | (b - lesser(b, b0) != z0)
            )
            marks |= mark << k
            n_marks += mark
            wraps |= (z > TOP - a) | (z > TOP - b)
            descends |= (a0 - lesser(a0, a) == z) & (b0 - lesser(b0, b) == z)
        if copy_ahead:
            out_src[written], out_dst[written] = src[i], dst[i]
            out_sizes[written] = sizes[i]
        copied, copy_ahead = copy_ahead, (n_marks == n) & separate
        if wraps | descends | (cap != TOP) | (state == DOWN):
            written, state = append_checked(
                inputs, (i, i + n), out, written, (run, state), cap
            )
        elif n_marks == n:  # nothing merges: the span as it is
            if not copied and (separate or written != i):
                for k in range(n):
                    out_src[written + k] = src[i + k]
                    out_dst[written + k] = dst[i + k]
                    out_sizes[written + k] = sizes[i + k]
            written += n
            state = SINGLE
        else:  # every run is a marked descriptor and those that follow it
            state = SINGLE if (marks >> (n - ONE)) & ONE else UP
            run_src = run[0]
            while marks != ZERO:
                p = i + np.uint64(trailing_zeros(marks))
                marks &= marks - ONE
                if p > i:  # the run before ends where descriptor p - 1 does
                    out_sizes[written - ONE] = src[p - ONE] - run_src + sizes[p - ONE]
                run_src = src[p]
                out_src[written] = run_src
                out_dst[written] = dst[p]
                written += ONE
            p = i + n - ONE
            out_sizes[written - ONE] = src[p] - run_src + sizes[p]
        i += n
    return written, state


@inline_helper
def append_checked(
    inputs: Any, span: Any, out: Any, written: Any, last: Any, cap: Any
) -> Any:
    """Append descriptors ``span`` of ``inputs`` as append_merged does, each
    tested with joined(): for spans where an end passes the last address,
    runs are capped, or a run descends.

    Args:
        inputs, span, out, written, cap: as append_merged.
        last: (the last descriptor written, its run's state).

    Returns:
        (the new number of descriptors, the state of the last one's run).
    """
    src, dst, sizes = inputs
    out_src, out_dst, out_sizes = out
    run, state = last
    for p in range(span[0], span[1]):
        # Read before writing: the outputs may be the inputs.
        descriptor = (src[p], dst[p], sizes[p])
        way = joined(run, state, descriptor, cap)
        if way != FRESH:
            run = grown(run, way, descriptor)
            state = way
            out_src[written - ONE], out_dst[written - ONE] = run[0], run[1]
            out_sizes[written - ONE] = run[2]
        else:
            run, state = descriptor, SINGLE
            out_src[written] = descriptor[0]
            out_dst[written] = descriptor[1]
            out_sizes[written] = descriptor[2]
            written += ONE
    return written, state


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
