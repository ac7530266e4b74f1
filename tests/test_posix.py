"""write_files/read_files: FilePlans through real files, bytes checked."""

from __future__ import annotations

import ctypes
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import (
    data_ptr,
    dtype_of,
    layouts,
    random_tensor,
    specs_for,
    tensor_bytes,
)
from hypothesis import given

import ptrres
from ptrres import _posix, reference

SENTINEL = 0xA5


def tensors_bytes(kv_caches: Any) -> list[bytes]:
    """Every byte of every tensor's rows, padding included."""
    out = []
    for entry in kv_caches.tensors:
        out.append(tensor_bytes(entry.tensor))
    return out


def op_bytes(plan: ptrres.FilePlan) -> list[bytes]:
    """The host bytes of every op of a plan."""
    return [
        ctypes.string_at(ptr, size)
        for ptr, size in zip(plan.dev_ptrs.tolist(), plan.sizes.tolist())
    ]


def zero_tensors(kv_caches: Any) -> None:
    for entry in kv_caches.tensors:
        entry.tensor[...] = 0  # the rows, not their padding


def expected_file(plan: ptrres.FilePlan, f: int, before: bytes) -> bytes:
    """A file's bytes after a store: ``before`` with each op's page copied in."""
    data = bytearray(before.ljust(int(plan.file_bytes[f]), b"\0"))
    length = len(before)
    for i in range(plan.file_starts[f], plan.file_starts[f + 1]):
        offset, size = int(plan.file_offsets[i]), int(plan.sizes[i])
        data[offset : offset + size] = ctypes.string_at(int(plan.dev_ptrs[i]), size)
        length = max(length, offset + size if size else length)
    return bytes(data[:length])


@given(
    layouts(),
    st.data(),
    st.integers(1, 8),
    st.sampled_from(["ref-major", "block-major"]),
    st.booleans(),
    st.booleans(),
)
def test_store_zero_load_round_trip(
    kv_caches: Any, data: Any, bpc: int, layout: str, merge: bool, prefilled: bool
) -> None:
    """Store to real files, zero the KV cache, load back: every page is back,
    every byte outside the pages stays zero, and every file byte no op covers
    keeps what the file held (partial chunks included)."""
    spec = data.draw(specs_for(kv_caches))
    device_ptrs = ptrres.resolve_device_pointers(spec, kv_caches)
    plan = ptrres.plan_file_ops(device_ptrs, bpc, layout=layout, coalesce=merge)
    original = tensors_bytes(kv_caches)
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"chunk{f}.bin" for f in range(plan.num_files)]
        before = []
        for f, path in enumerate(paths):
            content = bytes([SENTINEL]) * int(plan.file_bytes[f]) if prefilled else b""
            if prefilled:
                path.write_bytes(content)
            before.append(content)
        ptrres.write_files(
            plan, paths, max_workers=data.draw(st.sampled_from([None, 1, 3]))
        )
        for f, path in enumerate(paths):
            assert path.read_bytes() == expected_file(plan, f, before[f])
        zero_tensors(kv_caches)
        zeroed = tensors_bytes(kv_caches)  # rows zeroed, padding as it was
        ptrres.read_files(plan, paths)
    # Each byte is back if an op covers it, else as zeroed.
    restored = tensors_bytes(kv_caches)
    for t, entry in enumerate(kv_caches.tensors):
        base = data_ptr(entry.tensor)
        covered = np.zeros(len(original[t]), bool)
        for ptr, size in zip(plan.dev_ptrs.tolist(), plan.sizes.tolist()):
            if base <= ptr < base + len(original[t]):
                covered[ptr - base : ptr - base + size] = True
        got = np.frombuffer(restored[t], np.uint8)
        want = np.frombuffer(original[t], np.uint8)
        np.testing.assert_array_equal(got[covered], want[covered])
        unchanged = np.frombuffer(zeroed[t], np.uint8)
        np.testing.assert_array_equal(got[~covered], unchanged[~covered])


