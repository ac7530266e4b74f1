"""Hostile input to every public function: the reference's answer or a clear error.

Each example starts from a valid transfer (a layout, offloaded tensors, a spec,
offloaded ids) and corrupts a few of its parts: wrong types, NaN, huge and
negative numbers, mismatched lengths, 0-d and 2-d arrays, non-contiguous,
unaligned, read-only or byte-swapped arrays, None, objects missing attributes,
out= buffers that are short, aliased or wrong. Then every call must either
give the reference's answer or raise a PtrresError (a ValueError or TypeError;
the reference raises one of those two), and nothing may be written outside
the out= buffers that were passed: every input array and tensor is compared
with a copy, and out= buffers are views into larger arrays whose other bytes
are compared too. After each example, a good call still works.

Each test also runs explicit examples of empty input (no ids, no ops, no
groups) first: an empty array is checked as any other (issue 23).

HYPOTHESIS_PROFILE=long runs 100_000 random examples per test.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import (
    data_ptr,
    dtype_of,
    itemsize,
    random_tensor,
    row_stride,
    with_torch,
    zeros,
)
from hypothesis import example, given
from test_plans import PlanCase, plan_cases

import ptrres
from ptrres import reference

if with_torch():  # without it, no torch kinds are drawn
    import torch

# Failures a hostile call may end in: ptrres' own errors, and for the
# reference, which reads input with the same helpers, ValueError or TypeError.
REFERENCE_ERRORS = (ValueError, TypeError)

EXTREME_INTS = [
    -1,
    -(2**31),
    2**31,
    2**32,
    -(2**63),
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    2**100,
    -(2**100),
]

NOT_INTS = [
    None,
    True,
    False,
    1.0,
    2.5,
    math.nan,
    math.inf,
    -math.inf,
    "3",
    "",
    b"3",
    1j,
    Decimal(3),
    Fraction(3, 1),
    object(),
    [3],
    (),
    {},
    np.array([3]),
    np.float64(3.0),
    np.float32(math.nan),
    np.bool_(True),
    np.complex64(1),
    np.datetime64(3, "s"),
]


def numpy_ints() -> st.SearchStrategy[Any]:
    """Numpy integer scalars of every width, with their extreme values."""
    dtypes: list[Any] = [
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint32,
        np.uint64,
    ]
    return st.sampled_from(dtypes).flatmap(
        lambda dtype: st.integers(
            int(np.iinfo(dtype).min), int(np.iinfo(dtype).max)
        ).map(dtype)
    )


def scalars(small: int = 20) -> st.SearchStrategy[Any]:
    """Mostly plausible integers; sometimes extreme ones, or not integers at all."""
    return st.one_of(
        st.integers(-2, small),
        st.sampled_from(EXTREME_INTS),
        numpy_ints(),
        st.sampled_from(NOT_INTS),
        st.just(np.array(2)),  # a 0-d integer array: operator.index takes it
    )


ARRAY_DTYPES = [
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    ">i4",
    ">i8",
    ">u8",
    "float32",
    "float64",
    "bool",
    "object",
    "complex128",
    "U4",
]


def cast(values: list[int], dtype: str) -> np.ndarray:
    """values as dtype, wrapping or saturating as numpy does, never failing."""
    as_int = np.array([max(-(2**63), min(v, 2**64 - 1)) for v in values], object)
    try:
        return as_int.astype(dtype)
    except (OverflowError, ValueError, TypeError):
        wrapped = [v % 2**64 - (2**64 if v % 2**64 >= 2**63 else 0) for v in values]
        return np.array(wrapped, np.int64).astype(dtype)


@st.composite
def arrays_like(draw: Any, values: list[int]) -> Any:
    """``values`` as an array of any dtype and memory layout, or not an array.

    Most draws keep the values and change how they are held; some change the
    values too.
    """
    if draw(st.integers(0, 3)) == 0:
        values = list(values)
        if values and draw(st.booleans()):
            values[draw(st.integers(0, len(values) - 1))] = draw(
                st.one_of(st.integers(-3, 60), st.sampled_from(EXTREME_INTS))
            )
        else:
            values = draw(st.lists(st.integers(-3, 60), max_size=6))
    holder = draw(
        st.sampled_from(
            ["array"] * 6
            + ["list", "tuple", "torch", "none", "str", "range", "scalar", "dict"]
            if with_torch()
            else ["array"] * 6
            + ["list", "tuple", "none", "str", "range", "scalar", "dict"]
        )
    )
    if holder == "list":
        return list(values) + draw(st.sampled_from([[], [], [None], [1.5], ["1"]]))
    if holder == "tuple":
        return tuple(values)
    if holder == "torch":
        return torch.from_numpy(cast(values, "int64"))
    if holder == "none":
        return None
    if holder == "str":
        return ",".join(map(str, values))
    if holder == "range":
        return range(len(values))
    if holder == "scalar":
        return draw(scalars())
    if holder == "dict":
        return dict.fromkeys(values, 0)
    dtype = draw(st.sampled_from(["int32", "int64"] * 4 + ARRAY_DTYPES))
    array = cast(values, dtype)
    shape = draw(
        st.sampled_from(["1-d"] * 6 + ["strided", "reversed", "2-d", "column", "0-d"])
    )
    if shape == "strided":
        array = np.repeat(array, 2)[::2]
    elif shape == "reversed":
        array = array[::-1].copy()[::-1]
    elif shape == "2-d":
        array = np.stack([array, array])
    elif shape == "column":
        array = array.reshape(-1, 1)
    elif shape == "0-d":
        array = array[0] if array.size else np.array(0, array.dtype)
        array = np.asarray(array)
    flags = draw(st.sampled_from(["plain"] * 6 + ["read-only", "unaligned"]))
    if flags == "read-only":
        array.flags.writeable = False
    elif flags == "unaligned" and array.dtype.itemsize > 1 and array.dtype != object:
        raw = np.zeros(array.nbytes + 1, np.uint8)[1:]
        raw[:] = np.frombuffer(np.ascontiguousarray(array).tobytes(), np.uint8)
        array = raw.view(array.dtype).reshape(array.shape)
    return array


def sequences_like(values: list[int]) -> st.SearchStrategy[Any]:
    """Group sizes or block indices: plain lists most of the time."""
    # Sizes whose sum wraps around 2**64 to the right total.
    wrapping = [2**63 - 1, 2**63 - 1, sum(values) + 2] + [0] * (len(values) - 3)
    return st.one_of(
        st.just(wrapping if len(values) >= 3 else values),
        st.just(list(values)),
        st.just(tuple(values)),
        arrays_like(values),
        st.lists(scalars(), max_size=4),
        st.builds(
            lambda vs, i, x: [*vs[:i], x, *vs[i + 1 :]],
            st.just(list(values)),
            st.integers(0, max(len(values) - 1, 0)),
            scalars(),
        ),
        st.just(set(values)),
    )


class DuckTensor:
    """Answers ptrres' tensor calls with whatever it was given (even nonsense)."""

    def __init__(self, base_ptr: Any, stride0: Any, element_size: Any, shape: Any):
        self._base_ptr = base_ptr
        self._stride0 = stride0
        self._element_size = element_size
        self.shape = shape

    def data_ptr(self) -> Any:
        return self._base_ptr

    def stride(self, dim: int) -> Any:
        return self._stride0 if dim == 0 else 1

    def element_size(self) -> Any:
        return self._element_size

    def __repr__(self) -> str:
        return (
            f"DuckTensor({self._base_ptr!r}, {self._stride0!r}, "
            f"{self._element_size!r}, {self.shape!r})"
        )


