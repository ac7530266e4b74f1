"""ptrres.vllm on vLLM 0.34's file worker (``vllm/v1/kv_offload/fs/worker.py``):
``FSOffloadingWorker._submit_io`` against the release's own, on real
subclasses of vLLM's workers, the release's own FileMapper naming the files.

``ThreadPoolFSWorker`` subclasses write and read real files (one ``pwrite`` or
``pread`` per FileOp, between the op's pointer, CPU memory standing in for the
GPU's, and its bytes of the file); torch's event, which a CPU build lacks,
is a stub. vLLM's own op lists are captured from ``submit_io``.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

fs_worker = pytest.importorskip(
    "vllm.v1.kv_offload.fs.worker",
    reason="this vLLM has no file worker (vllm.v1.kv_offload.fs: 0.34 and later)",
)
from vllm.utils.math_utils import cdiv  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    OffloadKey,
    TransferResult,
    make_offload_key,
)
from vllm.v1.kv_offload.file_mapper import FileMapper  # noqa: E402
from vllm.v1.kv_offload.fs.worker import (  # noqa: E402
    FileOp,
    FSLoadStoreSpec,
    FSOffloadingWorker,
    ThreadPoolFSWorker,
)
from vllm.v1.kv_offload.pointer_utils import (  # noqa: E402
    iter_pointer_groups as vllm_iter_pointer_groups,
)
from vllm.v1.kv_offload.pointer_utils import (  # noqa: E402
    resolve_device_pointers as vllm_resolve,
)

import ptrres  # noqa: E402
from ptrres.vllm import _pointers, _state  # noqa: E402
from ptrres.vllm._file_pages import (  # noqa: E402
    OverlappingPagesError,
    SparsePages,
    group_verdict,
)
from ptrres.vllm._file_worker import (  # noqa: E402
    FILE_WORKER_CODE,
    file_worker_replacements,
)
from ptrres.vllm._fingerprint import MISSING, fingerprint  # noqa: E402
from ptrres.vllm._state import Replacement  # noqa: E402
from ptrres.vllm._warmup import warm_up_kernels  # noqa: E402

# vLLM's own, as the release ships them (the tests start unpatched).
VLLM_SUBMIT_IO = vars(FSOffloadingWorker)["_submit_io"]
VLLM_INIT = vars(FSOffloadingWorker)["__init__"]
FileOps = list[tuple[str, list[Any]]]


class FakeEvent:
    """torch.Event on a CPU build, which has none."""

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _cpu_event(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "Event", FakeEvent)


@contextlib.contextmanager
def attributes_set(replacements: Sequence[Replacement]) -> Iterator[None]:
    """The replacements set, then vLLM's originals restored."""
    for r in replacements:
        setattr(r.owner, r.name, r.replacement)
    try:
        yield
    finally:
        for r in reversed(replacements):
            setattr(r.owner, r.name, r.original)


@contextlib.contextmanager
def patched_file_worker() -> Iterator[None]:
    """The file worker's path patched, then restored as vLLM ships it.

    Until ``ptrres.vllm.patch()`` patches this path, its replacements are set
    here; then this one line becomes ``with plugin_patched():`` (patch(),
    then unpatch()).
    """
    with attributes_set(file_worker_replacements(lambda: True, warm_up_kernels)):
        yield


# --- workers --------------------------------------------------------------------


class CapturingWorker(FSOffloadingWorker):
    """Records what ``_submit_io`` hands ``submit_io``; does no I/O."""

    def __init__(self, file_mapper: Any, block_size_factor: int) -> None:
        super().__init__(file_mapper=file_mapper, block_size_factor=block_size_factor)
        self.submitted: list[tuple[FileOps, bool, Any]] = []

    def submit_io(
        self, file_ops: FileOps, is_store: bool, ready_event: Any
    ) -> list[Any]:
        self.submitted.append((file_ops, is_store, ready_event))
        return []


