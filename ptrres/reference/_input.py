"""Plain-numpy reference: what ptrres computes, written for clarity.

This module is the oracle of the test suite and the baseline of the
benchmarks. It follows vLLM's numpy resolver in shape (one vectorised
expression per group and ref), adds the checks of SPEC section 7, and reads
every tensor's geometry on every call, as vLLM does.

It shares nothing with the compiled path but the error classes and the result
types: it reads each tensor itself (data pointer, ``stride(0) *
element_size()``, rows) and checks its input in its own plain code, so that a
geometry or validation bug of the compiled path shows as a difference. Its
error messages are worded as the compiled path's (the tests check that they
agree).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .._errors import (
    BlockIdError,
    InputTypeError,
    LayoutError,
    OffloadedIdError,
    PtrresError,
    SpecError,
)
from .._results import (
    DevicePointerGroupInfo,
    DevicePointers,
    FilePlan,
    StridedTransferPlan,
    TransferPlan,
)

__all__ = [
    "coalesce",
    "iter_pointer_groups",
    "plan_canonical_transfer",
    "plan_file_ops",
    "plan_strided_transfer",
    "plan_transfer",
    "resolve_device_pointers",
]

# Pointers are computed in int64 by ptrres: every byte must lie below.
ADDRESS_LIMIT = 2**63 - 1
ID_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
DESCRIPTOR_DTYPES = (np.dtype(np.int64), np.dtype(np.uint64))


class Ref(NamedTuple):
    """One ref of one group, with its tensor's geometry (bytes)."""

    tensor_idx: int
    base_ptr: int
    row_stride_bytes: int
    page_size_bytes: int
    num_blocks: int


class Offloaded(NamedTuple):
    """An offloaded tensor: one row per chunk, split into sub-blocks (bytes)."""

    base_ptr: int
    row_stride_bytes: int
    sub_bytes: int
    num_chunks: int


def resolve_device_pointers(device_spec: Any, kv_caches: Any) -> DevicePointers:
    """ptr = base + block_id * row_stride_bytes, for every group, ref and block."""
    layout = _read_kv_caches(kv_caches)
    block_ids, group_sizes, block_indices = _read_spec(device_spec, len(layout))

    num_ops = sum(int(n) * len(refs) for n, refs in zip(group_sizes, layout))
    ptrs = np.empty(num_ops, dtype=np.uint64)
    sizes = np.empty(num_ops, dtype=np.uint64)
    op = 0
    first_id = 0
    for group, (n_blocks, refs) in enumerate(zip(group_sizes.tolist(), layout)):
        group_ids = block_ids[first_id : first_id + n_blocks]
        lowest, highest = (group_ids.min(), group_ids.max()) if n_blocks else (0, -1)
        for d, ref in enumerate(refs):
            if lowest < 0 or highest >= ref.num_blocks:
                raise _block_id_error(group_ids, ref, group, d)
            ptrs[op : op + n_blocks] = np.uint64(ref.base_ptr) + group_ids.astype(
                np.uint64
            ) * np.uint64(ref.row_stride_bytes)
            sizes[op : op + n_blocks] = ref.page_size_bytes
            op += n_blocks
        first_id += n_blocks

    return DevicePointers(
        ptrs=ptrs,
        sizes=sizes,
        group_block_counts=tuple(group_sizes.tolist()),
        group_data_ref_counts=tuple(len(refs) for refs in layout),
        block_indices=block_indices,
    )


def _block_id_error(
    group_ids: npt.NDArray[Any], ref: Ref, group: int, d: int
) -> BlockIdError:
    """The error for the first of a group's ids outside its ref's tensor."""
    position = int(np.flatnonzero((group_ids < 0) | (group_ids >= ref.num_blocks))[0])
    value = int(group_ids[position])
    return BlockIdError(
        f"group {group}, position {position}: block id {value} is out of range "
        f"for ref {d}, whose tensor {ref.tensor_idx} has {ref.num_blocks} blocks",
        group=group,
        position=position,
        value=value,
    )