class Broken:
    """An object whose every attribute (but its repr) raises, as a bad proxy might."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"broken: {name}")

    def __repr__(self) -> str:
        return "Broken()"


@st.composite
def tensors_like(draw: Any, tensor: Any) -> Any:
    """A tensor that replaces ``tensor``: odd shapes, strides, pointers, types."""
    kind = draw(
        st.sampled_from(
            ["duck"] * 4
            + ["numpy", "numpy-reversed", "numpy-broadcast", "numpy-3d", "numpy-1d"]
            + ["numpy-0d", "torch-t", "torch-0d", "none", "list", "sparse", "broken"]
            if with_torch()
            else ["duck"] * 4
            + ["numpy", "numpy-reversed", "numpy-broadcast", "numpy-3d", "numpy-1d"]
            + ["numpy-0d", "none", "list", "broken"]
        )
    )
    num_blocks, row = int(tensor.shape[0]), int(tensor.shape[1])
    if kind == "duck":
        duck = DuckTensor(
            draw(st.one_of(st.just(data_ptr(tensor)), scalars(2**20))),
            draw(
                st.one_of(st.just(row_stride(tensor) // itemsize(tensor)), scalars(64))
            ),
            draw(st.one_of(st.just(itemsize(tensor)), scalars(8))),
            draw(
                st.one_of(
                    st.just((num_blocks, row)),
                    st.tuples(scalars(), scalars()),
                    st.lists(scalars(), max_size=3).map(tuple),
                    st.sampled_from([None, 5, "ab", [3, 4]]),
                )
            ),
        )
        for method in draw(
            st.sets(st.sampled_from(["data_ptr", "stride", "element_size", "shape"]))
        ):
            setattr(duck, method, draw(st.sampled_from([None, 3, "x"])))
        return duck
    array = np.zeros((num_blocks, row), np.int8)
    if kind == "numpy":
        return array
    if kind == "numpy-reversed":
        return array[::-1]
    if kind == "numpy-broadcast":
        return np.broadcast_to(array[:1], array.shape)
    if kind == "numpy-3d":
        return np.zeros((num_blocks, 2, max(row // 2, 1)), np.int16)
    if kind == "numpy-1d":
        return np.zeros(num_blocks, np.int64)
    if kind == "numpy-0d":
        return np.array(3)
    if kind == "torch-t":
        return torch.zeros(row, num_blocks, dtype=torch.int8).t()
    if kind == "torch-0d":
        return torch.tensor(3)
    if kind == "none":
        return None
    if kind == "list":
        return array.tolist()
    if kind == "sparse":
        return torch.zeros(num_blocks, row).to_sparse()
    return Broken()


class Missing:
    """Stands for an attribute an object does not have."""


MISSING = Missing()


def namespace(**fields: Any) -> SimpleNamespace:
    """An object with these attributes, leaving out those that are MISSING."""
    return SimpleNamespace(**{k: v for k, v in fields.items() if v is not MISSING})


def maybe(draw: Any, value: Any, hostile: st.SearchStrategy[Any]) -> Any:
    """value, or (one time in six) a hostile replacement, or MISSING."""
    choice = draw(st.integers(0, 11))
    if choice == 0:
        return draw(hostile)
    if choice == 1:
        return MISSING
    return value


@st.composite
def hostile_layouts(draw: Any, kv: ptrres.CanonicalKVCaches) -> Any:
    """The layout, with some of its tensors, refs and lists corrupted."""
    if not draw(st.integers(0, 2)):
        return kv
    tensors = [
        namespace(
            tensor=maybe(draw, entry.tensor, tensors_like(entry.tensor)),
            page_size_bytes=entry.page_size_bytes,
        )
        for entry in kv.tensors
    ]
    group_data_refs = [
        [
            namespace(
                tensor_idx=maybe(draw, ref.tensor_idx, scalars(len(kv.tensors))),
                page_size_bytes=maybe(draw, ref.page_size_bytes, scalars(64)),
            )
            for ref in refs
        ]
        for refs in kv.group_data_refs
    ]
    tensors_field: Any = maybe(draw, tensors, st.sampled_from([None, 3, "ab", ()]))
    refs_field: Any = maybe(
        draw,
        group_data_refs,
        st.one_of(
            st.sampled_from([None, 3, "ab", [None], [[None]], [3], [["ab"]]]),
            st.just(group_data_refs[:-1]),
            st.just([*group_data_refs, []]),
        ),
    )
    return namespace(tensors=tensors_field, group_data_refs=refs_field)


@st.composite
def one_bad_id(draw: Any, ids: np.ndarray) -> np.ndarray:
    """ids (int32 or int64) with one of them (if any) out of every range."""
    ids = ids.copy()
    if len(ids):
        bad = draw(st.sampled_from([-1, -(2**31), 2**31 - 1, 1000]))
        ids[draw(st.integers(0, len(ids) - 1))] = bad
    return ids


@st.composite
def hostile_specs(draw: Any, spec: ptrres.GPULoadStoreSpec) -> Any:
    """The spec; or with one id out of range, and nothing else wrong; or with
    some of its fields corrupted."""
    choice = draw(st.integers(0, 3))
    if choice == 0:
        return spec
    if choice == 1:
        return ptrres.GPULoadStoreSpec(
            draw(one_bad_id(spec.block_ids)), spec.group_sizes, spec.block_indices
        )
    return namespace(
        block_ids=maybe(draw, spec.block_ids, arrays_like(spec.block_ids.tolist())),
        group_sizes=maybe(
            draw, list(spec.group_sizes), sequences_like(list(spec.group_sizes))
        ),
        block_indices=maybe(
            draw, list(spec.block_indices), sequences_like(list(spec.block_indices))
        ),
    )


@dataclass
class Guarded:
    """out= buffers as views into larger arrays whose other bytes must not change."""

    out: Any
    # How each buffer was made (for failure reports).
    kinds: list[str] = field(default_factory=list)
    # (parent array, its bytes before the call, view's first byte, view's bytes)
    parents: list[tuple[np.ndarray, bytes, int, int]] = field(
        default_factory=list, repr=False
    )

    def check(self, n_ops: int | None) -> None:
        """Only each view's bytes may change (its first n_ops entries, if known)."""
        for parent, before, start, size in self.parents:
            after = parent.tobytes()
            end = start + (size if n_ops is None else min(size, 8 * n_ops))
            assert after[:start] == before[:start], "written before an out= buffer"
            assert after[end:] == before[end:], "written past an out= buffer"


