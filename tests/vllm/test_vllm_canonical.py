"""ptrres.vllm on canonical layouts, against the installed vLLM's own handler (SPEC 10).

With ``canonical_layout=True`` vLLM fills descriptors with
``_fill_canonical_ops``: one per fragment of each kept block, stores keeping
only the blocks whose canonical page is this rank's. The patched handler gets
them from one ptrres plan: the same bytes, the same num_bytes (of the kept
blocks), submitted as the count after writer filtering from buffers sized by
vLLM's upper bound.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_vllm_handler import assert_same, transfer
from vllm_harness import (
    CopyEngine,
    Layout,
    draw_ids,
    fake_cuda,
    padded_rows,
    refused,
    specs,
    stubbed_vllm,
)

import ptrres
import ptrres.vllm as plugin

base = pytest.importorskip("vllm.v1.kv_offload.base")


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    plugin.unpatch()
    yield
    plugin.unpatch()


def canonical_handler(*tensors: Any) -> Any:
    """vLLM's own handler with a canonical CPU layout (stubs in place), from
    (GPU tensors, CPU tensors, refs per group, blocks_per_chunk, gpu_to_cpu)."""
    gpu_tensors, cpu_tensors, refs, blocks_per_chunk, gpu_to_cpu = tensors
    layout = Layout(list(gpu_tensors), list(cpu_tensors), refs, blocks_per_chunk)
    return layout.handler(gpu_to_cpu, canonical_layout=True)


# --- random canonical layouts --------------------------------------------------


@st.composite
def mappings(draw: st.DrawFn) -> Any:
    """A random mapping: 0-3 runs (some empty), strides at least the fragment,
    pages larger than the runs need, 1-4 writers."""
    runs = []
    local_end = canonical_end = 0
    for _ in range(draw(st.integers(0, 3))):
        size = draw(st.integers(1, 8))
        count = draw(st.integers(0, 4))
        run = base.CopyRun(
            local_offset=draw(st.integers(0, 16)),
            canonical_offset=draw(st.integers(0, 16)),
            fragment_size=size,
            num_fragments=count,
            local_stride=size + draw(st.integers(0, 8)),
            canonical_stride=size + draw(st.integers(0, 8)),
        )
        runs.append(run)
        if count:
            local_end = max(
                local_end,
                run.local_offset + (count - 1) * run.local_stride + size,
            )
            canonical_end = max(
                canonical_end,
                run.canonical_offset + (count - 1) * run.canonical_stride + size,
            )
    num_writers = draw(st.integers(1, 4))
    return base.CanonicalPageMapping(
        canonical_page_size_bytes=canonical_end + draw(st.integers(1, 8)),
        local_page_size_bytes=local_end + draw(st.integers(1, 8)),
        runs=tuple(runs),
        num_writers=num_writers,
        writer_index=draw(st.integers(0, num_writers - 1)),
        parallelism_agnostic=draw(st.booleans()),
    )


@st.composite
def canonical_transfers(draw: st.DrawFn) -> dict[str, Any]:
    """A canonical layout (groups, shared tensors, padding) and a transfer."""
    bpc = draw(st.integers(1, 8))
    num_tensors = draw(st.integers(1, 3))
    num_groups = draw(st.integers(1, 3))
    groups: list[list[tuple[int, Any]]] = [
        [
            (draw(st.integers(0, num_tensors - 1)), draw(mappings()))
            for _ in range(draw(st.integers(0, 3)))
        ]
        for _ in range(num_groups)
    ]
    # vLLM needs a ref on every tensor (it sizes CPU rows by their pages).
    used = {t for group in groups for t, _ in group}
    groups[-1] += [(t, draw(mappings())) for t in range(num_tensors) if t not in used]
    num_blocks = draw(st.integers(1, 12))
    num_cpu_chunks = draw(st.integers(1, 10))
    gpu, cpu = [], []
    for t in range(num_tensors):
        on_t = [m for group in groups for u, m in group if u == t]
        row = max(m.local_page_size_bytes for m in on_t) + draw(st.integers(0, 8))
        gpu.append(fake_cuda(padded_rows(num_blocks, row, draw(st.integers(0, 8)))))
        canonical = max(m.canonical_page_size_bytes for m in on_t)
        cpu.append(
            padded_rows(num_cpu_chunks, canonical * bpc, draw(st.integers(0, 16)))
        )
    refs = [
        [base.CanonicalKVCacheRef(t, m.local_page_size_bytes, m) for t, m in group]
        for group in groups
    ]
    ids = draw_ids(draw, num_groups, num_blocks, num_cpu_chunks, bpc)
    return {
        "tensors": (gpu, cpu, refs, bpc),
        "ids": ids,
        "dtype": draw(st.sampled_from([np.int32, np.int64])),
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=canonical_transfers(), gpu_to_cpu=st.booleans())
def test_descriptors_equal_vllms_on_random_canonical_layouts(
    case: dict[str, Any], gpu_to_cpu: bool
) -> None:
    engine = CopyEngine()
    fills: list[int] = []
    with stubbed_vllm(engine) as mp:
        try:
            handler = canonical_handler(*case["tensors"], gpu_to_cpu)
            src, dst = specs(*case["ids"], gpu_to_cpu=gpu_to_cpu, dtype=case["dtype"])
            expected = transfer(handler, engine, 1, src, dst)
            mp.setattr(handler, "_fill_group_ops", lambda *a, **k: fills.append(1))
            assert plugin.patch()
            assert_same(expected, transfer(handler, engine, 2, src, dst))
            assert_same(expected, transfer(handler, engine, 3, src, dst))
            assert handler._ptrres_plan.offloaded.canonical
            assert not fills  # ptrres built them, not vLLM
        finally:
            plugin.unpatch()


# --- vLLM's packed NHD mapping: a byte round trip, and bad ids -------------------

BLOCK_SIZE, ROW, TP = 4, 8, 2  # tokens per block, bytes per token per rank


def nhd_mapping(rank: int, tp: int = TP, num_writers: int = 1) -> Any:
    """Rank r of tp holds bytes [r*ROW, (r+1)*ROW) of each token's TP=1 row."""
    run = base.CopyRun(0, rank * ROW, ROW, BLOCK_SIZE, ROW, tp * ROW)
    return base.CanonicalPageMapping(
        tp * ROW * BLOCK_SIZE,
        ROW * BLOCK_SIZE,
        (run,),
        num_writers,
        rank % num_writers,
        True,
    )