class DiskWorker(ThreadPoolFSWorker):
    """Moves each FileOp's bytes between its pointer and its file on disk."""

    def __init__(self, file_mapper: Any, block_size_factor: int) -> None:
        super().__init__(file_mapper, block_size_factor, max_io_threads=2)
        self.files_submitted = 0

    def submit_io(self, file_ops: FileOps, is_store: bool, ready_event: Any) -> Any:
        self.files_submitted += len(file_ops)
        return super().submit_io(file_ops, is_store, ready_event)

    def write_block(self, file_path: str, ops: list[Any]) -> None:
        os.makedirs(os.path.dirname(file_path), exist_ok=True)
        fd = os.open(file_path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for op in ops:
                data = ctypes.string_at(op.device_ptr, op.size_bytes)
                os.pwrite(fd, data, op.file_offset)
        finally:
            os.close(fd)

    def read_block(self, file_path: str, ops: list[Any]) -> None:
        fd = os.open(file_path, os.O_RDONLY)
        try:
            for op in ops:
                data = os.pread(fd, op.size_bytes, op.file_offset)
                if len(data) != op.size_bytes:
                    raise OSError(f"{file_path}: short read at {op.file_offset}")
                ctypes.memmove(op.device_ptr, data, op.size_bytes)
        finally:
            os.close(fd)


def finished(worker: FSOffloadingWorker, job_id: int) -> TransferResult:
    """The job's result, once get_finished reports it."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for result in worker.get_finished():
            assert result.job_id == job_id
            return result
        time.sleep(0.001)
    raise AssertionError(f"job {job_id} never finished")


def file_mapper(root: Path | str, bsf: int) -> FileMapper:
    """vLLM's own FileMapper (its files under ``root``)."""
    return FileMapper(
        root_dir=str(root),
        model_name="org/model",
        tokens_per_hash=16,
        blocks_per_file=bsf,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        rank=0,
        dtype="bfloat16",
    )


# --- layouts ----------------------------------------------------------------------


class Layout:
    """KV caches of CPU int8 tensors (one per ref, rows padded), and a job."""

    def __init__(
        self,
        pages: Sequence[Sequence[int]],
        num_blocks: int = 8,
        pad: int = 8,
        seed: int = 0,
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tensors: list[torch.Tensor] = []
        refs = []
        for group_pages in pages:
            group_refs = []
            for page in group_pages:
                rows = torch.randint(
                    -128, 128, (num_blocks, page + pad), generator=generator
                ).to(torch.int8)
                group_refs.append(CanonicalKVCacheRef(len(self.tensors), page))
                self.tensors.append(rows)
            refs.append(group_refs)
        self.kv_caches = CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, t.shape[1]) for t in self.tensors], refs
        )
        self.pages = [list(p) for p in pages]

    def blocks(self, spec: GPULoadStoreSpec) -> list[bytes]:
        """The bytes of every (group, ref, block) of a spec, in op order."""
        out = []
        first = 0
        for g, n in enumerate(spec.group_sizes):
            ids = spec.block_ids[first : first + n].tolist()
            for ref in self.kv_caches.group_data_refs[g]:
                rows = self.tensors[ref.tensor_idx]
                out += [rows[i, : ref.page_size_bytes].numpy().tobytes() for i in ids]
            first += n
        return out

    def zero(self) -> None:
        for t in self.tensors:
            t.zero_()


def spec_of(
    block_ids: Sequence[int], group_sizes: Sequence[int], block_indices: Sequence[int]
) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(list(block_ids), list(group_sizes), list(block_indices))


def keys_for(spec: GPULoadStoreSpec, bsf: int, salt: int = 0) -> list[OffloadKey]:
    """One offload key per file: per non-empty group, per chunk."""
    keys = []
    for g, (n, index) in enumerate(zip(spec.group_sizes, spec.block_indices)):
        if n:
            for chunk in range(cdiv(n + index % bsf, bsf)):
                digest = (salt * 1_000_003 + g * 1009 + chunk + index).to_bytes(
                    16, "big"
                )
                keys.append(make_offload_key(digest, g))
    return keys


def vllm_ops(device_ptrs: Any, keys: list[OffloadKey], bsf: int) -> tuple[FileOps, int]:
    """vLLM's own _submit_io (unpatched): its op lists and bytes."""
    assert fs_worker.iter_pointer_groups is vllm_iter_pointer_groups
    worker = CapturingWorker(file_mapper("/kv", bsf), bsf)
    completions, num_bytes = VLLM_SUBMIT_IO(worker, device_ptrs, keys, True)
    assert completions == []
    (file_ops, _, _), *_ = worker.submitted
    return file_ops, num_bytes


