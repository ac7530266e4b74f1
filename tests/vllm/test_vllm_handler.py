"""ptrres.vllm against the installed vLLM's own offloading handler, on CPU tensors.

Skipped when vLLM is not importable (vllm_harness importorskips it).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_harness import (
    DEVICE_POINTERS,
    CopyEngine,
    draw_ids,
    make_layout,
    refused,
    specs,
    stubbed_vllm,
    worker,
)

import ptrres
import ptrres.vllm as plugin


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    """Every test starts and ends with vLLM as it ships."""
    plugin.unpatch()
    yield
    plugin.unpatch()


def transfer(handler: Any, engine: CopyEngine, job_id: int, src: Any, dst: Any) -> Any:
    """Run one transfer; return what was submitted and the transfer's bytes."""
    before = len(engine.calls)
    assert handler.transfer_async(job_id, src, dst) is True
    num_bytes = handler._transfers[-1].num_bytes
    assert handler.get_finished()[-1].transfer_size == num_bytes
    calls = engine.calls[before:]
    assert len(calls) <= 1
    if not calls:
        empty = np.empty(0, np.int64)
        return (empty, empty, empty), num_bytes
    return (calls[0].src, calls[0].dst, calls[0].sizes), num_bytes


def assert_same(vllm_result: Any, ptrres_result: Any) -> None:
    (v_src, v_dst, v_sizes), v_bytes = vllm_result
    (p_src, p_dst, p_sizes), p_bytes = ptrres_result
    assert p_src.dtype == v_src.dtype
    assert p_src.dtype in (np.int64, np.uint64)
    assert p_src.tobytes() == v_src.tobytes()
    assert p_dst.tobytes() == v_dst.tobytes()
    assert p_sizes.tobytes() == v_sizes.tobytes()
    assert p_bytes == v_bytes


# --- random direct layouts ---------------------------------------------------


@st.composite
def direct_transfers(draw: st.DrawFn) -> dict[str, Any]:
    """A direct layout and a transfer on it: groups, shared tensors, padding."""
    bpc = draw(st.integers(1, 8))
    num_tensors = draw(st.integers(1, 4))
    gpu_rows = [
        (draw(st.integers(1, 12)), draw(st.integers(1, 48)), draw(st.integers(0, 8)))
        for _ in range(num_tensors)
    ]
    num_groups = draw(st.integers(1, 3))
    refs = []
    for _ in range(num_groups):
        group = []
        for _ in range(draw(st.integers(0, 3))):
            t = draw(st.integers(0, num_tensors - 1))
            group.append((t, draw(st.integers(1, gpu_rows[t][1]))))
        refs.append(group)
    num_cpu_chunks = draw(st.integers(1, 10))
    num_blocks = min(n for n, _, _ in gpu_rows)
    ids = draw_ids(draw, num_groups, num_blocks, num_cpu_chunks, bpc)
    return {
        "layout": make_layout(
            gpu_rows, refs, bpc, num_cpu_chunks, cpu_pad=draw(st.integers(0, 16))
        ),
        "ids": ids,
        "dtype": draw(st.sampled_from([np.int32, np.int64])),
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=direct_transfers(), gpu_to_cpu=st.booleans())
def test_descriptors_equal_vllms_on_random_direct_layouts(
    case: dict[str, Any], gpu_to_cpu: bool
) -> None:
    engine = CopyEngine()
    with stubbed_vllm(engine):
        try:
            handler = case["layout"].handler(gpu_to_cpu)
            src, dst = specs(*case["ids"], gpu_to_cpu=gpu_to_cpu, dtype=case["dtype"])
            expected = transfer(handler, engine, 1, src, dst)
            assert plugin.patch()
            assert_same(expected, transfer(handler, engine, 2, src, dst))
            # The second patched call reuses the handler's plan and buffers.
            assert_same(expected, transfer(handler, engine, 3, src, dst))
        finally:
            plugin.unpatch()


def two_group_layout() -> Any:
    """Two groups sharing tensor 0, one padded ref, bpc 4."""
    return make_layout(
        [(16, 32, 8), (16, 64, 0)],
        [[(0, 24), (1, 64)], [(0, 32)]],
        blocks_per_chunk=4,
        num_cpu_chunks=8,
    )