def rank_handlers(
    rank: int, cpu: Any, num_blocks: int = 8, bpc: int = 2
) -> tuple[Any, Any, Any]:
    """(GPU tensor, store handler, load handler) of one TP rank: two groups."""
    gpu = torch.zeros((num_blocks, ROW * BLOCK_SIZE), dtype=torch.int8)
    mapping = nhd_mapping(rank)
    refs = [
        [base.CanonicalKVCacheRef(0, ROW * BLOCK_SIZE, mapping)],
        [base.CanonicalKVCacheRef(0, ROW * BLOCK_SIZE, mapping)],
    ]
    handlers = [
        canonical_handler([fake_cuda(gpu)], [cpu], refs, bpc, store)
        for store in (True, False)
    ]
    return gpu, handlers[0], handlers[1]


IDS = ([3, 4, 5, 1, 2], [3, 2], [1, 4])  # block ids, group sizes, block indices
CPU_IDS = [5, 2, 7]  # group 0: skip 1, 2 chunks; group 1: skip 0, 1 chunk


def test_two_ranks_store_one_canonical_page_and_load_it_back() -> None:
    """TP=2 ranks store their shards into one canonical CPU tensor: it then
    holds the TP=1 pages; each rank loads back exactly its own shard."""
    engine = CopyEngine(memmove=True)
    cpu = torch.zeros((8, TP * ROW * BLOCK_SIZE * 2), dtype=torch.int8)
    full = torch.randint(-128, 128, (8, BLOCK_SIZE, TP * ROW), dtype=torch.int8)
    block_ids, group_sizes, block_indices = IDS
    with stubbed_vllm(engine):
        plugin.patch()
        ranks = [rank_handlers(r, cpu) for r in range(TP)]
        for r, (gpu, store, _) in enumerate(ranks):
            shard = full[:, :, r * ROW : (r + 1) * ROW]
            gpu.copy_(shard.reshape(8, ROW * BLOCK_SIZE))
            transfer(store, engine, r, *specs(*IDS, CPU_IDS, gpu_to_cpu=True))
        # The canonical page of group g's block k: sub-block (skip + k) % 2 of
        # its chunk.
        page = TP * ROW * BLOCK_SIZE
        first = chunk = 0
        for n, index in zip(group_sizes, block_indices):
            for k in range(n):
                position = index % 2 + k
                row = CPU_IDS[chunk + position // 2]
                sub = position % 2
                got = cpu[row, sub * page : (sub + 1) * page]
                assert torch.equal(got, full[block_ids[first + k]].reshape(-1))
            chunk += (index % 2 + n + 1) // 2
            first += n
        targets = [b + 1 for b in block_ids]
        for r, (gpu, _, load) in enumerate(ranks):
            gpu.zero_()
            transfer(
                load, engine, 10 + r,
                *specs(targets, group_sizes, block_indices, CPU_IDS, gpu_to_cpu=False),
            )  # fmt: skip
            for source, target in zip(block_ids, targets):
                shard = full[source, :, r * ROW : (r + 1) * ROW].reshape(-1)
                assert torch.equal(gpu[target], shard)
    assert all(call.src.dtype == np.int64 for call in engine.calls)


def test_writer_rotation_stores_each_canonical_page_once() -> None:
    """Two ranks holding the same bytes (num_writers=2): each page is written
    by exactly one of them, and the submitted count is the kept blocks'."""
    engine = CopyEngine()
    cpu = torch.zeros((8, ROW * BLOCK_SIZE * 2), dtype=torch.int8)
    written: list[set[int]] = []
    with stubbed_vllm(engine):
        plugin.patch()
        for rank in range(2):
            run = base.CopyRun(0, 0, ROW, BLOCK_SIZE, ROW, ROW)
            page = ROW * BLOCK_SIZE
            mapping = base.CanonicalPageMapping(page, page, (run,), 2, rank, True)
            gpu = fake_cuda(torch.zeros((8, ROW * BLOCK_SIZE), dtype=torch.int8))
            refs = [[base.CanonicalKVCacheRef(0, page, mapping)] for _ in range(2)]
            store = canonical_handler([gpu], [cpu], refs, 2, True)
            (src, dst, sizes), num_bytes = transfer(
                store, engine, rank, *specs(*IDS, CPU_IDS, gpu_to_cpu=True)
            )
            assert num_bytes == len(src) * ROW == sizes.sum()
            written.append(set(dst.tolist()))
    assert not written[0] & written[1]
    # 5 blocks, BLOCK_SIZE fragments each, split between the two writers.
    assert len(written[0]) + len(written[1]) == 5 * BLOCK_SIZE


BAD_TRANSFERS = [
    ([3, 4, 5, 8, 2], CPU_IDS, ptrres.BlockIdError),
    ([3, 4, -1, 1, 2], CPU_IDS, ptrres.BlockIdError),
    (IDS[0], [5, 8, 7], ptrres.OffloadedIdError),
    (IDS[0], [5, 2], ptrres.OffloadedIdError),
    (IDS[0], [5, 2, 7, 1], ptrres.OffloadedIdError),
]


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
@pytest.mark.parametrize(("block_ids", "cpu_ids", "error"), BAD_TRANSFERS)
def test_canonical_bad_ids_are_refused_before_anything_is_submitted(
    gpu_to_cpu: bool,
    block_ids: list[int],
    cpu_ids: list[int],
    error: type,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = CopyEngine()
    cpu = torch.zeros((8, TP * ROW * BLOCK_SIZE * 2), dtype=torch.int8)
    with stubbed_vllm(engine):
        _, store, load = rank_handlers(1, cpu)
        handler = store if gpu_to_cpu else load
        good = specs(*IDS, CPU_IDS, gpu_to_cpu=gpu_to_cpu)
        expected = transfer(handler, engine, 1, *good)
        plugin.patch()
        bad = specs(block_ids, *IDS[1:], cpu_ids, gpu_to_cpu=gpu_to_cpu)
        raised = refused(handler, engine, 2, *bad, error, caplog)
        assert isinstance(raised, ValueError)
        assert len(engine.calls) == 1  # nothing submitted
        assert not handler._transfers
        assert len(handler._buffer_pool) == 1
        assert_same(expected, transfer(handler, engine, 3, *good))


def test_a_method_captured_while_patched_runs_vllms_own_after_unpatch() -> None:
    """A bound transfer_async kept across unpatch() gives vLLM's own fill."""
    engine = CopyEngine()
    cpu = torch.zeros((8, TP * ROW * BLOCK_SIZE * 2), dtype=torch.int8)
    fills: list[int] = []
    with stubbed_vllm(engine) as mp:
        _, store, _ = rank_handlers(0, cpu)
        good = specs(*IDS, CPU_IDS, gpu_to_cpu=True)
        expected = transfer(store, engine, 1, *good)
        plugin.patch()
        captured = store.transfer_async
        plugin.unpatch()
        original_fill = store._fill_group_ops

        def counted_fill(*args: Any, **kwargs: Any) -> Any:
            fills.append(1)
            return original_fill(*args, **kwargs)

        mp.setattr(store, "_fill_group_ops", counted_fill)
        assert captured(2, *good) is True
        store.get_finished()
    assert fills == [1, 1]  # vLLM filled both groups
    assert_same(expected, ((engine.calls[-1].src, engine.calls[-1].dst,
                            engine.calls[-1].sizes), expected[1]))  # fmt: skip
