"""Shared strategies and helpers: small KV-cache layouts built from torch tensors,
or numpy arrays without torch, and helpers that read or build either.

``--without torch`` (CI's Python matrix, .ci/python-matrix) leaves out, by
choice, the tests that need torch: the files, folders and tests NEEDS names,
and tests marked ``needs_torch``; the layouts drawn here are then numpy
arrays. ``--without nixl`` and ``--without vllm`` do the same for NIXL and
vLLM. Without the option, a missing torch or NIXL fails the run.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import ptrres

if TYPE_CHECKING:
    import torch

# CI's profile, and the default: derandomized (seeded by each test's own
# code, and no example database), so that every run draws the same examples.
# A rare draw then cannot fail one run in several and block a landing; what
# CI finds, a rerun finds again. Hunting is the long profile's job: random
# draws, new ones every run, and failures kept in .hypothesis/ and replayed
# first on the next run. What it finds becomes an @example of its test.
settings.register_profile(
    "ci",
    max_examples=60,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=100_000,
    deadline=None,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

JIT_DISABLED = os.environ.get("NUMBA_DISABLE_JIT", "0") not in ("", "0")

# What each `--without NAME` leaves out: files and folders of tests/ that
# need it throughout (torch: CUDA tensors, or a harness), every test in them;
# elsewhere, tests marked needs_<NAME>, tests that take a fixture of
# FIXTURES_NEEDING, and the tests named here by id ("file::test[param]").
NEEDS: dict[str, tuple[str, ...]] = {
    "torch": (
        "nixl", "vllm", "test_cuda.py",
    ),
    "nixl": ("nixl", "test_readme.py::test_docs_examples_run[docs/nixl.md]"),
    "vllm": ("vllm",),
}  # fmt: skip
FIXTURES_NEEDING = {"vllm": {"vllm_env"}}  # test_cli's checks of an installed vLLM
TESTS = Path(__file__).resolve().parent
# What this run leaves out (--without), set when pytest starts.
WITHOUT: set[str] = set()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--without",
        action="append",
        default=[],
        choices=sorted(NEEDS),
        help="leave out the tests that need this (repeatable): CI's runs on "
        "Pythons that torch, NIXL or vLLM are not installed for",
    )


def pytest_configure(config: pytest.Config) -> None:
    WITHOUT.update(config.getoption("without"))
    # A run that is not told to go without torch needs it, as it always has
    # (tests/nixl fail by themselves where NIXL is missing).
    if "torch" not in WITHOUT and importlib.util.find_spec("torch") is None:
        raise pytest.UsageError(
            "torch is not installed: install the test extra (pip install -e "
            "'.[dev]'), or pass --without torch to leave out the tests that need it"
        )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave out, by choice, the files and folders --without names."""
    for name in WITHOUT:
        if any(collection_path == TESTS / entry for entry in NEEDS[name]):
            return True
    return None


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [
        f"left out by --without {name}: {', '.join(NEEDS[name])}"
        for name in sorted(WITHOUT)
    ]


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Deselect, for each --without NAME, the tests that need it (NEEDS)."""

    def needs(item: pytest.Item, name: str) -> bool:
        test_id = item.nodeid.removeprefix("tests/")
        fixtures = set(getattr(item, "fixturenames", ()))
        return (
            item.get_closest_marker(f"needs_{name}") is not None
            or bool(fixtures & FIXTURES_NEEDING.get(name, set()))
            or test_id in NEEDS[name]
        )

    left_out = [item for item in items if any(needs(item, n) for n in WITHOUT)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]


def tensor_dtypes() -> list[Any]:
    """The dtypes of drawn tensors: torch's, or numpy's without torch (a
    2-byte integer stands for bfloat16)."""
    if "torch" in WITHOUT:
        return [np.int8, np.uint16, np.float16, np.float32]
    import torch

    return [torch.int8, torch.bfloat16, torch.float16, torch.float32]


@dataclass
class Case:
    """A layout, a spec that is valid for it, and the out= buffers to use."""

    kv_caches: ptrres.CanonicalKVCaches
    spec: ptrres.GPULoadStoreSpec
    out_dtype: Any  # None (allocate), np.int64 or np.uint64
    out_extra: int  # entries beyond the op count in the out buffers

    @property
    def num_ops(self) -> int:
        return sum(
            n * len(refs)
            for n, refs in zip(self.spec.group_sizes, self.kv_caches.group_data_refs)
        )

    def out(self) -> tuple[np.ndarray, np.ndarray] | None:
        if self.out_dtype is None:
            return None
        n = self.num_ops + self.out_extra
        return np.full(n, 7, self.out_dtype), np.full(n, 7, self.out_dtype)


def random_tensor(
    num_blocks: int, row_elements: int, pad_elements: int, dtype: Any, seed: int
) -> Any:
    """A (num_blocks, row_elements) tensor of random bytes, rows padded by pad:
    a torch tensor, or a numpy array for a numpy dtype."""
    if not isinstance(dtype, type | np.dtype):
        return random_torch_tensor(num_blocks, row_elements, pad_elements, dtype, seed)
    itemsize = np.dtype(dtype).itemsize
    rows = np.random.default_rng(seed).integers(
        0, 256, (num_blocks, (row_elements + pad_elements) * itemsize), np.uint8
    )
    return rows.view(dtype)[:, :row_elements]


def random_torch_tensor(
    num_blocks: int, row_elements: int, pad_elements: int, dtype: torch.dtype, seed: int
) -> torch.Tensor:
    """random_tensor() of a torch dtype."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    full = torch.randint(
        0,
        256,
        (num_blocks, (row_elements + pad_elements) * dtype.itemsize),
        dtype=torch.uint8,
        generator=generator,
    ).view(dtype)
    return full[:, :row_elements]