IDS = ([3, 4, 5, 9, 1, 2], [4, 2], [6, 1])  # block ids, group sizes, block indices
CPU_IDS = [5, 2, 7]  # group 0 spans 2 chunks (skip 2), group 1 one (skip 1)


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_the_handler_plan_is_built_once(gpu_to_cpu: bool) -> None:
    engine = CopyEngine()
    with stubbed_vllm(engine):
        handler = two_group_layout().handler(gpu_to_cpu)
        plugin.patch()
        src, dst = specs(*IDS, CPU_IDS, gpu_to_cpu=gpu_to_cpu)
        transfer(handler, engine, 1, src, dst)
        plan = handler._ptrres_plan
        assert isinstance(plan.table, ptrres.PointerTable)
        assert isinstance(plan.offloaded, ptrres.OffloadedLayout)
        transfer(handler, engine, 2, src, dst)
        assert handler._ptrres_plan is plan


def test_descriptors_go_into_vllms_pooled_buffers() -> None:
    """One buffer set serves every transfer, as in vLLM: ptrres writes into it."""
    engine = CopyEngine()
    with stubbed_vllm(engine):
        handler = two_group_layout().handler(True)
        plugin.patch()
        src, dst = specs(*IDS, CPU_IDS, gpu_to_cpu=True)
        handler.transfer_async(1, src, dst)
        pooled = handler._transfers[-1].batch_src
        handler.get_finished()
        handler.transfer_async(2, src, dst)
        assert handler._transfers[-1].batch_src is pooled
        assert pooled[:3].numpy().tolist() == engine.calls[-1].src[:3].tolist()


def test_transfers_in_flight_each_keep_their_buffers() -> None:
    engine = CopyEngine()
    with stubbed_vllm(engine):
        handler = two_group_layout().handler(False)
        a = specs(*IDS, CPU_IDS, gpu_to_cpu=False)
        b = specs([1, 2, 3, 4, 5, 6], *IDS[1:], [0, 1, 3], gpu_to_cpu=False)
        order = [a, b, a, b]
        expected = [transfer(handler, engine, i, *s) for i, s in enumerate(order)]
        plugin.patch()
        for job, s in enumerate(order):  # all four in flight at once
            handler.transfer_async(10 + job, *s)
        assert len({id(t.batch_src) for t in handler._transfers}) == 4
        got = engine.calls[-4:]
        bytes_moved = [t.num_bytes for t in handler._transfers]
        handler.get_finished()
        for job, s in enumerate(order):  # and one at a time again
            assert_same(expected[job], transfer(handler, engine, 20 + job, *s))
    for (want, want_bytes), call, num_bytes in zip(expected, got, bytes_moved):
        assert_same((want, want_bytes), ((call.src, call.dst, call.sizes), num_bytes))


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_xpu_uint64_buffers_get_the_same_descriptors(gpu_to_cpu: bool) -> None:
    engine = CopyEngine()
    with stubbed_vllm(engine, xpu=True):
        handler = two_group_layout().handler(gpu_to_cpu)
        src, dst = specs(*IDS, CPU_IDS, gpu_to_cpu=gpu_to_cpu)
        expected = transfer(handler, engine, 1, src, dst)
        assert expected[0][0].dtype == np.uint64  # vLLM's XPU buffers
        plugin.patch()
        assert_same(expected, transfer(handler, engine, 2, src, dst))


# --- bad ids -----------------------------------------------------------------


