"""The recorded vLLM 0.33 block-id traces (ptrres.bench.traces) and what they cost.

The traces were made by benchmarks/vllm_traces.py from vLLM's own scheduler,
block pool and CPU offloading connector; these tests read them with numpy
alone and check them against what vLLM's connector guarantees, then check
the run and descriptor counting against brute force and the reference.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import assume, example, given

from ptrres import GPULoadStoreSpec, reference
from ptrres._cli import main
from ptrres.bench import (
    CANONICAL_PRESETS,
    PRESETS,
    TRACES,
    count_coalesced,
    descriptor_counts,
    load_trace,
    run_lengths,
    trace_run_lengths,
)
from ptrres.bench.traces import TRACE_DIR, spread, trace_layout, transfer_spec

# Transfers checked per trace where planning each costs (spread over it).
SAMPLE = 40


def test_the_traces_ship() -> None:
    assert {"vllm033-lru", "vllm033-arc"} <= set(TRACES)
    for name in TRACES:
        assert (TRACE_DIR / f"{name}.npz").stat().st_size < 2_000_000


def test_the_traces_load_without_vllm_or_torch() -> None:
    code = (
        "import sys\n"
        "sys.modules['vllm'] = None; sys.modules['torch'] = None\n"
        "from ptrres.bench import TRACES, load_trace\n"
        "print(sum(len(load_trace(name)) for name in TRACES))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert int(result.stdout) > 0


@pytest.mark.parametrize("name", TRACES)
def test_metadata_says_how_the_trace_was_made(name: str) -> None:
    trace = load_trace(name)
    meta = trace.metadata
    assert meta["name"] == trace.name == name
    assert meta["vllm_version"] == "0.33.0"
    assert meta["policy"] in ("lru", "arc")
    assert meta["kv_cache_groups"] == 1
    assert trace.blocks_per_chunk == meta["blocks_per_chunk"]
    assert trace.blocks_per_chunk == (4 if name.endswith("-bpc4") else 1)
    assert (
        trace.num_cpu_blocks * trace.blocks_per_chunk
        == (meta["workload"]["cpu_capacity_gpu_blocks"])
    )
    assert trace.num_gpu_blocks == meta["workload"]["num_gpu_blocks"]
    assert meta["seed"] == meta["workload"]["seed"]
    counts = meta["counts"]
    assert counts["transfers"] == len(trace)
    assert counts["stores"] == int(trace.store.sum())
    assert counts["blocks_stored"] + counts["blocks_loaded"] == len(trace.gpu_ids)
    assert counts["chunks_stored"] + counts["chunks_loaded"] == len(trace.cpu_ids)


@pytest.mark.parametrize("name", TRACES)
def test_ids_are_in_range_and_offsets_consistent(name: str) -> None:
    trace = load_trace(name)
    n = len(trace)
    assert n > 100
    for side, ids in (("gpu", trace.gpu_ids), ("cpu", trace.cpu_ids)):
        offsets = getattr(trace, f"{side}_offsets")
        assert len(offsets) == n + 1
        assert offsets[0] == 0
        assert offsets[-1] == len(ids)
        assert (np.diff(offsets) > 0).all()  # no empty transfer
    # Block 0 is vLLM's null block: never transferred.
    assert trace.gpu_ids.min() >= 1
    assert trace.gpu_ids.max() < trace.num_gpu_blocks
    assert trace.cpu_ids.min() >= 0
    assert trace.cpu_ids.max() < trace.num_cpu_blocks
    assert (trace.block_indices >= 0).all()


@pytest.mark.parametrize("name", TRACES)
def test_stores_and_loads_both_happen(name: str) -> None:
    trace = load_trace(name)
    stores = int(trace.store.sum())
    assert 0 < stores < len(trace)
    # Loads bring back blocks the GPU pool evicted: many, not a stray few.
    assert len(trace) - stores > 50


@pytest.mark.parametrize("name", TRACES)
def test_each_transfer_has_the_chunks_its_blocks_need(name: str) -> None:
    trace = load_trace(name)
    bpc = trace.blocks_per_chunk
    for transfer in trace.transfers():
        n = len(transfer.gpu_ids)
        skip = transfer.block_index % bpc
        assert len(transfer.cpu_ids) == -(-(n + skip) // bpc)
        if transfer.store:
            # vLLM stores whole chunks only.
            assert skip == 0
            assert n % bpc == 0
        assert len(np.unique(transfer.gpu_ids)) == n
        assert len(np.unique(transfer.cpu_ids)) == len(transfer.cpu_ids)


def test_a_malformed_trace_is_refused(tmp_path: Path) -> None:
    trace = load_trace(TRACES[0])
    arrays: dict[str, Any] = {
        "store": trace.store,
        "gpu_offsets": trace.gpu_offsets,
        "gpu_ids": trace.gpu_ids,
        "cpu_offsets": trace.cpu_offsets,
        "cpu_ids": trace.cpu_ids,
        "block_indices": trace.block_indices,
        "metadata": np.array(json.dumps(trace.metadata)),
    }
    path = tmp_path / "copy.npz"
    np.savez(path, **arrays)
    assert len(load_trace(path)) == len(trace)  # any path loads
    bad = dict(arrays, gpu_offsets=trace.gpu_offsets[:-1])
    np.savez(path, **bad)
    with pytest.raises(ValueError, match="gpu_offsets"):
        load_trace(path)
    bad = dict(arrays, cpu_ids=trace.cpu_ids.astype(np.int32))
    np.savez(path, **bad)
    with pytest.raises(ValueError, match="cpu_ids"):
        load_trace(path)
    del arrays["store"]
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match="store"):
        load_trace(path)
    with pytest.raises(FileNotFoundError):
        load_trace("no-such-trace")


# --- runs, against brute force ------------------------------------------------


def brute_force_runs(
    gpu: list[int], cpu: list[int], bpc: int, block_index: int
) -> tuple[list[int], list[int], int]:
    """SPEC 6's greedy merge of (GPU, CPU sub-block) pairs, one pair at a time."""
    pairs = []
    for k, g in enumerate(gpu):
        j = block_index % bpc + k
        pairs.append((g, cpu[j // bpc] * bpc + j % bpc))
    runs: list[list[int]] = []  # [length, direction]
    last = None
    for g, c in pairs:
        if last is not None:
            step = (g - last[0], c - last[1])
            length, direction = runs[-1]
            if step == (1, 1) and direction in (0, 1):
                runs[-1] = [length + 1, 1]
                last = (g, c)
                continue
            if step == (-1, -1) and direction in (0, -1):
                runs[-1] = [length + 1, -1]
                last = (g, c)
                continue
        runs.append([1, 0])
        last = (g, c)
    ascending = [length for length, d in runs if d == 1]
    descending = [length for length, d in runs if d == -1]
    singles = sum(1 for length, d in runs if d == 0)
    return ascending, descending, singles


@st.composite
def paired_ids(draw: st.DrawFn) -> tuple[list[int], list[int], int, int]:
    """GPU ids and CPU chunk ids that step +1, -1 or jump, often together."""
    bpc = draw(st.integers(1, 4))
    block_index = draw(st.integers(0, 9))
    n = draw(st.integers(0, 40))
    steps = draw(
        st.lists(st.sampled_from([1, -1, 0, 1, -1, 2]), min_size=n, max_size=n)
    )
    gpu = [draw(st.integers(0, 50))]
    for step in steps[1:]:
        gpu.append(gpu[-1] + step if step != 2 else draw(st.integers(0, 50)))
    gpu = gpu[:n]
    n_chunks = -(-(n + block_index % bpc) // bpc)
    chunk_steps = draw(
        st.lists(st.sampled_from([1, -1, 0, 2]), min_size=n_chunks, max_size=n_chunks)
    )
    cpu = [draw(st.integers(0, 50))]
    for step in chunk_steps[1:]:
        cpu.append(cpu[-1] + step if step != 2 else draw(st.integers(0, 50)))
    return gpu, cpu[:n_chunks], bpc, block_index


@given(paired_ids())
@example(([40, 39, 38, 37], [12, 11, 10, 9], 1, 0))
@example(([5, 6, 5, 6, 7, 6, 5], [5, 6, 5, 6, 7, 6, 5], 1, 0))
@example(([1, 2, 3, 4, 5, 6, 7, 8], [3, 4], 4, 0))
@example(([2, 3, 4, 5], [3, 4], 4, 2))
def test_run_lengths_match_brute_force(
    case: tuple[list[int], list[int], int, int],
) -> None:
    gpu, cpu, bpc, block_index = case
    runs = run_lengths(
        np.array(gpu, np.int32), np.array(cpu, np.int64), bpc, block_index
    )
    ascending, descending, singles = brute_force_runs(gpu, cpu, bpc, block_index)
    assert runs.ascending.tolist() == ascending
    assert runs.descending.tolist() == descending
    assert runs.singles == singles
    assert runs.runs == len(ascending) + len(descending) + singles
    assert runs.ascending.sum() + runs.descending.sum() + singles == len(gpu)


# --- descriptor counts, against the reference and brute force ------------------


@st.composite
def descriptors(draw: st.DrawFn) -> tuple[list[int], list[int], list[int]]:
    """Descriptors that often continue the one before, up or down, on one or
    both sides."""
    n = draw(st.integers(0, 40))
    sizes = draw(st.lists(st.sampled_from([1, 2, 4]), min_size=n, max_size=n))
    src: list[int] = []
    dst: list[int] = []
    for i, size in enumerate(sizes):
        if not i:
            src.append(draw(st.integers(300, 400)))
            dst.append(draw(st.integers(300, 400)))
            continue
        src_how = draw(st.sampled_from(["up", "down", "jump"]))
        # Mostly the same way on both sides, as runs need.
        dst_how = draw(st.sampled_from([src_how, src_how, "up", "down", "jump"]))
        for side, how in ((src, src_how), (dst, dst_how)):
            if how == "up":
                side.append(side[-1] + sizes[i - 1])
            elif how == "down":
                side.append(side[-1] - size)
            else:
                # Never below 0 after 40 steps down: no wrap in uint64.
                side.append(draw(st.integers(200, 400)))
    return src, dst, sizes


def brute_force_merge(
    src: list[int], dst: list[int], sizes: list[int], descending: bool
) -> int:
    """SPEC 6's greedy merge, one descriptor at a time: how many are left."""
    merged: list[tuple[int, int, int]] = []
    direction = 0
    for a, b, size in zip(src, dst, sizes):
        if merged:
            run_a, run_b, run_size = merged[-1]
            if direction >= 0 and (a, b) == (run_a + run_size, run_b + run_size):
                merged[-1] = (run_a, run_b, run_size + size)
                direction = 1
                continue
            if descending and direction <= 0 and (a + size, b + size) == (run_a, run_b):
                merged[-1] = (a, b, run_size + size)
                direction = -1
                continue
        merged.append((a, b, size))
        direction = 0
    return len(merged)


@given(descriptors())
@example(([40, 39, 38], [12, 11, 10], [1, 1, 1]))
@example(([0, 4, 0, 4, 8, 4], [0, 4, 0, 4, 8, 4], [4, 4, 4, 4, 4, 4]))
def test_descriptor_counts_match_brute_force(
    case: tuple[list[int], list[int], list[int]],
) -> None:
    src, dst, sizes = case
    counts = count_coalesced(src, dst, sizes)
    assert counts.ascending == brute_force_merge(src, dst, sizes, False)
    assert counts.descending == brute_force_merge(src, dst, sizes, True)


@given(descriptors())
def test_the_ascending_count_is_the_references(
    case: tuple[list[int], list[int], list[int]],
) -> None:
    src, dst, sizes = case
    # Where nothing descends, both rules (and any reference) agree.
    assume(
        count_coalesced(src, dst, sizes).descending
        == (count_coalesced(src, dst, sizes).ascending)
    )
    merged = reference.coalesce(
        np.array(src, np.uint64), np.array(dst, np.uint64), np.array(sizes, np.uint64)
    )
    assert count_coalesced(src, dst, sizes).ascending == len(merged.sizes)


@pytest.mark.parametrize("name", TRACES)
def test_the_ascending_count_is_the_references_on_trace_plans(name: str) -> None:
    trace = load_trace(name)
    layout = trace_layout(trace, PRESETS["qwen2.5-7b"])
    for i in spread(len(trace), SAMPLE):
        transfer = trace.transfer(i)
        spec, chunk_ids = transfer_spec(transfer, layout.num_groups)
        plan = layout.table.plan_transfer(
            spec, layout.offloaded, chunk_ids, store=transfer.store
        )
        counts = count_coalesced(plan.src, plan.dst, plan.sizes)
        if counts.descending == counts.ascending:
            merged = reference.coalesce(plan.src, plan.dst, plan.sizes)
            assert counts.ascending == len(merged.sizes)


def test_breaks_stop_runs() -> None:
    src, dst, sizes = [0, 1, 2, 3], [10, 11, 12, 13], [1, 1, 1, 1]
    assert count_coalesced(src, dst, sizes) == (1, 1)
    assert count_coalesced(src, dst, sizes, breaks=[2]) == (2, 2)
    assert count_coalesced(src[::-1], dst[::-1], sizes, breaks=[1, 3]) == (4, 3)


@pytest.mark.parametrize("name", TRACES)
def test_counts_on_a_one_ref_row_are_the_runs(name: str) -> None:
    """On a layout whose pages fill their rows, each ref merges exactly as the
    (GPU, CPU) pairs run: descending count = refs x runs."""
    trace = load_trace(name)
    preset = PRESETS["llama-3.1-8b"]
    indices = spread(len(trace), SAMPLE)
    counts = descriptor_counts(trace, preset, indices)
    runs = trace_run_lengths(trace, indices)
    blocks = sum(len(trace.transfer(i).gpu_ids) for i in indices)
    assert counts.blocks == blocks
    assert counts.plain == blocks * preset.refs_per_group
    assert counts.descending == runs.runs * preset.refs_per_group
    assert counts.descending <= counts.ascending <= counts.plain
    assert counts.strided is None


def test_canonical_presets_count_strided_descriptors() -> None:
    trace = load_trace(TRACES[0])
    indices = spread(len(trace), 6)
    preset = CANONICAL_PRESETS["llama-3.1-70b-tp4-nhd"]
    counts = descriptor_counts(trace, preset, indices)
    assert counts.strided is not None
    fragments = preset.run[3]
    assert counts.plain == counts.strided * fragments


def synthetic_descending_trace_transfers() -> list[tuple[list[int], list[int]]]:
    """What vLLM PR #56110 saw eviction order hand out: paired descending ids."""
    return [([40, 39, 38], [12, 11, 10]), ([9, 8, 7, 3, 4, 5], [20, 19, 18, 1, 2, 3])]


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("preset_name", ["llama-3.1-8b", "hybrid-4x12"])
def test_ptrres_coalesce_counts_descending_runs(store: bool, preset_name: str) -> None:
    """ptrres' own plan_transfer(coalesce=True) merges runs both ways (SPEC 6):
    its count is the descending count, on made-up descending ids and on every
    layout over trace transfers."""
    trace = load_trace(TRACES[0])
    layout = trace_layout(trace, PRESETS[preset_name])
    groups = layout.num_groups
    cases = [
        (
            GPULoadStoreSpec(
                np.array(g * groups, np.int32), [len(g)] * groups, [0] * groups
            ),
            np.array(c * groups, np.int64),
            store,
        )
        for g, c in synthetic_descending_trace_transfers()
    ]
    for i in spread(len(trace), 8):
        transfer = trace.transfer(i)
        spec, chunk_ids = transfer_spec(transfer, groups)
        cases.append((spec, chunk_ids, transfer.store))
    for spec, chunk_ids, direction in cases:
        plan = layout.table.plan_transfer(
            spec, layout.offloaded, chunk_ids, store=direction
        )
        n = len(plan.sizes)
        per_ref = n // (groups * layout.refs)
        counts = count_coalesced(
            plan.src, plan.dst, plan.sizes, breaks=np.arange(per_ref, n, per_ref)
        )
        merged = layout.table.plan_transfer(
            spec, layout.offloaded, chunk_ids, store=direction, coalesce=True
        )
        assert len(merged.sizes) == counts.descending


# --- the command -----------------------------------------------------------------


def test_bench_trace_prints_runs_timings_and_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "trace.json"
    name = TRACES[0]
    status = main(
        ["bench", "--trace", name, "--quick", "--transfers", "6",
         "--preset", "llama-3.1-8b", "--preset", "deepseek-v3-mla-tp8",
         "--json", str(out)]
    )  # fmt: skip
    assert status == 0
    printed = capsys.readouterr().out
    assert f"trace {name}: vLLM 0.33.0" in printed
    assert "runs of paired (GPU block, CPU sub-block) ids" in printed
    assert "ptrres.reference" in printed
    assert "descriptors over the counted transfers" in printed
    for header in ("plain", "ascending", "descending", "ptrres c=True", "strided"):
        assert header in printed
    assert "llama-3.1-8b" in printed
    assert "deepseek-v3-mla-tp8" in printed
    results = json.loads(out.read_text())
    (result,) = results["traces"]
    assert result["trace"] == name
    assert result["transfers_counted"] == 6
    assert [(t["preset"], t["operation"]) for t in result["timings"]] == [
        ("llama-3.1-8b", "resolve"),
        ("llama-3.1-8b", "plan"),
    ]
    assert all(
        t["reference_seconds"] > 0 < t["ptrres_seconds"] for t in result["timings"]
    )
    direct, canonical = result["descriptor_counts"]
    assert direct["preset"] == "llama-3.1-8b"
    assert direct["strided"] is None
    assert canonical["preset"] == "deepseek-v3-mla-tp8"
    assert canonical["strided"] is not None
    for row in (direct, canonical):
        assert row["transfers"] == 6
        assert row["descending"] <= row["ascending"] <= row["plain"]
    assert set(result["run_lengths"]) == {"store", "load", "all"}
