"""The benchmark support (ptrres.bench): layouts, specs, timing, baselines."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import assert_same_pointers

import ptrres
from ptrres import bench, reference


@pytest.mark.parametrize("name", list(bench.PRESETS))
def test_presets_build_layouts_ptrres_accepts(name: str) -> None:
    preset = bench.PRESETS[name]
    kv = preset.kv_caches(num_blocks=64)
    assert [len(refs) for refs in kv.group_data_refs] == [
        preset.refs_per_group
    ] * preset.num_groups
    assert preset.num_refs == preset.num_groups * preset.refs_per_group
    table = ptrres.PointerTable(kv)
    spec = bench.make_spec(preset, 5, num_blocks=64, run_length=3, id_dtype=np.int32)
    assert spec.block_ids.dtype == np.int32
    assert spec.group_sizes == (5,) * preset.num_groups
    assert_same_pointers(
        table.resolve(spec), reference.resolve_device_pointers(spec, kv)
    )
    # Virtual tensors never overlap, and their rows are as wide as the pages.
    bases = sorted(entry.tensor.data_ptr() for entry in kv.tensors)
    assert all(b - a >= bench.VIRTUAL_ALIGN for a, b in itertools.pairwise(bases))
    for group, page in zip(kv.group_data_refs, preset.group_page_sizes):
        assert {ref.page_size_bytes for ref in group} == {page}


def test_offloaded_tensors_and_ids_make_a_valid_plan() -> None:
    preset = bench.PRESETS["hybrid-4x12"]
    kv = preset.kv_caches(num_blocks=128)
    tensors = preset.offloaded_tensors(4, num_chunks=64)
    assert len(tensors) == len(kv.tensors)
    assert tensors[0].shape == (64, 4 * kv.tensors[0].tensor.shape[1])
    assert "VirtualTensor(0x" in repr(tensors[0])
    spec = bench.make_spec(preset, 9, num_blocks=128, block_index=6)
    ids = bench.make_offloaded_ids(spec, 4, num_chunks=64)
    assert len(ids) == preset.num_groups * 3  # skip 2: 11 blocks, 3 chunks
    plan = ptrres.PointerTable(kv).plan_transfer(
        spec, ptrres.OffloadedLayout(tensors, 4), ids, store=False
    )
    expected = reference.plan_transfer(spec, kv, tensors, 4, ids, store=False)
    assert plan.src.tolist() == expected.src.tolist()
    assert plan.dst.tolist() == expected.dst.tolist()


@pytest.mark.parametrize("store", [True, False])
def test_vllm_style_baselines_match_the_reference(store: bool) -> None:
    """The numpy baselines the benchmarks time compute what ptrres does."""
    preset = bench.PRESETS["llama-3.1-8b"]
    kv = preset.kv_caches(num_blocks=256)
    spec = bench.make_spec(preset, 20, num_blocks=256, block_index=3)
    ptrs, sizes = bench.vllm_style_resolve(spec, kv)
    expected = reference.resolve_device_pointers(spec, kv)
    assert ptrs.tolist() == expected.ptrs.tolist()
    assert sizes.tolist() == expected.sizes.tolist()
    tensors = preset.offloaded_tensors(4, num_chunks=32)
    ids = bench.make_offloaded_ids(spec, 4, num_chunks=32)
    src, dst, plan_sizes = bench.vllm_style_plan(spec, kv, tensors, 4, ids, store)
    plan = reference.plan_transfer(spec, kv, tensors, 4, ids, store=store)
    assert src.tolist() == plan.src.tolist()
    assert dst.tolist() == plan.dst.tolist()
    assert plan_sizes.tolist() == plan.sizes.tolist()


def test_vllm_style_resolve_skips_empty_groups() -> None:
    preset = bench.PRESETS["hybrid-4x12"]
    kv = preset.kv_caches(num_blocks=16)
    spec = ptrres.GPULoadStoreSpec(np.array([1, 2, 3]), [0, 3, 0, 0], [0, 0, 0, 0])
    ptrs, _ = bench.vllm_style_resolve(spec, kv)
    assert ptrs.tolist() == reference.resolve_device_pointers(spec, kv).ptrs.tolist()
    src, _, _ = bench.vllm_style_plan(
        spec, kv, preset.offloaded_tensors(1, num_chunks=8), 1, np.arange(3), True
    )
    assert src.tolist() == ptrs.tolist()


def test_compare_times_every_contender_in_interleaved_rounds() -> None:
    calls = {"a": 0, "b": 0}

    def count(name: str) -> None:
        calls[name] += 1

    timings = bench.compare(
        {"a": lambda: count("a"), "b": lambda: count("b")}, seconds=0.02, rounds=3
    )
    assert set(timings) == {"a", "b"}
    for timing in timings.values():
        assert len(timing.rounds) == 3
        assert timing.seconds == sorted(timing.rounds)[1]  # the median
        assert timing.seconds > 0
    assert calls["a"] > 3
    assert calls["b"] > 3


def test_geometric_mean() -> None:
    assert bench.geometric_mean([1.0, 4.0, 16.0]) == pytest.approx(4.0)
