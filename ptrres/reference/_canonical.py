"""Canonical layouts (SPEC 10): plan_canonical_transfer, plan_strided_transfer.

Shaped like vLLM 0.33's SingleDirectionOffloadingHandler: a fragment
template per ref (_build_copy_plan), block base pointers per group and ref
(compute_sub_block_ptrs), the writer filter of stores (_canonical_page_ids,
_filter_writer_blocks), then one broadcast add per side (_fill_canonical_ops).
It reads tensors and mappings itself.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .._errors import BlockIdError, InputTypeError, LayoutError, OffloadedIdError
from .._results import StridedTransferPlan, TransferPlan
from ._input import as_blocks_per_chunk, as_ids, read_spec, read_tensor


class Rows(NamedTuple):
    """A tensor's rows (bytes), as _tensor_rows reads them."""

    base_ptr: int
    row_stride: int
    row_bytes: int
    num_rows: int


# A ref's copy template: its items (see _mapping_items), num_writers and
# writer_index.
Template = tuple[npt.NDArray[np.int64], int, int]
# The descriptors of one (group, ref): (src, dst, width, height, src_pitch,
# dst_pitch) arrays.
Descriptors = tuple[npt.NDArray[Any], ...]


def plan_canonical_transfer(
    device_spec: Any,
    kv_caches: Any,
    offloaded_tensors: Any,
    blocks_per_chunk: int,
    offloaded_ids: Any,
    *,
    store: bool,
) -> TransferPlan:
    """Flat descriptors of a canonical store or load: group -> ref -> kept
    block -> fragment, as vLLM 0.33's ``_fill_canonical_ops``."""
    plans = _canonical_plans(
        device_spec, kv_caches, offloaded_tensors, blocks_per_chunk, offloaded_ids,
        store, canonical=True, strided=False,
    )  # fmt: skip
    src, dst, sizes = (_concatenated(plans, column) for column in range(3))
    return TransferPlan(src, dst, sizes, int(sizes.sum(dtype=np.uint64)))


def plan_strided_transfer(
    device_spec: Any,
    kv_caches: Any,
    offloaded_tensors: Any,
    blocks_per_chunk: int,
    offloaded_ids: Any,
    *,
    store: bool,
    canonical: bool = True,
) -> StridedTransferPlan:
    """One 2-D descriptor per (kept block, ref, run); a direct layout
    (``canonical=False``) gives one single-row descriptor per (block, ref)."""
    plans = _canonical_plans(
        device_spec, kv_caches, offloaded_tensors, blocks_per_chunk, offloaded_ids,
        store, canonical=canonical, strided=True,
    )  # fmt: skip
    src, dst, width, height, src_pitch, dst_pitch = (
        _concatenated(plans, column) for column in range(6)
    )
    num_bytes = int((width * height).sum(dtype=np.uint64))
    return StridedTransferPlan(src, dst, width, height, src_pitch, dst_pitch, num_bytes)


def _concatenated(plans: list[Descriptors], column: int) -> npt.NDArray[np.uint64]:
    parts = [plan[column].ravel() for plan in plans]
    return np.concatenate(parts).astype(np.uint64) if parts else np.zeros(0, np.uint64)


def _tensor_rows(tensor: Any, what: str) -> Rows:
    """(base pointer, row stride in bytes, bytes of a row, rows) of a tensor,
    or of an object holding one as ``.tensor``, read and checked by read_tensor."""
    base_ptr, row_stride, rows, row_bytes = read_tensor(
        getattr(tensor, "tensor", tensor), what
    )
    return Rows(base_ptr, row_stride, row_bytes, rows)