@st.composite
def jobs(draw: st.DrawFn) -> tuple[Layout, GPULoadStoreSpec, int]:
    """A layout (1-3 groups of 0-3 refs, equal pages within each group), a
    job on it and the block size factor."""
    num_groups = draw(st.integers(1, 3))
    pages = [
        [draw(st.sampled_from([8, 24, 64]))] * draw(st.integers(0, 3))
        for _ in range(num_groups)
    ]
    if not any(pages):
        pages[0] = [16]
    num_blocks = 8
    group_sizes = [draw(st.integers(0, 6)) for _ in range(num_groups)]
    block_indices = [draw(st.integers(0, 20)) for _ in range(num_groups)]
    n = sum(group_sizes)
    ids = draw(st.lists(st.integers(0, num_blocks - 1), min_size=n, max_size=n))
    bsf = draw(st.integers(1, 4))
    layout = Layout(pages, num_blocks, seed=draw(st.integers(0, 3)))
    return layout, spec_of(ids, group_sizes, block_indices), bsf


# --- the op lists -------------------------------------------------------------------


@given(jobs())
def test_op_lists_are_vllms(job: tuple[Layout, GPULoadStoreSpec, int]) -> None:
    """The same files in the same order, the same FileOps (vLLM's class), the
    same bytes, the same event and submit_io call: from ptrres's DevicePointers
    (planned from the checked ids) and from vLLM's own (from the pointers)."""
    layout, spec, bsf = job
    keys = keys_for(spec, bsf)
    vllm_dp = vllm_resolve(spec, layout.kv_caches)
    expected, expected_bytes = vllm_ops(vllm_dp, keys, bsf)
    with patched_file_worker():
        ours = _pointers.resolve_device_pointers(spec, layout.kv_caches)
        assert _pointers.resolved_table(ours) is not None
        for device_ptrs in (ours, vllm_dp):
            worker = CapturingWorker(file_mapper("/kv", bsf), bsf)
            completions, num_bytes = worker._submit_io(device_ptrs, keys, False)
            assert completions == []
            assert num_bytes == expected_bytes
            ((file_ops, is_store, event),) = worker.submitted
            assert file_ops == expected
            assert is_store is False
            assert isinstance(event, FakeEvent)
            for _, ops in file_ops:
                assert all(type(op) is FileOp for op in ops)


def test_the_op_lists_of_a_known_job() -> None:
    """By hand: partial first chunks, a group of no refs (files without ops)
    and an empty group (no file); vLLM's offsets (d * bsf + slot) * page."""
    layout = Layout([[64, 64], [], [32], [16]])
    spec = spec_of([1, 2, 3, 0, 5, 6], [3, 1, 2, 0], [1, 0, 5, 0])
    keys = keys_for(spec, 2)
    with patched_file_worker():
        worker = CapturingWorker(file_mapper("/kv", 2), 2)
        dp = _pointers.resolve_device_pointers(spec, layout.kv_caches)
        _, num_bytes = worker._submit_io(dp, keys, True)
    ((file_ops, _, _),) = worker.submitted
    t = [int(x.data_ptr()) for x in layout.tensors]
    row, row2 = 64 + 8, 32 + 8
    ops = [
        [(op.device_ptr, op.size_bytes, op.file_offset) for op in o]
        for _, o in file_ops
    ]
    assert ops == [
        # group 0 (block index 1: slot 1 first), each ref's region 2 pages
        [(t[0] + 1 * row, 64, 64), (t[1] + 1 * row, 64, 192)],
        [
            (t[0] + 2 * row, 64, 0), (t[0] + 3 * row, 64, 64),
            (t[1] + 2 * row, 64, 128), (t[1] + 3 * row, 64, 192),
        ],
        [],  # group 1: one block, no refs
        # group 2 (block index 5: slot 1 first), one ref of 32 B pages
        [(t[2] + 5 * row2, 32, 32)],
        [(t[2] + 6 * row2, 32, 0)],
    ]  # fmt: skip
    assert [path for path, _ in file_ops] == [
        file_mapper("/kv", 2).get_file_name(key) for key in keys
    ]
    assert num_bytes == 3 * 2 * 64 + 2 * 32


# --- files on disk --------------------------------------------------------------


def _store(
    worker: DiskWorker, job_id: int, layout: Layout, spec: Any, keys: list[OffloadKey]
) -> TransferResult:
    dp = _pointers.job_resolver(vllm_resolve)(spec, layout.kv_caches)
    assert worker.submit_store(job_id, dp, FSLoadStoreSpec(keys))
    return finished(worker, job_id)


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.bin"))
    }


HYBRID = [[48, 48, 48], [], [16, 16]]
HYBRID_SPEC = ([7, 0, 3, 3, 5, 1, 6], [4, 0, 3], [3, 0, 9])