GUARD = 16  # entries on each side of an out= view


@st.composite
def out_buffers(draw: Any, n_ops: int, count: int) -> Guarded:
    """None, or ``count`` out= buffers for n_ops ops: good ones, mostly."""
    if draw(st.integers(0, 2)) == 0:
        return Guarded(None)
    guarded = Guarded(None)
    buffers: list[Any] = []
    for _ in range(count):
        kind = draw(
            st.sampled_from(
                ["good"] * 8
                + ["short", "int32", "float64", "big-endian", "2-d", "strided"]
                + ["read-only", "unaligned", "list", "torch", "none", "same"]
                if with_torch()
                else ["good"] * 8
                + ["short", "int32", "float64", "big-endian", "2-d", "strided"]
                + ["read-only", "unaligned", "list", "none", "same"]
            )
        )
        guarded.kinds.append(kind)
        length = n_ops + draw(st.integers(0, 3))
        if kind == "short":
            length = max(n_ops - 1, 0)
        if kind == "same" and buffers:
            buffers.append(buffers[-1])  # aliased with the previous buffer
            continue
        if kind == "list":
            buffers.append([0] * length)
            continue
        if kind == "torch":
            buffers.append(torch.zeros(length, dtype=torch.int64))
            continue
        if kind == "none":
            buffers.append(None)
            continue
        dtype: Any = {
            "int32": np.int32,
            "float64": np.float64,
            "big-endian": ">i8",
        }.get(kind, draw(st.sampled_from([np.int64, np.uint64])))
        factor = 2 if kind in ("2-d", "strided") else 1
        parent = np.full(length * factor + 2 * GUARD + 1, 77, dtype)
        if kind == "unaligned":
            raw = parent.view(np.uint8)[1 : 1 + (len(parent) - 1) * parent.itemsize]
            view = raw.view(dtype)[GUARD : GUARD + length]
        elif kind == "2-d":
            view = parent[GUARD : GUARD + 2 * length].reshape(length, 2)
        elif kind == "strided":
            view = parent[GUARD : GUARD + 2 * length : 2]
        else:
            view = parent[GUARD : GUARD + length]
        if kind == "read-only":
            view.flags.writeable = False
        start = view.__array_interface__["data"][0] - parent.ctypes.data
        guarded.parents.append((parent, parent.tobytes(), start, view.nbytes))
        buffers.append(view)
    container = draw(st.sampled_from(["tuple"] * 6 + ["list", "short", "long", "int"]))
    guarded.kinds.append(container)
    if container == "list":
        guarded.out = buffers
    elif container == "short":
        guarded.out = tuple(buffers[:-1])
    elif container == "long":
        guarded.out = (*buffers, buffers[0])
    elif container == "int":
        guarded.out = 3
    else:
        guarded.out = tuple(buffers)
    return guarded


def empty_out(count: int, *, aliased: bool = False, read_only: bool = False) -> Guarded:
    """``count`` out= buffers of no entries, views between guarded bytes.

    Aliased buffers (one view passed ``count`` times) share no byte they would
    be written to: ptrres must take them. Read-only ones it must refuse.
    """
    guarded = Guarded(None, kinds=["empty"] * count)
    buffers = []
    for _ in range(1 if aliased else count):
        parent = np.full(2 * GUARD, 77, np.int64)
        view = parent[GUARD:GUARD]
        if read_only:
            view.flags.writeable = False
        guarded.parents.append((parent, parent.tobytes(), 8 * GUARD, 0))
        buffers.append(view)
    guarded.out = tuple(buffers * count if aliased else buffers)
    return guarded


def snapshot(*objects: Any) -> list[tuple[Any, bytes]]:
    """The bytes of every numpy array or CPU tensor among objects (one level deep)."""
    found: list[tuple[Any, bytes]] = []
    for obj in objects:
        items = obj if isinstance(obj, (list, tuple)) else [obj]
        for item in items:
            if isinstance(item, SimpleNamespace):
                item = vars(item).get("tensor")
            if isinstance(item, np.ndarray) and item.dtype != object:
                found.append((item, item.tobytes()))
            elif (
                with_torch()
                and isinstance(item, torch.Tensor)
                and item.layout == torch.strided
            ):
                found.append((item, tensor_bytes(item)))
    return found


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    if tensor.numel() == 0:
        return b""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_unchanged(snapshots: list[tuple[Any, bytes]]) -> None:
    for item, before in snapshots:
        if isinstance(item, np.ndarray):
            assert item.tobytes() == before, "an input array was written to"
        else:
            assert tensor_bytes(item) == before, "an input tensor was written to"


