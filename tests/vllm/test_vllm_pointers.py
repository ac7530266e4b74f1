"""vLLM 0.34's pointer_utils and what calls it, against vLLM's own code
(issue 39, item 1): its resolve_device_pointers and iter_pointer_groups as
ptrres's (same results, of vLLM's own types, every id checked); the
offloading connector's resolve, whose bad job fails as a failed copy fails
it, through vLLM's own connector worker, CPUOffloadingWorker and handlers;
and the worker's one table, built and warmed where vLLM builds the worker.

Skipped on vLLM 0.30-0.33, which have no pointer_utils.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_harness import (
    CONNECTOR_MODULE,
    DEVICE_POINTERS,
    CopyEngine,
    Layout,
    draw_ids,
    make_layout,
    specs,
    stubbed_vllm,
    worker,
)

import ptrres
import ptrres.vllm as plugin
from ptrres.vllm import _pointers, _state

if not DEVICE_POINTERS:
    pytest.skip(
        "vLLM 0.30-0.33 have no pointer_utils: their handler takes block ids",
        allow_module_level=True,
    )

pointer_utils = importlib.import_module("vllm.v1.kv_offload.pointer_utils")
base = importlib.import_module("vllm.v1.kv_offload.base")
connector = importlib.import_module(CONNECTOR_MODULE)
common = importlib.import_module(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common"
)
# vLLM's own, kept before anything is patched.
VLLM_RESOLVE = pointer_utils.resolve_device_pointers
VLLM_GROUPS = pointer_utils.iter_pointer_groups


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    plugin.unpatch()
    yield
    plugin.unpatch()


@st.composite
def resolutions(draw: st.DrawFn) -> tuple[Layout, Any]:
    """A direct layout (shared tensors, padded rows, empty groups) and a
    GPU spec on it, with int32 or int64 ids."""
    num_tensors = draw(st.integers(1, 4))
    gpu_rows = [
        (draw(st.integers(1, 12)), draw(st.integers(1, 48)), draw(st.integers(0, 8)))
        for _ in range(num_tensors)
    ]
    refs = [
        [
            (
                t := draw(st.integers(0, num_tensors - 1)),
                draw(st.integers(1, gpu_rows[t][1])),
            )
            for _ in range(draw(st.integers(0, 3)))
        ]
        for _ in range(draw(st.integers(1, 3)))
    ]
    bpc = draw(st.integers(1, 4))
    layout = make_layout(gpu_rows, refs, bpc, num_cpu_chunks=4)
    num_blocks = min(n for n, _, _ in gpu_rows)
    block_ids, sizes, indices, _ = draw_ids(draw, len(refs), num_blocks, 4, bpc)
    spec = base.GPULoadStoreSpec(block_ids, sizes, indices)
    spec.block_ids = spec.block_ids.astype(draw(st.sampled_from([np.int32, np.int64])))
    return layout, spec


def same_pointers(ours: Any, theirs: Any, *, exact_type: bool = True) -> None:
    if exact_type:
        assert type(ours) is base.DevicePointers
    else:  # the connector's: a subclass, its arrays made when first read
        assert isinstance(ours, base.DevicePointers)
    assert ours.ptrs.dtype == theirs.ptrs.dtype == np.uint64
    assert ours.ptrs.tobytes() == theirs.ptrs.tobytes()
    assert ours.sizes.dtype == np.uint64
    assert ours.sizes.tolist() == theirs.sizes.tolist()
    for name in ("group_block_counts", "group_data_ref_counts", "block_indices"):
        assert getattr(ours, name) == getattr(theirs, name)
        assert all(type(v) is int for v in getattr(ours, name))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=resolutions(), blocks_per_chunk=st.integers(1, 5))
def test_pointer_utils_gives_vllms_results_of_vllms_types(
    case: tuple[Layout, Any], blocks_per_chunk: int
) -> None:
    layout, spec = case
    kv_caches = layout.kv_caches()
    expected = VLLM_RESOLVE(spec, kv_caches)
    groups = list(VLLM_GROUPS(expected, blocks_per_chunk))
    plugin.patch()
    ours = pointer_utils.resolve_device_pointers(spec, kv_caches)
    same_pointers(ours, expected)
    found = list(pointer_utils.iter_pointer_groups(ours, blocks_per_chunk))
    assert found == groups
    assert all(type(info) is base.DevicePointerGroupInfo for info in found)
    # The drop-in and the connector's resolve agree too.
    same_pointers(
        ptrres_as_vllm(ptrres.resolve_device_pointers(spec, kv_caches)), expected
    )
    deferred = connector.resolve_device_pointers(spec, kv_caches)
    assert "_ptrres_arrays" not in vars(deferred)  # nothing resolved yet
    same_pointers(deferred, expected, exact_type=False)
    assert dataclasses.replace(deferred).ptrs.tobytes() == expected.ptrs.tobytes()


def ptrres_as_vllm(pointers: Any) -> Any:
    return base.DevicePointers(**dataclasses.asdict(pointers))


def eight_blocks() -> tuple[Any, Any]:
    """The issue's case: one 8-block tensor of 64-byte pages."""
    tensor = torch.zeros((8, 64), dtype=torch.int8)
    kv_caches = base.CanonicalKVCaches(
        [base.CanonicalKVCacheTensor(tensor, 64)], [[base.CanonicalKVCacheRef(0, 64)]]
    )
    return tensor, kv_caches