def test_store_then_load_gives_back_every_byte(tmp_path: Path) -> None:
    layout = Layout(HYBRID)
    spec = spec_of(*HYBRID_SPEC)
    keys = keys_for(spec, 4)
    stored = layout.blocks(spec)
    with patched_file_worker():
        worker = DiskWorker(file_mapper(tmp_path, 4), 4)
        result = _store(worker, 1, layout, spec, keys)
        assert result.success
        assert result.transfer_size == sum(map(len, stored))
        layout.zero()
        dp = _pointers.job_resolver(vllm_resolve)(spec, layout.kv_caches)
        assert worker.submit_load(2, FSLoadStoreSpec(keys), dp)
        assert finished(worker, 2).success
        worker.shutdown()
    assert layout.blocks(spec) == stored
    assert len(_files(tmp_path)) == len(keys) == 3


def test_files_are_vllms_byte_for_byte(tmp_path: Path) -> None:
    layout = Layout(HYBRID, seed=1)
    spec = spec_of(*HYBRID_SPEC)
    keys = keys_for(spec, 4)
    vllm_worker = DiskWorker(file_mapper(tmp_path / "vllm", 4), 4)
    assert _store(vllm_worker, 1, layout, spec, keys).success
    vllm_worker.shutdown()
    with patched_file_worker():
        worker = DiskWorker(file_mapper(tmp_path / "ptrres", 4), 4)
        assert _store(worker, 1, layout, spec, keys).success
        worker.shutdown()
    vllm_files, ours = _files(tmp_path / "vllm"), _files(tmp_path / "ptrres")
    assert len(ours) == 3
    assert ours == vllm_files


# --- bad jobs ------------------------------------------------------------------------


class Records(logging.Handler):
    """The records of one logger, formatted with their tracebacks."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@contextlib.contextmanager
def logged(logger: logging.Logger) -> Iterator[Records]:
    records = Records()
    logger.addHandler(records)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)


def test_bad_ids_fail_the_job_and_write_nothing(tmp_path: Path) -> None:
    layout = Layout(HYBRID)
    good = spec_of(*HYBRID_SPEC)
    bad = spec_of([7, 0, 3, 3, 5, 1, 11], *HYBRID_SPEC[1:])  # group 2, position 2
    keys = keys_for(good, 4)
    resolve = _pointers.job_resolver(vllm_resolve)
    refused = resolve(bad, layout.kv_caches)
    # Found when planned from its ids (or when its pointers are read).
    assert _pointers.resolved_table(refused) is not None
    # vLLM's own raises in the engine step (its first read of the pointers).
    with pytest.raises(ptrres.BlockIdError):
        VLLM_SUBMIT_IO(CapturingWorker(file_mapper("/kv", 4), 4), refused, keys, True)
    with patched_file_worker(), logged(fs_worker.logger) as log:
        worker = DiskWorker(file_mapper(tmp_path, 4), 4)
        for job_id in (1, 2):  # a store, then a load
            if job_id == 1:
                assert worker.submit_store(job_id, refused, FSLoadStoreSpec(keys))
            else:
                assert worker.submit_load(job_id, FSLoadStoreSpec(keys), refused)
            result = finished(worker, job_id)
            assert not result.success
            assert result.transfer_size == 0
            assert f"I/O failed for job {job_id}" in log.text
        assert "group 2, position 2: block id 11 is out of range" in log.text
        assert worker.files_submitted == 0
        assert _files(tmp_path) == {}
        # A sync load's wait raises the error, as for a failed read.
        assert worker.submit_load(3, FSLoadStoreSpec(keys), refused)
        with pytest.raises(ptrres.BlockIdError, match="block id 11"):
            worker.wait({3})
        worker.get_finished()
        # The worker goes on.
        assert _store(worker, 4, layout, good, keys).success
        worker.shutdown()
    assert len(_files(tmp_path)) == 3


@pytest.mark.parametrize("extra", [-1, 1])
def test_keys_not_one_per_file_fail_the_job(tmp_path: Path, extra: int) -> None:
    layout = Layout(HYBRID)
    spec = spec_of(*HYBRID_SPEC)
    keys = keys_for(spec, 4)
    keys = keys[:-1] if extra < 0 else [*keys, make_offload_key(b"x" * 16, 0)]
    dp = vllm_resolve(spec, layout.kv_caches)
    # vLLM's own raises (IndexError, or its assertion).
    with pytest.raises((IndexError, AssertionError)):
        VLLM_SUBMIT_IO(CapturingWorker(file_mapper("/kv", 4), 4), dp, keys, True)
    with patched_file_worker(), logged(fs_worker.logger) as log:
        worker = DiskWorker(file_mapper(tmp_path, 4), 4)
        assert worker.submit_store(1, dp, FSLoadStoreSpec(keys))
        assert not finished(worker, 1).success
        worker.shutdown()
    assert (
        f"the job has {len(keys)} offload keys, but its blocks fill 3 files" in log.text
    )
    assert _files(tmp_path) == {}


# --- unequal pages in one group -------------------------------------------------------


def test_overlapping_pages_are_refused(tmp_path: Path) -> None:
    """Pages of 200 B and 100 B, two blocks per file: vLLM's own puts ref 1's
    slot 0 at bytes 200-300, inside ref 0's slot 1; ptrres fails the job."""
    layout = Layout([[200, 100]])
    spec = spec_of([3, 4], [2], [0])
    keys = keys_for(spec, 2)
    vllm_dp = vllm_resolve(spec, layout.kv_caches)
    ((_, ops),), _ = vllm_ops(vllm_dp, keys, 2)
    assert [(op.size_bytes, op.file_offset) for op in ops] == [
        (200, 0), (200, 200), (100, 200), (100, 300),
    ]  # fmt: skip
    with patched_file_worker(), logged(fs_worker.logger) as log:
        worker = DiskWorker(file_mapper(tmp_path, 2), 2)
        ours = _pointers.resolve_device_pointers(spec, layout.kv_caches)
        for job_id, dp in enumerate((ours, vllm_dp)):  # from the table, the pointers
            completions, _ = worker._submit_io(dp, keys, True)
            with pytest.raises(OverlappingPagesError) as refused:
                completions[0].result()
            error = refused.value
            assert (error.group, error.refs, error.pages) == (0, (0, 1), [200, 100])
            assert worker.submit_store(job_id, dp, FSLoadStoreSpec(keys))
            assert not finished(worker, job_id).success
        worker.shutdown()
    assert worker.files_submitted == 0
    assert _files(tmp_path) == {}
    assert (
        "group 0: vLLM 0.34's file worker puts ref d's block in slot s at byte "
        "(d * block_size_factor + s) * page(d) of the file, and this group's refs "
        "have pages of different sizes (ref 0: 200 B, ref 1: 100 B), so with "
        "block_size_factor 2 ref 1's slot 0 (bytes 200-300) overlaps ref 0's slot "
        "1 (bytes 200-400)"
    ) in log.text