@dataclass
class Outcome:
    """What a call returned, or the error it raised."""

    value: Any = None
    error: BaseException | None = None


def call(function: Any, *args: Any, **kwargs: Any) -> Outcome:
    """Call, keeping the result or the error; errors other than ours fail."""
    try:
        return Outcome(value=function(*args, **kwargs))
    except ptrres.PtrresError as exc:
        error = exc
    assert isinstance(error, (ValueError, TypeError))
    return Outcome(error=error)


def call_reference(function: Any, *args: Any, **kwargs: Any) -> Outcome:
    try:
        return Outcome(value=function(*args, **kwargs))
    except REFERENCE_ERRORS as exc:
        return Outcome(error=exc)


def arrays_of(result: Any) -> tuple[Any, ...]:
    if isinstance(result, ptrres.DevicePointers):
        return (
            result.ptrs.tolist(),
            result.sizes.tolist(),
            tuple(result.group_block_counts),
            tuple(result.group_data_ref_counts),
            tuple(result.block_indices),
        )
    if isinstance(result, ptrres.TransferPlan):
        return (
            result.src.tolist(),
            result.dst.tolist(),
            result.sizes.tolist(),
            result.num_bytes,
        )
    return tuple(result)


def assert_same(
    actual: Outcome,
    expected: Outcome,
    *,
    out_valid: bool = True,
    same_class: bool = True,
) -> None:
    """Both raised the same error (see assert_same_error), or both gave the
    same answer.

    With out_valid False, the out= buffers are ones ptrres must refuse: it
    must then fail (with any of its errors) whatever the reference did.
    """
    if not out_valid:
        assert actual.error is not None, (
            f"ptrres took out= buffers it must refuse, and returned {actual.value!r}"
        )
        return
    if expected.error is not None:
        assert actual.error is not None, (
            f"ptrres returned {actual.value!r} where the reference raised "
            f"{expected.error!r}"
        )
        assert_same_error(actual.error, expected.error, same_class=same_class)
        return
    assert actual.error is None, (
        f"ptrres raised {actual.error!r} where the reference returned "
        f"{expected.value!r}"
    )
    assert arrays_of(actual.value) == arrays_of(expected.value), (
        f"ptrres returned {actual.value!r}, the reference {expected.value!r}"
    )


ID_ERRORS = (ptrres.BlockIdError, ptrres.OffloadedIdError)


def assert_same_error(
    actual: BaseException, expected: BaseException, *, same_class: bool = True
) -> None:
    """The same error: the same class and message and, for an id, the same
    group, position and value.

    With same_class False (several parts of a call may be wrong, and ptrres
    may check them in another order than the reference), only an id error
    must be the same on both sides: every other check passed for it.
    An expected error without a message (an oracle's) is not judged by it.
    """
    either_names_an_id = isinstance(actual, ID_ERRORS) or isinstance(
        expected, ID_ERRORS
    )
    if not same_class and not either_names_an_id:
        return
    assert type(actual) is type(expected), (
        f"ptrres raised {actual!r} where the reference raised {expected!r}"
    )
    if isinstance(expected, ID_ERRORS):
        for name in ("group", "position", "value"):
            assert getattr(actual, name) == getattr(expected, name), (
                f"ptrres raised {actual!r} where the reference raised "
                f"{expected!r}: they name different {name}s"
            )
    if str(expected):
        assert str(actual) == str(expected)


# The dtypes ptrres writes descriptors to (native byte order).
OUT_DTYPES = (np.dtype(np.int64), np.dtype(np.uint64))


def out_is_valid(out: Any, count: int, n_ops: int | None) -> bool:
    """Whether ptrres must take these out= buffers for a call of n_ops ops.

    None (allocate) is valid; otherwise a tuple or list of ``count`` 1-D
    int64 or uint64 numpy arrays, each writable, aligned and contiguous, with
    at least n_ops entries, whose first n_ops entries share no byte. With
    n_ops None (the call fails before the op count is known), the length is
    not judged, and the whole buffers must be apart.
    """
    if out is None:
        return True
    if type(out) not in (tuple, list) or len(out) != count:
        return False
    for buffer in out:
        if type(buffer) is not np.ndarray or buffer.dtype not in OUT_DTYPES:
            return False
        if buffer.ndim != 1 or not buffer.flags.carray:
            return False
        if n_ops is not None and len(buffer) < n_ops:
            return False
    used = [buffer[:n_ops] for buffer in out]
    return not any(
        np.shares_memory(a, b) for i, a in enumerate(used) for b in used[i + 1 :]
    )


def is_short_out_error(error: BaseException | None) -> bool:
    """An out= buffer refused as too short (the op count decides)."""
    return isinstance(error, ptrres.OutBufferError) and bool(
        re.search(r"holds \d+ entries but this transfer has \d+ ops", str(error))
    )


def assert_same_with_out(
    actual: Outcome,
    expected: Outcome,
    out: Any,
    count: int,
    n_ops: int | None,
    *,
    same_class: bool = True,
) -> None:
    """assert_same for a call given out= buffers; n_ops None if the reference failed.

    A failing reference leaves the op count unknown: a valid buffer may then
    still be too short, and ptrres may say so before it finds the bad input.
    """
    short = n_ops is None and is_short_out_error(actual.error)
    if short and out_is_valid(out, count, None):
        return
    valid = out_is_valid(out, count, n_ops)
    assert_same(actual, expected, out_valid=valid, same_class=same_class)


# A layout and spec that must keep working after every hostile call.
GOOD_KV = ptrres.CanonicalKVCaches(
    [ptrres.CanonicalKVCacheTensor(random_tensor(8, 16, 0, dtype_of("int8"), 0), 16)],
    [[ptrres.CanonicalKVCacheRef(0, 16)]],
)
GOOD_TABLE = ptrres.PointerTable(GOOD_KV)
GOOD_SPEC = ptrres.GPULoadStoreSpec([1, 7, 2])
GOOD_PTRS = reference.resolve_device_pointers(GOOD_SPEC, GOOD_KV).ptrs.tolist()


