"""The file-tier kernel: device pointers to (file, offset) ops (SPEC 11).

One file holds one chunk of one group. plan_file_ops_kernel writes each
file's ops, ordered ref -> block, and where each file's ops start; it returns
the number of ops written or a negative status, as every kernel does.
PointerTable.plan_file_ops resolves into scratch with resolve_kernel first,
then calls this one: one kernel signature fewer to compile at start-up.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._config import inline_helper, kernel
from .coalesce import DOWN, FRESH, SINGLE, UP, ascends, grown, joined
from .common import (
    ONE,
    OVERLAPPING_BUFFERS,
    ZERO,
    IntArray,
    UIntArray,
    chunk_slot,
    lesser,
    overlaps,
)

# Statuses beyond those of common: an op whose size is not its ref's page
# (the other ops of that ref in that group), and a file whose layout would
# not fit in int64 bytes.
BAD_OP_SIZE = np.int64(-4)
FILE_TOO_LARGE = np.int64(-5)

# Rows of the per-group array of plan_file_ops_kernel.
GROUP_IDX, GROUP_SIZE, GROUP_REFS, GROUP_SKIP = 0, 1, 2, 3

# Rows of its per-file output, one entry per file plus one: where each file's
# ops start (the last entry: the number of ops), each file's group (the last
# entry unused) and each file's bytes (the last entry: the plan's num_bytes,
# as uint64 bits). One array, not three: one allocation and two arguments
# fewer on every call.
FILE_START, FILE_GROUP, FILE_BYTES = 0, 1, 2


@inline_helper
def file_ops_overlap(
    dev_out: UIntArray,
    off_out: UIntArray,
    size_out: UIntArray,
    ptrs: UIntArray,
    sizes: UIntArray,
) -> bool:
    """Whether the three op outputs share a byte with each other or an input.

    The per-file outputs are the wrapper's own, fresh arrays: only the ops
    can be a caller's buffers. `|`, not `or`: one branch on the result.
    """
    return bool(
        overlaps(dev_out, off_out) | overlaps(dev_out, size_out)
        | overlaps(off_out, size_out) | overlaps(dev_out, ptrs)
        | overlaps(off_out, ptrs) | overlaps(size_out, ptrs)
        | overlaps(dev_out, sizes) | overlaps(off_out, sizes)
        | overlaps(size_out, sizes)
    )  # fmt: skip


@inline_helper
def group_files(
    ptrs: UIntArray,
    first_op: int,
    n_blocks: int,
    sizes: UIntArray,
    n_refs: int,
    refs_from: Any,
    skip: int,
    bpc: np.uint64,
    block_major: bool,
    merge: bool,
    cap: np.uint64,
    group: int,
    dev_out: UIntArray,
    off_out: UIntArray,
    size_out: UIntArray,
    written: np.uint64,
    files: IntArray,
    n_files: int,
) -> Any:
    """Append the files of one group: one per chunk, ops ordered ref -> block.

    Files are written in order, each file's ops in order: with ``merge``, op
    i + 1 is merged into the run of op i when it continues it on both sides,
    upwards or downwards (coalesce.joined, within max_run_bytes ``cap``),
    inside one file only, and from one ref into the next only when their
    ``allocations`` are equal or unknown (empty).

    Args:
        ptrs: device pointers; those of ref d of this group are
            ``ptrs[first_op + d * n_blocks:][:n_blocks]``.
        sizes: the ops' sizes, as ptrs: every op of a ref has the ref's
            page, and ``bpc`` times the sum of the group's pages fits in
            int64 (both checked).
        refs_from: (the allocation of each ref, the group's first ref in it).
        skip: slot of the group's first block in its first chunk.

    Returns:
        The new number of ops and of files.
    """
    total = ZERO
    for d in range(n_refs):
        total += sizes[first_op + d * n_blocks]
    n_chunks = (np.uint64(n_blocks) + np.uint64(skip) + bpc - ONE) // bpc
    for chunk in range(n_chunks):
        files[FILE_START, n_files] = np.int64(written)
        files[FILE_GROUP, n_files] = group
        files[FILE_BYTES, n_files] = np.int64(bpc * total)
        n_files += 1
        # Blocks k of this chunk: slots skip + k - chunk * bpc in [0, bpc).
        chunk_start = np.uint64(chunk) * bpc
        first_k = chunk_start - lesser(chunk_start, np.uint64(skip))
        end_k = lesser(np.uint64(n_blocks), chunk_start + bpc - np.uint64(skip))
        _, first_slot = chunk_slot(first_k, np.uint64(skip), bpc)
        before = ZERO
        # The file's last op, kept in registers: read back from the outputs,
        # each op's test would wait on the store before it. Only ops of one
        # file merge: its first starts a run.
        run = (ZERO, ZERO, ZERO)
        state = FRESH
        for d in range(n_refs):
            ref_ops = np.uint64(first_op) + np.uint64(d) * np.uint64(n_blocks)
            page = sizes[ref_ops]
            if block_major:
                offset, step = first_slot * total + before, total
            else:
                offset, step = bpc * before + first_slot * page, page
            if not merge:
                # One op per block, branch-free: the loop vectorises.
                for k in range(first_k, end_k):
                    dev_out[written] = ptrs[ref_ops + k]
                    off_out[written] = offset
                    size_out[written] = page
                    offset += step
                    written += ONE
            else:
                # A run passes into this ref's ops only from the same
                # allocation (when the caller knows the refs' allocations).
                allocations, first_ref = refs_from
                if allocations.size and d > 0:
                    ref = first_ref + d
                    if allocations[ref] != allocations[ref - 1]:
                        state = FRESH
                # The ref's first op may grow the run either way.
                rest = first_k  # the ref's ops after its first
                if rest < end_k:
                    op = (ptrs[ref_ops + rest], offset, page)
                    way = joined(run, state, op, cap)
                    if way != FRESH:
                        run = grown(run, way, op)
                        dev_out[written - ONE] = run[0]
                        off_out[written - ONE] = run[1]
                        size_out[written - ONE] = run[2]
                        state = way
                    else:
                        run, state = op, SINGLE
                        dev_out[written], off_out[written], size_out[written] = op
                        written += ONE
                    offset += step
                    rest += ONE
                # A ref's file offsets only grow: its other ops go on a run
                # only upwards, and a descending run ends here.
                if state == DOWN:
                    state = FRESH
                for k in range(rest, end_k):
                    op = (ptrs[ref_ops + k], offset, page)
                    if (state != FRESH) & ascends(run, op, cap):
                        run = (run[0], run[1], run[2] + page)
                        size_out[written - ONE] = run[2]
                        state = UP
                    else:
                        run, state = op, SINGLE
                        dev_out[written], off_out[written], size_out[written] = op
                        written += ONE
                    offset += step
            before += page
    return written, n_files


@kernel(
    "int64(uint64[::1], uint64[::1], int64[:, ::1], int64[::1], int64, boolean,"
    " boolean, int64, uint64[::1], uint64[::1], uint64[::1], int64[:, ::1])"
)
def plan_file_ops_kernel(
    ptrs: UIntArray,
    sizes: UIntArray,
    groups: IntArray,
    allocations: IntArray,
    blocks_per_chunk: int,
    block_major: bool,
    merge: bool,
    max_run_bytes: int,
    dev_out: UIntArray,
    off_out: UIntArray,
    size_out: UIntArray,
    files: IntArray,
) -> int:
    """The file ops of resolved device pointers (SPEC 11).

    Args:
        ptrs, sizes: DevicePointers' arrays, ordered group -> ref -> block.
        groups: (4, n) for the n non-empty groups: GROUP_IDX, GROUP_SIZE,
            GROUP_REFS and GROUP_SKIP (block index % blocks_per_chunk).
        allocations: the allocation of the tensor of each ref of those
            groups, in order (common.ALLOCATION), or empty when unknown: a
            merged op then passes from one ref into the next wherever the
            pointers continue.
        blocks_per_chunk: slots per file (>= 1).
        block_major: llm-d's layout if True, else PR #56076's ref-major one.
        merge: coalesce ops that continue each other on both sides, inside
            one file only (group_files).
        max_run_bytes: the largest merged op (>= 1), or NO_CAP.
        dev_out, off_out, size_out: the ops, at least as long as ``ptrs``.
        files: (3, n_files + 1), the rows FILE_START, FILE_GROUP and
            FILE_BYTES (see there). The wrapper's own: it shares no memory
            with the caller's arrays.

    Returns:
        The number of ops written, BAD_OP_SIZE, FILE_TOO_LARGE or
        OVERLAPPING_BUFFERS. Nothing is written unless every check passes.
    """
    if file_ops_overlap(dev_out, off_out, size_out, ptrs, sizes):
        return OVERLAPPING_BUFFERS
    bpc = np.uint64(blocks_per_chunk)
    cap = np.uint64(np.int64(max_run_bytes))  # NO_CAP (-1) becomes 2**64 - 1
    n_groups = groups.shape[1]
    # Check first: every op of a ref has the ref's page, and files fit: every
    # offset of a file of bpc * (the sum of its group's pages) bytes is an
    # int64. Nothing is allocated here: group_files reads each ref's page
    # from its first op, so that kernels run without Numba's runtime.
    limit = np.uint64(2**63 - 1) // bpc
    op = 0
    num_bytes = ZERO
    for g in range(n_groups):
        n_blocks, n_refs = groups[GROUP_SIZE, g], groups[GROUP_REFS, g]
        file_bytes = ZERO  # per chunk: bpc times this
        too_large = False
        for _ in range(n_refs):
            page = sizes[op]
            # The bits where any size differs from the page: no branch in
            # the loop, so that it vectorises.
            differs = ZERO
            for k in range(op, op + n_blocks):
                differs |= sizes[k] ^ page
            if differs:
                return BAD_OP_SIZE
            too_large |= page > limit - file_bytes
            file_bytes += lesser(page, limit - file_bytes)  # stays <= limit
            num_bytes += page * np.uint64(n_blocks)
            op += n_blocks
        if too_large:
            return FILE_TOO_LARGE
    files[FILE_BYTES, files.shape[1] - 1] = np.int64(num_bytes)
    # Typed int64 from the start: a literal 0 would have group_files compiled
    # a second time, for Literal[int](0), while Numba infers the loop's types.
    written = ZERO
    n_files = op = first_ref = np.int64(0)
    for g in range(n_groups):
        n_blocks, n_refs = groups[GROUP_SIZE, g], groups[GROUP_REFS, g]
        written, n_files = group_files(
            ptrs, op, n_blocks, sizes, n_refs, (allocations, first_ref),
            groups[GROUP_SKIP, g], bpc, block_major, merge, cap,
            groups[GROUP_IDX, g], dev_out, off_out, size_out, written, files,
            n_files,
        )  # fmt: skip
        op += n_blocks * n_refs
        first_ref += n_refs
    files[FILE_START, n_files] = np.int64(written)
    return np.int64(written)