def host_plan(n_files: int = 40, bpc: int = 4) -> tuple[Any, ptrres.FilePlan]:
    """A 2-group layout on CPU tensors and the plan of many blocks."""
    tensors = [random_tensor(64, 32, 0, dtype_of("int8"), t) for t in range(3)]
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(t, 32) for t in tensors],
        [
            [ptrres.CanonicalKVCacheRef(0, 32), ptrres.CanonicalKVCacheRef(1, 16)],
            [ptrres.CanonicalKVCacheRef(2, 24)],
        ],
    )
    n = n_files // 2 * bpc - 1
    rng = np.random.default_rng(0)
    spec = ptrres.GPULoadStoreSpec(rng.integers(0, 64, 2 * n), [n, n], [1, 1])
    return kv, ptrres.PointerTable(kv).plan_file_ops(spec, bpc, coalesce=True)


def test_parallel_write_is_the_serial_write(tmp_path: Path) -> None:
    _, plan = host_plan()
    assert plan.num_files == 40
    serial = [tmp_path / f"serial{f}" for f in range(plan.num_files)]
    parallel = [str(tmp_path / f"parallel{f}") for f in range(plan.num_files)]
    ptrres.write_files(plan, serial, max_workers=1)
    ptrres.write_files(plan, parallel, max_workers=8)
    for a, b in zip(serial, parallel):
        assert a.read_bytes() == Path(b).read_bytes()
        assert os.stat(b).st_mode & 0o777 == 0o644 & ~_umask()
    assert sorted(os.listdir(tmp_path)) == sorted(
        [p.name for p in serial] + [Path(p).name for p in parallel]
    )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_partial_calls_are_resumed(tmp_path: Path, monkeypatch: Any) -> None:
    """POSIX may move fewer bytes than asked: the rest is asked for again,
    across buffer boundaries, and IOV_MAX caps each call."""
    kv, plan = host_plan(n_files=6)
    paths = [tmp_path / f"f{f}" for f in range(plan.num_files)]
    ptrres.write_files(plan, paths)
    expected = [p.read_bytes() for p in paths]
    real_pwritev, real_preadv = os.pwritev, os.preadv
    calls = []

    def short(real: Any) -> Any:
        def call(fd: int, buffers: list[Any], offset: int) -> int:
            calls.append(len(buffers))
            first = memoryview(buffers[0])
            return real(fd, [first[: max(1, len(first) // 3 + 5)]], offset)  # type: ignore[no-any-return]

        return call

    monkeypatch.setattr(os, "pwritev", short(real_pwritev))
    monkeypatch.setattr(os, "preadv", short(real_preadv))
    monkeypatch.setattr(_posix, "IOV_MAX", 2)
    again = [tmp_path / f"g{f}" for f in range(plan.num_files)]
    ptrres.write_files(plan, again, max_workers=2)
    assert [p.read_bytes() for p in again] == expected
    assert max(calls) <= 2
    original = op_bytes(plan)
    zero_tensors(kv)
    assert op_bytes(plan) != original
    ptrres.read_files(plan, again)
    assert op_bytes(plan) == original


def test_a_write_that_makes_no_progress_names_file_and_offset(
    tmp_path: Path, monkeypatch: Any
) -> None:
    _, plan = host_plan(n_files=2)
    monkeypatch.setattr(os, "pwritev", lambda fd, buffers, offset: 0)
    path = tmp_path / "stuck"
    offset = int(plan.file_offsets[0])
    with pytest.raises(OSError, match=f"short write to {path} at offset {offset}"):
        ptrres.write_files(plan, [path, tmp_path / "other"], max_workers=1)


def test_short_read_names_file_and_offset(tmp_path: Path) -> None:
    _, plan = host_plan(n_files=2)
    paths = [tmp_path / "a", tmp_path / "b"]
    ptrres.write_files(plan, paths)
    size = paths[1].stat().st_size
    os.truncate(paths[1], size - 5)
    with pytest.raises(
        OSError, match=f"short read from {paths[1]} at offset {size - 5}"
    ):
        ptrres.read_files(plan, paths)


def test_missing_file_on_read(tmp_path: Path) -> None:
    _, plan = host_plan(n_files=2)
    paths = [tmp_path / "a", tmp_path / "b"]
    ptrres.write_files(plan, [paths[0], tmp_path / "c"])
    with pytest.raises(FileNotFoundError, match=re.escape(str(paths[1]))):
        ptrres.read_files(plan, paths, max_workers=2)


def test_empty_files_and_plans(tmp_path: Path) -> None:
    """A group without refs has files of no ops: they are created, empty."""
    device_ptrs = ptrres.DevicePointers(
        np.zeros(0, np.uint64), np.zeros(0, np.uint64), (3,), (0,), (0,)
    )
    plan = ptrres.plan_file_ops(device_ptrs, 2)
    paths = [tmp_path / "x", tmp_path / "y"]
    ptrres.write_files(plan, paths)
    assert [p.read_bytes() for p in paths] == [b"", b""]
    ptrres.read_files(plan, paths)
    empty = ptrres.plan_file_ops(
        ptrres.DevicePointers(
            np.zeros(0, np.uint64), np.zeros(0, np.uint64), (), (), ()
        ),
        2,
    )
    ptrres.write_files(empty, [])


@pytest.mark.parametrize(
    ("change", "paths", "kwargs", "error", "pattern"),
    [
        ({}, 1, {}, ptrres.SpecError, "2 files but 1 paths"),
        ({}, 3, {}, ptrres.SpecError, "2 files but 3 paths"),
        ({}, "str", {}, ptrres.InputTypeError, "paths must be a sequence"),
        ({}, [1, 2], {}, ptrres.InputTypeError, r"paths\[0\]"),
        ({}, 2, {"max_workers": 0}, ptrres.SpecError, "max_workers"),
        ({}, 2, {"max_workers": "2"}, ptrres.InputTypeError, "max_workers"),
        ({"file_starts": np.array([0, 1])}, 2, {}, ptrres.SpecError, "file_starts"),
        ({"file_starts": [0, 1, 2]}, 2, {}, ptrres.InputTypeError, "file_starts"),
        ({"sizes": np.zeros(3, np.uint64)}, 2, {}, ptrres.SpecError, "sizes"),
        (
            {"dev_ptrs": np.zeros(3, np.float32)},
            2,
            {},
            ptrres.InputTypeError,
            "dev_ptrs",
        ),
        ("huge offset", 2, {}, ptrres.SpecError, "op 0"),
    ],
)
def test_bad_input(
    tmp_path: Path, change: Any, paths: Any, kwargs: Any, error: Any, pattern: str
) -> None:
    _, plan = host_plan(n_files=2)
    if change == "huge offset":
        plan.file_offsets = plan.file_offsets.copy()
        plan.file_offsets[0] = 2**63 - 10
    else:
        for name, value in change.items():
            setattr(plan, name, value)
    if isinstance(paths, int):
        paths = [tmp_path / f"p{i}" for i in range(paths)]
    for function in (ptrres.write_files, ptrres.read_files):
        with pytest.raises(error, match=pattern):
            function(plan, paths, **kwargs)
    assert os.listdir(tmp_path) == []  # nothing was created
    with pytest.raises(ptrres.InputTypeError, match="plan must have"):
        ptrres.write_files(object(), [])


def test_reference_plan_gives_the_same_files(tmp_path: Path) -> None:
    """The executor reads any object with a FilePlan's fields."""
    kv, _ = host_plan(n_files=4)
    ref = reference.plan_file_ops(
        reference.resolve_device_pointers(
            ptrres.GPULoadStoreSpec(np.arange(7), [4, 3], [1, 1]), kv
        ),
        4,
    )
    ptrres.write_files(ref, [tmp_path / f"r{f}" for f in range(ref.num_files)])
    assert len(os.listdir(tmp_path)) == ref.num_files