def assert_still_working() -> None:
    assert GOOD_TABLE.resolve(GOOD_SPEC).ptrs.tolist() == GOOD_PTRS
    assert ptrres.resolve_device_pointers(GOOD_SPEC, GOOD_KV).ptrs.tolist() == (
        GOOD_PTRS
    )


@pytest.fixture(scope="module", autouse=True)
def closed_kernels() -> None:
    """Kernels closed to new signatures: an unconverted dtype fails loudly."""
    ptrres.warmup()


# Layouts of the empty examples: one int8 tensor of 4 blocks of 16 bytes, its
# groups with no ref or one; and issue 23's, one (1, 1) tensor and no ref.
def example_layout(*refs_per_group: int) -> ptrres.CanonicalKVCaches:
    return ptrres.CanonicalKVCaches(
        [
            ptrres.CanonicalKVCacheTensor(
                random_tensor(4, 16, 0, dtype_of("int8"), 0), 16
            )
        ],
        [[ptrres.CanonicalKVCacheRef(0, 16)] * n for n in refs_per_group],
    )


ISSUE_23_LAYOUT = ptrres.CanonicalKVCaches(
    [ptrres.CanonicalKVCacheTensor(random_tensor(1, 1, 0, dtype_of("int8"), 0), 1)],
    [[]],
)
ONE_REF = example_layout(1)
NO_GROUPS = example_layout()
# Offloaded tensors for ONE_REF: 3 chunks of 2 sub-blocks of 16 bytes.
EXAMPLE_OFFLOADED = [random_tensor(3, 32, 0, dtype_of("int8"), 100)]


def no_blocks(block_ids: Any = (), **fields: Any) -> SimpleNamespace:
    """A spec of one group without blocks; ``fields`` replace its parts."""
    return namespace(
        **{"block_ids": block_ids, "group_sizes": [0], "block_indices": [0], **fields}
    )


@dataclass
class ResolveCall:
    """A hostile resolve: a layout, a spec and out= buffers."""

    kv: Any
    spec: Any
    guarded: Guarded


@st.composite
def hostile_resolves(draw: Any) -> ResolveCall:
    case = draw(plan_cases())
    return ResolveCall(
        draw(hostile_layouts(case.kv_caches)),
        draw(hostile_specs(case.spec)),
        draw(out_buffers(case.num_ops, 2)),
    )


@given(hostile_resolves())
# Issue 23's draw: numpy's float32 of no ids is no integer array either.
@example(
    ResolveCall(ISSUE_23_LAYOUT, no_blocks(np.array([], np.float32)), Guarded(None))
)
@example(ResolveCall(ONE_REF, no_blocks(np.array([], np.float64)), empty_out(2)))
@example(ResolveCall(ONE_REF, no_blocks(zeros(0, dtype="float32")), Guarded(None)))
@example(ResolveCall(ONE_REF, no_blocks(np.array([], bool)), Guarded(None)))
@example(ResolveCall(ONE_REF, no_blocks(np.zeros((0, 1), np.int64)), Guarded(None)))
# [] has no dtype of its own (numpy reads it as float64): no ids, accepted.
@example(ResolveCall(ONE_REF, no_blocks([]), empty_out(2, aliased=True)))
@example(ResolveCall(ONE_REF, no_blocks(range(0)), empty_out(2, read_only=True)))
# No groups: their sizes and indices are checked as the ids are.
@example(ResolveCall(NO_GROUPS, no_blocks(group_sizes=np.array([])), Guarded(None)))
@example(
    ResolveCall(
        NO_GROUPS,
        no_blocks(
            group_sizes=np.array([], np.uint64), block_indices=np.array([], "U4")
        ),
        Guarded(None),
    )
)
@example(
    ResolveCall(
        NO_GROUPS, no_blocks(group_sizes=(), block_indices=range(0)), empty_out(2)
    )
)
def test_hostile_resolve(call_: ResolveCall) -> None:
    kv, spec, guarded = call_.kv, call_.spec, call_.guarded
    inputs = snapshot(spec.block_ids if hasattr(spec, "block_ids") else None)
    inputs += snapshot(getattr(kv, "tensors", None))

    expected = call_reference(reference.resolve_device_pointers, spec, kv)
    table = call(ptrres.PointerTable, kv)
    if table.error is None:
        assert_same(call(table.value.resolve, spec), expected)
        with_out = call(table.value.resolve, spec, out=guarded.out)
        n_ops = None if expected.error else len(expected.value.ptrs)
        assert_same_with_out(with_out, expected, guarded.out, 2, n_ops)
        guarded.check(n_ops)
    else:
        assert expected.error is not None
    assert_same(call(ptrres.resolve_device_pointers, spec, kv), expected)
    assert_unchanged(inputs)
    assert_still_working()


@st.composite
def hostile_device_pointers(draw: Any, device_ptrs: ptrres.DevicePointers) -> Any:
    fields: dict[str, Any] = {
        "ptrs": device_ptrs.ptrs,
        "sizes": device_ptrs.sizes,
        "group_block_counts": device_ptrs.group_block_counts,
        "group_data_ref_counts": device_ptrs.group_data_ref_counts,
        "block_indices": device_ptrs.block_indices,
    }
    if not draw(st.integers(0, 2)):
        return device_ptrs
    hostile: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, np.ndarray):
            values = [int(v) for v in value.tolist()]
            if values and draw(st.integers(0, 3)) == 0:
                k = draw(st.integers(0, len(values) - 1))
                values[k] = (values[k] + draw(st.sampled_from([1, 8, -8, 2**63]))) % (
                    2**64
                )
            hostile[name] = maybe(
                draw,
                np.array(values, np.uint64),
                arrays_like(values),
            )
        else:
            hostile[name] = maybe(draw, value, sequences_like(list(value)))
    return namespace(**hostile)


