"""The compiled kernels. They only compute into arrays they are given.

A kernel never sees a Python object and never raises. It returns how many
entries it wrote, or a negative status: BAD_BLOCK_ID or BAD_OFFLOADED_ID when
an id is out of range (the wrapper then finds the first bad id and raises an
error that names the group, the position and the value), OVERLAPPING_BUFFERS
when an output shares memory with another output or an input (checked before
anything is written). What a failed call wrote is never returned: the wrapper
zeroes it.

Indices are unsigned wherever they are computed: Numba then adds no
negative-index wraparound, and the inner loops vectorise. A range check is
``uint64(id) >= limit``, which also rejects negative ids.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ._config import inline_helper, kernel

# Columns of PointerTable.ref_table: one row per (group, ref), in copy order,
# in the order of the fields of _layout.RefRow.
BASE_PTR = 0  # data pointer of the ref's tensor
ROW_STRIDE = 1  # bytes between two blocks of that tensor
PAGE_SIZE = 2  # bytes to copy per block (the ref's page_size_bytes)
NUM_BLOCKS = 3  # blocks in the tensor: valid ids are 0 <= id < NUM_BLOCKS
TENSOR_IDX = 4  # index of the tensor in CanonicalKVCaches.tensors
REF_COLUMNS = 5

# Columns of the offloaded side of each ref (same rows as the ref table), in
# the order of the fields of _layout.OffloadedGeometry.
OFF_BASE_PTR = 0  # data pointer of the offloaded tensor of the ref's tensor_idx
OFF_ROW_STRIDE = 1  # bytes between two chunks (rows) of it
OFF_SUB_BYTES = 2  # bytes of one sub-block: row bytes // blocks_per_chunk
OFF_NUM_CHUNKS = 3  # chunks (rows) it holds
OFF_COLUMNS = 4

# Negative statuses a kernel returns instead of a count. Every kernel returns
# int64 on every path, so that compiling lazily for the argument types infers
# exactly the declared signature.
BAD_BLOCK_ID = np.int64(-1)
BAD_OFFLOADED_ID = np.int64(-2)
# An output shares memory with another output or with an input: nothing is
# written, since the results would overwrite each other or the ids.
OVERLAPPING_BUFFERS = np.int64(-3)

# max_run_bytes when runs are not capped. Kernels take the cap as an int64
# (Numba types a Python int faster than a numpy scalar) and read it as uint64:
# -1 is then the largest cap there is.
NO_CAP = -1

# Unsigned constants: Numba types uint64 mixed with a plain int as float64.
ZERO = np.uint64(0)
ONE = np.uint64(1)

IntArray = npt.NDArray[Any]
UIntArray = npt.NDArray[np.uint64]

_TABLE = "int64[:, ::1], int64[::1]"
_IDS = ("int32[::1]", "int64[::1]")


@kernel(
    *(f"int64({_TABLE}, {ids}, int64[::1], uint64[::1], uint64[::1])" for ids in _IDS)
)
def resolve_kernel(
    ref_table: IntArray,
    group_ref_start: IntArray,
    block_ids: IntArray,
    group_sizes: IntArray,
    ptrs: UIntArray,
    sizes: UIntArray,
) -> int:
    """Fill ptrs and sizes for every (group, ref, block), in that order.

    Args:
        ref_table: (n_refs, REF_COLUMNS), rows ordered by group then ref.
        group_ref_start: the refs of group g are rows
            group_ref_start[g]:group_ref_start[g + 1] of ref_table.
        block_ids: the spec's ids, group by group.
        group_sizes: ids per group, checked to sum to len(block_ids).
        ptrs, sizes: outputs, at least as long as the number of ops.

    Returns:
        The number of ops written, BAD_BLOCK_ID or OVERLAPPING_BUFFERS.
    """
    # No output may share a byte with the other or with the ids (written
    # out: a helper function or a loop costs compile time, and in plan_kernel
    # speed). The outputs are both empty or both not.
    if ptrs.size:
        p0, s0, i0 = ptrs.ctypes.data, sizes.ctypes.data, block_ids.ctypes.data
        p1, s1 = p0 + np.uint64(ptrs.nbytes), s0 + np.uint64(sizes.nbytes)
        i1 = i0 + np.uint64(block_ids.nbytes)
        if (p0 < s1) & (s0 < p1) | (i0 < i1) & (
            (p0 < i1) & (i0 < p1) | (s0 < i1) & (i0 < s1)
        ):  # fmt: skip
            return OVERLAPPING_BUFFERS
    op = ZERO
    first_id = ZERO
    for group in range(group_sizes.shape[0]):
        n_blocks = np.uint64(group_sizes[group])
        for ref in range(group_ref_start[group], group_ref_start[group + 1]):
            base_ptr = ref_table[ref, BASE_PTR]
            row_stride = ref_table[ref, ROW_STRIDE]
            page_size = ref_table[ref, PAGE_SIZE]
            num_blocks = np.uint64(ref_table[ref, NUM_BLOCKS])
            # The range check is accumulated without a branch, so that the
            # loop vectorises; meanwhile a bad id counts as block 0, so that
            # no product overflows (the pointers are zeroed anyway).
            out_of_range = False
            for k in range(n_blocks):
                block_id = np.int64(block_ids[first_id + k])
                bad = np.uint64(block_id) >= num_blocks
                out_of_range |= bad
                ptrs[op + k] = base_ptr + (0 if bad else block_id) * row_stride
                sizes[op + k] = page_size
            if out_of_range:
                return BAD_BLOCK_ID
            op += n_blocks
        first_id += n_blocks
    return np.int64(op)


# One signature: the wrappers widen int32 ids (a copy that costs little next
# to a plan), since each signature of this kernel takes a second to compile.
@kernel(
    f"int64({_TABLE}, int64[:, ::1], int64[::1], int64[:, ::1], int64[::1],"
    " int64, boolean, boolean, int64, uint64[::1], uint64[::1], uint64[::1])"
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
        src, dst, sizes: outputs, at least as long as the number of ops.

    Returns:
        The number of descriptors written, BAD_OFFLOADED_ID (also for a wrong
        number of offloaded ids), BAD_BLOCK_ID or OVERLAPPING_BUFFERS.
    """
    # No output may share a byte with another or with the ids (written out,
    # as in resolve_kernel). The outputs are all empty or all not.
    if src.size:
        s0, d0, z0 = src.ctypes.data, dst.ctypes.data, sizes.ctypes.data
        s1, d1 = s0 + np.uint64(src.nbytes), d0 + np.uint64(dst.nbytes)
        z1 = z0 + np.uint64(sizes.nbytes)
        b0, c0 = block_ids.ctypes.data, offloaded_ids.ctypes.data
        b1, c1 = b0 + np.uint64(block_ids.nbytes), c0 + np.uint64(offloaded_ids.nbytes)
        if (
            (s0 < d1) & (d0 < s1) | (s0 < z1) & (z0 < s1) | (d0 < z1) & (z0 < d1)
            | (b0 < b1) & ((s0 < b1) & (b0 < s1) | (d0 < b1) & (b0 < d1)
                           | (z0 < b1) & (b0 < z1))
            | (c0 < c1) & ((s0 < c1) & (c0 < s1) | (d0 < c1) & (c0 < d1)
                           | (z0 < c1) & (c0 < z1))
        ):  # fmt: skip
            return OVERLAPPING_BUFFERS
    bpc = np.uint64(blocks_per_chunk)
    cap = np.uint64(np.int64(max_run_bytes))  # NO_CAP (-1) becomes 2**64 - 1
    group_sizes, block_indices = groups[0], groups[1]
    n_groups = group_sizes.shape[0]
    # Device pointers go to src on a store and to dst on a load; contiguity is
    # the same condition in either direction.
    if store:
        dev_out, off_out = src, dst
    else:
        dev_out, off_out = dst, src

    # Check every id before writing: each group's smallest and largest device
    # and offloaded ids against each of its refs' tensors.
    n_offloaded_ids = np.uint64(offloaded_ids.shape[0])
    first_id = first_chunk = ZERO
    max_group_size = ZERO
    for group in range(n_groups):
        n_blocks = np.uint64(group_sizes[group])
        if n_blocks == ZERO:
            continue
        n_chunks = (n_blocks + np.uint64(block_indices[group]) % bpc + bpc - ONE) // bpc
        if first_chunk + n_chunks > n_offloaded_ids:
            return BAD_OFFLOADED_ID
        ids = block_ids[first_id : first_id + n_blocks]
        chunks = offloaded_ids[first_chunk : first_chunk + n_chunks]
        lowest_id, highest_id = id_range(ids)
        lowest_chunk, highest_chunk = id_range(chunks)
        for ref in range(group_ref_start[group], group_ref_start[group + 1]):
            if lowest_id < 0 or highest_id >= ref_table[ref, NUM_BLOCKS]:
                return BAD_BLOCK_ID
            if lowest_chunk < 0 or highest_chunk >= offloaded_refs[ref, OFF_NUM_CHUNKS]:
                return BAD_OFFLOADED_ID
        max_group_size = max(max_group_size, n_blocks)
        first_id += n_blocks
        first_chunk += n_chunks
    if first_chunk != n_offloaded_ids:
        return BAD_OFFLOADED_ID

    # Per group: the chunk and sub-block of each block, and (when merging)
    # where the runs of contiguous blocks start.
    chunk_of = np.empty(max_group_size, np.int64)
    sub_block_of = np.empty(max_group_size, np.int64)
    run_starts = np.empty(max_group_size + ONE, np.uint64)
    written = ZERO
    first_id = first_chunk = ZERO
    for group in range(n_groups):
        n_blocks = np.uint64(group_sizes[group])
        if n_blocks == ZERO:
            continue
        ids = block_ids[first_id : first_id + n_blocks]
        first_id += n_blocks
        sub = np.uint64(block_indices[group]) % bpc
        for k in range(n_blocks):
            chunk_of[k] = offloaded_ids[first_chunk]
            sub_block_of[k] = np.int64(sub)
            sub += ONE
            if sub == bpc:
                sub = ZERO
                first_chunk += ONE
        if sub != ZERO:
            first_chunk += ONE

        runs_of = (-1, -1, -1, -1)  # the geometry run_starts was found for
        n_runs = ZERO
        for ref in range(group_ref_start[group], group_ref_start[group + 1]):
            base_ptr = ref_table[ref, BASE_PTR]
            row_stride = ref_table[ref, ROW_STRIDE]
            page_size = ref_table[ref, PAGE_SIZE]
            off_base_ptr = offloaded_refs[ref, OFF_BASE_PTR]
            off_row_stride = offloaded_refs[ref, OFF_ROW_STRIDE]
            sub_bytes = offloaded_refs[ref, OFF_SUB_BYTES]
            dev_ptr = np.uint64(base_ptr + np.int64(ids[0]) * row_stride)
            off_ptr = np.uint64(
                off_base_ptr
                + chunk_of[0] * off_row_stride
                + sub_block_of[0] * sub_bytes
            )
            page = np.uint64(page_size)
            first_op = ZERO  # the ops before it joined the last descriptor
            if merge:
                # Refs of one group usually share their geometry, and with it
                # their runs: find them once per group.
                geometry = (row_stride, page_size, off_row_stride, sub_bytes)
                if geometry != runs_of:
                    runs_of = geometry
                    n_runs = find_runs(
                        ids, chunk_of, sub_block_of, row_stride, page_size,
                        off_row_stride, sub_bytes, run_starts,
                    )  # fmt: skip
                if n_runs < n_blocks:
                    written = append_runs(
                        dev_out, off_out, sizes, written, ids, chunk_of,
                        sub_block_of, run_starts, n_runs, base_ptr, row_stride,
                        page, off_base_ptr, off_row_stride, sub_bytes, cap,
                    )  # fmt: skip
                    continue
                # No two blocks of this ref continue each other: only the
                # first may continue the last descriptor (of another ref).
                if written > ZERO and continues(
                    dev_out[written - ONE], off_out[written - ONE],
                    sizes[written - ONE], dev_ptr, off_ptr, page, cap,
                ):  # fmt: skip
                    sizes[written - ONE] += page
                    first_op = ONE
            # One descriptor per block, branch-free: the loop vectorises.
            for k in range(first_op, n_blocks):
                op = written + k - first_op
                dev_out[op] = base_ptr + np.int64(ids[k]) * row_stride
                off_out[op] = (
                    off_base_ptr
                    + chunk_of[k] * off_row_stride
                    + sub_block_of[k] * sub_bytes
                )
                sizes[op] = page_size
            written += n_blocks - first_op
    return np.int64(written)


