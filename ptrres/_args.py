"""Coercing what callers pass: ids, counts, ints, sequences and out= buffers.

These helpers turn duck-typed Python objects into the plain integers and
contiguous arrays that the kernels take, and raise the errors of SPEC section 7
(InputTypeError, SpecError, OutBufferError) when something is wrong.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import numpy.typing as npt

from ._errors import InputTypeError, OutBufferError, SpecError
from ._kernels.common import NO_CAP

INT32 = np.dtype(np.int32)
INT64 = np.dtype(np.int64)
UINT64 = np.dtype(np.uint64)
ID_DTYPES = (INT32, INT64)
OUT_DTYPES = (INT64, UINT64)
# The attributes ptrres reads from a GPULoadStoreSpec and a DevicePointers.
SPEC_FIELDS = ("block_ids", "group_sizes", "block_indices")
DEVICE_POINTERS_FIELDS = (
    "ptrs",
    "sizes",
    "group_block_counts",
    "group_data_ref_counts",
    "block_indices",
)
GROUP_FIELDS = DEVICE_POINTERS_FIELDS[2:]  # what iter_pointer_groups reads


def as_int(value: Any, what: str, *what_args: object) -> int:
    """Return ``value`` as a Python int, or raise InputTypeError.

    ``what`` names the value; it is formatted with ``what_args`` only when an
    error is raised, so that a hot loop pays nothing for the message.
    """
    if type(value) is int:
        return value
    if not isinstance(value, (bool, np.bool_)):
        try:
            return operator.index(value)
        except TypeError:
            pass
    name = what.format(*what_args)
    raise InputTypeError(
        f"{name} must be an integer, got {type(value).__name__} {value!r}"
    )


def attributes(obj: Any, names: tuple[str, ...], what: str) -> tuple[Any, ...]:
    """``obj``'s attributes ``names``, or an InputTypeError naming those it lacks."""
    try:
        return tuple([getattr(obj, name) for name in names])
    except AttributeError:
        raise missing_attributes(obj, names, what) from None


def missing_attributes(obj: Any, names: tuple[str, ...], what: str) -> InputTypeError:
    """The error for an object that lacks some of the attributes it needs."""
    missing = [name for name in names if not hasattr(obj, name)] or names
    return InputTypeError(
        f"{what} must have the attributes {', '.join(names)}; "
        f"{type(obj).__name__} has no {', '.join(missing)}"
    )


def as_list(values: Any, what: str) -> list[Any]:
    """A caller's sequence (of tensors, refs, counts...) as a list."""
    if not isinstance(values, (str, bytes, dict)):
        try:
            return list(values)
        except TypeError:
            pass
    raise InputTypeError(f"{what} must be a sequence, got {type(values).__name__}")


def as_block_ids(block_ids: Any, what: str = "block_ids") -> npt.NDArray[Any]:
    """Return block ids as a C-contiguous 1-D int32 or int64 array.

    Other integer dtypes become int64; values int64 cannot hold are rejected.
    """
    if isinstance(block_ids, np.ndarray):
        ids = block_ids
    else:
        try:
            ids = np.asarray(block_ids)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InputTypeError(f"{what} is not an integer array: {exc}") from None
        if ids.size == 0 and ids.dtype.kind == "f" and not hasattr(block_ids, "dtype"):
            ids = ids.astype(np.int64)  # numpy reads [] as float64
    if ids.dtype.kind not in "iu":
        raise InputTypeError(f"{what} must be integers, got dtype {ids.dtype}")
    if ids.ndim != 1:
        raise InputTypeError(
            f"{what} must be 1-D, got a {ids.ndim}-D array of shape {ids.shape}"
        )
    if ids.dtype not in ID_DTYPES:
        if ids.dtype == np.uint64 and ids.size and int(ids.max()) > 2**63 - 1:
            position = int(np.argmax(ids > 2**63 - 1))
            raise InputTypeError(
                f"{what}[{position}] = {int(ids[position])} does not fit in int64"
            )
        ids = ids.astype(np.int64)
    # The kernels take C-contiguous, aligned, writable arrays (Numba types
    # read-only or unaligned arrays apart); they never write to the ids.
    return ids if ids.flags.carray else np.array(ids, order="C")


