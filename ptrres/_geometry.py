"""Where things lie in memory: device tensors, their refs, offloaded tensors.

Reads a caller's tensors (torch, numpy, or anything answering their calls)
into plain integers, checking the layout as it goes (SPEC 7), and says which
offloaded chunk and sub-block a block goes to (num_chunks).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ._args import as_int, as_list, attributes
from ._errors import InputTypeError, LayoutError, PtrresError


class TensorGeometry(NamedTuple):
    """Where a tensor's rows (blocks) lie in memory, in bytes."""

    base_ptr: int
    row_stride_bytes: int
    num_blocks: int
    # Bytes of one row's elements; the stride may be larger (padding).
    row_bytes: int
    # Which allocation the tensor is a view of (allocation_of).
    allocation: int
    # Where its memory is (device_of): HOST, a CUDA device index, or None.
    device: int | None


class MemoryRegion(NamedTuple):
    """One allocation a layout's tensors lie in: what a transfer engine
    registers (NIXL's ``register_memory``, cuFile's ``cuFileBufRegister``).

    It spans the bytes of every tensor of the layout in that allocation, from
    the lowest to the end of the highest.
    """

    # First byte of the tensors' bytes in the allocation.
    address: int
    # Bytes from there to the end of the last tensor's last row.
    nbytes: int
    # HOST (-1) for host memory, else the CUDA device index (NIXL's devId for
    # VRAM); None where the tensors do not say.
    device: int | None


class RefRow(NamedTuple):
    """One ref of one group, resolved against its tensor."""

    base_ptr: int
    row_stride_bytes: int
    page_size_bytes: int
    num_blocks: int
    tensor_idx: int
    allocation: int  # the tensor's (TensorGeometry.allocation)


# A table's refs, group by group, as it read them (read_layout).
Groups = Sequence[Sequence[RefRow]]

# The kernels compute pointers in int64: every byte of a tensor must lie below.
ADDRESS_LIMIT = 2**63 - 1
# The device of host memory (TensorGeometry.device, MemoryRegion.device).
HOST = -1


def tensor_geometry(
    tensor: Any, tensor_idx: int, name: str = "tensors[{}].tensor"
) -> TensorGeometry:
    """Read the geometry of a torch tensor (any device) or a numpy array.

    Any object with torch's ``data_ptr()``, ``stride()``, ``element_size()`` and
    ``shape`` will do; one whose answers fail or make no sense is refused.
    ``name`` (formatted with ``tensor_idx``) names the tensor in errors.
    """
    what = name.format(tensor_idx)
    if isinstance(tensor, np.ndarray):
        shape: tuple[int, ...] = tensor.shape
        base_ptr: int = tensor.__array_interface__["data"][0]
        row_stride_bytes: int = tensor.strides[0] if shape else 0
        element_size: int = tensor.itemsize
    else:
        shape, base_ptr, row_stride_bytes, element_size = _tensor_answers(tensor, what)
    if not shape:
        raise LayoutError(f"{what} is 0-d; its first dimension must be blocks")
    if min(shape) < 0 or element_size < 0:
        raise LayoutError(
            f"{what} has shape {shape} and element size {element_size}: "
            "none may be negative"
        )
    if row_stride_bytes < 0:
        raise LayoutError(f"{what} has a negative row stride ({row_stride_bytes} B)")
    num_blocks = shape[0]
    row_bytes = math.prod(shape[1:]) * element_size
    end = base_ptr + (num_blocks - 1) * row_stride_bytes + row_bytes
    if base_ptr < 0 or max(end, row_stride_bytes, num_blocks) > ADDRESS_LIMIT:
        raise LayoutError(
            f"{what} at 0x{base_ptr:x} ({num_blocks} rows of {row_bytes} B, "
            f"{row_stride_bytes} B apart) does not lie between 0 and 2**63 - 1, "
            "the addresses ptrres computes"
        )
    allocation = allocation_of(tensor, -1 - tensor_idx)
    return TensorGeometry(
        base_ptr,
        row_stride_bytes,
        num_blocks,
        row_bytes,
        allocation,
        device_of(tensor),
    )


def device_of(tensor: Any) -> int | None:
    """Where a tensor's memory is: HOST for a numpy array or a torch tensor on
    the CPU, the device index of a CUDA tensor, None for anything else (a
    device of another kind, an object without ``device``)."""
    if isinstance(tensor, np.ndarray):
        return HOST
    try:
        device = tensor.device
        kind = device.type
        if kind == "cpu":
            return HOST
        if kind == "cuda":
            index = device.index
            return 0 if index is None else operator.index(index)
    except Exception:  # no device to read: unknown
        pass
    return None