@st.composite
def hostile_pointer_groups(draw: Any) -> tuple[Any, Any]:
    """Device pointers (perhaps corrupted) and a blocks_per_chunk."""
    case = draw(plan_cases())
    device_ptrs = reference.resolve_device_pointers(case.spec, case.kv_caches)
    return (
        draw(hostile_device_pointers(device_ptrs)),
        draw(st.one_of(st.integers(1, 9), scalars(9))),
    )


def no_groups(**fields: Any) -> SimpleNamespace:
    """Device pointers of no groups; ``fields`` replace their parts."""
    empty = np.zeros(0, np.uint64)
    return namespace(
        **{
            "ptrs": empty,
            "sizes": empty,
            "group_block_counts": (),
            "group_data_ref_counts": (),
            "block_indices": (),
            **fields,
        }
    )


@given(hostile_pointer_groups())
# Counts are read one by one: no counts of any dtype are no groups.
@example((no_groups(group_block_counts=np.array([])), 2))
@example((no_groups(block_indices=np.array([], "U4")), 1))
@example((no_groups(), 0))
@example((no_groups(), 1.0))
def test_hostile_iter_pointer_groups(pointer_groups: tuple[Any, Any]) -> None:
    hostile, bpc = pointer_groups
    expected = call_reference(lambda: list(reference.iter_pointer_groups(hostile, bpc)))
    actual = call(lambda: list(ptrres.iter_pointer_groups(hostile, bpc)))
    assert_same(actual, expected)
    assert_still_working()


@st.composite
def hostile_offloaded(draw: Any, case: PlanCase) -> tuple[Any, Any]:
    """Offloaded tensors and blocks_per_chunk, perhaps corrupted."""
    tensors: Any = [
        maybe(draw, tensor, tensors_like(tensor)) for tensor in case.offloaded_tensors
    ]
    tensors = [t for t in tensors if t is not MISSING]
    tensors = maybe(
        draw,
        tensors,
        st.sampled_from([None, 3, "ab", [None], tensors[:-1], [*tensors, None]]),
    )
    if tensors is MISSING:
        tensors = []
    bpc = maybe(draw, case.blocks_per_chunk, scalars(9))
    return tensors, (1 if bpc is MISSING else bpc)


def expected_plan(
    spec: Any,
    kv: Any,
    tensors: Any,
    bpc: Any,
    ids: Any,
    store: Any,
    merge: Any,
    max_run_bytes: Any,
) -> Outcome:
    """The reference's plan, coalesced the same way when asked to.

    ptrres checks store, coalesce and max_run_bytes, in that order, before it
    looks at a single id: so does this, with ptrres' wording for coalesce.
    """

    def plan() -> ptrres.TransferPlan:
        if type(store) is bool:  # else the reference refuses store first
            if type(merge) is not bool:
                raise ptrres.InputTypeError(
                    f"coalesce must be True or False, got {merge!r}"
                )
            empty = np.zeros(0, np.uint64)
            reference.coalesce(empty, empty, empty, max_run_bytes=max_run_bytes)
        result = reference.plan_transfer(spec, kv, tensors, bpc, ids, store=store)
        if merge:
            return reference.coalesce(
                result.src, result.dst, result.sizes, max_run_bytes=max_run_bytes
            )
        return result

    return call_reference(plan)


@dataclass
class PlanCall:
    """A hostile plan_transfer: every argument, and out= buffers."""

    kv: Any
    spec: Any
    tensors: Any
    bpc: Any
    ids: Any
    store: Any = True
    merge: Any = False
    max_run_bytes: Any = None
    guarded: Guarded = field(default_factory=lambda: Guarded(None))


@st.composite
def hostile_plans(draw: Any) -> PlanCall:
    case = draw(plan_cases())
    kv = draw(hostile_layouts(case.kv_caches))
    spec = draw(hostile_specs(case.spec))
    tensors, bpc = draw(hostile_offloaded(case))
    ids = draw(
        st.one_of(
            st.just(case.offloaded_ids),
            one_bad_id(case.offloaded_ids),
            arrays_like(case.offloaded_ids.tolist()),
        )
    )
    return PlanCall(
        kv,
        spec,
        tensors,
        bpc,
        ids,
        store=draw(st.one_of(st.booleans(), st.sampled_from([0, 1, None]))),
        merge=draw(st.one_of(st.booleans(), st.sampled_from([1, "yes"]))),
        max_run_bytes=draw(st.one_of(st.none(), st.integers(1, 200), scalars(200))),
        guarded=draw(out_buffers(case.num_ops, 3)),
    )


def empty_plan(ids: Any = (), spec: Any = None, **fields: Any) -> PlanCall:
    """A plan of ONE_REF without blocks: no ids, ``ids`` as offloaded ids."""
    spec = no_blocks(np.zeros(0, np.int64)) if spec is None else spec
    return PlanCall(ONE_REF, spec, EXAMPLE_OFFLOADED, 2, ids, **fields)