def as_group_sizes(
    group_sizes: Any, n_groups: int, n_block_ids: int
) -> npt.NDArray[np.int64]:
    """Check a spec's group sizes against the layout and the ids; return int64."""
    sizes = _per_group(group_sizes, "group_sizes", "group size", n_groups)
    total = sum(sizes.tolist())  # exact: a numpy sum wraps around 2**64
    if total != n_block_ids:
        raise SpecError(
            f"group sizes sum to {total} but there are {n_block_ids} block ids"
        )
    return sizes


def as_block_indices(block_indices: Any, n_groups: int) -> tuple[int, ...]:
    """Check a spec's block indices (one per group, each >= 0); return ints."""
    indices = _per_group(block_indices, "block_indices", "block index", n_groups)
    return tuple(indices.tolist())


def _per_group(
    values: Any, what: str, entry: str, n_groups: int
) -> npt.NDArray[np.int64]:
    """One int >= 0 per group, as int64; ``entry`` names one in errors."""
    array = _as_int_array(values, what)
    if len(array) != n_groups:
        raise SpecError(
            f"{what} has {len(array)} entries but the KV caches have {n_groups} groups"
        )
    negative = np.flatnonzero(array < 0)
    if len(negative):
        group = int(negative[0])
        raise SpecError(f"group {group}: {entry} {int(array[group])} is negative")
    return array


def _as_int_array(values: Any, what: str) -> npt.NDArray[np.int64]:
    """A 1-D int64 array from a sequence of ints; no silent float truncation."""
    if isinstance(values, (str, bytes)) or values is None:
        raise InputTypeError(f"{what} must be a sequence of ints, got {values!r}")
    if isinstance(values, (list, tuple)) and all(type(v) is int for v in values):
        # numpy would make [0, 2**63] float64, and [2**64] an object array.
        for value in values:
            if not -(2**63) <= value < 2**63:
                raise SpecError(f"{what} holds {value}, which is too large")
        return np.array(values, np.int64)
    try:
        array = np.asarray(values)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InputTypeError(f"{what} must be a sequence of ints: {exc}") from None
    if array.ndim == 0:  # a scalar, a set, a dict...
        raise InputTypeError(
            f"{what} must be a sequence of ints, got {type(values).__name__}"
        )
    if array.ndim != 1:
        raise InputTypeError(f"{what} must be 1-D, got shape {array.shape}")
    if array.size == 0 and (array.dtype.kind in "iu" or not hasattr(values, "dtype")):
        return np.zeros(0, np.int64)
    if array.dtype.kind not in "iu":
        raise InputTypeError(f"{what} must be integers, got {values!r}")
    if array.dtype == np.uint64 and int(array.max()) > 2**63 - 1:
        raise SpecError(f"{what} holds {int(array.max())}, which is too large")
    return np.ascontiguousarray(array, dtype=np.int64)


def descriptor_array(values: Any, what: str) -> npt.NDArray[np.uint64]:
    """Pointers or sizes given by a caller, as a contiguous 1-D uint64 array."""
    if type(values) is np.ndarray and values.ndim == 1 and values.flags.carray:
        if values.dtype is UINT64:
            return values
        if values.dtype is INT64:
            return values.view(np.uint64)
    if not isinstance(values, np.ndarray):
        raise InputTypeError(
            f"{what} must be a numpy array, got {type(values).__name__}"
        )
    if values.dtype not in OUT_DTYPES:
        raise InputTypeError(f"{what} must be int64 or uint64, got {values.dtype}")
    if values.ndim != 1:
        raise InputTypeError(f"{what} must be 1-D, got shape {values.shape}")
    if not values.flags.carray:  # read by the kernels, never written
        values = np.array(values, order="C")
    view: npt.NDArray[np.uint64] = values.view(np.uint64)
    return view


# The out= buffers callers pass: (ptrs, sizes), (src, dst, sizes), ...
Buffers = tuple[npt.NDArray[Any], ...]
# What the out= buffers of each call are, in order (for out_arrays).
PTRS_SIZES = ("out[0] (ptrs)", "out[1] (sizes)")

SRC_DST_SIZES = ("out[0] (src)", "out[1] (dst)", "out[2] (sizes)")


