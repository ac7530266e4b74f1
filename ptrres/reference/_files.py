"""File tier (SPEC 11): the ops of vLLM PR #56076's FSOffloadingWorker.

Written as the PR's worker builds them (walk iter_pointer_groups, then for
each chunk, ref and block append one (dev_ptr, file_offset, size) op), with
the PR's pitfalls fixed: block_indices set the first slot, each ref has its
own page, and ops merge only when both sides continue. Plain Python.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import InputTypeError, SpecError
from .._results import FilePlan
from ._coalesce import merged_runs
from ._input import as_descriptors
from ._resolve import iter_pointer_groups

FILE_LAYOUTS = ("ref-major", "block-major")


def plan_file_ops(
    device_ptrs: Any,
    blocks_per_chunk: int,
    *,
    layout: str = "ref-major",
    coalesce: bool = False,
    max_run_bytes: int | None = None,
) -> FilePlan:
    """One file per (non-empty group, chunk), its ops ordered ref -> block."""
    if not isinstance(layout, str):
        raise InputTypeError(f"layout must be a str, got {type(layout).__name__}")
    if layout not in FILE_LAYOUTS:
        raise SpecError(f"layout must be one of {FILE_LAYOUTS}, got {layout!r}")
    if type(coalesce) is not bool:
        raise InputTypeError(f"coalesce must be True or False, got {coalesce!r}")
    if max_run_bytes is not None:
        if isinstance(max_run_bytes, (bool, np.bool_)) or not isinstance(
            max_run_bytes, (int, np.integer)
        ):
            raise InputTypeError(f"max_run_bytes must be an int, got {max_run_bytes!r}")
        if max_run_bytes < 1:
            raise SpecError(f"max_run_bytes must be >= 1, got {max_run_bytes}")
    cap = 2**64 - 1 if max_run_bytes is None else min(int(max_run_bytes), 2**64 - 1)
    groups = list(iter_pointer_groups(device_ptrs, blocks_per_chunk))
    bpc = int(blocks_per_chunk)
    if bpc >= 2**63:
        raise SpecError(f"blocks_per_chunk must be < 2**63, got {bpc}")
    ptrs = as_descriptors(device_ptrs.ptrs, "device_ptrs.ptrs")
    sizes = as_descriptors(device_ptrs.sizes, "device_ptrs.sizes")
    n_ops = sum(info.group_size * info.n_data_refs for info in groups)
    if not len(ptrs) == len(sizes) == n_ops:
        raise SpecError(
            f"device_ptrs has {len(ptrs)} ptrs and {len(sizes)} sizes; its groups "
            f"make {n_ops} ops"
        )

    files: list[list[tuple[int, int, int]]] = []  # per file: (ptr, offset, size)
    file_groups: list[int] = []
    file_bytes: list[int] = []
    for info in groups:
        pages = []
        for d in range(info.n_data_refs):
            first = info.dev_ptr_offset + d * info.group_size
            ref_sizes = [int(size) for size in sizes[first : first + info.group_size]]
            for position, size in enumerate(ref_sizes):
                if size != ref_sizes[0]:
                    raise SpecError(
                        f"group {info.group_idx}, ref {d}, position {position}: "
                        f"size {size} differs from the ref's first ({ref_sizes[0]})"
                    )
            pages.append(ref_sizes[0])
        total = sum(pages)
        if bpc * total > 2**63 - 1:
            raise SpecError(f"group {info.group_idx}: files of {bpc * total} B")
        for chunk in range(info.n_chunks):
            ops = []
            for d, page in enumerate(pages):
                before = sum(pages[:d])
                for k in range(info.group_size):
                    slot = info.skip + k - chunk * bpc
                    if not 0 <= slot < bpc:
                        continue
                    ptr = int(ptrs[info.dev_ptr_offset + d * info.group_size + k])
                    if layout == "ref-major":
                        offset = bpc * before + slot * page
                    else:
                        offset = slot * total + before
                    ops.append((ptr, offset, page))
            # Pointers alone do not say where allocations end: ops merge
            # wherever both sides continue, inside one file.
            files.append(merged_runs(ops, cap) if coalesce else ops)
            file_groups.append(info.group_idx)
            file_bytes.append(bpc * total)

    all_ops = [op for ops in files for op in ops]
    columns = np.array(all_ops, dtype=np.uint64).reshape(len(all_ops), 3)
    return FilePlan(
        dev_ptrs=columns[:, 0].copy(),
        file_offsets=columns[:, 1].copy(),
        sizes=columns[:, 2].copy(),
        file_starts=np.cumsum([0] + [len(ops) for ops in files], dtype=np.int64),
        file_groups=np.array(file_groups, dtype=np.int64),
        file_bytes=np.array(file_bytes, dtype=np.int64),
        num_bytes=int(sum(int(size) for size in sizes)),
    )