@st.composite
def layouts(draw: Any, max_groups: int = 4, max_tensors: int = 4) -> Any:
    """A CanonicalKVCaches: shared tensors, empty groups, padded rows, any dtype."""
    n_tensors = draw(st.integers(1, max_tensors))
    tensors = []
    for t in range(n_tensors):
        dtype = draw(st.sampled_from(tensor_dtypes()))
        tensor = random_tensor(
            num_blocks=draw(st.integers(1, 12)),
            row_elements=draw(st.integers(1, 16)),
            pad_elements=draw(st.sampled_from([0, 0, 1, 3])),
            dtype=dtype,
            seed=t,
        )
        tensors.append(ptrres.CanonicalKVCacheTensor(tensor, row_stride(tensor)))
    group_data_refs = []
    for _ in range(draw(st.integers(1, max_groups))):
        refs = []
        for _ in range(draw(st.integers(0, 4))):
            tensor_idx = draw(st.integers(0, n_tensors - 1))
            tensor = tensors[tensor_idx].tensor
            row_bytes = tensor.shape[1] * tensor.itemsize
            page = draw(st.integers(0, row_bytes))
            refs.append(ptrres.CanonicalKVCacheRef(tensor_idx, page))
        group_data_refs.append(refs)
    return ptrres.CanonicalKVCaches(tensors, group_data_refs)


@st.composite
def specs_for(draw: Any, kv_caches: ptrres.CanonicalKVCaches) -> Any:
    """A spec whose every id is valid for every ref of its group."""
    ids: list[int] = []
    group_sizes = []
    for refs in kv_caches.group_data_refs:
        limit = min(
            (kv_caches.tensors[r.tensor_idx].tensor.shape[0] for r in refs),
            default=50,
        )
        group_ids = draw(st.lists(st.integers(0, limit - 1), max_size=6))
        ids += group_ids
        group_sizes.append(len(group_ids))
    block_indices = [draw(st.integers(0, 20)) for _ in group_sizes]
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    return ptrres.GPULoadStoreSpec(
        np.array(ids, dtype=dtype), group_sizes, block_indices
    )


@st.composite
def cases(draw: Any) -> Case:
    kv_caches = draw(layouts())
    return Case(
        kv_caches=kv_caches,
        spec=draw(specs_for(kv_caches)),
        out_dtype=draw(st.sampled_from([None, np.int64, np.uint64])),
        out_extra=draw(st.integers(0, 3)),
    )


def assert_same_pointers(actual: Any, expected: Any) -> None:
    """Two DevicePointers hold the same ops and the same group metadata."""
    assert actual.ptrs.dtype == np.uint64
    assert actual.sizes.dtype == np.uint64
    np.testing.assert_array_equal(actual.ptrs, expected.ptrs)
    np.testing.assert_array_equal(actual.sizes, expected.sizes)
    assert actual.group_block_counts == tuple(expected.group_block_counts)
    assert actual.group_data_ref_counts == tuple(expected.group_data_ref_counts)
    assert actual.block_indices == tuple(expected.block_indices)