@given(hostile_plans())
# Issue 23's case for offloaded ids: a float32 array of none is refused.
@example(empty_plan(np.array([], np.float32)))
@example(empty_plan(np.array([], np.float64), merge=True, guarded=empty_out(3)))
@example(empty_plan(zeros(0, dtype="float32"), store=False))
@example(empty_plan(np.array([], object)))
@example(empty_plan([], no_blocks(np.array([], np.float32))))
@example(
    empty_plan([], no_blocks(zeros(0, dtype="float32")), merge=True, max_run_bytes=8)
)
# Valid and empty: the reference's empty plan, into empty out= buffers too.
@example(empty_plan([], guarded=empty_out(3, aliased=True)))
@example(empty_plan(np.array([], np.int8), merge=True, guarded=empty_out(3)))
@example(empty_plan((), guarded=empty_out(3, read_only=True)))
@example(empty_plan(range(0), merge=True, max_run_bytes=0))
def test_hostile_plan_transfer(call_: PlanCall) -> None:
    kv, spec, tensors, bpc, ids = (
        call_.kv, call_.spec, call_.tensors, call_.bpc, call_.ids
    )  # fmt: skip
    store, merge, max_run_bytes = call_.store, call_.merge, call_.max_run_bytes
    guarded = call_.guarded
    inputs = snapshot(spec.block_ids if hasattr(spec, "block_ids") else None, ids)
    inputs += snapshot(getattr(kv, "tensors", None), tensors)

    expected = expected_plan(spec, kv, tensors, bpc, ids, store, merge, max_run_bytes)
    table = call(ptrres.PointerTable, kv)
    offloaded = call(ptrres.OffloadedLayout, tensors, bpc)
    if table.error is not None or offloaded.error is not None:
        assert expected.error is not None
    else:
        kwargs = {"store": store, "coalesce": merge, "max_run_bytes": max_run_bytes}
        plan = table.value.plan_transfer
        actual = call(plan, spec, offloaded.value, ids, **kwargs)
        assert_same(actual, expected, same_class=False)
        with_out = call(plan, spec, offloaded.value, ids, out=guarded.out, **kwargs)
        # Unmerged, the plan has one op per resolved pointer: no more is written.
        resolved = call_reference(reference.resolve_device_pointers, spec, kv)
        n_ops = None if expected.error else len(resolved.value.ptrs)
        assert_same_with_out(
            with_out, expected, guarded.out, 3, n_ops, same_class=False
        )
        guarded.check(n_ops)
    assert_unchanged(inputs)
    assert_still_working()


def block_ids_behind(device_ptrs: Any, kv: ptrres.CanonicalKVCaches) -> list[int]:
    """The block ids behind valid device pointers (0 for groups without refs)."""
    ids: list[int] = []
    op = 0
    for count, refs in zip(device_ptrs.group_block_counts, kv.group_data_refs):
        n = int(count)  # counts may be 0-d arrays: [0] * array(2) broadcasts
        if refs:
            tensor = kv.tensors[refs[0].tensor_idx].tensor
            stride = row_stride(tensor)
            ids += [
                (int(p) - data_ptr(tensor)) // stride
                for p in device_ptrs.ptrs[op : op + n]
            ]
        else:
            ids += [0] * n
        op += n * len(refs)
    return ids


def first_bad_pointer(
    ptrs: np.ndarray, sizes: np.ndarray, counts: Any, kv: ptrres.CanonicalKVCaches
) -> tuple[int, int, int] | None:
    """The (group, position, pointer) of the first op that is not a block of its
    ref, the same block as ref 0's, with the ref's page as its size; or None.

    Ref 0's pointer names the group's block: (ptr - base) / row stride.
    """
    op = 0
    for group, (n, refs) in enumerate(zip(counts, kv.group_data_refs)):
        blocks = [-1] * n
        for d, ref in enumerate(refs):
            tensor = kv.tensors[ref.tensor_idx].tensor
            base = data_ptr(tensor)
            stride = row_stride(tensor)
            for k in range(n):
                ptr = int(ptrs[op + k]) % 2**64
                if d == 0 and ptr >= base:
                    blocks[k] = (ptr - base) // stride
                if not (
                    0 <= blocks[k] < tensor.shape[0]
                    and ptr == base + blocks[k] * stride
                    and int(sizes[op + k]) % 2**64 == ref.page_size_bytes
                ):
                    return group, k, ptr
            op += n
    return None


def expected_from_pointers(
    hostile: Any, device_ptrs: ptrres.DevicePointers, kv: ptrres.CanonicalKVCaches
) -> Outcome | None:
    """What plan_from_device_pointers must do with hostile pointers, or None.

    Known when the group counts are the resolved ones and ptrs and sizes are
    1-D int64 or uint64 arrays (perhaps with an entry changed): too few or
    too many ops are a SpecError, and a pointer that is not its block a
    DevicePointerError naming it (its message is not judged). Otherwise it is
    ptrres' answer to judge (None).
    """
    fields = ("group_block_counts", "group_data_ref_counts", "block_indices")
    if any(
        getattr(hostile, name, None) is not getattr(device_ptrs, name)
        for name in fields
    ):
        return None
    ptrs, sizes = getattr(hostile, "ptrs", None), getattr(hostile, "sizes", None)
    if not all(
        type(array) is np.ndarray and array.dtype in OUT_DTYPES and array.ndim == 1
        for array in (ptrs, sizes)
    ):
        return None
    assert ptrs is not None
    assert sizes is not None
    n_ops = len(device_ptrs.ptrs)
    if len(ptrs) != n_ops or len(sizes) != n_ops:
        return Outcome(error=ptrres.SpecError(""))
    bad = first_bad_pointer(ptrs, sizes, device_ptrs.group_block_counts, kv)
    if bad is None:
        return Outcome()  # a valid plan: that of the spec behind the pointers
    group, position, value = bad
    return Outcome(
        error=ptrres.DevicePointerError("", group=group, position=position, value=value)
    )


@dataclass
class FromPointersCall:
    """A valid transfer, its resolved pointers, and those pointers perhaps
    corrupted."""

    case: PlanCase
    device_ptrs: ptrres.DevicePointers
    hostile: Any
    store: bool
    merge: bool


@st.composite
def hostile_from_pointers(draw: Any) -> FromPointersCall:
    case = draw(plan_cases())
    device_ptrs = reference.resolve_device_pointers(case.spec, case.kv_caches)
    return FromPointersCall(
        case,
        device_ptrs,
        draw(hostile_device_pointers(device_ptrs)),
        draw(st.booleans()),
        draw(st.booleans()),
    )


def no_ops(
    kv: ptrres.CanonicalKVCaches,
    group_sizes: list[int],
    offloaded_ids: list[int],
    merge: bool = False,
    **fields: Any,
) -> FromPointersCall:
    """Pointers of no ops for ``kv`` (groups without blocks, or without refs);
    ``fields`` replace their parts (the counts stay the resolved objects)."""
    spec = ptrres.GPULoadStoreSpec(
        np.zeros(sum(group_sizes), np.int64), group_sizes, [1] * len(group_sizes)
    )
    case = PlanCase(kv, EXAMPLE_OFFLOADED, 2, spec, np.array(offloaded_ids, np.int64))
    device_ptrs = reference.resolve_device_pointers(spec, kv)
    hostile = namespace(**{**vars(device_ptrs), **fields})  # the same objects
    return FromPointersCall(case, device_ptrs, hostile, True, merge)


