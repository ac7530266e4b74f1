"""plan_file_ops(): device pointers to the (file, offset) ops of the file tier.

vLLM PR #56076's ``FSOffloadingWorker``s (GPUDirect Storage, POSIX, NIXL)
store one chunk of one group per file. This module turns resolved device
pointers, or a spec's block ids against a PointerTable, into every file's
ops, in one compiled pass (SPEC section 11).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from . import _file_kernels
from ._errors import InputTypeError, SpecError
from ._kernels import OVERLAPPING_BUFFERS
from ._layout import (
    DEVICE_POINTERS_FIELDS,
    INT64,
    SPEC_FIELDS,
    as_int,
    attributes,
    descriptor_array,
    missing_attributes,
    num_chunks,
    out_arrays,
    overlap_error,
)
from ._pointer_utils import iter_pointer_groups
from ._table import _block_ids, max_run_arg
from ._types import FilePlan

if TYPE_CHECKING:
    from ._table import Buffers, PointerTable

# The layouts of a file (SPEC 11).
LAYOUTS = ("ref-major", "block-major")
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
    bpc, block_major, merge, cap = _options(
        blocks_per_chunk, layout, coalesce, max_run_bytes
    )
    raw_ptrs, raw_sizes, *counts = attributes(
        device_ptrs, DEVICE_POINTERS_FIELDS, "device_ptrs"
    )
    groups, n_ops, n_files = _groups(device_ptrs, counts, bpc)
    ptrs = descriptor_array(raw_ptrs, "device_ptrs.ptrs")
    sizes = descriptor_array(raw_sizes, "device_ptrs.sizes")
    if not len(ptrs) == len(sizes) == n_ops:
        raise SpecError(
            f"device_ptrs has {len(ptrs)} ptrs and {len(sizes)} sizes, but its "
            f"groups make {n_ops} ops"
        )
    dev_out, off_out, size_out = out_arrays(out, n_ops, FILE_OPS)
    file_starts, file_groups, file_bytes = _file_arrays(n_files, 1)
    written = _file_kernels.plan_file_ops_kernel(
        ptrs, sizes, groups, bpc, block_major, merge, cap,
        dev_out, off_out, size_out, file_starts, file_groups, file_bytes,
    )  # fmt: skip
    if written < 0:
        if written == OVERLAPPING_BUFFERS:
            raise overlap_error("out's dev_ptrs, file_offsets and sizes, and the input")
        raise _size_error(list(iter_pointer_groups(device_ptrs, bpc)), sizes, bpc)
    if written < n_ops:
        dev_out, off_out, size_out = (
            dev_out[:written],
            off_out[:written],
            size_out[:written],
        )
    return FilePlan(
        dev_out, off_out, size_out, file_starts, file_groups, file_bytes[:n_files],
        int(file_bytes[n_files:].view(np.uint64)[0]),
    )  # fmt: skip


def plan_table_file_ops(
    table: PointerTable,
    device_spec: Any,
    blocks_per_chunk: int,
    *,
    layout: str = "ref-major",
    coalesce: bool = False,
    max_run_bytes: int | None = None,
    out: Buffers | None = None,
) -> FilePlan:
    """PointerTable.plan_file_ops: resolve a spec and plan its files in one pass."""
    bpc, block_major, merge, cap = _options(
        blocks_per_chunk, layout, coalesce, max_run_bytes
    )
    try:
        raw_ids = device_spec.block_ids
        raw_sizes, raw_indices = device_spec.group_sizes, device_spec.block_indices
    except AttributeError:
        raise missing_attributes(device_spec, SPEC_FIELDS, "device_spec") from None
    block_ids = _block_ids(raw_ids)
    n_ops, num_bytes, group_sizes, block_indices = table._check_groups(
        raw_sizes, raw_indices, len(block_ids)
    )
    if block_ids.dtype is not INT64:
        block_ids = block_ids.astype(np.int64)
    n_files = sum(num_chunks(n, i, bpc) for n, i in zip(group_sizes, block_indices))
    dev_out, off_out, size_out = out_arrays(out, n_ops, FILE_OPS)
    file_starts, file_groups, file_bytes = _file_arrays(n_files)
    written = _file_kernels.table_file_ops_kernel(
        table.ref_table, table.group_ref_start, block_ids,
        table._group_array(group_sizes, block_indices), bpc, block_major, merge,
        cap, dev_out, off_out, size_out, file_starts, file_groups, file_bytes,
    )  # fmt: skip
    if written < 0:
        if written == OVERLAPPING_BUFFERS:
            raise overlap_error("out's dev_ptrs, file_offsets and sizes, and block_ids")
        bad = table._bad_block_id(block_ids, group_sizes)
        if bad is not None:
            raise table._block_id_error(bad)
        raise _too_large_error(
            [
                (g, [ref.page_size_bytes for ref in refs])
                for g, (refs, n) in enumerate(zip(table._groups, group_sizes))
                if n
            ],
            bpc,
        )
    return FilePlan(
        dev_out[:written], off_out[:written], size_out[:written], file_starts,
        file_groups, file_bytes, num_bytes,
    )  # fmt: skip


# The non-empty groups of plan_file_ops, by their (group_block_counts,
# group_data_ref_counts, block_indices, bpc): transfers repeat their shapes,
# and reading the counts costs more than planning a few hundred ops.
_GroupsEntry = tuple[npt.NDArray[np.int64], int, int]
_groups_cache: dict[tuple[Any, ...], _GroupsEntry] = {}
_MAX_CACHED_GROUPS = 256


def _groups(device_ptrs: Any, counts: list[Any], bpc: int) -> _GroupsEntry:
    """The kernel's (4, n) array of non-empty groups, the ops and the files.

    Counts given as tuples of Python ints (as DevicePointers holds them) are
    looked up in a cache; anything else goes through iter_pointer_groups'
    checks, which also produce the error messages.
    """
    key = None
    if all(type(values) is tuple for values in counts):
        key = (*counts, bpc)
        entry = _groups_cache.get(key)
        if entry is not None and all(
            type(value) is int for values in counts for value in values
        ):
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
    if key is not None and all(type(v) is int for values in counts for v in values):
        if len(_groups_cache) >= _MAX_CACHED_GROUPS:
            _groups_cache.clear()
        _groups_cache[key] = entry
    return entry


def _options(
    blocks_per_chunk: Any, layout: Any, coalesce: Any, max_run_bytes: Any
) -> tuple[int, bool, bool, int]:
    """The checked options: bpc, block-major or not, merge, the kernels' cap."""
    bpc = as_int(blocks_per_chunk, "blocks_per_chunk")
    if not 1 <= bpc < 2**63:  # the kernels take an int64
        raise SpecError(f"blocks_per_chunk must be >= 1 and < 2**63, got {bpc}")
    if not isinstance(layout, str):
        raise InputTypeError(
            f"layout must be one of {LAYOUTS}, got {type(layout).__name__}"
        )
    if layout not in LAYOUTS:
        raise SpecError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if type(coalesce) is not bool:
        raise InputTypeError(f"coalesce must be True or False, got {coalesce!r}")
    return bpc, layout == "block-major", coalesce, max_run_arg(max_run_bytes)