@pytest.mark.parametrize(("block_id", "offset"), [(8, 512), (-1, -64)])
def test_bad_ids_raise_from_pointer_utils(block_id: int, offset: int) -> None:
    tensor, kv_caches = eight_blocks()
    spec = base.GPULoadStoreSpec([block_id], [1], [0])
    # vLLM's own: a pointer outside the tensor, silently.
    wrapped = int(VLLM_RESOLVE(spec, kv_caches).ptrs[0])
    assert wrapped == (tensor.data_ptr() + offset) % 2**64
    plugin.patch()
    with pytest.raises(ptrres.BlockIdError) as raised:
        pointer_utils.resolve_device_pointers(spec, kv_caches)
    assert (raised.value.group, raised.value.position, raised.value.value) == (
        0,
        0,
        block_id,
    )
    # ptrres's public drop-in raises, as it always has.
    with pytest.raises(ptrres.BlockIdError):
        ptrres.resolve_device_pointers(spec, kv_caches)


def test_the_connectors_resolve_raises_nothing_in_the_engine_step() -> None:
    """A malformed spec gives a refusal, every field of which raises; a bad
    id a DevicePointers whose pointers raise it when read (ptrres's handler
    and file worker find it planning from the ids, and fail the job)."""
    _, kv_caches = eight_blocks()
    plugin.patch()
    malformed = base.GPULoadStoreSpec([3, 4], [2], [0])
    malformed.group_sizes = [3]  # three blocks said, two given
    refused = connector.resolve_device_pointers(malformed, kv_caches)
    assert isinstance(refused, base.DevicePointers)
    error = _pointers.refusal(refused)
    assert isinstance(error, ptrres.SpecError)
    for field in dataclasses.fields(base.DevicePointers):
        with pytest.raises(ptrres.SpecError):
            getattr(refused, field.name)
    with pytest.raises(ptrres.SpecError):
        dataclasses.replace(refused)
    with pytest.raises(ptrres.SpecError):
        list(pointer_utils.iter_pointer_groups(refused, 1))
    assert repr(refused) == f"RefusedDevicePointers({error})"

    bad = connector.resolve_device_pointers(
        base.GPULoadStoreSpec([3, 8], [2], [0]), kv_caches
    )
    assert isinstance(bad, base.DevicePointers)
    assert _pointers.refusal(bad) is None
    assert bad.group_block_counts == (2,)
    assert "not resolved yet" in repr(bad)  # a log line never raises
    for name in ("ptrs", "sizes"):
        with pytest.raises(ptrres.BlockIdError, match="block id 8") as raised:
            getattr(bad, name)
        assert (raised.value.group, raised.value.position) == (0, 1)
    with pytest.raises(ptrres.BlockIdError):
        dataclasses.replace(bad)
    # A good job after it.
    good = connector.resolve_device_pointers(
        base.GPULoadStoreSpec([3, 7], [2], [0]), kv_caches
    )
    assert _pointers.refusal(good) is None
    assert _pointers.resolved_table(good) is not None
    assert good.ptrs.tolist() == [good.ptrs[0], good.ptrs[0] + 4 * 64]


def test_vllms_own_handler_raises_on_a_bad_job() -> None:
    """Where the handler's path is left alone, a job with a bad id raises as
    soon as vLLM reads its pointers: never a copy of an address outside the
    tensor, never a copy of nothing reported done."""
    layout = one_group()
    kv_caches = layout.kv_caches()
    engine = CopyEngine()
    with stubbed_vllm(engine):
        handler = layout.handler(True).handler  # vLLM's own, unwrapped
        plugin.patch()
        vllm_transfer = _state.vllm_own(type(handler).transfer_async)
        gpu, cpu = specs([3, 9], [2], [0], [0, 1], gpu_to_cpu=True)
        bad = connector.resolve_device_pointers(gpu, kv_caches)
        with pytest.raises(ptrres.BlockIdError, match="block id 9"):
            vllm_transfer(handler, 1, bad, cpu)
    assert not engine.calls