@given(hostile_from_pointers())
@example(no_ops(ONE_REF, [0], []))
@example(no_ops(ONE_REF, [0], [], True, ptrs=np.zeros(0, np.int64)))
@example(no_ops(ONE_REF, [0], [], sizes=np.zeros(0, np.float64)))
@example(no_ops(ONE_REF, [0], [], ptrs=np.zeros((0, 1), np.uint64)))
# A group of blocks but no refs: no ops, and yet two chunks to cover.
@example(no_ops(example_layout(0), [3], [0, 2], True))
def test_hostile_plan_from_device_pointers(call_: FromPointersCall) -> None:
    case, device_ptrs, hostile = call_.case, call_.device_ptrs, call_.hostile
    store, merge = call_.store, call_.merge
    table = ptrres.PointerTable(case.kv_caches)
    inputs = snapshot(
        *(getattr(hostile, name, None) for name in ("ptrs", "sizes")),
        case.offloaded_ids,
    )
    actual = call(
        table.plan_from_device_pointers,
        hostile,
        case.offloaded,
        case.offloaded_ids,
        store=store,
        coalesce=merge,
    )
    known = expected_from_pointers(hostile, device_ptrs, case.kv_caches)
    if known is not None and known.error is not None:
        assert actual.error is not None, (
            f"ptrres returned {actual.value!r} where it must raise {known.error!r}"
        )
        assert_same_error(actual.error, known.error)
    elif known is not None or actual.error is None:
        # The pointers are those of some valid spec: the plan is its plan.
        assert actual.error is None, f"valid device pointers refused: {actual.error!r}"
        spec = ptrres.GPULoadStoreSpec(
            np.array(block_ids_behind(hostile, case.kv_caches), np.int64),
            list(hostile.group_block_counts),
            list(hostile.block_indices),
        )
        expected = expected_plan(
            spec, case.kv_caches, case.offloaded_tensors,
            case.blocks_per_chunk, case.offloaded_ids, store, merge, None,
        )  # fmt: skip
        assert_same(actual, expected)
        assert_same(
            call(reference.resolve_device_pointers, spec, case.kv_caches),
            Outcome(
                value=ptrres.DevicePointers(
                    np.asarray(hostile.ptrs).astype(np.uint64),
                    np.asarray(hostile.sizes).astype(np.uint64),
                    tuple(hostile.group_block_counts),
                    tuple(hostile.group_data_ref_counts),
                    tuple(hostile.block_indices),
                )
            ),
        )
    assert_unchanged(inputs)
    assert_still_working()


@st.composite
def hostile_descriptors(draw: Any) -> tuple[Any, Any, Any]:
    n = draw(st.integers(0, 8))
    start = draw(st.sampled_from([0, 2**20, 2**63 - 64, 2**64 - 256]))
    sizes = draw(
        st.lists(
            st.sampled_from([0, 1, 8, 64, 2**62, 2**63, 2**64 - 1]),
            min_size=n,
            max_size=n,
        )
    )
    src, dst = [], []
    s, d = start, draw(st.sampled_from([0, 2**30, 2**64 - 128]))
    for size in sizes:
        src.append(s % 2**64)
        dst.append(d % 2**64)
        s += size + draw(st.sampled_from([0, 0, 8]))
        d += size + draw(st.sampled_from([0, 0, -8]))
    dtype = draw(st.sampled_from([np.uint64, np.int64]))
    arrays = [cast(values, dtype) for values in (src, dst, sizes)]
    which = draw(st.sets(st.integers(0, 2), max_size=2))
    result = [
        draw(arrays_like(array.tolist())) if k in which else array
        for k, array in enumerate(arrays)
    ]
    return result[0], result[1], result[2]


@st.composite
def hostile_coalesces(draw: Any) -> tuple[Any, Any, Guarded]:
    """Descriptors, a max_run_bytes and out= buffers."""
    descriptors = draw(hostile_descriptors())
    max_run_bytes = draw(st.one_of(st.none(), st.integers(1, 200), scalars(200)))
    n = len(descriptors[2]) if np.ndim(descriptors[2]) == 1 else 0
    return descriptors, max_run_bytes, draw(out_buffers(n, 3))


NO_DESCRIPTORS = np.zeros(0, np.uint64)


@given(hostile_coalesces())
@example(
    ((np.array([], np.float32), NO_DESCRIPTORS, NO_DESCRIPTORS), None, empty_out(3))
)
@example(((NO_DESCRIPTORS, NO_DESCRIPTORS, np.array([], bool)), 8, Guarded(None)))
@example(
    ((NO_DESCRIPTORS, np.zeros((0, 2), np.int64), NO_DESCRIPTORS), None, Guarded(None))
)
@example(((NO_DESCRIPTORS, NO_DESCRIPTORS, []), None, Guarded(None)))
@example(((NO_DESCRIPTORS,) * 3, 0, empty_out(3)))
@example(((NO_DESCRIPTORS,) * 3, 1.5, Guarded(None)))
@example(((NO_DESCRIPTORS,) * 3, None, empty_out(3, aliased=True)))
@example(((np.zeros(0, np.int64),) * 3, 2**64, empty_out(3, read_only=True)))
def test_hostile_coalesce(call_: tuple[Any, Any, Guarded]) -> None:
    descriptors, max_run_bytes, guarded = call_
    inputs = snapshot(*descriptors)
    expected = call_reference(
        reference.coalesce, *descriptors, max_run_bytes=max_run_bytes
    )
    actual = call(ptrres.coalesce, *descriptors, max_run_bytes=max_run_bytes)
    assert_same(actual, expected)
    with_out = call(
        ptrres.coalesce, *descriptors, max_run_bytes=max_run_bytes, out=guarded.out
    )
    n_ops = None if expected.error else len(descriptors[2])
    assert_same_with_out(with_out, expected, guarded.out, 3, n_ops)
    guarded.check(None)
    assert_unchanged(inputs)
    assert_still_working()
