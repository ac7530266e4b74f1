"""Coalescing: merging descriptors that continue each other on both sides.

coalesce_kernel merges a finished plan; find_runs and append_runs let
plan_kernel merge while it fills, with exactly coalesce_kernel's result.
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
    overlaps,
)

# A descriptor or a run of them: (src or device ptr, dst or offloaded ptr, size).
Descriptor = tuple[np.uint64, np.uint64, np.uint64]


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
        & (a - min(a, run_a) == run_size)
        & (b - min(b, run_b) == run_size)
        & (run_size <= max_run_bytes)
        & (size <= max_run_bytes - min(run_size, max_run_bytes))
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
    written = ZERO
    run = (ZERO, ZERO, ZERO)
    for i in range(sizes.shape[0]):
        # Read before writing: the outputs may be the inputs.
        descriptor = (src[i], dst[i], sizes[i])
        if written > ZERO and continues(run, descriptor, cap):
            run = (run[0], run[1], run[2] + descriptor[2])
            out_sizes[written - ONE] = run[2]
        else:
            run = descriptor
            out_src[written] = descriptor[0]
            out_dst[written] = descriptor[1]
            out_sizes[written] = descriptor[2]
            written += ONE
    return np.int64(written)


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
def find_runs(blocks: Any, rows: Any, run_starts: UIntArray) -> Any:
    """Split a group's blocks into runs contiguous on both sides, for a ref
    of this geometry: block k continues block k - 1 when both its device and
    its offloaded pointer start where k - 1's page ends.

    Returns:
        The number of runs; run r is blocks run_starts[r]:run_starts[r + 1].
    """
    ref_row, off_row = rows
    row_stride, page_size = ref_row[ROW_STRIDE], ref_row[PAGE_SIZE]
    off_row_stride, sub_bytes = off_row[OFF_ROW_STRIDE], off_row[OFF_SUB_BYTES]
    ids, chunk_of, sub_block_of = blocks
    n_blocks = np.uint64(ids.shape[0])
    run_starts[0] = ZERO
    n_runs = ONE
    for k in range(ONE, n_blocks):
        device_step = (np.int64(ids[k]) - np.int64(ids[k - ONE])) * row_stride
        offloaded_step = (chunk_of[k] - chunk_of[k - ONE]) * off_row_stride + (
            sub_block_of[k] - sub_block_of[k - ONE]
        ) * sub_bytes
        if device_step != page_size or offloaded_step != page_size:
            run_starts[n_runs] = k
            n_runs += ONE
    run_starts[n_runs] = n_blocks
    return n_runs


@inline_helper
def append_runs(
    out: Any, written: Any, blocks: Any, runs: UIntArray, rows: Any, cap: Any
) -> Any:
    """Append one ref's runs of pages as coalesce_kernel would, page by page.

    The first run's pages first grow the last descriptor while it ends where
    they start and stays within the cap (max_run_bytes). Every other page goes
    into a new descriptor holding as many pages of its run as the cap allows
    (one when a page alone is over it): no run continues the run before it, as
    find_runs split them there.

    Args:
        out: (device-side, offloaded-side, sizes) outputs; ``written`` of
            them are filled.
        blocks, rows: as block_pointers.
        runs: run r is blocks runs[r]:runs[r + 1] (find_runs's run_starts).

    Returns:
        The new number of descriptors.
    """
    dev_out, off_out, sizes = out
    page = np.uint64(rows[0][PAGE_SIZE])
    if page == ZERO:
        pages_per_descriptor = np.uint64(blocks[0].shape[0])
    elif page > cap:
        pages_per_descriptor = ONE
    else:
        pages_per_descriptor = cap // page
    for run in range(np.uint64(runs.shape[0]) - ONE):
        start = runs[run]
        n_pages = runs[run + ONE] - start
        dev_ptr, off_ptr = block_pointers(rows, blocks, start)
        if run == ZERO and written > ZERO:
            last = written - ONE
            run_size = sizes[last]
            if continues(
                (dev_out[last], off_out[last], run_size), (dev_ptr, off_ptr, page), cap
            ):
                joined = n_pages
                if page > ZERO:
                    joined = min(n_pages, (cap - run_size) // page)
                sizes[last] = run_size + joined * page
                dev_ptr += joined * page
                off_ptr += joined * page
                n_pages -= joined
        while n_pages > ZERO:
            pages = min(n_pages, pages_per_descriptor)
            dev_out[written] = dev_ptr
            off_out[written] = off_ptr
            sizes[written] = pages * page
            written += ONE
            dev_ptr += pages * page
            off_ptr += pages * page
            n_pages -= pages
    return written