def memory_regions(geometries: Sequence[TensorGeometry]) -> tuple[MemoryRegion, ...]:
    """One MemoryRegion per allocation of the tensors, in order of first
    appearance: the span of their bytes in it (a tensor without a block
    spans nothing), on their device (None where they disagree)."""
    spans: dict[int, tuple[int, int, int | None]] = {}
    for geometry in geometries:
        if geometry.num_blocks == 0 or geometry.row_bytes == 0:
            continue
        start = geometry.base_ptr
        end = start + (geometry.num_blocks - 1) * geometry.row_stride_bytes
        end += geometry.row_bytes
        known = spans.get(geometry.allocation)
        if known is None:
            spans[geometry.allocation] = (start, end, geometry.device)
        else:
            device = known[2] if known[2] == geometry.device else None
            spans[geometry.allocation] = (
                min(known[0], start),
                max(known[1], end),
                device,
            )
    return tuple(
        MemoryRegion(start, end - start, device)
        for start, end, device in spans.values()
    )


def allocation_of(tensor: Any, unknown: int) -> int:
    """A number that two tensors share when they are views of one allocation
    on the same side, so that a merged copy may pass from one into the other
    (SPEC 6): the data pointer of a torch tensor's ``untyped_storage()``; for
    a numpy array, that of the array that owns its memory, or the identity
    of the object whose buffer it views (an ``mmap``, a ``bytearray``).

    Args:
        unknown: the answer for any other object (or one whose storage
            cannot be read): a negative number of its own, so that no copy
            passes from it into another tensor.
    """
    if isinstance(tensor, np.ndarray):
        owner: Any = tensor
        while True:
            if isinstance(owner, np.ndarray) and owner.base is not None:
                owner = owner.base
            elif isinstance(owner, memoryview) and owner.obj is not None:
                owner = owner.obj
            else:
                break
        if isinstance(owner, np.ndarray):
            data: int = owner.__array_interface__["data"][0]
            return data
        return id(owner)  # alive as long as the views are
    try:
        storage = tensor.untyped_storage()
        return as_int(storage.data_ptr(), "untyped_storage().data_ptr()")
    except Exception:  # not a torch tensor: no storage to compare
        return unknown


def _tensor_answers(tensor: Any, what: str) -> tuple[tuple[int, ...], int, int, int]:
    """Shape, data pointer, row stride and element size of a torch-like tensor."""
    try:
        if not callable(getattr(tensor, "data_ptr", None)):
            raise InputTypeError(
                f"{what} must be a torch tensor or a numpy array, "
                f"got {type(tensor).__name__}"
            )
        raw_shape = tuple(tensor.shape)
        shape = tuple(
            as_int(n, "{}.shape[{}]", what, d) for d, n in enumerate(raw_shape)
        )
        base_ptr = as_int(tensor.data_ptr(), "{}.data_ptr()", what)
        element_size = as_int(tensor.element_size(), "{}.element_size()", what)
        stride = as_int(tensor.stride(0), "{}.stride(0)", what) if shape else 0
    except PtrresError:
        raise
    except Exception as exc:  # a tensor without storage, a broken proxy...
        raise InputTypeError(
            f"{what}: reading its shape, data_ptr(), element_size() and stride(0) "
            f"failed ({type(exc).__name__}: {exc})"
        ) from exc
    return shape, base_ptr, stride * element_size, element_size


def read_layout(kv_caches: Any) -> tuple[list[TensorGeometry], list[list[RefRow]]]:
    """The tensors of a CanonicalKVCaches, and for each group its refs
    resolved to their tensors.

    Checks the layout as it goes: tensor_idx in range, every page within a row.
    """
    tensors, group_data_refs = attributes(
        kv_caches, ("tensors", "group_data_refs"), "kv_caches"
    )
    geometries = [
        tensor_geometry(attributes(entry, ("tensor",), f"kv_caches.tensors[{t}]")[0], t)
        for t, entry in enumerate(as_list(tensors, "kv_caches.tensors"))
    ]
    groups = []
    for group, refs in enumerate(as_list(group_data_refs, "group_data_refs")):
        rows = []
        for d, ref in enumerate(as_list(refs, f"group_data_refs[{group}]")):
            raw_idx, raw_page = attributes(
                ref, ("tensor_idx", "page_size_bytes"), f"group {group}, ref {d}"
            )
            tensor_idx = as_int(raw_idx, "group {}, ref {}: tensor_idx", group, d)
            if not 0 <= tensor_idx < len(geometries):
                raise LayoutError(
                    f"group {group}, ref {d}: tensor_idx {tensor_idx} is out of "
                    f"range (there are {len(geometries)} tensors)"
                )
            page_size = as_int(raw_page, "group {}, ref {}: page_size_bytes", group, d)
            geometry = geometries[tensor_idx]
            if not 0 <= page_size <= min(geometry.row_stride_bytes, geometry.row_bytes):
                raise LayoutError(
                    _page_error(page_size, geometry, group, d, tensor_idx)
                )
            rows.append(
                RefRow(
                    geometry.base_ptr,
                    geometry.row_stride_bytes,
                    page_size,
                    geometry.num_blocks,
                    tensor_idx,
                    geometry.allocation,
                )
            )
        groups.append(rows)
    return geometries, groups