def _mapping_items(
    mapping: Any, group: int, d: int, row_limit: int, sub: int, strided: bool
) -> Template:
    """A ref's items, checked: rows (local, canonical, width, height,
    local_stride, canonical_stride) of its fragments, or of its runs when
    strided; and its num_writers and writer_index."""
    where = f"group {group}, ref {d}"
    if mapping is None:
        raise LayoutError(f"{where} has no mapping, but the layout is canonical")
    canonical_page = int(mapping.canonical_page_size_bytes)
    local_page = int(mapping.local_page_size_bytes)
    num_writers, writer_index = int(mapping.num_writers), int(mapping.writer_index)
    if min(canonical_page, local_page) < 0:
        raise LayoutError(f"{where}: a negative page size")
    if num_writers < 1 or not 0 <= writer_index < num_writers:
        raise LayoutError(f"{where}: writer {writer_index} of {num_writers}")
    if local_page > row_limit:
        raise LayoutError(f"{where}: the local page is larger than a row")
    if canonical_page > sub:
        raise LayoutError(f"{where}: the canonical page is larger than a sub-block")
    rows = []
    for r, run in enumerate(mapping.runs):
        fields = [
            int(run.local_offset),
            int(run.canonical_offset),
            int(run.fragment_size),
            int(run.num_fragments),
            int(run.local_stride),
            int(run.canonical_stride),
        ]
        if min(fields) < 0:
            raise LayoutError(f"{where}, run {r}: a negative field")
        local, canonical, size, count, local_stride, canonical_stride = fields
        if count == 0:
            continue
        if local + (count - 1) * local_stride + size > local_page:
            raise LayoutError(f"{where}, run {r}: outside the local page")
        if canonical + (count - 1) * canonical_stride + size > canonical_page:
            raise LayoutError(f"{where}, run {r}: outside the canonical page")
        if strided:
            rows.append(fields)
        else:
            for i in range(count):
                offsets = [local + i * local_stride, canonical + i * canonical_stride]
                rows.append([*offsets, size, 1, size, size])
    return np.array(rows, np.int64).reshape(-1, 6), num_writers, writer_index


def _canonical_plans(
    device_spec: Any,
    kv_caches: Any,
    offloaded_tensors: Any,
    blocks_per_chunk: int,
    offloaded_ids: Any,
    store: bool,
    *,
    canonical: bool,
    strided: bool,
) -> list[Descriptors]:
    """The descriptors of each (group, ref) with blocks to copy, in order."""
    if type(store) is not bool:
        raise InputTypeError(f"store must be True or False, got {store!r}")
    bpc = as_blocks_per_chunk(blocks_per_chunk)
    device = [
        _tensor_rows(t, f"tensors[{i}].tensor") for i, t in enumerate(kv_caches.tensors)
    ]
    offloaded = [
        _tensor_rows(t, f"offloaded_tensors[{i}]")
        for i, t in enumerate(offloaded_tensors)
    ]
    ids = _read_ids(device_spec, len(kv_caches.group_data_refs), offloaded_ids, bpc)
    block_ids, group_sizes, block_indices, chunk_ids, n_chunks = ids
    # Every ref's template first: a bad mapping fails whatever the ids.
    templates = _copy_templates(kv_caches, device, offloaded, bpc, canonical, strided)

    plans: list[Descriptors] = []
    first_id = first_chunk = 0
    for group, refs in enumerate(kv_caches.group_data_refs):
        group_size = group_sizes[group]
        group_ids = block_ids[first_id : first_id + group_size]
        group_chunks = chunk_ids[first_chunk : first_chunk + n_chunks[group]]
        first_id += group_size
        first_chunk += n_chunks[group]
        if group_size == 0:
            continue
        skip = block_indices[group] % bpc
        for d, ref in enumerate(refs):
            rows, off_rows = device[ref.tensor_idx], offloaded[ref.tensor_idx]
            if group_ids.min() < 0 or group_ids.max() >= rows.num_rows:
                raise BlockIdError(
                    f"group {group}: a block id is out of range for ref {d}",
                    group=group, position=-1, value=-1,
                )  # fmt: skip
            if group_chunks.min() < 0 or group_chunks.max() >= off_rows.num_rows:
                raise OffloadedIdError(
                    f"group {group}: an offloaded id is out of range for ref {d}"
                )
            items, num_writers, writer_index = templates[group][d]
            if len(items) == 0:
                continue
            device_bases, offloaded_bases = _block_bases(
                group_ids, group_chunks, skip, bpc, rows, off_rows
            )
            # Stores keep the blocks whose canonical page is this rank's.
            if store and num_writers > 1:
                pages = _canonical_page_ids(group_chunks, skip, group_size, bpc)
                kept = pages % num_writers == writer_index
                device_bases = device_bases[kept]
                offloaded_bases = offloaded_bases[kept]
            plans.append(_fill(device_bases, offloaded_bases, items, store))
    return plans