def out_arrays(
    out: Any, n_ops: int, buffers: tuple[str, ...]
) -> list[npt.NDArray[np.uint64]]:
    """The output arrays of a call: new ones, or uint64 views of out= buffers.

    Args:
        out: None, or one buffer per entry of ``buffers`` (see out_view), in a
            tuple or list, or as the rows of a 2-D array.
        n_ops: entries each output needs.
        buffers: the names of the buffers (two or more), PTRS_SIZES or
            SRC_DST_SIZES say.
    """
    if out is None:
        return [np.empty(n_ops, np.uint64) for _ in buffers]
    if (type(out) is tuple or isinstance(out, (list, np.ndarray))) and len(out) == len(
        buffers
    ):
        # The first two or three written out, as every call so far has them:
        # a comprehension costs a third of a microsecond more, on every call.
        # Any further buffers (a strided plan has six) are taken in a loop.
        views = [
            out_view(out[0], n_ops, buffers[0]),
            out_view(out[1], n_ops, buffers[1]),
        ]
        if len(buffers) > 2:
            views.append(out_view(out[2], n_ops, buffers[2]))
            if len(buffers) > 3:  # a loop costs a tenth of a microsecond
                views += [
                    out_view(out[i], n_ops, buffers[i]) for i in range(3, len(out))
                ]
        return views
    count = f"{len(out)} items" if hasattr(out, "__len__") else "not a sequence"
    raise InputTypeError(
        f"out must hold {len(buffers)} buffers ({', '.join(buffers)}): got a "
        f"{type(out).__name__}, {count}"
    )


def out_view(buffer: Any, n_ops: int, what: str) -> npt.NDArray[np.uint64]:
    """The first n_ops entries of a caller's out= buffer, as a uint64 view.

    The buffer must be a writable, C-contiguous 1-D int64 or uint64 numpy array
    (a torch tensor's ``.numpy()`` is one) with at least n_ops entries.
    """
    if (
        type(buffer) is np.ndarray
        and buffer.ndim == 1
        and len(buffer) >= n_ops
        and buffer.flags.carray  # contiguous, aligned and writable
    ):
        view: npt.NDArray[Any] = buffer if len(buffer) == n_ops else buffer[:n_ops]
        if view.dtype is UINT64:
            return view
        if view.dtype is INT64:
            as_uint64: npt.NDArray[np.uint64] = view.view(UINT64)  # 40 ns less
            return as_uint64  # than view(np.uint64), which looks the dtype up
    return _checked_out_view(buffer, n_ops, what)


def _checked_out_view(buffer: Any, n_ops: int, what: str) -> npt.NDArray[np.uint64]:
    if not isinstance(buffer, np.ndarray):
        raise InputTypeError(
            f"{what} must be a numpy array (for a torch tensor, pass "
            f"tensor.numpy()), got {type(buffer).__name__}"
        )
    if buffer.dtype not in OUT_DTYPES:
        raise InputTypeError(f"{what} must be int64 or uint64, got {buffer.dtype}")
    if buffer.ndim != 1:
        raise InputTypeError(f"{what} must be 1-D, got shape {buffer.shape}")
    if len(buffer) < n_ops:
        raise OutBufferError(
            f"{what} holds {len(buffer)} entries but this transfer has {n_ops} ops"
        )
    if not buffer.flags.writeable:
        raise OutBufferError(f"{what} is read-only")
    if not buffer.flags.c_contiguous:
        raise OutBufferError(f"{what} is not contiguous")
    if not buffer.flags.aligned:
        raise OutBufferError(f"{what} is not aligned to 8 bytes")
    return buffer[:n_ops].view(np.uint64)


def block_ids_arg(block_ids: Any, what: str = "block_ids") -> npt.NDArray[Any]:
    """Block ids as the kernels take them; arrays that already fit pass as is."""
    if (
        type(block_ids) is np.ndarray
        and block_ids.dtype in ID_DTYPES
        and block_ids.ndim == 1
        and block_ids.flags.carray  # contiguous, aligned and writable
    ):
        return block_ids
    return as_block_ids(block_ids, what)


def max_run_arg(max_run_bytes: Any) -> int:
    """max_run_bytes (None or an int >= 1), checked, as the kernels take it.

    The kernels take an int64 and read it as uint64: a cap of 2**63 or more
    goes as its two's complement, and 2**64 - 1 or more means no cap (NO_CAP).
    """
    if max_run_bytes is None:
        return NO_CAP
    cap = as_int(max_run_bytes, "max_run_bytes")
    if cap < 1:
        raise SpecError(f"max_run_bytes must be >= 1, got {cap}")
    if cap >= 2**64 - 1:
        return NO_CAP
    return cap if cap < 2**63 else cap - 2**64