def _page_error(
    page_size: int, geometry: TensorGeometry, group: int, d: int, tensor_idx: int
) -> str:
    where = f"group {group}, ref {d} (tensor {tensor_idx}): page_size_bytes {page_size}"
    if page_size < 0:
        return f"{where} is negative"
    if page_size > geometry.row_stride_bytes:
        return f"{where} is larger than the row stride ({geometry.row_stride_bytes} B)"
    return (
        f"{where} is larger than a row ({geometry.row_bytes} B): the last "
        "block's page would end outside the tensor"
    )


class OffloadedGeometry(NamedTuple):
    """Where the chunks (rows) of an offloaded tensor lie, in bytes."""

    base_ptr: int
    row_stride_bytes: int
    # Bytes of one of the blocks_per_chunk sub-blocks of a row.
    sub_bytes: int
    num_chunks: int
    allocation: int  # as TensorGeometry.allocation


def read_offloaded(
    tensors: Any, blocks_per_chunk: Any
) -> tuple[list[OffloadedGeometry], tuple[MemoryRegion, ...]]:
    """Check offloaded tensors (one row per chunk); return their geometry,
    and the allocations they lie in (memory_regions).

    Each tensor may be given as is or as an object with a ``.tensor``
    attribute (a CanonicalKVCacheTensor).
    """
    bpc = as_int(blocks_per_chunk, "blocks_per_chunk")
    if not 1 <= bpc < 2**63:  # the kernels take an int64
        raise LayoutError(f"blocks_per_chunk must be >= 1 and < 2**63, got {bpc}")
    geometries = []
    tensor_geometries = []
    for t, entry in enumerate(as_list(tensors, "offloaded tensors")):
        geometry = tensor_geometry(_unwrapped(entry), t, "offloaded tensors[{}]")
        tensor_geometries.append(geometry)
        if geometry.row_bytes % bpc:
            raise LayoutError(
                f"offloaded tensors[{t}]: a row of {geometry.row_bytes} B does not "
                f"split into {bpc} sub-blocks"
            )
        if geometry.num_blocks > 1 and geometry.row_stride_bytes < geometry.row_bytes:
            raise LayoutError(
                f"offloaded tensors[{t}]: rows of {geometry.row_bytes} B overlap "
                f"(row stride {geometry.row_stride_bytes} B)"
            )
        geometries.append(
            OffloadedGeometry(
                base_ptr=geometry.base_ptr,
                row_stride_bytes=geometry.row_stride_bytes,
                sub_bytes=geometry.row_bytes // bpc,
                num_chunks=geometry.num_blocks,
                allocation=geometry.allocation,
            )
        )
    return geometries, memory_regions(tensor_geometries)


def _unwrapped(entry: Any) -> Any:
    """An offloaded tensor given as is, or as the .tensor of an entry."""
    try:
        if not hasattr(entry, "data_ptr") and hasattr(entry, "tensor"):
            return entry.tensor
    except Exception:  # tensor_geometry() then says what is wrong
        pass
    return entry


def offloaded_rows(
    groups: list[list[RefRow]], offloaded: list[OffloadedGeometry]
) -> list[OffloadedGeometry]:
    """The offloaded tensor of every ref, in copy order, checking that it fits.

    Offloaded tensors are aligned with the device tensors by tensor_idx, and
    every ref's page must fit in one sub-block of its offloaded tensor.
    """
    rows = []
    for group, refs in enumerate(groups):
        for d, ref in enumerate(refs):
            if ref.tensor_idx >= len(offloaded):
                raise LayoutError(
                    f"group {group}, ref {d}: tensor {ref.tensor_idx} has no "
                    f"offloaded tensor (there are {len(offloaded)})"
                )
            geometry = offloaded[ref.tensor_idx]
            if ref.page_size_bytes > geometry.sub_bytes:
                raise LayoutError(
                    f"group {group}, ref {d}: a page of {ref.page_size_bytes} B does "
                    f"not fit in a sub-block of offloaded tensors[{ref.tensor_idx}] "
                    f"({geometry.sub_bytes} B)"
                )
            rows.append(geometry)
    return rows


def chunk_slot(k: int, skip: int, blocks_per_chunk: int) -> tuple[int, int]:
    """Chunk (counted from the group's first) and sub-block of a group's block k.

    The group starts at sub-block ``skip = block_index % blocks_per_chunk`` of
    its first chunk (SPEC 5). The kernels' _kernels.common.chunk_slot is the
    same formula, on uint64.
    """
    return divmod(skip + k, blocks_per_chunk)


def num_chunks(group_size: int, block_index: int, blocks_per_chunk: int) -> int:
    """Offloaded chunks a group spans (0 for an empty group): its last block's
    chunk, plus one."""
    if group_size == 0:
        return 0
    skip = block_index % blocks_per_chunk
    return chunk_slot(group_size - 1, skip, blocks_per_chunk)[0] + 1
