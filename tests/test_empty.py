"""Empty input is checked as any other (issue 23), by ptrres and the reference.

No ids, no ops and no groups take no shortcut past a check: an array (or a
tensor) of ids of no integer dtype is refused whatever its length, by every
call that takes ids. Only a sequence without a dtype of its own (``[]``,
which numpy reads as float64) is no ids. And plans of no ops, files of no
ops and groups of no blocks are the reference's.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from conftest import dtype_of, random_tensor, with_torch

import ptrres
from ptrres import reference

if with_torch():  # its tests are marked needs_torch
    import torch

BLOCKS = 4
PAGE = 16
MAPPING = ptrres.CanonicalPageMapping(
    canonical_page_size_bytes=PAGE,
    local_page_size_bytes=PAGE,
    runs=(ptrres.CopyRun(0, 0, PAGE, 1, PAGE, PAGE),),
    num_writers=1,
    writer_index=0,
    parallelism_agnostic=True,
)


def layout(*refs_per_group: int, canonical: bool = False) -> ptrres.CanonicalKVCaches:
    """One int8 tensor of BLOCKS blocks of PAGE bytes; groups of n refs each."""
    tensor = random_tensor(BLOCKS, PAGE, 0, dtype_of("int8"), 0)
    ref = ptrres.CanonicalKVCacheRef(0, PAGE, MAPPING if canonical else None)
    return ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(tensor, PAGE)],
        [[ref] * n for n in refs_per_group],
    )


# Offloaded: one chunk per block (blocks_per_chunk 1), BLOCKS chunks.
OFFLOADED = [random_tensor(BLOCKS, PAGE, 0, dtype_of("int8"), 1)]


def spec(block_ids: Any) -> SimpleNamespace:
    """One group holding ``block_ids`` (of any type), from block index 0."""
    return SimpleNamespace(
        block_ids=block_ids, group_sizes=[len(block_ids)], block_indices=[0]
    )


def int_ids(n: int) -> npt.NDArray[np.int64]:
    """n valid ids (block or chunk ids): 0, 1, ..., n - 1."""
    return np.arange(n, dtype=np.int64)


# Each call that takes block ids, given them; offloaded ids are valid int64.
BLOCK_ID_CALLS: dict[str, Callable[[Any], Any]] = {
    "resolve": lambda ids: ptrres.PointerTable(layout(1)).resolve(spec(ids)),
    "resolve_device_pointers": lambda ids: ptrres.resolve_device_pointers(
        spec(ids), layout(1)
    ),
    "reference.resolve_device_pointers": lambda ids: reference.resolve_device_pointers(
        spec(ids), layout(1)
    ),
    "plan_transfer": lambda ids: ptrres.PointerTable(layout(1)).plan_transfer(
        spec(ids), ptrres.OffloadedLayout(OFFLOADED, 1), int_ids(len(ids)), store=True
    ),
    "reference.plan_transfer": lambda ids: reference.plan_transfer(
        spec(ids), layout(1), OFFLOADED, 1, int_ids(len(ids)), store=True
    ),
    "plan_file_ops": lambda ids: ptrres.PointerTable(layout(1)).plan_file_ops(
        spec(ids), 1
    ),
    "canonical plan_transfer": lambda ids: ptrres.PointerTable(
        layout(1, canonical=True)
    ).plan_transfer(
        spec(ids),
        ptrres.OffloadedLayout(OFFLOADED, 1, canonical=True),
        int_ids(len(ids)),
        store=False,
    ),
    "reference.plan_canonical_transfer": lambda ids: reference.plan_canonical_transfer(
        spec(ids),
        layout(1, canonical=True),
        OFFLOADED,
        1,
        int_ids(len(ids)),
        store=False,
    ),
    "plan_strided_transfer": lambda ids: ptrres.PointerTable(
        layout(1, canonical=True)
    ).plan_strided_transfer(
        spec(ids),
        ptrres.OffloadedLayout(OFFLOADED, 1, canonical=True),
        int_ids(len(ids)),
        store=True,
    ),
    "reference.plan_strided_transfer": lambda ids: reference.plan_strided_transfer(
        spec(ids),
        layout(1, canonical=True),
        OFFLOADED,
        1,
        int_ids(len(ids)),
        store=True,
    ),
}


def _from_pointers(ids: Any) -> Any:
    """plan_from_device_pointers of len(ids) blocks, ``ids`` as offloaded ids."""
    table = ptrres.PointerTable(layout(1))
    device_ptrs = table.resolve(spec(int_ids(len(ids))))
    return table.plan_from_device_pointers(
        device_ptrs, ptrres.OffloadedLayout(OFFLOADED, 1), ids, store=True
    )


# Each call that takes offloaded ids, given them; block ids are valid int64.
OFFLOADED_ID_CALLS: dict[str, Callable[[Any], Any]] = {
    "plan_transfer": lambda ids: ptrres.PointerTable(layout(1)).plan_transfer(
        spec(int_ids(len(ids))), ptrres.OffloadedLayout(OFFLOADED, 1), ids, store=True
    ),
    "reference.plan_transfer": lambda ids: reference.plan_transfer(
        spec(int_ids(len(ids))), layout(1), OFFLOADED, 1, ids, store=True
    ),
    "plan_from_device_pointers": _from_pointers,
    "canonical plan_transfer": lambda ids: ptrres.PointerTable(
        layout(1, canonical=True)
    ).plan_transfer(
        spec(int_ids(len(ids))),
        ptrres.OffloadedLayout(OFFLOADED, 1, canonical=True),
        ids,
        store=True,
    ),
    "reference.plan_canonical_transfer": lambda ids: reference.plan_canonical_transfer(
        spec(int_ids(len(ids))),
        layout(1, canonical=True),
        OFFLOADED,
        1,
        ids,
        store=True,
    ),
    "plan_strided_transfer": lambda ids: ptrres.PointerTable(
        layout(1, canonical=True)
    ).plan_strided_transfer(
        spec(int_ids(len(ids))),
        ptrres.OffloadedLayout(OFFLOADED, 1, canonical=True),
        ids,
        store=False,
    ),
    "reference.plan_strided_transfer": lambda ids: reference.plan_strided_transfer(
        spec(int_ids(len(ids))),
        layout(1, canonical=True),
        OFFLOADED,
        1,
        ids,
        store=False,
    ),
}


def torch_marked(cases: dict[str, Any]) -> list[Any]:
    """The names of cases, those of torch tensors ("torch ...") marked
    needs_torch."""
    return [
        pytest.param(name, marks=pytest.mark.needs_torch)
        if name.startswith("torch")
        else name
        for name in cases
    ]


# Ids of no integer dtype, each as a function of how many (0 or 2).
NOT_INTEGERS: dict[str, Callable[[int], Any]] = {
    "float32": lambda n: np.ones(n, np.float32),
    "float64": lambda n: np.ones(n, np.float64),
    "bool": lambda n: np.ones(n, bool),
    "object": lambda n: np.ones(n, object),
    "torch float32": lambda n: torch.ones(n),
    "torch bool": lambda n: torch.ones(n, dtype=torch.bool),
}


@pytest.mark.parametrize("n", [0, 2])
@pytest.mark.parametrize("dtype", torch_marked(NOT_INTEGERS))
@pytest.mark.parametrize(
    ("what", "name"),
    [("block_ids", name) for name in BLOCK_ID_CALLS]
    + [("offloaded_ids", name) for name in OFFLOADED_ID_CALLS],
)
def test_ids_of_no_integer_dtype_are_refused_whatever_their_length(
    what: str, name: str, dtype: str, n: int
) -> None:
    calls = BLOCK_ID_CALLS if what == "block_ids" else OFFLOADED_ID_CALLS
    ids = NOT_INTEGERS[dtype](n)
    numpy_dtype = np.asarray(ids).dtype
    with pytest.raises(
        ptrres.InputTypeError,
        match=f"^{what} must be integers, got dtype {numpy_dtype}$",
    ):
        calls[name](ids)


# No ids given without a dtype of their own, or of an integer dtype.
NO_IDS: dict[str, Callable[[], Any]] = {
    "[]": list,
    "()": tuple,
    "range(0)": lambda: range(0),
    "int8": lambda: np.zeros(0, np.int8),
    "uint64": lambda: np.zeros(0, np.uint64),
    "torch int64": lambda: torch.zeros(0, dtype=torch.int64),
}


@pytest.mark.parametrize("ids", torch_marked(NO_IDS))
@pytest.mark.parametrize(
    ("what", "name"),
    [("block_ids", name) for name in BLOCK_ID_CALLS]
    + [("offloaded_ids", name) for name in OFFLOADED_ID_CALLS],
)
def test_no_ids_without_a_dtype_or_of_an_integer_one_plan_nothing(
    what: str, name: str, ids: str
) -> None:
    calls = BLOCK_ID_CALLS if what == "block_ids" else OFFLOADED_ID_CALLS
    result = calls[name](NO_IDS[ids]())
    # The ops' arrays (uint64): a file plan's file_starts is [0], of int64.
    ops = [
        value
        for value in vars(result).values()
        if isinstance(value, np.ndarray) and value.dtype == np.uint64
    ]
    assert ops
    assert all(len(array) == 0 for array in ops)


@pytest.mark.parametrize("resolve", ["table", "drop-in", "reference"])
@pytest.mark.parametrize(
    ("field", "values", "error"),
    [
        ("group_sizes", np.zeros(0), ptrres.InputTypeError),
        pytest.param(
            "group_sizes",
            torch.zeros(0) if with_torch() else None,
            ptrres.InputTypeError,
            marks=pytest.mark.needs_torch,
        ),
        ("block_indices", np.zeros(0, "U4"), ptrres.InputTypeError),
        ("block_indices", np.zeros(0, bool), ptrres.InputTypeError),
        ("group_sizes", np.zeros(0, np.uint64), None),
        ("block_indices", range(0), None),
        ("group_sizes", (), None),
    ],
)
def test_no_groups_have_their_sizes_and_indices_checked(
    resolve: str, field: str, values: Any, error: Any
) -> None:
    kv = layout()  # no groups
    no_groups = SimpleNamespace(
        **{"block_ids": [], "group_sizes": [], "block_indices": [], field: values}
    )
    call: Callable[[], ptrres.DevicePointers] = {
        "table": lambda: ptrres.PointerTable(kv).resolve(no_groups),
        "drop-in": lambda: ptrres.resolve_device_pointers(no_groups, kv),
        "reference": lambda: reference.resolve_device_pointers(no_groups, kv),
    }[resolve]
    if error is None:
        device_ptrs = call()
        assert len(device_ptrs.ptrs) == 0
        assert device_ptrs.group_block_counts == ()
    else:
        with pytest.raises(error, match=f"^{field} must be integers, got "):
            call()


def assert_same_file_plan(actual: ptrres.FilePlan, expected: ptrres.FilePlan) -> None:
    for name in ("dev_ptrs", "file_offsets", "sizes"):
        assert getattr(actual, name).dtype == np.uint64, name
    for name in ("file_starts", "file_groups", "file_bytes"):
        assert getattr(actual, name).dtype == np.int64, name
    for name in vars(expected):
        np.testing.assert_array_equal(
            getattr(actual, name), getattr(expected, name), err_msg=name
        )


# (refs per group, blocks per group): no groups; groups of no blocks; a group
# of blocks but no refs (files without ops); and the three side by side.
EMPTY_FILE_LAYOUTS = [
    ((), ()),
    ((1,), (0,)),
    ((2, 0), (0, 0)),
    ((0,), (3,)),
    ((1, 0, 2), (0, 3, 2)),
]


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("file_layout", ["ref-major", "block-major"])
@pytest.mark.parametrize(("refs", "blocks"), EMPTY_FILE_LAYOUTS)
def test_file_plans_of_empty_groups_are_the_reference(
    refs: tuple[int, ...], blocks: tuple[int, ...], file_layout: str, merge: bool
) -> None:
    kv = layout(*refs)
    empty_spec = ptrres.GPULoadStoreSpec(
        np.zeros(sum(blocks), np.int64), list(blocks), [1] * len(blocks)
    )
    device_ptrs = reference.resolve_device_pointers(empty_spec, kv)
    kwargs: dict[str, Any] = {"layout": file_layout, "coalesce": merge}
    expected = reference.plan_file_ops(device_ptrs, 2, **kwargs)
    assert_same_file_plan(ptrres.plan_file_ops(device_ptrs, 2, **kwargs), expected)
    table = ptrres.PointerTable(kv)
    assert_same_file_plan(table.plan_file_ops(empty_spec, 2, **kwargs), expected)
    ops = len(device_ptrs.ptrs)
    out = tuple(np.zeros(ops, np.int64) for _ in range(3))
    plan = table.plan_file_ops(empty_spec, 2, out=out, **kwargs)
    assert_same_file_plan(plan, expected)
    assert expected.num_files == sum(-(-(n + 1) // 2) for n in blocks if n)


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"blocks_per_chunk": 0}, ptrres.SpecError),
        ({"blocks_per_chunk": 2**63}, ptrres.SpecError),
        ({"blocks_per_chunk": 1.0}, ptrres.InputTypeError),
        ({"blocks_per_chunk": True}, ptrres.InputTypeError),
        ({"layout": "x"}, ptrres.SpecError),
        ({"layout": 3}, ptrres.InputTypeError),
        ({"coalesce": 1}, ptrres.InputTypeError),
        ({"max_run_bytes": 0}, ptrres.SpecError),
        ({"max_run_bytes": 1.5}, ptrres.InputTypeError),
        ({"max_run_bytes": True}, ptrres.InputTypeError),
    ],
)
@pytest.mark.parametrize("refs", [(), (1,), (0,)])
def test_file_plans_of_no_ops_check_their_options(
    refs: tuple[int, ...], options: dict[str, Any], error: Any
) -> None:
    kv = layout(*refs)
    n_groups = len(refs)
    no_blocks = ptrres.GPULoadStoreSpec([], [0] * n_groups, [0] * n_groups)
    device_ptrs = reference.resolve_device_pointers(no_blocks, kv)
    options = {"blocks_per_chunk": 2, **options}
    bpc = options.pop("blocks_per_chunk")
    with pytest.raises(error):
        ptrres.plan_file_ops(device_ptrs, bpc, **options)
    with pytest.raises(error):
        ptrres.PointerTable(kv).plan_file_ops(no_blocks, bpc, **options)
    with pytest.raises(error):
        reference.plan_file_ops(device_ptrs, bpc, **options)