BAD_TRANSFERS = [
    # (block ids, cpu ids, error): a GPU id past the tensors, a negative one,
    # a CPU id past the chunks, too few and too many CPU ids.
    ([3, 4, 5, 16, 1, 2], CPU_IDS, ptrres.BlockIdError),
    ([3, 4, 5, 9, -1, 2], CPU_IDS, ptrres.BlockIdError),
    (IDS[0], [5, 8, 7], ptrres.OffloadedIdError),
    (IDS[0], [5, 2], ptrres.OffloadedIdError),
    (IDS[0], [5, 2, 7, 1], ptrres.OffloadedIdError),
]


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
@pytest.mark.parametrize(("block_ids", "cpu_ids", "error"), BAD_TRANSFERS)
def test_bad_ids_are_refused_before_anything_is_submitted(
    gpu_to_cpu: bool,
    block_ids: list[int],
    cpu_ids: list[int],
    error: type,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = CopyEngine()
    with stubbed_vllm(engine):
        handler = two_group_layout().handler(gpu_to_cpu)
        good_src, good_dst = specs(*IDS, CPU_IDS, gpu_to_cpu=gpu_to_cpu)
        expected = transfer(handler, engine, 1, good_src, good_dst)
        plugin.patch()
        pool = list(handler._buffer_pool)
        bad_src, bad_dst = specs(block_ids, *IDS[1:], cpu_ids, gpu_to_cpu=gpu_to_cpu)
        raised = refused(handler, engine, 2, bad_src, bad_dst, error, caplog)
        assert isinstance(raised, ValueError)
        assert engine.calls == [engine.calls[0]]  # nothing submitted
        assert not handler._transfers
        assert [b[0] for b in handler._buffer_pool] == [b[0] for b in pool]
        # The handler and its pooled buffers keep working.
        assert_same(expected, transfer(handler, engine, 3, good_src, good_dst))


def test_a_failed_first_transfer_returns_its_new_buffers_to_the_pool(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = CopyEngine()
    with stubbed_vllm(engine):
        handler = two_group_layout().handler(True)
        plugin.patch()
        src, dst = specs(*IDS, [5, 2, 99], gpu_to_cpu=True)
        error = refused(handler, engine, 1, src, dst, ptrres.OffloadedIdError, caplog)
        assert "99" in str(error)
        assert len(handler._buffer_pool) == 1
        assert not engine.calls


def test_malformed_group_sizes_get_ptrres_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = CopyEngine()
    with stubbed_vllm(engine):
        handler = two_group_layout().handler(True)
        plugin.patch()
        src, dst = specs(*IDS, CPU_IDS, gpu_to_cpu=True)
        src.group_sizes = [7, -1]
        refused(handler, engine, 1, src, dst, ptrres.SpecError, caplog)
        src.group_sizes = ["4", 2]
        refused(handler, engine, 2, src, dst, ptrres.PtrresError, caplog)
        assert not engine.calls
        assert DEVICE_POINTERS or len(handler._buffer_pool) == 1


# --- a byte round trip -------------------------------------------------------


def test_patched_store_then_load_moves_the_bytes() -> None:
    engine = CopyEngine(memmove=True)
    layout = two_group_layout()
    gpu = [t.as_subclass(torch.Tensor) for t in layout.gpu_tensors]
    for t in gpu:
        t.copy_(torch.randint(-128, 128, t.shape, dtype=torch.int8))
    before = [t.clone() for t in gpu]
    with stubbed_vllm(engine):
        store, load = layout.handler(True), layout.handler(False)
        plugin.patch()
        block_ids, group_sizes, block_indices = IDS
        transfer(store, engine, 1, *specs(*IDS, CPU_IDS, gpu_to_cpu=True))
        for t in gpu:
            t.zero_()
        targets = [b + 1 for b in block_ids]  # load into other blocks
        transfer(
            load,
            engine,
            2,
            *specs(targets, group_sizes, block_indices, CPU_IDS, gpu_to_cpu=False),
        )
    first = 0
    for n, refs in zip(group_sizes, layout.refs):
        for source, target in zip(
            block_ids[first : first + n], targets[first : first + n]
        ):
            for ref in refs:
                page = ref.page_size_bytes
                got = gpu[ref.tensor_idx][target, :page]
                assert torch.equal(got, before[ref.tensor_idx][source, :page])
        first += n
    # Bytes past a page (its row's padding) are never written.
    assert not gpu[0][[b + 1 for b in block_ids[:4]], 24:].any()


# --- coalescing --------------------------------------------------------------


def contiguous_layout() -> Any:
    """Pages that fill their rows, so consecutive blocks continue each other."""
    return make_layout([(32, 64, 0)], [[(0, 64)]], 4, 8)


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_coalescing_merges_on_the_cumemcpybatchasync_path(
    gpu_to_cpu: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PTRRES_VLLM_COALESCE", "1")
    engine = CopyEngine(memmove=True)
    layout = contiguous_layout()
    with stubbed_vllm(engine):
        handler = layout.handler(gpu_to_cpu)
        src, dst = specs(range(4, 12), [8], [0], [2, 3], gpu_to_cpu=gpu_to_cpu)
        (v_src, v_dst, _v_sizes), v_bytes = transfer(handler, engine, 1, src, dst)
        plugin.patch()
        (p_src, p_dst, p_sizes), p_bytes = transfer(handler, engine, 2, src, dst)
    assert p_bytes == v_bytes == 8 * 64
    assert len(v_src) == 8
    # Blocks 4..11 and chunks 2, 3 are one run on both sides.
    assert (p_src.tolist(), p_dst.tolist(), p_sizes.tolist()) == (
        [v_src[0]],
        [v_dst[0]],
        [8 * 64],
    )


def test_coalescing_never_touches_the_triton_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's Triton kernel (a functools.partial) gets vLLM's descriptors."""
    import functools

    monkeypatch.setenv("PTRRES_VLLM_COALESCE", "1")
    engine = CopyEngine()

    def triton_like(*args: Any, bytes_per_chunk: int, **kwargs: Any) -> None:
        engine(*args, **kwargs)

    with stubbed_vllm(engine):
        handler = contiguous_layout().handler(False)
        handler._swap_blocks_batch = functools.partial(triton_like, bytes_per_chunk=64)
        src, dst = specs(range(4, 12), [8], [0], [2, 3], gpu_to_cpu=False)
        expected = transfer(handler, engine, 1, src, dst)
        plugin.patch()
        assert_same(expected, transfer(handler, engine, 2, src, dst))
        assert handler._ptrres_plan.coalesce is False


def test_coalescing_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PTRRES_VLLM_COALESCE", raising=False)
    engine = CopyEngine()
    with stubbed_vllm(engine):
        handler = contiguous_layout().handler(True)
        src, dst = specs(range(4, 12), [8], [0], [2, 3], gpu_to_cpu=True)
        expected = transfer(handler, engine, 1, src, dst)
        plugin.patch()
        assert_same(expected, transfer(handler, engine, 2, src, dst))


@pytest.mark.parametrize("pinned", [True, False])
def test_loads_follow_the_releases_choice_of_copy_function(
    pinned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM sends loads of small pages to its Triton kernel; from 0.31 on,
    host_memory_is_pinned=False sends them to ops.swap_blocks_batch instead,
    where the plugin coalesces (0.30's constructor has no such parameter)."""
    monkeypatch.setenv("PTRRES_VLLM_COALESCE", "1")
    monkeypatch.setattr(worker, "HAS_TRITON", True)
    monkeypatch.setattr(
        worker,
        "triton",
        SimpleNamespace(next_power_of_2=lambda n: 1 << (n - 1).bit_length()),
    )
    triton = CopyEngine()

    def triton_kernel(*args: Any, bytes_per_chunk: int, **kwargs: Any) -> None:
        assert bytes_per_chunk == 64
        triton(*args, **kwargs)

    monkeypatch.setattr(worker, "swap_blocks_batch", triton_kernel)
    Handler = worker.SingleDirectionOffloadingHandler
    takes_pinned = "host_memory_is_pinned" in inspect.signature(Handler).parameters
    import vllm

    assert takes_pinned == (not vllm.__version__.startswith("0.30."))
    layout = contiguous_layout()
    engine = CopyEngine()
    with stubbed_vllm(engine):
        plugin.patch()

        def load_handler() -> Any:
            return layout.handler(
                False, **({} if pinned else {"host_memory_is_pinned": False})
            )

        if not pinned and not takes_pinned:
            with pytest.raises(TypeError, match="host_memory_is_pinned"):
                load_handler()
            return
        handler = load_handler()
        src, dst = specs(range(4, 12), [8], [0], [2, 3], gpu_to_cpu=False)
        assert handler.transfer_async(1, src, dst)
        assert handler._ptrres_plan.coalesce is not pinned
    (call,) = (triton if pinned else engine).calls
    assert not (engine if pinned else triton).calls
    # Triton gets vLLM's 8 descriptors; swap_blocks_batch one merged run.
    assert call.sizes.tolist() == ([64] * 8 if pinned else [8 * 64])