class Ids(NamedTuple):
    """A canonical plan's ids and counts, checked (_read_ids)."""

    block_ids: npt.NDArray[np.int64]
    group_sizes: list[int]
    block_indices: list[int]
    # As many as the groups span chunks; n_chunks[g] of them are group g's.
    chunk_ids: npt.NDArray[np.int64]
    n_chunks: list[int]


def _read_ids(device_spec: Any, n_groups: int, offloaded_ids: Any, bpc: int) -> Ids:
    """The spec's ids, group sizes and block indices, and the offloaded ids."""
    block_ids, group_sizes, block_indices = read_spec(device_spec, n_groups)
    chunk_ids = as_ids(offloaded_ids, "offloaded_ids").astype(np.int64)
    n_chunks = [0 if n == 0 else -(-(n + i % bpc) // bpc) for n, i in
                zip(group_sizes.tolist(), block_indices)]  # fmt: skip
    if len(chunk_ids) != sum(n_chunks):
        raise OffloadedIdError(
            f"there are {len(chunk_ids)} offloaded ids, but the groups span "
            f"{sum(n_chunks)} chunks"
        )
    return Ids(
        block_ids.astype(np.int64), group_sizes.tolist(), list(block_indices),
        chunk_ids, n_chunks,
    )  # fmt: skip


def _copy_templates(
    kv_caches: Any,
    device: list[Rows],
    offloaded: list[Rows],
    bpc: int,
    canonical: bool,
    strided: bool,
) -> list[list[Template]]:
    """Each ref's copy template, by group (vLLM's _build_copy_plan): its
    mapping's fragments (or runs, strided), or one whole page if direct."""
    templates: list[list[Template]] = []
    for group, refs in enumerate(kv_caches.group_data_refs):
        templates.append([])
        for d, ref in enumerate(refs):
            _, stride, row_bytes, _ = device[ref.tensor_idx]
            sub = offloaded[ref.tensor_idx].row_bytes // bpc
            page = int(ref.page_size_bytes)
            if canonical:
                templates[-1].append(
                    _mapping_items(
                        ref.mapping, group, d, min(stride, row_bytes), sub, strided
                    )
                )
            else:
                templates[-1].append((np.array([[0, 0, page, 1, page, page]]), 1, 0))
    return templates


def _block_bases(
    group_ids: npt.NDArray[np.int64],
    group_chunks: npt.NDArray[np.int64],
    skip: int,
    bpc: int,
    rows: Rows,
    off_rows: Rows,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The base pointer of every block of a group on each side, the device's
    and its offloaded sub-block's, for one ref (compute_sub_block_ptrs)."""
    base, stride, _, _ = rows
    off_base, off_stride, off_row_bytes, _ = off_rows
    all_subs = (
        off_base
        + group_chunks[:, None] * off_stride
        + np.arange(bpc)[None, :] * (off_row_bytes // bpc)
    ).ravel()
    return base + group_ids * stride, all_subs[skip : skip + len(group_ids)]


def _canonical_page_ids(
    group_chunks: npt.NDArray[np.int64], skip: int, group_size: int, bpc: int
) -> npt.NDArray[np.int64]:
    """The canonical page id (chunk * bpc + sub-block) of every block of a
    group (vLLM's _canonical_page_ids); page % num_writers writes it."""
    page_ids = (group_chunks[:, None] * bpc + np.arange(bpc)).ravel()
    return page_ids[skip : skip + group_size]


def _fill(
    device_bases: npt.NDArray[np.int64],
    offloaded_bases: npt.NDArray[np.int64],
    items: npt.NDArray[np.int64],
    store: bool,
) -> Descriptors:
    """One descriptor per (kept block, item), src and dst by direction: one
    broadcast add per side (vLLM's _fill_canonical_ops)."""
    device_ptrs = device_bases[:, None] + items[None, :, 0]
    offloaded_ptrs = offloaded_bases[:, None] + items[None, :, 1]
    shape = device_ptrs.shape
    width, height = (np.broadcast_to(items[:, c], shape) for c in (2, 3))
    local_pitch, canonical_pitch = (np.broadcast_to(items[:, c], shape) for c in (4, 5))
    if store:
        return device_ptrs, offloaded_ptrs, width, height, local_pitch, canonical_pitch
    return offloaded_ptrs, device_ptrs, width, height, canonical_pitch, local_pitch