def memory_bytes(ptr: int, size: int) -> bytes:
    """The bytes at a raw CPU pointer."""
    return ctypes.string_at(ptr, size)


def row_stride(tensor: Any) -> int:
    """Bytes from one row of a torch tensor or numpy array to the next."""
    if isinstance(tensor, np.ndarray):
        return int(tensor.strides[0])
    return int(tensor.stride(0) * tensor.itemsize)


def data_ptr(tensor: Any) -> int:
    """Where a torch tensor's or numpy array's first element is."""
    if isinstance(tensor, np.ndarray):
        return int(tensor.ctypes.data)
    return int(tensor.data_ptr())


def with_torch() -> bool:
    """Whether this run has torch: tests then build torch tensors, as the
    3.11 run always has; under --without torch, numpy arrays."""
    return "torch" not in WITHOUT


def dtype_of(name: str) -> Any:
    """A dtype by name ("int8", "uint8", "int64", "float32", ...): torch's, or
    numpy's without torch."""
    if not with_torch():
        return np.dtype(name)
    import torch

    return getattr(torch, name)


def zeros(*shape: int, dtype: str = "int8") -> Any:
    """A zeroed tensor of a shape: torch.zeros, or np.zeros without torch."""
    if not with_torch():
        return np.zeros(shape, np.dtype(dtype))
    import torch

    return torch.zeros(shape, dtype=getattr(torch, dtype))


def as_tensor(array: np.ndarray) -> Any:
    """A numpy array as a torch tensor of the same memory (torch.from_numpy),
    or the array itself without torch."""
    if not with_torch():
        return array
    import torch

    return torch.from_numpy(array)


def itemsize(tensor: Any) -> int:
    """Bytes per element of a torch tensor or numpy array."""
    return int(tensor.itemsize)


def span(tensor: Any) -> int:
    """Bytes from a 2-D tensor's first element to its last, padding included."""
    rows, row_elements = (int(n) for n in tensor.shape)
    if rows * row_elements == 0:
        return 0
    return (rows - 1) * row_stride(tensor) + row_elements * itemsize(tensor)


def tensor_bytes(tensor: Any) -> bytes:
    """Every byte a 2-D tensor spans, padding included."""
    return ctypes.string_at(data_ptr(tensor), span(tensor))


def zero(tensor: Any) -> None:
    """Zero every byte a 2-D tensor spans, padding included."""
    ctypes.memset(data_ptr(tensor), 0, span(tensor))


def allocation(tensor: Any) -> int:
    """Where the allocation a tensor views starts: its torch storage, or the
    numpy array that owns its memory."""
    if not isinstance(tensor, np.ndarray):
        return int(tensor.untyped_storage().data_ptr())
    while isinstance(tensor.base, np.ndarray):
        tensor = tensor.base
    return int(tensor.ctypes.data)


def clone(tensor: Any) -> Any:
    """A copy in new memory: Tensor.clone(), or ndarray.copy()."""
    return tensor.copy() if isinstance(tensor, np.ndarray) else tensor.clone()


def copy_into(dst: Any, src: Any) -> None:
    """Copy src's elements into dst: Tensor.copy_(), or np.copyto()."""
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
    else:
        dst.copy_(src)


def equal(a: Any, b: Any) -> bool:
    """Same shape and elements: torch.equal, or numpy's without torch."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    import torch

    return bool(torch.equal(a, b))


def row_bytes(tensor: Any, block: int) -> bytes:
    """The bytes of one row (block) of a tensor, read through torch (or numpy)."""
    if isinstance(tensor, np.ndarray):
        return bytes(tensor[block].tobytes())
    import torch

    return bytes(tensor[block].contiguous().view(torch.uint8).numpy().tobytes())


@pytest.fixture
def llama_like() -> ptrres.CanonicalKVCaches:
    """Two groups over four bf16 tensors of 10 blocks; group 1 shares tensor 2
    (2-byte numpy arrays without torch)."""
    bf16 = tensor_dtypes()[1]
    tensors = [
        ptrres.CanonicalKVCacheTensor(random_tensor(10, 32, 0, bf16, t), 64)
        for t in range(4)
    ]
    return ptrres.CanonicalKVCaches(
        tensors,
        [
            [ptrres.CanonicalKVCacheRef(t, 64) for t in range(3)],
            [ptrres.CanonicalKVCacheRef(2, 48), ptrres.CanonicalKVCacheRef(3, 64)],
        ],
    )