@inline_helper
def id_range(ids: IntArray) -> tuple[int, int]:
    """The smallest and the largest of a non-empty array of ids, as int64.

    A plain loop: it compiles much faster than ndarray.min() and max().
    """
    lowest = highest = np.int64(ids[0])
    for k in range(1, ids.shape[0]):
        block_id = np.int64(ids[k])
        lowest = min(lowest, block_id)
        highest = max(highest, block_id)
    return lowest, highest


@inline_helper
def find_runs(
    ids: IntArray,
    chunk_of: IntArray,
    sub_block_of: IntArray,
    row_stride: int,
    page_size: int,
    off_row_stride: int,
    sub_bytes: int,
    run_starts: UIntArray,
) -> Any:
    """Split a group's blocks into runs contiguous on both sides, for a ref
    of this geometry: block k continues block k - 1 when both its device and
    its offloaded pointer start where k - 1's page ends.

    Returns:
        The number of runs; run r is blocks run_starts[r]:run_starts[r + 1].
    """
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
    dev_out: UIntArray,
    off_out: UIntArray,
    sizes: UIntArray,
    written: np.uint64,
    ids: IntArray,
    chunk_of: IntArray,
    sub_block_of: IntArray,
    run_starts: UIntArray,
    n_runs: np.uint64,
    base_ptr: int,
    row_stride: int,
    page: np.uint64,
    off_base_ptr: int,
    off_row_stride: int,
    sub_bytes: int,
    max_run_bytes: np.uint64,
) -> Any:
    """Append one ref's runs of pages as coalesce_kernel would, page by page.

    The first run's pages first grow the last descriptor while it ends where
    they start and stays within max_run_bytes. Every other page goes into a
    new descriptor holding as many pages of its run as the cap allows (one
    when a page alone is over it): no run continues the run before it, as
    find_runs split them there.

    Returns:
        The new number of descriptors.
    """
    if page == ZERO:
        pages_per_descriptor = np.uint64(ids.shape[0])
    elif page > max_run_bytes:
        pages_per_descriptor = ONE
    else:
        pages_per_descriptor = max_run_bytes // page
    for run in range(n_runs):
        start = run_starts[run]
        n_pages = run_starts[run + ONE] - start
        dev_ptr = np.uint64(base_ptr + np.int64(ids[start]) * row_stride)
        off_ptr = np.uint64(
            off_base_ptr
            + chunk_of[start] * off_row_stride
            + sub_block_of[start] * sub_bytes
        )
        if run == ZERO and written > ZERO:
            last = written - ONE
            run_size = sizes[last]
            if continues(
                dev_out[last], off_out[last], run_size, dev_ptr, off_ptr, page,
                max_run_bytes,
            ):  # fmt: skip
                joined = n_pages
                if page > ZERO:
                    joined = min(n_pages, (max_run_bytes - run_size) // page)
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


@inline_helper
def continues(
    run_a: np.uint64,
    run_b: np.uint64,
    run_size: np.uint64,
    a: np.uint64,
    b: np.uint64,
    size: np.uint64,
    max_run_bytes: np.uint64,
) -> bool:
    """Whether (a, b, size) continues the run (run_a, run_b, run_size).

    It does when it starts where the run ends on both sides (the ends not
    wrapping around the address space) and the grown run stays within
    max_run_bytes. Computed without wrapping (a - run_a only where a >=
    run_a): without the JIT, numpy warns of every overflow.
    """
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
    # one that overlaps its own input must be it (in place). Written out, as
    # in resolve_kernel; all six arrays are empty or none is.
    if sizes.size:
        os0, od0, oz0 = out_src.ctypes.data, out_dst.ctypes.data, out_sizes.ctypes.data
        s0, d0, z0 = src.ctypes.data, dst.ctypes.data, sizes.ctypes.data
        os1, od1 = os0 + np.uint64(out_src.nbytes), od0 + np.uint64(out_dst.nbytes)
        oz1, z1 = oz0 + np.uint64(out_sizes.nbytes), z0 + np.uint64(sizes.nbytes)
        s1, d1 = s0 + np.uint64(src.nbytes), d0 + np.uint64(dst.nbytes)
        if (
            (os0 < od1) & (od0 < os1) | (os0 < oz1) & (oz0 < os1)
            | (od0 < oz1) & (oz0 < od1)
            | (os0 < d1) & (d0 < os1) | (os0 < z1) & (z0 < os1)
            | (od0 < s1) & (s0 < od1) | (od0 < z1) & (z0 < od1)
            | (oz0 < s1) & (s0 < oz1) | (oz0 < d1) & (d0 < oz1)
            | (os0 < s1) & (s0 < os1) & (os0 != s0)
            | (od0 < d1) & (d0 < od1) & (od0 != d0)
            | (oz0 < z1) & (z0 < oz1) & (oz0 != z0)
        ):  # fmt: skip
            return OVERLAPPING_BUFFERS
    cap = np.uint64(np.int64(max_run_bytes))  # NO_CAP (-1) becomes 2**64 - 1
    written = ZERO
    run_src = run_dst = run_size = ZERO
    for i in range(sizes.shape[0]):
        # Read before writing: the outputs may be the inputs.
        src_ptr, dst_ptr, size = src[i], dst[i], sizes[i]
        if written > ZERO and continues(
            run_src, run_dst, run_size, src_ptr, dst_ptr, size, cap
        ):
            run_size += size
            out_sizes[written - ONE] = run_size
        else:
            run_src, run_dst, run_size = src_ptr, dst_ptr, size
            out_src[written] = src_ptr
            out_dst[written] = dst_ptr
            out_sizes[written] = size
            written += ONE
    return np.int64(written)


@kernel(f"int64({_TABLE}, int64[::1], uint64[::1], uint64[::1], int64[::1])")
def block_ids_from_pointers(
    ref_table: IntArray,
    group_ref_start: IntArray,
    group_sizes: IntArray,
    ptrs: UIntArray,
    sizes: UIntArray,
    block_ids: IntArray,
) -> int:
    """Recover the block ids behind resolved device pointers, checking them.

    Every op must be ``base + id * row_stride`` of its ref's tensor, with
    ``0 <= id < num_blocks``, the same id for every ref of its group, and the
    ref's page as its size. Ids of a group without refs cannot be recovered
    and are set to 0 (no op uses them).

    Returns:
        -1 when every op checks out, else the index of the first op that does
        not.
    """
    op = 0
    first_id = 0
    for group in range(group_sizes.shape[0]):
        n_blocks = group_sizes[group]
        first_ref = group_ref_start[group]
        for k in range(n_blocks):
            block_ids[first_id + k] = 0
        for ref in range(first_ref, group_ref_start[group + 1]):
            base_ptr = np.uint64(ref_table[ref, BASE_PTR])
            row_stride = np.uint64(ref_table[ref, ROW_STRIDE])
            page_size = np.uint64(ref_table[ref, PAGE_SIZE])
            num_blocks = np.uint64(ref_table[ref, NUM_BLOCKS])
            for k in range(n_blocks):
                ptr = ptrs[op + k]
                if ref == first_ref and ptr >= base_ptr and row_stride > 0:
                    block_ids[first_id + k] = np.int64((ptr - base_ptr) // row_stride)
                block_id = np.uint64(block_ids[first_id + k])
                if (
                    block_id >= num_blocks
                    or ptr != base_ptr + block_id * row_stride
                    or sizes[op + k] != page_size
                ):
                    return op + k
            op += n_blocks
        first_id += n_blocks
    return -1