def _file_arrays(
    n_files: int, extra_bytes: int = 0
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """file_starts, file_groups and file_bytes (with extra entries) for n files."""
    return (
        np.empty(n_files + 1, np.int64),
        np.empty(n_files, np.int64),
        np.empty(n_files + extra_bytes, np.int64),
    )


def _size_error(infos: list[Any], sizes: npt.NDArray[np.uint64], bpc: int) -> SpecError:
    """The error of a failed plan_file_ops: an op size, or a file too large."""
    pages = []
    for info in infos:
        group_pages = []
        for d in range(info.n_data_refs):
            first = info.dev_ptr_offset + d * info.group_size
            ref_sizes = sizes[first : first + info.group_size]
            bad = np.flatnonzero(ref_sizes != ref_sizes[0])
            if len(bad):
                position = int(bad[0])
                return SpecError(
                    f"group {info.group_idx}, ref {d}, position {position}: size "
                    f"{int(ref_sizes[position])} differs from the ref's first size "
                    f"{int(ref_sizes[0])}; every op of one ref of one group has "
                    "the ref's page as its size"
                )
            group_pages.append(int(ref_sizes[0]))
        pages.append((info.group_idx, group_pages))
    return _too_large_error(pages, bpc)


def _too_large_error(pages: list[tuple[int, list[int]]], bpc: int) -> SpecError:
    """The error for the first group whose files would pass 2**63 - 1 bytes."""
    for group, group_pages in pages:
        if bpc * sum(group_pages) > 2**63 - 1:
            return SpecError(
                f"group {group}: a file of blocks_per_chunk * sum(pages) = "
                f"{bpc} * {sum(group_pages)} bytes has offsets beyond 2**63 - 1"
            )
    raise AssertionError("the kernel reported a plan error that is not there")
