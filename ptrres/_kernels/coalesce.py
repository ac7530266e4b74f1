"""Coalescing: merging descriptors that continue each other on both sides.

coalesce_kernel merges a finished plan, as append_merged does, which the
canonical kernel also runs on each ref it fills; find_runs, fill_runs and
append_capped let plan_kernel merge while it fills, with exactly
coalesce_kernel's result.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._config import inline_helper, kernel
from .common import (
    BASE_PTR,
    OFF_BASE_PTR,
    OFF_ROW_STRIDE,
    OFF_SUB_BYTES,
    ONE,
    OVERLAPPING_BUFFERS,
    PAGE_SIZE,
    ROW_STRIDE,
    ZERO,
    UIntArray,
    greater,
    lesser,
    overlaps,
    rows_of,
    trailing_zeros,
)

# A descriptor or a run of them: (src or device ptr, dst or offloaded ptr, size).
Descriptor = tuple[np.uint64, np.uint64, np.uint64]

# Rows of find_runs's table of runs.
RUN_STARTS, RUN_DEVICE, RUN_OFFLOADED, RUN_BYTES = 0, 1, 2, 3


@inline_helper
def continues(run: Descriptor, descriptor: Descriptor, max_run_bytes: Any) -> bool:
    """Whether ``descriptor`` continues ``run`` (both (a, b, size)).

    It does when it starts where the run ends on both sides (the ends not
    wrapping around the address space) and the grown run stays within
    max_run_bytes. Computed without wrapping (a - run_a only where a >=
    run_a): without the JIT, numpy warns of every overflow.
    """
    run_a, run_b, run_size = run
    a, b, size = descriptor
    # `&`, not `and`: one branch on the result instead of eight.
    return bool(
        (a >= run_a)
        & (b >= run_b)
        & (a - lesser(a, run_a) == run_size)
        & (b - lesser(b, run_b) == run_size)
        & (run_size <= max_run_bytes)
        & (size <= max_run_bytes - lesser(run_size, max_run_bytes))
    )


@kernel(
    "int64(uint64[::1], uint64[::1], uint64[::1], int64,"
    " uint64[::1], uint64[::1], uint64[::1])"
)
def coalesce_kernel(
    src: UIntArray,
    dst: UIntArray,
    sizes: UIntArray,
    max_run_bytes: int,
    out_src: UIntArray,
    out_dst: UIntArray,
    out_sizes: UIntArray,
) -> int:
    """Merge descriptors that continue each other on both sides (SPEC 6).

    The outputs may be the inputs themselves: a descriptor is read before any
    write reaches its position. Otherwise no output may share memory with
    another output or an input.

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
    span = (ZERO, np.uint64(sizes.shape[0]))
    return np.int64(append_merged(inputs, span, outputs, ZERO, cap))


# Descriptors append_merged classifies at a time: the bits of a uint64.
SPAN = 64
TOP = np.uint64(2**64 - 1)  # the last address, and NO_CAP read as uint64


@inline_helper
def append_merged(inputs: Any, span: Any, out: Any, written: Any, cap: Any) -> Any:
    """Append descriptors ``span`` (first, one past the last) of ``inputs`` to
    the ``written`` descriptors of ``out``, merged as coalesce_kernel merges.

    ``out`` may be ``inputs`` itself when written <= span's first: a
    descriptor is read before any write reaches its position.

    Descriptors go SPAN at a time. One pass over a span sets the bit of each
    descriptor that does not start where the one before it ends on both
    sides: only those start runs. Then, unless an end passes the last address
    or runs are capped (then continues() decides, descriptor by descriptor),
    only the marked descriptors are visited (trailing_zeros), each starting a
    run that the next mark ends: a merge-heavy span costs its pass. A span
    where every descriptor is marked is copied as it is; when the buffers
    differ and the span before was such a span too, before the pass, while
    the span is in cache: a plan that merges little costs about a copy.

    Args:
        inputs, out: (src, dst, sizes) arrays.
        cap: max_run_bytes as uint64.

    Returns:
        The new number of descriptors.
    """
    src, dst, sizes = inputs
    out_src, out_dst, out_sizes = out
    i, end = span
    if written == ZERO and i < end:  # the first descriptor starts a run
        out_src[0], out_dst[0], out_sizes[0] = src[i], dst[i], sizes[i]
        written, i = ONE, i + ONE
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
        if copy_ahead:
            out_src[written], out_dst[written] = src[i], dst[i]
            out_sizes[written] = sizes[i]
        copied, copy_ahead = copy_ahead, (n_marks == n) & separate
        if wraps | (cap != TOP):
            written = append_checked(inputs, (i, i + n), out, written, run, cap)
        elif n_marks == n:  # nothing merges: the span as it is
            if not copied and (separate or written != i):
                for k in range(n):
                    out_src[written + k] = src[i + k]
                    out_dst[written + k] = dst[i + k]
                    out_sizes[written + k] = sizes[i + k]
            written += n
        else:  # every run is a marked descriptor and those that follow it
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
    return written


