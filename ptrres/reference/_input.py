"""Reading the reference's input: plain code of its own, worded as ptrres's.

Every capability of the reference reads its tensors, spec, ids and
descriptors through these helpers, written apart from ptrres's own (_args,
_geometry) so that a validation bug there shows as a difference. Their error
messages are worded as ptrres's (the tests check that they agree).
"""

from __future__ import annotations

import math
import operator
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .._errors import InputTypeError, LayoutError, PtrresError, SpecError

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


def as_int(value: Any, what: str) -> int:
    """``value`` as a Python int: an int or anything with __index__, not a bool."""
    if not isinstance(value, (bool, np.bool_)):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise InputTypeError(
        f"{what} must be an integer, got {type(value).__name__} {value!r}"
    )


def attributes(obj: Any, names: tuple[str, ...], what: str) -> tuple[Any, ...]:
    """``obj``'s attributes ``names``; an InputTypeError names those it lacks."""
    missing = [name for name in names if not hasattr(obj, name)]
    if missing:
        raise InputTypeError(
            f"{what} must have the attributes {', '.join(names)}; "
            f"{type(obj).__name__} has no {', '.join(missing)}"
        )
    return tuple(getattr(obj, name) for name in names)


def as_list(values: Any, what: str) -> list[Any]:
    """A sequence (of tensors, refs, counts...) as a list; not a str or dict."""
    if not isinstance(values, (str, bytes, dict)):
        try:
            return list(values)
        except TypeError:
            pass
    raise InputTypeError(f"{what} must be a sequence, got {type(values).__name__}")


def read_tensor(tensor: Any, what: str) -> tuple[int, int, int, int]:
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
                as_int(n, f"{what}.shape[{d}]") for d, n in enumerate(tensor.shape)
            )
            base_ptr = as_int(tensor.data_ptr(), f"{what}.data_ptr()")
            element_size = as_int(tensor.element_size(), f"{what}.element_size()")
            stride = as_int(tensor.stride(0), f"{what}.stride(0)") if shape else 0
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


def read_kv_caches(kv_caches: Any) -> list[list[Ref]]:
    """For each group, its refs with their tensors' geometry, checked."""
    tensors, group_data_refs = attributes(
        kv_caches, ("tensors", "group_data_refs"), "kv_caches"
    )
    geometries = []
    for t, entry in enumerate(as_list(tensors, "kv_caches.tensors")):
        (tensor,) = attributes(entry, ("tensor",), f"kv_caches.tensors[{t}]")
        geometries.append(read_tensor(tensor, f"tensors[{t}].tensor"))
    layout = []
    for group, refs in enumerate(as_list(group_data_refs, "group_data_refs")):
        group_refs = []
        for d, ref in enumerate(as_list(refs, f"group_data_refs[{group}]")):
            where = f"group {group}, ref {d}"
            raw_idx, raw_page = attributes(
                ref, ("tensor_idx", "page_size_bytes"), where
            )
            tensor_idx = as_int(raw_idx, f"{where}: tensor_idx")
            if not 0 <= tensor_idx < len(geometries):
                raise LayoutError(
                    f"{where}: tensor_idx {tensor_idx} is out of range "
                    f"(there are {len(geometries)} tensors)"
                )
            page = as_int(raw_page, f"{where}: page_size_bytes")
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


def as_blocks_per_chunk(value: Any) -> int:
    """Device blocks per offloaded chunk: an int >= 1 (and < 2**63)."""
    bpc = as_int(value, "blocks_per_chunk")
    if not 1 <= bpc < 2**63:
        raise LayoutError(f"blocks_per_chunk must be >= 1 and < 2**63, got {bpc}")
    return bpc


def read_offloaded(tensors: Any, blocks_per_chunk: Any) -> list[Offloaded]:
    """The offloaded tensors (each as is, or as the .tensor of an entry)."""
    bpc = as_blocks_per_chunk(blocks_per_chunk)
    offloaded = []
    for t, entry in enumerate(as_list(tensors, "offloaded tensors")):
        try:
            if not hasattr(entry, "data_ptr") and hasattr(entry, "tensor"):
                entry = entry.tensor
        except Exception:  # read_tensor() says what is wrong with it
            pass
        base_ptr, row_stride, rows, row_bytes = read_tensor(
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


def offloaded_of_refs(
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


def read_spec(
    device_spec: Any, n_groups: int
) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64], tuple[int, ...]]:
    """A spec's block ids, group sizes (int64) and block indices, checked."""
    raw_ids, raw_sizes, raw_indices = attributes(
        device_spec, ("block_ids", "group_sizes", "block_indices"), "device_spec"
    )
    block_ids = as_ids(raw_ids, "block_ids")
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


def as_ids(values: Any, what: str) -> npt.NDArray[Any]:
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


def as_descriptors(values: Any, what: str) -> npt.NDArray[np.uint64]:
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