# --- CPUOffloadingWorker, built through its real __init__ ------------------------


def two_groups() -> Layout:
    """Two groups sharing tensor 0, one padded ref; 16 GPU blocks, bpc 2."""
    return make_layout(
        [(16, 32, 8), (16, 64, 0)],
        [[(0, 24), (1, 64)], [(0, 32)]],
        blocks_per_chunk=2,
        num_cpu_chunks=8,
    )


def cpu_worker(layout: Layout, kv_caches: Any) -> Any:
    return worker.CPUOffloadingWorker(
        kv_caches=kv_caches,
        blocks_per_chunk=layout.blocks_per_chunk,
        num_cpu_chunks=layout.num_cpu_chunks,
    )


HANDLERS = ("_store_handler", "_load_handler", "_expedited_load_handler")


def test_the_worker_builds_one_table_for_its_handlers_and_the_resolve(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ptrres._pointer_utils import table_for
    from ptrres.vllm import _warmup

    # The warmup is said at INFO once a process: as if this were the first.
    monkeypatch.setattr(_warmup, "_warmup_logged", False)
    layout = two_groups()
    kv_caches = layout.kv_caches()
    with stubbed_vllm():
        plugin.patch()
        with caplog.at_level(logging.INFO):
            offloading = cpu_worker(layout, kv_caches)
    plans = [getattr(offloading, name)._ptrres_plan for name in HANDLERS]
    table = table_for(kv_caches)
    assert all(plan.table is table for plan in plans)
    assert [[g.base_ptr for g in plan.offloaded.geometries] for plan in plans] == [
        [t.data_ptr() for t in getattr(offloading, name).cpu_tensors]
        for name in HANDLERS
    ]
    assert any("ptrres warmup" in r.getMessage() for r in caplog.records)
    # The connector's resolve finds that table: its pointers carry it.
    spec = base.GPULoadStoreSpec([1, 2, 3], [2, 1], [0, 0])
    assert (
        _pointers.resolved_table(connector.resolve_device_pointers(spec, kv_caches))
        is table
    )


def jobs() -> list[tuple[list[int], list[int], list[int], list[int]]]:
    """(block ids, group sizes, block indices, CPU chunk ids) of a few jobs."""
    return [
        ([3, 4, 5, 9, 1], [4, 1], [1, 0], [5, 2, 7, 0]),
        ([15, 0], [1, 1], [3, 2], [0, 1]),
        ([], [0, 0], [0, 0], []),
        ([6, 7, 8], [3, 0], [0, 5], [4, 6]),
    ]


def run_jobs(offloading: Any, kv_caches: Any, engine: CopyEngine) -> list[Any]:
    """Every job stored then loaded (and loaded expedited), as the connector
    submits them; what each submitted."""
    submitted = []
    for number, (ids, sizes, indices, cpu_ids) in enumerate(jobs()):
        gpu, cpu = specs(ids, sizes, indices, cpu_ids, gpu_to_cpu=True)
        resolve = connector.resolve_device_pointers
        for job, kind in enumerate(("store", "load", "expedited"), 3 * number):
            before = len(engine.calls)
            pointers = resolve(gpu, kv_caches)
            if kind == "store":
                assert offloading.submit_store(job, pointers, cpu) is True
            else:
                expedited = kind == "expedited"
                assert offloading.submit_load(job, cpu, pointers, expedited) is True
            submitted.append([(c.src, c.dst, c.sizes) for c in engine.calls[before:]])
        results = offloading.get_finished()
        assert all(r.success for r in results)
    return submitted


def test_the_patched_worker_submits_vllms_descriptors() -> None:
    """Built patched, then run patched and, unpatched, by vLLM's own code:
    the same descriptors into the same CPU tensors."""
    layout = two_groups()
    kv_caches = layout.kv_caches()
    with stubbed_vllm() as mp:
        engine = CopyEngine()
        mp.setattr(worker.ops, "swap_blocks_batch", engine)
        plugin.patch()
        offloading = cpu_worker(layout, kv_caches)
        got = run_jobs(offloading, kv_caches, engine)
        plugin.unpatch()
        assert connector.resolve_device_pointers is VLLM_RESOLVE
        expected = run_jobs(offloading, kv_caches, engine)
    assert len(got) == len(expected) == 3 * len(jobs())
    for want, have in zip(expected, got):
        assert len(want) == len(have)
        for arrays, ours in zip(want, have):
            for a, b in zip(arrays, ours):
                assert a.dtype == b.dtype
                assert a.tobytes() == b.tobytes()


def test_a_replaced_device_pointers_is_planned_from_its_pointers() -> None:
    """An out-of-tree worker may rebuild the pointers (dataclasses.replace):
    the handler plans from what they say, each pointer checked."""
    layout = two_groups()
    kv_caches = layout.kv_caches()
    with stubbed_vllm() as mp:
        engine = CopyEngine()
        mp.setattr(worker.ops, "swap_blocks_batch", engine)
        plugin.patch()
        offloading = cpu_worker(layout, kv_caches)
        gpu, cpu = specs([3, 4, 5, 9, 1], [4, 1], [1, 0], [5, 2, 7, 0], gpu_to_cpu=True)
        resolved = connector.resolve_device_pointers(gpu, kv_caches)
        offloading.submit_store(1, resolved, cpu)
        rebuilt = dataclasses.replace(resolved)
        assert _pointers.resolved_table(rebuilt) is None
        offloading.submit_store(2, rebuilt, cpu)
        first, second = engine.calls
        assert first.src.tobytes() == second.src.tobytes()
        assert first.dst.tobytes() == second.dst.tobytes()
        # A pointer a block past its tensor fails that job.
        bad = rebuilt.ptrs.copy()
        bad[3] += np.uint64(16 * 40)
        offloading.submit_store(3, dataclasses.replace(rebuilt, ptrs=bad), cpu)
        results = offloading.get_finished()
    assert [(r.job_id, r.success) for r in results] == [
        (1, True),
        (2, True),
        (3, False),
    ]
    assert len(engine.calls) == 2


def test_bytes_go_out_and_come_back() -> None:
    layout = two_groups()
    kv_caches = layout.kv_caches()
    for i, tensor in enumerate(layout.gpu_tensors):
        values = torch.arange(tensor.numel(), dtype=torch.int64) * (7 + i)
        tensor.copy_((values % 251 - 125).to(torch.int8).view(tensor.shape))
    before = [t.clone() for t in layout.gpu_tensors]
    ids = ([3, 4, 5, 9, 1], [4, 1], [1, 0], [5, 2, 7, 0])
    with stubbed_vllm(CopyEngine(memmove=True)):
        plugin.patch()
        offloading = cpu_worker(layout, kv_caches)
        gpu, cpu = specs(*ids, gpu_to_cpu=True)
        offloading.submit_store(
            1, connector.resolve_device_pointers(gpu, kv_caches), cpu
        )
        for tensor in layout.gpu_tensors:
            tensor.zero_()
        offloading.submit_load(
            2, cpu, connector.resolve_device_pointers(gpu, kv_caches)
        )
        assert [r.success for r in offloading.get_finished()] == [True, True]
    for (group, refs), blocks in zip(
        enumerate(layout.refs), np.split(np.array(ids[0]), np.cumsum(ids[1])[:-1])
    ):
        for ref in refs:
            page = ref.page_size_bytes
            got = layout.gpu_tensors[ref.tensor_idx][blocks, :page]
            want = before[ref.tensor_idx][blocks, :page]
            assert torch.equal(got, want), (group, ref)


# --- vLLM's own connector worker: a bad job fails, the engine goes on -----------


def connector_worker(offloading: Any) -> Any:
    """vLLM 0.34's OffloadingConnectorWorker, through its real __init__, whose
    spec hands it ``offloading``."""
    spec = SimpleNamespace(
        replicated_layout=False,
        config=SimpleNamespace(
            canonical_layout=False, parallel=SimpleNamespace(rank=0)
        ),
        get_worker=lambda kv_caches: offloading,
    )
    return connector.OffloadingConnectorWorker(spec, None, None)


def job(
    req: str,
    block_ids: list[int],
    cpu_ids: list[int],
    *,
    store: bool,
    sync: bool = False,
) -> Any:
    gpu, cpu = specs(block_ids, [len(block_ids)], [0], cpu_ids, gpu_to_cpu=True)
    src, dst = (gpu, cpu) if store else (cpu, gpu)
    return common.TransferJob(req_id=req, src_spec=src, dst_spec=dst, sync=sync)


def metadata(
    load: dict[int, Any] | None = None, store: dict[int, Any] | None = None
) -> Any:
    return common.OffloadingConnectorMetadata(
        load_jobs=load or {}, store_jobs=store or {}
    )


def one_group() -> Layout:
    return make_layout([(8, 64, 0)], [[(0, 64)]], blocks_per_chunk=1, num_cpu_chunks=4)


@pytest.mark.parametrize(
    ("block_ids", "cpu_ids", "message"),
    [
        ([3, 8], [0, 1], "block id 8"),
        ([3, -1], [0, 1], "block id -1"),
        ([3, 4], [0, 4], "4"),
    ],
)
def test_a_bad_job_fails_as_a_failed_copy_fails_it(
    block_ids: list[int],
    cpu_ids: list[int],
    message: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    layout = one_group()
    kv_caches = layout.kv_caches()
    gpu = layout.gpu_tensors[0]
    gpu.copy_(torch.arange(gpu.numel()).remainder(127).to(torch.int8).view(gpu.shape))
    stored = gpu[[3, 5]].clone()
    engine = CopyEngine(memmove=True)
    with stubbed_vllm(engine):
        plugin.patch()
        offloading = cpu_worker(layout, kv_caches)
        worker_ = connector_worker(offloading)
        worker_._init_worker(kv_caches)
        with caplog.at_level(logging.ERROR, logger="ptrres.vllm"):
            # A store, deferred to the next step as vLLM does, then run.
            worker_.prepare_store_kv(
                metadata(store={1: job("a", block_ids, cpu_ids, store=True)})
            )
            worker_.start_kv_transfers(metadata())
            # An async load.
            worker_.start_kv_transfers(
                metadata(load={2: job("b", block_ids, cpu_ids, store=False)})
            )
        assert not engine.calls  # nothing copied
        assert any(message in r.getMessage() for r in caplog.records)
        assert worker_.get_finished(set()) == (set(), {"b"})
        assert worker_.take_failed_recving() == {"b"}
        meta = worker_.build_connector_worker_meta()
        assert set(meta.failed_jobs) == {1, 2}
        # A sync load fails the way 0.34 fails it: its step cannot go on.
        worker_.start_kv_transfers(
            metadata(load={3: job("c", block_ids, cpu_ids, store=False, sync=True)})
        )
        with pytest.raises(RuntimeError, match="sync load job 3 failed"):
            worker_.get_finished(set())
        # The engine goes on: good jobs are copied.
        worker_.prepare_store_kv(
            metadata(store={4: job("d", [3, 5], [0, 1], store=True)})
        )
        worker_.start_kv_transfers(
            metadata(load={5: job("e", [6, 7], [0, 1], store=False)})
        )
        assert worker_.get_finished(set()) == (set(), {"e"})
        assert not worker_.take_failed_recving()
    assert len(engine.calls) == 2
    store_call, load_call = engine.calls
    cpu = offloading._store_handler.cpu_tensors[0]
    assert store_call.dst.tolist() == [cpu.data_ptr(), cpu.data_ptr() + 64]
    assert load_call.src.tolist() == store_call.dst.tolist()
    assert load_call.dst.tolist() == [gpu.data_ptr() + 64 * b for b in (6, 7)]
    assert torch.equal(gpu[[6, 7]], stored)
    assert bytes((ctypes.c_char * 64).from_address(cpu.data_ptr())) == bytes(
        stored[0].numpy().tobytes()
    )


def test_a_name_imported_from_patched_pointer_utils_is_given_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A module that imports pointer_utils' functions by name after they were
    patched takes ptrres's; where its own path is left alone (here the file
    worker, whose _submit_io changed), unpatch() still gives it vLLM's."""
    fs_worker = importlib.import_module("vllm.v1.kv_offload.fs.worker")

    def submit_io(self: Any, device_ptrs: Any, keys: Any, is_store: bool) -> Any:
        raise AssertionError("never called")

    monkeypatch.setattr(fs_worker.FSOffloadingWorker, "_submit_io", submit_io)
    with pytest.warns(plugin.VllmPatchWarning, match="file worker"):
        plugin.patch()
    assert not _state.patched(_state.FILE_WORKER)
    assert _state.patched(_state.POINTER_UTILS)
    # What `from pointer_utils import iter_pointer_groups` would take now.
    monkeypatch.setattr(
        fs_worker, "iter_pointer_groups", pointer_utils.iter_pointer_groups
    )
    assert fs_worker.iter_pointer_groups is _pointers.iter_pointer_groups
    plugin.unpatch()
    assert fs_worker.iter_pointer_groups is VLLM_GROUPS
    assert pointer_utils.iter_pointer_groups is VLLM_GROUPS