@inline_helper
def append_checked(
    inputs: Any, span: Any, out: Any, written: Any, run: Descriptor, cap: Any
) -> Any:
    """Append descriptors ``span`` of ``inputs`` as append_merged does, each
    tested with continues(): for spans where an end passes the last address,
    or where runs are capped.

    Args:
        inputs, span, out, written, cap: as append_merged.
        run: the last descriptor written.

    Returns:
        The new number of descriptors.
    """
    src, dst, sizes = inputs
    out_src, out_dst, out_sizes = out
    for p in range(span[0], span[1]):
        # Read before writing: the outputs may be the inputs.
        descriptor = (src[p], dst[p], sizes[p])
        if continues(run, descriptor, cap):
            run = (run[0], run[1], run[2] + descriptor[2])
            out_sizes[written - ONE] = run[2]
        else:
            run = descriptor
            out_src[written] = descriptor[0]
            out_dst[written] = descriptor[1]
            out_sizes[written] = descriptor[2]
            written += ONE
    return written


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
def starts_run(before: Any, block: Any, steps: Any) -> bool:
    """Whether a block starts a run, for a ref: whether its device or its
    offloaded pointer does not start where the page of the block before it
    ends. Plain values, not the arrays: a helper taking arrays costs
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
    return bool((device_step != page_size) | (offloaded_step != page_size))


@inline_helper
def find_runs(blocks: Any, steps: Any, runs: Any) -> Any:
    """Split a group's blocks into runs contiguous on both sides, for refs of
    these steps (starts_run), and give each run its offsets and bytes.

    A run's pointers, for a ref of these steps, are the ref's base pointers
    plus the offsets of its first block: id * row stride on the device side,
    chunk * offloaded row stride + sub-block * sub-block bytes on the other.
    They are computed here, once for every ref that shares the steps, so
    that fill_runs only adds (which also vectorises better than multiplies).
    The loop stores block k where the next run would go, and counts a run
    only where one starts.

    Args:
        blocks: as block_pointers.
        steps: as starts_run.
        runs: (4, m) with m > the group's size, filled as rows RUN_STARTS
            (run r is blocks runs[RUN_STARTS, r:r + 2]), RUN_DEVICE,
            RUN_OFFLOADED and RUN_BYTES.

    Returns:
        (the number of runs, the blocks of the longest).
    """
    ids, chunk_of, sub_block_of = blocks
    row_stride, page_size, off_row_stride, sub_bytes = steps
    n_blocks = np.uint64(ids.shape[0])
    starts, device = runs[RUN_STARTS], runs[RUN_DEVICE]
    offloaded, run_bytes = runs[RUN_OFFLOADED], runs[RUN_BYTES]
    starts[0] = 0
    n_runs = longest = ONE
    run_start = ZERO
    for k in range(ONE, n_blocks):
        starts[n_runs] = k
        before = (ids[k - ONE], chunk_of[k - ONE], sub_block_of[k - ONE])
        block = (ids[k], chunk_of[k], sub_block_of[k])
        begins = starts_run(before, block, steps)
        n_runs += np.uint64(begins)
        run_start = k if begins else run_start
        longest = greater(longest, k + ONE - run_start)
    starts[n_runs] = n_blocks
    # Each output in its own loop: they vectorise.
    for run in range(n_runs):
        device[run] = np.int64(ids[starts[run]]) * row_stride
    for run in range(n_runs):
        k = starts[run]
        offloaded[run] = chunk_of[k] * off_row_stride + sub_block_of[k] * sub_bytes
    for run in range(n_runs):
        run_bytes[run] = (starts[run + ONE] - starts[run]) * page_size
    return n_runs, longest


@inline_helper
def fill_runs(
    out: Any, written: Any, tables: Any, refs: Any, runs: Any, n_runs: Any, cap: Any
) -> Any:
    """Append the runs of pages of refs that share their steps (find_runs's),
    one descriptor per run, as coalesce_kernel would merge their pages: for
    runs that each fit the cap (max_run_bytes). All the refs in one call:
    they share the runs, and the last descriptor stays in registers from one
    ref to the next.

    A ref's first run may first grow the last descriptor, while it ends where
    the run starts and stays within the cap; no other run
    continues the run before it, as find_runs split them there.

    Args:
        out, written, cap: as append_capped.
        tables: (ref_table, offloaded_refs).
        refs: (first, one past the last) of the refs.
        runs, n_runs: find_runs's.

    Returns:
        The new number of descriptors.
    """
    dev_out, off_out, sizes = out
    starts, device = runs[RUN_STARTS], runs[RUN_DEVICE]
    offloaded, run_bytes = runs[RUN_OFFLOADED], runs[RUN_BYTES]
    # The last descriptor, kept in registers: read back from the outputs
    # right after a vector store, it would stall each ref.
    last = (ZERO, ZERO, ZERO)
    if written > ZERO:
        last = (dev_out[written - ONE], off_out[written - ONE], sizes[written - ONE])
    for ref in range(refs[0], refs[1]):
        ref_row, off_row = rows_of(tables, ref)
        base_ptr, off_base_ptr = ref_row[BASE_PTR], off_row[OFF_BASE_PTR]
        page = np.uint64(ref_row[PAGE_SIZE])
        first_run = ZERO
        if written > ZERO:
            dev_ptr = np.uint64(base_ptr + device[0])
            off_ptr = np.uint64(off_base_ptr + offloaded[0])
            if continues(last, (dev_ptr, off_ptr, page), cap):
                n_pages = np.uint64(starts[1])
                joined = n_pages
                if page > ZERO:
                    joined = lesser(n_pages, (cap - last[2]) // page)
                last = (last[0], last[1], last[2] + joined * page)
                sizes[written - ONE] = last[2]
                first_run = ONE
                if joined < n_pages:  # the rest of the run: within the cap
                    last = (
                        dev_ptr + joined * page,
                        off_ptr + joined * page,
                        (n_pages - joined) * page,
                    )
                    dev_out[written], off_out[written], sizes[written] = last
                    written += ONE
        # One output per loop: each vectorises (one loop writing all three
        # does not: too many arrays to check for overlap).
        shift = written - first_run
        for run in range(first_run, n_runs):
            dev_out[shift + run] = base_ptr + device[run]
        for run in range(first_run, n_runs):
            off_out[shift + run] = off_base_ptr + offloaded[run]
        for run in range(first_run, n_runs):
            sizes[shift + run] = run_bytes[run]
        if n_runs > first_run:
            final = n_runs - ONE
            last = (
                np.uint64(base_ptr + device[final]),
                np.uint64(off_base_ptr + offloaded[final]),
                np.uint64(run_bytes[final]),
            )
        written += n_runs - first_run
    return written


@inline_helper
def steps_of(rows: Any) -> Any:
    """A ref's (row stride, page size, offloaded row stride, sub-block
    bytes): what decides where its runs break (starts_run)."""
    ref_row, off_row = rows
    return (
        ref_row[ROW_STRIDE],
        ref_row[PAGE_SIZE],
        off_row[OFF_ROW_STRIDE],
        off_row[OFF_SUB_BYTES],
    )


@inline_helper
def append_capped(out: Any, written: Any, blocks: Any, rows: Any, cap: Any) -> Any:
    """Append one ref's pages as coalesce_kernel would merge them, page by
    page: for a ref whose longest run the cap (max_run_bytes) splits, where
    fill_runs does not apply. Each page grows the last descriptor when it
    continues it (continues()), or starts the next.

    Args:
        out: (device-side, offloaded-side, sizes) outputs; ``written`` of
            them are filled.
        blocks, rows: as block_pointers.
        cap: max_run_bytes as uint64.

    Returns:
        The new number of descriptors.
    """
    dev_out, off_out, sizes = out
    page = np.uint64(rows[0][PAGE_SIZE])
    for k in range(np.uint64(blocks[0].shape[0])):
        dev_ptr, off_ptr = block_pointers(rows, blocks, k)
        joins = False
        if written > ZERO:
            last = (
                dev_out[written - ONE],
                off_out[written - ONE],
                sizes[written - ONE],
            )
            joins = continues(last, (dev_ptr, off_ptr, page), cap)
        if joins:
            sizes[written - ONE] += page
        else:
            dev_out[written] = dev_ptr
            off_out[written] = off_ptr
            sizes[written] = page
            written += ONE
    return written
