"""execute: apply copy descriptors to host memory, in order (the execution oracle).

A plan means the bytes it leaves. Descriptor i copies ``sizes[i]`` bytes from
``src[i]`` to ``dst[i]`` after every descriptor before it, so where two write
the same byte the later one wins. execute() does exactly that, on host memory,
one ``ctypes.memmove`` per descriptor; a 2-D descriptor (StridedTransferPlan,
SPEC 10) is one memmove per row, row r copying ``width[i]`` bytes from
``src[i] + r * src_pitch[i]`` to ``dst[i] + r * dst_pitch[i]``. Two plans
mean the same when each, executed on the same memory, leaves the same bytes:
the tests hold coalesced plans, strided plans and the reference's plans to
that.

Pointers are raw addresses of this process, and a wrong one crashes it.
Given ``within`` (the allocations a plan may touch), every descriptor is
checked first, each side inside one allocation, and nothing is copied unless
all are.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import Any

import numpy as np

from .._errors import InputTypeError, SpecError
from ._input import as_descriptors, as_int, as_list, attributes

# One copy: (source address, destination address, bytes).
Copy = tuple[int, int, int]
# One allocation: [start, end) addresses.
Region = tuple[int, int]

FLAT_FIELDS = ("src", "dst", "sizes")
STRIDED_FIELDS = ("src", "dst", "width", "height", "src_pitch", "dst_pitch")


def execute(plan: Any, *, within: Iterable[Any] | None = None) -> int:
    """Apply a plan's descriptors in order; return the bytes copied.

    Args:
        plan: a TransferPlan (any object with src, dst and sizes) or a
            StridedTransferPlan (any object with src, dst, width, height,
            src_pitch and dst_pitch; one with a ``height`` is read as one),
            each field a 1-D int64 or uint64 numpy array, all of one length.
        within: optional allocations the plan may touch, each a contiguous
            numpy array or an ``(address, nbytes)`` pair; every copy's source
            and destination must then each lie inside one of them.

    Raises:
        InputTypeError: a field missing, or not a 1-D int64/uint64 array.
        SpecError: fields of different lengths, or (with ``within``) a copy
            outside every allocation, before anything is copied.
    """
    if hasattr(plan, "height"):
        fields = [
            as_descriptors(array, f"plan.{name}")
            for array, name in zip(
                attributes(plan, STRIDED_FIELDS, "plan"), STRIDED_FIELDS
            )
        ]
        columns = _same_length(fields, STRIDED_FIELDS)
        copies = [
            (src + r * src_pitch, dst + r * dst_pitch, width)
            for src, dst, width, height, src_pitch, dst_pitch in zip(*columns)
            for r in range(height)
        ]
    else:
        src, dst, sizes = attributes(plan, FLAT_FIELDS, "plan")
        copies = _flat_copies(src, dst, sizes, "plan.")
    return _apply(copies, within)


def execute_descriptors(
    src: Any, dst: Any, sizes: Any, *, within: Iterable[Any] | None = None
) -> int:
    """execute() of the plan ``(src, dst, sizes)``; return the bytes copied."""
    return _apply(_flat_copies(src, dst, sizes), within)


def _flat_copies(src: Any, dst: Any, sizes: Any, prefix: str = "") -> list[Copy]:
    fields = [
        as_descriptors(array, prefix + name)
        for array, name in zip((src, dst, sizes), FLAT_FIELDS)
    ]
    return list(zip(*_same_length(fields, FLAT_FIELDS)))


def _same_length(fields: list[Any], names: tuple[str, ...]) -> list[list[int]]:
    """The fields as lists of Python ints, checked to be of one length."""
    if len({len(field) for field in fields}) > 1:
        lengths = ", ".join(f"{n} {len(f)}" for n, f in zip(names, fields))
        raise SpecError(f"the plan's fields differ in length: {lengths}")
    return [field.tolist() for field in fields]


def _apply(copies: list[Copy], within: Iterable[Any] | None) -> int:
    """Check every copy against ``within`` (if given), then copy, in order."""
    if within is not None:
        regions = _regions(within)
        for i, (src, dst, size) in enumerate(copies):
            for side, start in (("source", src), ("destination", dst)):
                if size and not any(
                    a <= start and start + size <= b for a, b in regions
                ):
                    raise SpecError(
                        f"copy {i}: its {side} bytes [0x{start:x}, "
                        f"0x{start + size:x}) lie inside none of the allocations "
                        "given"
                    )
    for src, dst, size in copies:
        if size:
            ctypes.memmove(dst, src, size)
    return sum(size for _, _, size in copies)


def _regions(within: Iterable[Any]) -> list[Region]:
    """Each allocation as [start, end) addresses."""
    regions = []
    for k, entry in enumerate(as_list(within, "within")):
        if isinstance(entry, np.ndarray):
            if not (entry.flags.c_contiguous or entry.flags.f_contiguous):
                raise InputTypeError(f"within[{k}] is not a contiguous array")
            start, nbytes = entry.ctypes.data, entry.nbytes
        elif isinstance(entry, tuple) and len(entry) == 2:
            start = as_int(entry[0], f"within[{k}] address")
            nbytes = as_int(entry[1], f"within[{k}] nbytes")
        else:
            raise InputTypeError(
                f"within[{k}] must be a numpy array or an (address, nbytes) "
                f"pair, got {type(entry).__name__}"
            )
        regions.append((start, start + nbytes))
    return regions