def test_sparse_pages_keep_vllms_layout(tmp_path: Path) -> None:
    """Pages growing from ref to ref (100 B, then 200 B): vLLM's ranges do not
    overlap, so its own layout (with a gap) is kept, said once."""
    layout = Layout([[16, 16], [100, 200]])
    spec = spec_of([1, 2, 3, 4], [2, 2], [0, 1])
    keys = keys_for(spec, 2)
    vllm_dp = vllm_resolve(spec, layout.kv_caches)
    expected, expected_bytes = vllm_ops(vllm_dp, keys, 2)
    stored = layout.blocks(spec)
    logger = _state.reporter()
    with patched_file_worker(), logged(logger) as log:
        ours = _pointers.resolve_device_pointers(spec, layout.kv_caches)
        for dp in (ours, vllm_dp, ours):
            worker = CapturingWorker(file_mapper("/kv", 2), 2)
            assert worker._submit_io(dp, keys, True)[1] == expected_bytes
            assert worker.submitted[0][0] == expected
        disk = DiskWorker(file_mapper(tmp_path, 2), 2)
        assert _store(disk, 1, layout, spec, keys).success
        layout.zero()
        assert disk.submit_load(2, FSLoadStoreSpec(keys), ours)
        assert finished(disk, 2).success
        disk.shutdown()
    assert layout.blocks(spec) == stored
    said = [line for line in log.lines if "whose ranges in vLLM's file layout" in line]
    assert said == [
        "INFO ptrres: group 1's refs have pages of different sizes (ref 0: 100 B, "
        "ref 1: 200 B) whose ranges in vLLM's file layout do not overlap: its file "
        "jobs keep vLLM's own _submit_io, so that every engine reads the same bytes"
    ]


