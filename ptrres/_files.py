"""plan_file_ops(): device pointers to the (file, offset) ops of the file tier.

vLLM PR #56076's ``FSOffloadingWorker``s (GPUDirect Storage, POSIX, NIXL)
store one chunk of one group per file. This module turns resolved device
pointers, or a spec's block ids against a PointerTable, into every file's
ops, in one compiled pass (SPEC section 11). PointerTable.plan_file_ops
checks its options and spec and comes here with its arrays
(plan_spec_file_ops).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from . import _kernels
from ._args import (
    DEVICE_POINTERS_FIELDS,
    Buffers,
    as_int,
    descriptor_array,
    max_run_arg,
    missing_attributes,
    out_arrays,
)
from ._diagnose import file_plan_error, overlap_error, resolve_error
from ._errors import InputTypeError, SpecError
from ._geometry import Groups
from ._groups import GroupCounts, iter_pointer_groups
from ._kernels.files import FILE_BYTES, FILE_GROUP, FILE_START
from ._results import DevicePointers, FilePlan

IntTable = npt.NDArray[np.int64]

# The layouts of a file (SPEC 11), and whether each is block-major.
LAYOUTS = ("ref-major", "block-major")
_BLOCK_MAJOR = {"ref-major": False, "block-major": True}
# What the out= buffers of plan_file_ops are, in order (for out_arrays).
FILE_OPS = ("out[0] (dev_ptrs)", "out[1] (file_offsets)", "out[2] (sizes)")


def plan_file_ops(
    device_ptrs: Any,
    blocks_per_chunk: int,
    *,
    layout: str = "ref-major",
    coalesce: bool = False,
    max_run_bytes: int | None = None,
    out: Buffers | None = None,
) -> FilePlan:
    """Every file's ops for resolved device pointers (SPEC 11).

    One file holds one chunk of one group; files are numbered in (non-empty
    group, chunk) order, the order of the offload keys. Block k of a group
    (j = skip + k) lands in slot ``s = j % bpc`` of the group's file
    ``j // bpc``. With the pages P[d] of the group's refs and ``before(d) =
    P[0] + ... + P[d - 1]``:

        ref-major (PR #56076):  file_offset = bpc * before(d) + s * P[d]
        block-major (llm-d):    file_offset = s * sum(P) + before(d)

    A file's ops are ordered ref -> block. A partial first chunk leaves slots
    [0, skip) untouched.

    Args:
        device_ptrs: DevicePointers (any object with its fields), ordered
            group -> ref -> block, as resolve_device_pointers returns them.
            Every op of one ref of one group must have the same size.
        blocks_per_chunk: device blocks per file (>= 1).
        layout: "ref-major" (each ref has a region of bpc slots) or
            "block-major" (each slot holds every ref).
        coalesce: merge op i + 1 into op i when both its device pointer and
            its file offset continue op i, inside one file only.
        max_run_bytes: the largest merged op, when coalescing.
        out: optional ``(dev_ptrs, file_offsets, sizes)`` buffers, 1-D int64
            or uint64, at least as long as the number of ops, apart from each
            other and from the input. The plan's op arrays are then uint64
            views of them.

    Returns:
        A FilePlan.

    Raises:
        SpecError: counts that do not match the pointers, an op whose size is
            not its ref's page, a file larger than 2**63 - 1 bytes.
        InputTypeError, OutBufferError: malformed input.
    """
    options = file_options(blocks_per_chunk, layout, coalesce, max_run_bytes)
    try:
        raw_ptrs, raw_sizes = device_ptrs.ptrs, device_ptrs.sizes
        counts = (
            device_ptrs.group_block_counts,
            device_ptrs.group_data_ref_counts,
            device_ptrs.block_indices,
        )
    except AttributeError:
        raise missing_attributes(
            device_ptrs, DEVICE_POINTERS_FIELDS, "device_ptrs"
        ) from None
    groups, n_ops, n_files = _groups(device_ptrs, counts, options[0])
    ptrs = descriptor_array(raw_ptrs, "device_ptrs.ptrs")
    sizes = descriptor_array(raw_sizes, "device_ptrs.sizes")
    if not len(ptrs) == len(sizes) == n_ops:
        raise SpecError(
            f"device_ptrs has {len(ptrs)} ptrs and {len(sizes)} sizes, but its "
            f"groups make {n_ops} ops"
        )
    outputs = None if out is None else out_arrays(out, n_ops, FILE_OPS)
    return _run(ptrs, sizes, groups, n_files, options, outputs, device_ptrs, _UNKNOWN)


def plan_spec_file_ops(
    ref_table: IntTable,
    ref_allocations: IntTable,
    group_ref_start: IntTable,
    group_sizes: IntTable,
    ref_rows: Groups,
    ref_counts: tuple[int, ...],
    block_ids: npt.NDArray[Any],
    counts: GroupCounts,
    options: FileOptions,
    out: Buffers | None,
) -> FilePlan:
    """PointerTable.plan_file_ops: resolve a checked spec into scratch,
    checking every block id before anything is written, then plan its files.

    Args:
        ref_table, group_ref_start: the table's.
        ref_allocations: its ALLOCATION column, contiguous.
        group_sizes: counts' group sizes as an int64 array.
        ref_rows, ref_counts: the table's refs, group by group, and how
            many each group has.
        options: file_options()'s.
        block_ids, out: as PointerTable.plan_file_ops().
    """
    n_ops, _, sizes_of_groups, block_indices = counts
    outputs = None
    if out is not None:
        outputs = out_arrays(out, n_ops, FILE_OPS)
        # The kernel reads the ids' pointers from scratch, but the plan must
        # not overwrite the caller's ids either.
        for buffer in outputs:
            if len(buffer) and np.may_share_memory(buffer, block_ids):
                raise overlap_error(
                    "out's dev_ptrs, file_offsets and sizes, and block_ids"
                )
    ptrs = np.empty(n_ops, np.uint64)
    sizes = np.empty(n_ops, np.uint64)
    status = _kernels.resolve_kernel(
        ref_table, group_ref_start, block_ids, group_sizes, ptrs, sizes
    )
    if status < 0:  # the scratch is the wrapper's own: only an id can be bad
        raise resolve_error(ref_rows, block_ids, sizes_of_groups)
    resolved = DevicePointers(ptrs, sizes, sizes_of_groups, ref_counts, block_indices)
    groups, _, n_files = _groups(
        resolved, (sizes_of_groups, ref_counts, block_indices), options[0]
    )
    # The allocation of each ref of the non-empty groups, in order: what
    # merging needs (a plain plan never reads it).
    allocations = _UNKNOWN
    if options[2]:
        allocations = ref_allocations
        if not all(sizes_of_groups):  # the refs of empty groups left out
            non_empty = np.repeat(
                np.asarray(sizes_of_groups) > 0, np.diff(group_ref_start)
            )
            allocations = np.ascontiguousarray(ref_allocations[non_empty])
    return _run(ptrs, sizes, groups, n_files, options, outputs, resolved, allocations)


# Device pointers alone do not say which allocation each lies in: merged ops
# then pass from one ref into the next wherever the pointers continue.
_UNKNOWN = np.empty(0, np.int64)

# Checked options (file_options): bpc, block-major or not, merge, the cap.
FileOptions = tuple[int, bool, bool, int]


def _run(
    ptrs: npt.NDArray[np.uint64],
    sizes: npt.NDArray[np.uint64],
    groups: npt.NDArray[np.int64],
    n_files: int,
    options: FileOptions,
    outputs: list[npt.NDArray[np.uint64]] | None,
    device_ptrs: Any,
    allocations: npt.NDArray[np.int64],
) -> FilePlan:
    """Run the file kernel on checked input, and turn a failure into its error.

    ``outputs`` are the views out_arrays made of the caller's out= buffers, or
    None for new arrays (made here: out_arrays' generic path costs more).
    ``allocations`` are the refs' (the kernel's), or _UNKNOWN.
    """
    bpc, block_major, merge, cap = options
    n_ops = len(ptrs)
    if outputs is None:
        dev_out = np.empty(n_ops, np.uint64)
        off_out = np.empty(n_ops, np.uint64)
        size_out = np.empty(n_ops, np.uint64)
    else:
        dev_out, off_out, size_out = outputs
    files = np.empty((3, n_files + 1), np.int64)
    written = _kernels.plan_file_ops_kernel(
        ptrs, sizes, groups, allocations, bpc, block_major, merge, cap,
        dev_out, off_out, size_out, files,
    )  # fmt: skip
    if written < 0:
        if written == _kernels.OVERLAPPING_BUFFERS:
            raise overlap_error("out's dev_ptrs, file_offsets and sizes, and the input")
        raise file_plan_error(list(iter_pointer_groups(device_ptrs, bpc)), sizes, bpc)
    if written < n_ops:
        dev_out, off_out, size_out = (
            dev_out[:written],
            off_out[:written],
            size_out[:written],
        )
    num_bytes = files.item(FILE_BYTES, n_files)  # the sum of sizes, int64 bits
    return FilePlan(
        dev_out, off_out, size_out, files[FILE_START],
        files[FILE_GROUP, :n_files], files[FILE_BYTES, :n_files],
        num_bytes if num_bytes >= 0 else num_bytes + 2**64,
    )  # fmt: skip


# The non-empty groups of a file plan, by their (group_block_counts,
# group_data_ref_counts, block_indices) and bpc: transfers repeat their
# shapes, and reading the counts costs more than planning a few hundred ops.
_GroupsEntry = tuple[npt.NDArray[np.int64], int, int]
_groups_cache: dict[tuple[Any, ...], _GroupsEntry] = {}
_MAX_CACHED_GROUPS = 256


def _groups(device_ptrs: Any, counts: tuple[Any, Any, Any], bpc: int) -> _GroupsEntry:
    """The kernel's (4, n) array of non-empty groups, the ops and the files.

    Counts given as tuples of Python ints (as DevicePointers holds them) are
    looked up in a cache; anything else goes through iter_pointer_groups'
    checks, which also produce the error messages.
    """
    block_counts, ref_counts, block_indices = counts
    key = None
    if (
        type(block_counts) is tuple
        and type(ref_counts) is tuple
        and type(block_indices) is tuple
    ):
        key = (block_counts, ref_counts, block_indices, bpc)
        entry = _groups_cache.get(key)
        # A hit by equal values still needs them to be ints: True == 1.
        if entry is not None and _all_ints(key):
            return entry
    infos = list(iter_pointer_groups(device_ptrs, bpc))
    groups = np.array(
        [
            [info.group_idx for info in infos],
            [info.group_size for info in infos],
            [info.n_data_refs for info in infos],
            [info.skip for info in infos],
        ],
        np.int64,
    ).reshape(4, len(infos))
    entry = (
        groups,
        sum(info.group_size * info.n_data_refs for info in infos),
        sum(info.n_chunks for info in infos),
    )
    if key is not None and _all_ints(key):
        if len(_groups_cache) >= _MAX_CACHED_GROUPS:
            _groups_cache.clear()
        _groups_cache[key] = entry
    return entry


_INT_ONLY = {int}


def _all_ints(key: tuple[Any, ...]) -> bool:
    """Whether the three count tuples of a cache key hold Python ints only."""
    counts_a, counts_b, counts_c, _ = key
    return _INT_ONLY.issuperset(map(type, counts_a + counts_b + counts_c))


def file_options(
    blocks_per_chunk: Any, layout: Any, coalesce: Any, max_run_bytes: Any
) -> FileOptions:
    """The checked options: bpc, block-major or not, merge, the kernel's cap."""
    if type(blocks_per_chunk) is int:
        bpc = blocks_per_chunk
    else:
        bpc = as_int(blocks_per_chunk, "blocks_per_chunk")
    if not 1 <= bpc < 2**63:  # the kernel takes an int64
        raise SpecError(f"blocks_per_chunk must be >= 1 and < 2**63, got {bpc}")
    if not isinstance(layout, str):
        raise InputTypeError(
            f"layout must be one of {LAYOUTS}, got {type(layout).__name__}"
        )
    block_major = _BLOCK_MAJOR.get(layout)
    if block_major is None:
        raise SpecError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if type(coalesce) is not bool:
        raise InputTypeError(f"coalesce must be True or False, got {coalesce!r}")
    cap = _kernels.NO_CAP if max_run_bytes is None else max_run_arg(max_run_bytes)
    return bpc, block_major, coalesce, cap
