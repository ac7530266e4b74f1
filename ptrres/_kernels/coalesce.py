"""Coalescing: merging descriptors that continue each other on both sides.

A run of descriptors is ascending (each starts where the one before ends, on
both sides) or descending (each ends where the one before starts, on both
sides); a run is one or the other, and a direction change ends it (SPEC 6).
Merged, a run is one descriptor from its lowest address on each side.

coalesce_kernel merges a finished plan, as append_merged does, which the
canonical kernel also runs on each ref it fills; joined() and grown() decide
and grow one run at a time, for every kernel that merges (plan_runs.py lets
plan_kernel merge while it fills, with exactly coalesce_kernel's result).

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
    OFF_ALLOCATION,
    ONE,
    OVERLAPPING_BUFFERS,
    ZERO,
    IntArray,
    UIntArray,
    lesser,
    overlaps,
    trailing_zeros,
)

# A descriptor or a run of them: (src or device ptr, dst or offloaded ptr, size).
Descriptor = tuple[np.uint64, np.uint64, np.uint64]

# Run states (see the module's docstring).
FRESH = np.uint64(0)
SINGLE = np.uint64(1)
UP = np.uint64(2)
DOWN = np.uint64(3)


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