@pytest.mark.parametrize(
    ("pages", "verdict"),
    [
        ([64, 64, 64], None),
        ([200, 100], (0, 1)),  # ref 1 from byte 200 (bsf 2), in ref 0's 0-400
        ([100, 200], "sparse"),
        ([200, 200, 200, 200, 200, 100], (2, 5)),  # ref 5: 1000-1200 in 800-1200
        ([10, 10, 10, 10, 1000, 100], "sparse"),  # smaller, yet in a gap
        ([16, 0, 4], (0, 2)),  # a page of 0 B spans nothing
    ],
)
def test_which_unequal_pages_overlap(pages: list[int], verdict: Any) -> None:
    """vLLM's ranges [d * bsf * P[d], (d + 1) * bsf * P[d]), by brute force."""
    found = group_verdict(3, pages, 2)
    spans = [(d * 2 * p, (d + 1) * 2 * p) for d, p in enumerate(pages) if p]
    overlapping = any(
        a[0] < b[1] and b[0] < a[1] for a, b in itertools.combinations(spans, 2)
    )
    assert isinstance(found, OverlappingPagesError) == overlapping
    if verdict is None:
        assert found is None
    elif verdict == "sparse":
        assert found == SparsePages(3, tuple(pages))
    else:
        assert isinstance(found, OverlappingPagesError)
        assert (found.group, found.refs, found.pages) == (3, verdict, pages)


# --- the patch ----------------------------------------------------------------------


def test_what_is_replaced() -> None:
    replacements = file_worker_replacements(lambda: True, lambda: None)
    assert [(r.owner, r.name, r.original) for r in replacements] == [
        (FSOffloadingWorker, "__init__", VLLM_INIT),
        (FSOffloadingWorker, "_submit_io", VLLM_SUBMIT_IO),
        (fs_worker, "iter_pointer_groups", vllm_iter_pointer_groups),
    ]
    assert replacements[2].replacement is _pointers.iter_pointer_groups
    # Where another path's replacement is bound already, vLLM's is recorded.
    ours = _pointers.iter_pointer_groups
    other = Replacement(fs_worker, "x", vllm_iter_pointer_groups, ours)
    with attributes_set(
        [Replacement(fs_worker, "iter_pointer_groups", vllm_iter_pointer_groups, ours)]
    ):
        _state.applied["other path"] = [other]
        try:
            (*_, binding) = file_worker_replacements(lambda: True, lambda: None)
        finally:
            del _state.applied["other path"]
    assert binding.original is vllm_iter_pointer_groups


def test_what_the_patch_depends_on_is_here() -> None:
    found = fingerprint(FILE_WORKER_CODE)
    assert MISSING not in found.values()
    assert "vllm.v1.kv_offload.fs.worker:FSOffloadingWorker._submit_io" in found


def test_kernels_are_made_ready_where_the_worker_is_built() -> None:
    calls: list[int] = []
    prepare: Callable[[], None] = lambda: calls.append(1)  # noqa: E731
    layout = Layout([[16]])
    spec = spec_of([1], [1], [0])
    dp = _pointers.resolve_device_pointers(spec, layout.kv_caches)
    before = CapturingWorker(file_mapper("/kv", 1), 1)  # built unpatched
    with attributes_set(file_worker_replacements(lambda: True, prepare)):
        before._submit_io(dp, keys_for(spec, 1), True)  # its first job
        assert calls == [1]
        CapturingWorker(file_mapper("/kv", 1), 1)
        CapturingWorker(file_mapper("/kv", 1), 1)
        assert calls == [1]  # once per patch
    with attributes_set(file_worker_replacements(lambda: True, prepare)):
        CapturingWorker(file_mapper("/kv", 1), 1)
        assert calls == [1, 1]


def test_vllms_own_code_where_the_path_is_off_or_the_kernels_fail() -> None:
    layout = Layout([[16]])
    refused = _pointers.job_resolver(vllm_resolve)(
        spec_of([9], [1], [0]), layout.kv_caches
    )
    keys = keys_for(spec_of([9], [1], [0]), 1)

    def broken() -> None:
        raise RuntimeError("no kernels here")

    for active, prepare in ((lambda: False, warm_up_kernels), (lambda: True, broken)):
        with attributes_set(file_worker_replacements(active, prepare)):
            worker = CapturingWorker(file_mapper("/kv", 1), 1)
            with pytest.raises(ptrres.BlockIdError):  # vLLM's: it raises
                worker._submit_io(refused, keys, True)


def test_vllm_is_restored() -> None:
    with patched_file_worker():
        assert vars(FSOffloadingWorker)["_submit_io"] is not VLLM_SUBMIT_IO
    assert vars(FSOffloadingWorker)["_submit_io"] is VLLM_SUBMIT_IO
    assert vars(FSOffloadingWorker)["__init__"] is VLLM_INIT
    assert fs_worker.iter_pointer_groups is vllm_iter_pointer_groups