def iter_pointer_groups(
    device_ptrs: Any, blocks_per_chunk: int
) -> Iterator[DevicePointerGroupInfo]:
    """One DevicePointerGroupInfo per non-empty group (eager list, as an iterator)."""
    blocks_per_chunk = _as_int(blocks_per_chunk, "blocks_per_chunk")
    if blocks_per_chunk < 1:
        raise SpecError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
    names = ("group_block_counts", "group_data_ref_counts", "block_indices")
    fields = _attributes(device_ptrs, names, "device_ptrs")
    counts = [_as_list(values, name) for values, name in zip(fields, names)]
    if len({len(c) for c in counts}) != 1:
        raise SpecError(
            "group_block_counts, group_data_ref_counts and block_indices have "
            f"{len(counts[0])}, {len(counts[1])} and {len(counts[2])} entries; "
            "they need one per group"
        )
    infos = []
    dev_ptr_offset = 0
    for group_idx, (group_size, n_data_refs, block_index) in enumerate(zip(*counts)):
        group_size = _as_int(group_size, f"group {group_idx}: group size")
        n_data_refs = _as_int(n_data_refs, f"group {group_idx}: n_data_refs")
        block_index = _as_int(block_index, f"group {group_idx}: block index")
        if min(group_size, n_data_refs, block_index) < 0:
            raise SpecError(
                f"group {group_idx}: group size {group_size}, n_data_refs "
                f"{n_data_refs} and block index {block_index} must be >= 0"
            )
        if group_size == 0:
            continue
        skip = block_index % blocks_per_chunk
        n_chunks = (group_size + skip + blocks_per_chunk - 1) // blocks_per_chunk
        infos.append(
            DevicePointerGroupInfo(
                group_idx, group_size, n_data_refs, skip, n_chunks, dev_ptr_offset
            )
        )
        dev_ptr_offset += group_size * n_data_refs
    return iter(infos)


def plan_transfer(
    device_spec: Any,
    kv_caches: Any,
    offloaded_tensors: Any,
    blocks_per_chunk: int,
    offloaded_ids: Any,
    *,
    store: bool,
) -> TransferPlan:
    """Copy descriptors of a store or a load (SPEC 5), shaped like vLLM's fill.

    Resolve the device side, walk the groups with iter_pointer_groups, and fill
    each ref's offloaded pointers and both sides with one vectorised
    expression each.
    """
    if type(store) is not bool:
        raise InputTypeError(f"store must be True or False, got {store!r}")
    layout = _read_kv_caches(kv_caches)
    offloaded = _offloaded_of_refs(
        layout, _read_offloaded(offloaded_tensors, blocks_per_chunk)
    )
    # A numpy uint64 would turn int64 // uint64 into float64: use a Python int.
    blocks_per_chunk = _as_int(blocks_per_chunk, "blocks_per_chunk")
    chunk_ids = _block_ids(offloaded_ids, "offloaded_ids")
    device_ptrs = resolve_device_pointers(device_spec, kv_caches)
    groups = list(iter_pointer_groups(device_ptrs, blocks_per_chunk))
    chunks_per_group = [0] * len(layout)
    for info in groups:
        chunks_per_group[info.group_idx] = info.n_chunks
    if len(chunk_ids) != sum(chunks_per_group):
        raise OffloadedIdError(
            f"there are {len(chunk_ids)} offloaded ids, but the groups span "
            f"{chunks_per_group} chunks (blocks_per_chunk={blocks_per_chunk}): "
            f"{sum(chunks_per_group)} in all"
        )

    n_ops = len(device_ptrs.ptrs)
    src = np.empty(n_ops, dtype=np.uint64)
    dst = np.empty(n_ops, dtype=np.uint64)
    sizes = device_ptrs.sizes.copy()
    first_ref_of_group = np.cumsum([0] + [len(refs) for refs in layout])
    first_chunk = 0
    for info in groups:
        group_chunks = chunk_ids[first_chunk : first_chunk + info.n_chunks]
        first_chunk += info.n_chunks
        j = info.skip + np.arange(info.group_size)
        chunk = group_chunks[j // blocks_per_chunk].astype(np.uint64)
        sub_block = (j % blocks_per_chunk).astype(np.uint64)
        for d in range(info.n_data_refs):
            geometry = offloaded[first_ref_of_group[info.group_idx] + d]
            out_of_range = (group_chunks < 0) | (group_chunks >= geometry.num_chunks)
            if out_of_range.any():
                position = int(np.argmax(out_of_range))
                value = int(group_chunks[position])
                tensor_idx = layout[info.group_idx][d].tensor_idx
                raise OffloadedIdError(
                    f"group {info.group_idx}, position {position}: offloaded id "
                    f"{value} is out of range for ref {d}, whose offloaded tensor "
                    f"{tensor_idx} has {geometry.num_chunks} chunks",
                    group=info.group_idx,
                    position=position,
                    value=value,
                )
            off_ptrs = (
                np.uint64(geometry.base_ptr)
                + chunk * np.uint64(geometry.row_stride_bytes)
                + sub_block * np.uint64(geometry.sub_bytes)
            )
            first_op = info.dev_ptr_offset + d * info.group_size
            ops = slice(first_op, first_op + info.group_size)
            dev_ptrs = device_ptrs.ptrs[ops]
            src[ops], dst[ops] = (dev_ptrs, off_ptrs) if store else (off_ptrs, dev_ptrs)
    return TransferPlan(src, dst, sizes, int(sizes.sum(dtype=np.uint64)))


def coalesce(
    src: Any, dst: Any, sizes: Any, *, max_run_bytes: int | None = None
) -> TransferPlan:
    """Merge descriptors that continue each other on both sides (SPEC 6).

    Without a cap, runs are found with one vectorised comparison; with one,
    each descriptor is placed greedily, in order, in plain Python. A merged
    size must fit in uint64: no cap means a cap of 2**64 - 1.
    """
    src = _descriptors(src, "src")
    dst = _descriptors(dst, "dst")
    sizes = _descriptors(sizes, "sizes")
    if not len(src) == len(dst) == len(sizes):
        raise SpecError(
            f"src, dst and sizes have {len(src)}, {len(dst)} and {len(sizes)} entries"
        )
    num_bytes = int(sizes.sum(dtype=np.uint64))
    cap = None if max_run_bytes is None else _as_int(max_run_bytes, "max_run_bytes")
    if cap is not None and cap < 1:
        raise SpecError(f"max_run_bytes must be >= 1, got {cap}")
    if cap is None and sizes.sum(dtype=np.float64) >= 2.0**62:
        cap = 2**64 - 1  # a run could wrap the vectorised sum: merge greedily
    if cap is not None:
        cap = min(cap, 2**64 - 1)
    if len(sizes) == 0:
        return TransferPlan(src.copy(), dst.copy(), sizes.copy(), num_bytes)
    # i + 1 continues i when both ends meet, without wrapping around 2**64.
    src_end = src[:-1] + sizes[:-1]
    dst_end = dst[:-1] + sizes[:-1]
    continues = (src_end == src[1:]) & (dst_end == dst[1:])
    continues &= (src_end >= sizes[:-1]) & (dst_end >= sizes[:-1])
    if cap is None:
        starts = np.flatnonzero(np.concatenate(([True], ~continues)))
        return TransferPlan(
            src[starts], dst[starts], np.add.reduceat(sizes, starts), num_bytes
        )
    out_src, out_dst, out_sizes = [int(src[0])], [int(dst[0])], [int(sizes[0])]
    for i in range(1, len(sizes)):
        size = int(sizes[i])
        if continues[i - 1] and out_sizes[-1] + size <= cap:
            out_sizes[-1] += size
        else:
            out_src.append(int(src[i]))
            out_dst.append(int(dst[i]))
            out_sizes.append(size)
    return TransferPlan(
        np.array(out_src, np.uint64),
        np.array(out_dst, np.uint64),
        np.array(out_sizes, np.uint64),
        num_bytes,
    )


# Reading the input: plain code of its own, worded as the compiled path's.


def _as_int(value: Any, what: str) -> int:
    """``value`` as a Python int: an int or anything with __index__, not a bool."""
    if not isinstance(value, (bool, np.bool_)):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise InputTypeError(
        f"{what} must be an integer, got {type(value).__name__} {value!r}"
    )


def _attributes(obj: Any, names: tuple[str, ...], what: str) -> tuple[Any, ...]:
    """``obj``'s attributes ``names``; an InputTypeError names those it lacks."""
    missing = [name for name in names if not hasattr(obj, name)]
    if missing:
        raise InputTypeError(
            f"{what} must have the attributes {', '.join(names)}; "
            f"{type(obj).__name__} has no {', '.join(missing)}"
        )
    return tuple(getattr(obj, name) for name in names)


def _as_list(values: Any, what: str) -> list[Any]:
    """A sequence (of tensors, refs, counts...) as a list; not a str or dict."""
    if not isinstance(values, (str, bytes, dict)):
        try:
            return list(values)
        except TypeError:
            pass
    raise InputTypeError(f"{what} must be a sequence, got {type(values).__name__}")


def _tensor(tensor: Any, what: str) -> tuple[int, int, int, int]:
    """(base pointer, row stride, rows, row bytes) of a numpy array or a tensor.

    A numpy array is read through .ctypes.data, strides[0] and itemsize; any
    other object must answer torch's data_ptr(), stride(0), element_size()
    and shape (a torch tensor on any device, or a stand-in for one).
    """
    if isinstance(tensor, np.ndarray):
        shape = tuple(tensor.shape)
        base_ptr = tensor.ctypes.data
        row_stride = tensor.strides[0] if shape else 0
        element_size = tensor.itemsize
    else:
        try:
            if not callable(getattr(tensor, "data_ptr", None)):
                raise InputTypeError(
                    f"{what} must be a torch tensor or a numpy array, "
                    f"got {type(tensor).__name__}"
                )
            shape = tuple(
                _as_int(n, f"{what}.shape[{d}]") for d, n in enumerate(tensor.shape)
            )
            base_ptr = _as_int(tensor.data_ptr(), f"{what}.data_ptr()")
            element_size = _as_int(tensor.element_size(), f"{what}.element_size()")
            stride = _as_int(tensor.stride(0), f"{what}.stride(0)") if shape else 0
        except PtrresError:
            raise
        except Exception as exc:  # no storage, a broken proxy...
            raise InputTypeError(
                f"{what}: reading its shape, data_ptr(), element_size() and "
                f"stride(0) failed ({type(exc).__name__}: {exc})"
            ) from exc
        row_stride = stride * element_size
    if not shape:
        raise LayoutError(f"{what} is 0-d; its first dimension must be blocks")
    if min(shape) < 0 or element_size < 0:
        raise LayoutError(
            f"{what} has shape {shape} and element size {element_size}: "
            "none may be negative"
        )
    if row_stride < 0:
        raise LayoutError(f"{what} has a negative row stride ({row_stride} B)")
    rows = shape[0]
    row_bytes = math.prod(shape[1:]) * element_size
    end = base_ptr + (rows - 1) * row_stride + row_bytes
    if base_ptr < 0 or max(end, row_stride, rows) > ADDRESS_LIMIT:
        raise LayoutError(
            f"{what} at 0x{base_ptr:x} ({rows} rows of {row_bytes} B, "
            f"{row_stride} B apart) does not lie between 0 and 2**63 - 1, "
            "the addresses ptrres computes"
        )
    return base_ptr, row_stride, rows, row_bytes


def _read_kv_caches(kv_caches: Any) -> list[list[Ref]]:
    """For each group, its refs with their tensors' geometry, checked."""
    tensors, group_data_refs = _attributes(
        kv_caches, ("tensors", "group_data_refs"), "kv_caches"
    )
    geometries = []
    for t, entry in enumerate(_as_list(tensors, "kv_caches.tensors")):
        (tensor,) = _attributes(entry, ("tensor",), f"kv_caches.tensors[{t}]")
        geometries.append(_tensor(tensor, f"tensors[{t}].tensor"))
    layout = []
    for group, refs in enumerate(_as_list(group_data_refs, "group_data_refs")):
        group_refs = []
        for d, ref in enumerate(_as_list(refs, f"group_data_refs[{group}]")):
            where = f"group {group}, ref {d}"
            raw_idx, raw_page = _attributes(
                ref, ("tensor_idx", "page_size_bytes"), where
            )
            tensor_idx = _as_int(raw_idx, f"{where}: tensor_idx")
            if not 0 <= tensor_idx < len(geometries):
                raise LayoutError(
                    f"{where}: tensor_idx {tensor_idx} is out of range "
                    f"(there are {len(geometries)} tensors)"
                )
            page = _as_int(raw_page, f"{where}: page_size_bytes")
            base_ptr, row_stride, rows, row_bytes = geometries[tensor_idx]
            page_error = f"{where} (tensor {tensor_idx}): page_size_bytes {page}"
            if page < 0:
                raise LayoutError(f"{page_error} is negative")
            if page > row_stride:
                raise LayoutError(
                    f"{page_error} is larger than the row stride ({row_stride} B)"
                )
            if page > row_bytes:
                raise LayoutError(
                    f"{page_error} is larger than a row ({row_bytes} B): the last "
                    "block's page would end outside the tensor"
                )
            group_refs.append(Ref(tensor_idx, base_ptr, row_stride, page, rows))
        layout.append(group_refs)
    return layout


def _blocks_per_chunk(value: Any) -> int:
    """Device blocks per offloaded chunk: an int >= 1 (and < 2**63)."""
    bpc = _as_int(value, "blocks_per_chunk")
    if not 1 <= bpc < 2**63:
        raise LayoutError(f"blocks_per_chunk must be >= 1 and < 2**63, got {bpc}")
    return bpc


def _read_offloaded(tensors: Any, blocks_per_chunk: Any) -> list[Offloaded]:
    """The offloaded tensors (each as is, or as the .tensor of an entry)."""
    bpc = _blocks_per_chunk(blocks_per_chunk)
    offloaded = []
    for t, entry in enumerate(_as_list(tensors, "offloaded tensors")):
        try:
            if not hasattr(entry, "data_ptr") and hasattr(entry, "tensor"):
                entry = entry.tensor
        except Exception:  # _tensor() says what is wrong with it
            pass
        base_ptr, row_stride, rows, row_bytes = _tensor(
            entry, f"offloaded tensors[{t}]"
        )
        if row_bytes % bpc:
            raise LayoutError(
                f"offloaded tensors[{t}]: a row of {row_bytes} B does not "
                f"split into {bpc} sub-blocks"
            )
        if rows > 1 and row_stride < row_bytes:
            raise LayoutError(
                f"offloaded tensors[{t}]: rows of {row_bytes} B overlap "
                f"(row stride {row_stride} B)"
            )
        offloaded.append(Offloaded(base_ptr, row_stride, row_bytes // bpc, rows))
    return offloaded


def _offloaded_of_refs(
    layout: list[list[Ref]], offloaded: list[Offloaded]
) -> list[Offloaded]:
    """The offloaded tensor of every ref, in op order: its page must fit."""
    of_refs = []
    for group, refs in enumerate(layout):
        for d, ref in enumerate(refs):
            if ref.tensor_idx >= len(offloaded):
                raise LayoutError(
                    f"group {group}, ref {d}: tensor {ref.tensor_idx} has no "
                    f"offloaded tensor (there are {len(offloaded)})"
                )
            tensor = offloaded[ref.tensor_idx]
            if ref.page_size_bytes > tensor.sub_bytes:
                raise LayoutError(
                    f"group {group}, ref {d}: a page of {ref.page_size_bytes} B does "
                    f"not fit in a sub-block of offloaded tensors[{ref.tensor_idx}] "
                    f"({tensor.sub_bytes} B)"
                )
            of_refs.append(tensor)
    return of_refs


def _read_spec(
    device_spec: Any, n_groups: int
) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64], tuple[int, ...]]:
    """A spec's block ids, group sizes (int64) and block indices, checked."""
    raw_ids, raw_sizes, raw_indices = _attributes(
        device_spec, ("block_ids", "group_sizes", "block_indices"), "device_spec"
    )
    block_ids = _block_ids(raw_ids, "block_ids")
    group_sizes = _per_group(raw_sizes, "group_sizes", "group size", n_groups)
    total = sum(group_sizes.tolist())  # exact: a numpy sum wraps around 2**64
    if total != len(block_ids):
        raise SpecError(
            f"group sizes sum to {total} but there are {len(block_ids)} block ids"
        )
    block_indices = tuple(
        _per_group(raw_indices, "block_indices", "block index", n_groups).tolist()
    )
    return block_ids, group_sizes, block_indices


def _block_ids(values: Any, what: str) -> npt.NDArray[Any]:
    """Ids as a 1-D int32 or int64 array (other integer dtypes become int64).

    Whatever its length, an array (or a tensor) must be of an integer dtype:
    only a sequence without a dtype of its own, such as ``[]``, which numpy
    reads as float64, may be empty and of no integer type.
    """
    try:
        ids = np.asarray(values)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InputTypeError(f"{what} is not an integer array: {exc}") from None
    if ids.size == 0 and ids.dtype.kind == "f" and not hasattr(values, "dtype"):
        ids = ids.astype(np.int64)  # numpy reads [] as float64
    if ids.dtype.kind not in "iu":
        raise InputTypeError(f"{what} must be integers, got dtype {ids.dtype}")
    if ids.ndim != 1:
        raise InputTypeError(
            f"{what} must be 1-D, got a {ids.ndim}-D array of shape {ids.shape}"
        )
    if ids.dtype not in ID_DTYPES:
        if ids.dtype == np.uint64 and (ids > 2**63 - 1).any():
            position = int(np.argmax(ids > 2**63 - 1))
            raise InputTypeError(
                f"{what}[{position}] = {int(ids[position])} does not fit in int64"
            )
        ids = ids.astype(np.int64)
    return ids


def _per_group(values: Any, what: str, entry: str, n_groups: int) -> npt.NDArray[Any]:
    """One int >= 0 per group (group sizes, block indices), as int64."""
    if isinstance(values, (str, bytes)) or values is None:
        raise InputTypeError(f"{what} must be a sequence of ints, got {values!r}")
    if isinstance(values, (list, tuple)) and all(type(v) is int for v in values):
        too_large = [v for v in values if not -(2**63) <= v < 2**63]
        if too_large:
            raise SpecError(f"{what} holds {too_large[0]}, which is too large")
        array = np.array(values, np.int64)
    else:
        try:
            array = np.asarray(values)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InputTypeError(f"{what} must be a sequence of ints: {exc}") from None
        if array.ndim == 0:
            raise InputTypeError(
                f"{what} must be a sequence of ints, got {type(values).__name__}"
            )
        if array.ndim != 1:
            raise InputTypeError(f"{what} must be 1-D, got shape {array.shape}")
        # No entries: fine if integers, or a sequence without a dtype of its own.
        if array.size == 0 and (
            array.dtype.kind in "iu" or not hasattr(values, "dtype")
        ):
            array = np.zeros(0, np.int64)
        if array.dtype.kind not in "iu":
            raise InputTypeError(f"{what} must be integers, got {values!r}")
        if array.dtype == np.uint64 and int(array.max()) > 2**63 - 1:
            raise SpecError(f"{what} holds {int(array.max())}, which is too large")
        array = array.astype(np.int64)
    if len(array) != n_groups:
        raise SpecError(
            f"{what} has {len(array)} entries but the KV caches have {n_groups} groups"
        )
    negative = np.flatnonzero(array < 0)
    if len(negative):
        group = int(negative[0])
        raise SpecError(f"group {group}: {entry} {int(array[group])} is negative")
    return array


def _descriptors(values: Any, what: str) -> npt.NDArray[np.uint64]:
    """Pointers or sizes: a 1-D int64 or uint64 numpy array, read as uint64."""
    if not isinstance(values, np.ndarray):
        raise InputTypeError(
            f"{what} must be a numpy array, got {type(values).__name__}"
        )
    if values.dtype not in DESCRIPTOR_DTYPES:
        raise InputTypeError(f"{what} must be int64 or uint64, got {values.dtype}")
    if values.ndim != 1:
        raise InputTypeError(f"{what} must be 1-D, got shape {values.shape}")
    return values.astype(np.uint64)


# ---------------------------------------------------------------------------
# File tier (SPEC 11): the ops of vLLM PR #56076's FSOffloadingWorker.
#
# Written as the PR's worker builds them (walk iter_pointer_groups, then for
# each chunk, ref and block append one (dev_ptr, file_offset, size) op), with
# the PR's pitfalls fixed: block_indices set the first slot, each ref has its
# own page, and ops merge only when both sides continue. Plain Python, using
# nothing of ptrres but its errors and types.

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
    ptrs = _descriptors(device_ptrs.ptrs, "device_ptrs.ptrs")
    sizes = _descriptors(device_ptrs.sizes, "device_ptrs.sizes")
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
            files.append(_merged(ops, cap) if coalesce else ops)
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


def _merged(ops: list[tuple[int, int, int]], cap: int) -> list[tuple[int, int, int]]:
    """Merge op i + 1 into op i when both its pointer and its offset continue."""
    merged: list[tuple[int, int, int]] = []
    for ptr, offset, size in ops:
        if merged:
            run_ptr, run_offset, run_size = merged[-1]
            if (
                run_ptr + run_size == ptr
                and run_offset + run_size == offset
                and run_size + size <= cap
            ):
                merged[-1] = (run_ptr, run_offset, run_size + size)
                continue
        merged.append((ptr, offset, size))
    return merged


# ---------------------------------------------------------------------------
# Canonical layouts (SPEC 10)
#
# Self-contained: it reads tensors and mappings itself, and imports nothing
# from ptrres but its errors and result types. Shaped like vLLM 0.33's
# SingleDirectionOffloadingHandler: a fragment template per ref
# (_build_copy_plan), block base pointers per group and ref
# (compute_sub_block_ptrs), the writer filter of stores (_canonical_page_ids,
# _filter_writer_blocks), then one broadcast add per side (_fill_canonical_ops).
# ---------------------------------------------------------------------------


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


def _concatenated(plans: list[tuple[Any, ...]], column: int) -> npt.NDArray[np.uint64]:
    parts = [plan[column].ravel() for plan in plans]
    return np.concatenate(parts).astype(np.uint64) if parts else np.zeros(0, np.uint64)


def _tensor_rows(tensor: Any, what: str) -> tuple[int, int, int, int]:
    """(base pointer, row stride in bytes, bytes of a row, rows) of a tensor,
    or of an object holding one as ``.tensor``, read and checked by _tensor."""
    base_ptr, row_stride, rows, row_bytes = _tensor(
        getattr(tensor, "tensor", tensor), what
    )
    return base_ptr, row_stride, row_bytes, rows


def _mapping_items(
    mapping: Any, group: int, d: int, row_limit: int, sub: int, strided: bool
) -> tuple[npt.NDArray[np.int64], int, int]:
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
) -> list[tuple[Any, ...]]:
    """The descriptors of each (group, ref), as (src, dst, width, height,
    src_pitch, dst_pitch) arrays."""
    if type(store) is not bool:
        raise InputTypeError(f"store must be True or False, got {store!r}")
    bpc = _blocks_per_chunk(blocks_per_chunk)
    device = [
        _tensor_rows(t, f"tensors[{i}].tensor") for i, t in enumerate(kv_caches.tensors)
    ]
    offloaded = [
        _tensor_rows(t, f"offloaded_tensors[{i}]")
        for i, t in enumerate(offloaded_tensors)
    ]
    spec = _read_spec(device_spec, len(kv_caches.group_data_refs))
    block_ids = spec[0].astype(np.int64)
    group_sizes, block_indices = spec[1].tolist(), list(spec[2])
    chunk_ids = _block_ids(offloaded_ids, "offloaded_ids").astype(np.int64)
    n_chunks = [0 if n == 0 else -(-(n + i % bpc) // bpc) for n, i in
                zip(group_sizes, block_indices)]  # fmt: skip
    if len(chunk_ids) != sum(n_chunks):
        raise OffloadedIdError(
            f"there are {len(chunk_ids)} offloaded ids, but the groups span "
            f"{sum(n_chunks)} chunks"
        )
    # Every ref's items first: a bad mapping fails whatever the ids.
    items: list[list[tuple[npt.NDArray[np.int64], int, int]]] = []
    for group, refs in enumerate(kv_caches.group_data_refs):
        items.append([])
        for d, ref in enumerate(refs):
            _, stride, row_bytes, _ = device[ref.tensor_idx]
            sub = offloaded[ref.tensor_idx][2] // bpc
            page = int(ref.page_size_bytes)
            if canonical:
                items[-1].append(
                    _mapping_items(
                        ref.mapping, group, d, min(stride, row_bytes), sub, strided
                    )
                )
            else:
                items[-1].append((np.array([[0, 0, page, 1, page, page]]), 1, 0))

    plans: list[tuple[Any, ...]] = []
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
            base, stride, _, num_blocks = device[ref.tensor_idx]
            off_base, off_stride, off_row_bytes, num_chunks = offloaded[ref.tensor_idx]
            if group_ids.min() < 0 or group_ids.max() >= num_blocks:
                raise BlockIdError(
                    f"group {group}: a block id is out of range for ref {d}",
                    group=group, position=-1, value=-1,
                )  # fmt: skip
            if group_chunks.min() < 0 or group_chunks.max() >= num_chunks:
                raise OffloadedIdError(
                    f"group {group}: an offloaded id is out of range for ref {d}"
                )
            ref_items, num_writers, writer_index = items[group][d]
            if len(ref_items) == 0:
                continue
            # Base pointer of every block on each side (compute_sub_block_ptrs).
            device_bases = base + group_ids * stride
            all_subs = (
                off_base
                + group_chunks[:, None] * off_stride
                + np.arange(bpc)[None, :] * (off_row_bytes // bpc)
            ).ravel()
            offloaded_bases = all_subs[skip : skip + group_size]
            # Stores keep the blocks whose canonical page is this rank's.
            if store and num_writers > 1:
                page_ids = (group_chunks[:, None] * bpc + np.arange(bpc)).ravel()
                writes = page_ids[skip : skip + group_size] % num_writers
                device_bases = device_bases[writes == writer_index]
                offloaded_bases = offloaded_bases[writes == writer_index]
            device_ptrs = device_bases[:, None] + ref_items[None, :, 0]
            offloaded_ptrs = offloaded_bases[:, None] + ref_items[None, :, 1]
            shape = device_ptrs.shape
            width, height = (np.broadcast_to(ref_items[:, c], shape) for c in (2, 3))
            local_pitch, canonical_pitch = (
                np.broadcast_to(ref_items[:, c], shape) for c in (4, 5)
            )
            if store:
                plans.append(
                    (device_ptrs, offloaded_ptrs, width, height, local_pitch,
                     canonical_pitch)
                )  # fmt: skip
            else:
                plans.append(
                    (offloaded_ptrs, device_ptrs, width, height, canonical_pitch,
                     local_pitch)
                )  # fmt: skip
    return plans
