"""vLLM's NIXL index path, patched against vLLM's own (issues 31 and 40):
the two ``_compute_desc_ids`` calls of one ``_read_blocks``, in one process,
interleaved; and what ``ptrres.vllm.patch()`` now costs.

``NixlPullConnectorWorker._read_blocks`` turns a request's block ids into
NIXL descriptor ids twice, before it posts the READ: for the remote side
(``block_size_ratio=None``, the remote engine's ``dst_num_blocks`` and
per-region block counts) and then for its own (its own counts, and its
ratio to the peer's block size: 1 here). Both calls are timed together, with
the ids as vLLM passes them: one Python list of ints per KV-cache group.
The contenders, on the installed release:

- ``vllm``: vLLM's own ``NixlBaseConnectorWorker._compute_desc_ids``;
- ``compiled``: the plugin's, every id checked and the indices built by one
  kernel (``desc_ids_kernel``): ``ptrres.vllm._nixl.patched_functions``
  (``compiled=True``) on 0.30 to 0.33, ``ptrres.vllm._nixl_pairs`` on 0.34;
- ``wrap`` (0.30 to 0.33): the same check (``compiled=False``), then vLLM's
  own method, as the plugin does there for Mamba models. (0.34's patch
  builds every model's ids with the kernel, Mamba's included.)

Each is called on a bare worker (``object.__new__`` holding only what
``_compute_desc_ids`` reads), as vLLM calls it: by keyword, the worker
first. The outputs are checked equal (values and dtype) first.

Layouts: 32 regions (Llama-3.1-8B, one region a layer) and 80 (Llama-3.1-70B
at TP4), remote pools of 24,576 and 32,768 blocks, local ones of 32,768 and
40,960. ``one group``: every region of group 0 (0.30-0.33: vLLM's fast path,
``uses_region_group_mapping`` False; 0.34: pairs ``(range(regions), [0] *
regions)``). ``hybrid``: 4 groups, the regions split among them in 4 runs,
each group with its own ids (0.30-0.33: region-group mapping; 0.34: each
region paired at its group); each group has as many ids as a one-group
request, so both write the same number of indices. ``mamba`` (0.34): a
hybrid Mamba model of as many regions, one in 8 an attention layer (group
0, every request's ids) and the others Mamba2 layers (group 1, 4 SSM
descriptors a layer, one state block a request): vLLM's Mamba branch, int32
ids. Ids are ``scattered`` (distinct, drawn at random from the pool, in the
order drawn) or ``consecutive`` (one run at a random start), on each side.
Then the shipped traces (``ptrres.bench.TRACES``, vLLM 0.33's own
allocators): a few transfers of each size bucket, the GPU ids as the local
side's, the CPU positions as the remote's, one group, each cell the
transfers of one bucket in turn.

Timing: ``ptrres.bench.compare`` per cell (the contenders take turns in
rounds, each round a batch of calls), the median over rounds and the best;
with each, the minor page faults of one transfer and the most memory it
holds at once (tracemalloc, which numpy reports to). First on this
process's heap, which reuses the memory freed by the previous call (no page
faults), then on fresh pages: in a child whose glibc malloc maps every block
of 64 KiB or more anew and keeps no free memory at its heap's top
(FRESH_MALLOC), so that every large array is faulted in page by page as it
is written, which is what the filer saw when each request's index arrays
landed on fresh pages. Between the two tables, where the patched path's
time goes (layout lookup, list-to-array conversion against vLLM's own,
kernel, range check).

Last, the patch-cost tables: ``ptrres.vllm.patch()`` timed in fresh
interpreters right after what triggers it, with this tree's ptrres (and with
``PTRRES_VLLM_NIXL=0``) and with the tree before the NIXL patch
(``--before``, extracted with ``git archive``, first on PYTHONPATH),
alternating: once where only ``vllm.v1.kv_offload.cpu.gpu_worker`` is
imported, once where a GPU worker's modules are (its model runner,
OffloadingConnector). Patching the NIXL path imports vLLM's NIXL worker
modules; what vLLM's own import of them costs there is timed after the
before tree's patch().

Run: python benchmarks/nixl_desc_ids.py [--quick] [--rounds N]
     [--patch-cost | --no-patch-cost] [--before REV]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Loopback only, before vLLM imports NIXL (and its UCX).
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# (name, regions, remote pool, local pool): one region a layer.
MODELS = (
    ("llama-3.1-8b", 32, 24576, 32768),
    ("llama-3.1-70b-tp4", 80, 32768, 40960),
)
BLOCKS = (16, 256, 2048)
HYBRID_GROUPS = 4
# A Mamba model's attention layers: one region in MAMBA_ATTENTION; the
# others Mamba2 (3 conv sub-projections and the SSM state: 4 descriptors).
MAMBA_ATTENTION = 8
MAMBA_CONV_OFFSETS = [(0, 1024), (1024, 256), (1280, 256)]
# Transfers of each size bucket per trace.
TRACE_TRANSFERS = 4
# The commit before the plugin patched vLLM's NIXL connector (0fc90d3).
BEFORE_NIXL = "0fc90d3^"
# The fresh-pages table runs in a child whose glibc malloc maps every block
# of 64 KiB or more anew and unmaps it when freed, and keeps no free memory
# at the top of its heap: every large array is faulted in page by page as
# it is first written. (Set from the start: in a process that has run a
# while, free chunks in the heap's bins would serve large arrays anyway.)
FRESH_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(64 * 1024),
    "MALLOC_TRIM_THRESHOLD_": str(64 * 1024),
    "MALLOC_TOP_PAD_": "0",
}


@dataclass(frozen=True)
class Case:
    """One cell: a layout, an id pattern and a size; both calls' arguments,
    one pair of calls per transfer (traces: several)."""

    model: str
    regions: int
    groups: str  # "one group", "hybrid", "mamba", or a trace's name
    ids: str  # "scattered", "consecutive", or a trace's size bucket
    blocks: int  # ids per group, per side (traces: per transfer, the most)
    worker: Any
    calls: tuple[tuple[dict[str, Any], dict[str, Any]], ...]  # (remote, local)


@dataclass(frozen=True)
class Vllm:
    """The installed vLLM's NIXL worker: its module, class and spec types."""

    base_worker: Any
    cls: Any
    specs: tuple[Any, ...]
    mamba_spec: Any
    # Whether it pairs regions by layer name (0.34).
    pairs: bool

    @property
    def contenders(self) -> tuple[str, ...]:
        return ("vllm", "compiled") if self.pairs else ("vllm", "compiled", "wrap")


def load_vllm() -> Vllm:
    """vLLM's base_worker module, its worker class, and the spec classes."""
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)  # "NIXL is not available"
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    specs = (FullAttentionSpec, SlidingWindowSpec, SlidingWindowSpec, FullAttentionSpec)
    return Vllm(
        base_worker,
        base_worker.NixlBaseConnectorWorker,
        specs,
        MambaSpec,
        hasattr(base_worker, "_RegionPairs"),
    )


class ConvDecomp:
    """What _compute_desc_ids reads of vLLM's MambaConvSplitInfo."""

    local_conv_offsets = MAMBA_CONV_OFFSETS


def bare_worker(
    vllm: Vllm, regions: int, owners: list[int], specs: Any, mamba: bool = False
) -> Any:
    """A worker never initialised, holding only what _compute_desc_ids reads
    (vLLM 0.30 to 0.34); ``mamba``: a Mamba model's, whose SSM state is in
    every region but the attention ones."""
    # vLLM's __del__ shuts NIXL down, which a bare worker never started.
    bare = type("BareWorker", (vllm.cls,), {"__del__": lambda self: None})
    worker: Any = object.__new__(bare)
    groups = max(owners) + 1
    for name, value in {
        "_has_mamba": mamba,
        "_conv_decomp": ConvDecomp() if mamba else None,
        "_ssm_region_indices": [r for r, g in enumerate(owners) if g] if mamba else [],
        "_scratch_region_indices": [],
        "_group_spec_types": tuple(specs[:groups]),
        "_ple_group_index": None,
        "_transfer_layer_group_ids": (),
        "num_regions": regions,
        "block_len_per_layer": [4096] * regions,
        "region_group_ids": owners,
        "_uses_region_group_mapping": groups > 1,
    }.items():
        setattr(worker, name, value)
    return worker


def draw_ids(
    rng: np.random.Generator, pool: int, blocks: int, groups: int, pattern: str
) -> list[list[int]]:
    """One side's ids, one list of Python ints per group, as vLLM passes them;
    the groups' ids distinct from each other."""
    if pattern == "scattered":
        drawn = rng.choice(pool, blocks * groups, replace=False)
    else:
        drawn = int(rng.integers(pool - blocks * groups)) + np.arange(blocks * groups)
    return [drawn[g * blocks : (g + 1) * blocks].tolist() for g in range(groups)]


def call_pair(
    vllm: Vllm,
    regions: int,
    owners: list[int],
    remote_ids: list[list[int]],
    local_ids: list[list[int]],
    remote_pool: int,
    local_pool: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The remote and the local call of one _read_blocks, as the release
    makes them (0.34: each region paired at its group, the peer's regions in
    the same order)."""
    remote: dict[str, Any] = {
        "block_ids": remote_ids,
        "dst_num_blocks": remote_pool,
        "block_size_ratio": None,
        "physical_blocks_per_logical": 1,
        "region_num_blocks": [remote_pool] * regions,
    }
    if vllm.pairs:
        remote["pairs"] = (list(range(regions)), list(owners))
        remote["ssm_regions"] = None
    else:
        remote["region_group_ids"] = owners
        remote["uses_region_group_mapping"] = max(owners) > 0
    local = {
        **remote,
        "block_ids": local_ids,
        "dst_num_blocks": local_pool,
        "block_size_ratio": 1,
        "region_num_blocks": [local_pool] * regions,
    }
    if vllm.pairs:
        local.pop("ssm_regions")
    return remote, local


def cases(vllm: Vllm, blocks_list: tuple[int, ...]) -> list[Case]:
    """Every cell: both models, one group, hybrid (and, on 0.34, a Mamba
    model), both id patterns."""
    rng = np.random.default_rng(31)
    found = []
    layouts = ["one group", "hybrid", *(["mamba"] if vllm.pairs else [])]
    for model, regions, remote_pool, local_pool in MODELS:
        for groups in layouts:
            if groups == "mamba":
                owners = [int(r % MAMBA_ATTENTION != 0) for r in range(regions)]
                specs = (vllm.specs[0], vllm.mamba_spec)
                worker = bare_worker(vllm, regions, owners, specs, mamba=True)
            else:
                n_groups = 1 if groups == "one group" else HYBRID_GROUPS
                # Hybrid: the regions in n_groups runs, one per group.
                owners = [r * n_groups // regions for r in range(regions)]
                worker = bare_worker(vllm, regions, owners, vllm.specs)
            for ids in ("scattered", "consecutive"):
                for blocks in blocks_list:
                    mamba_groups = groups == "mamba"

                    def side(
                        pool: int,
                        ids: str = ids,
                        blocks: int = blocks,
                        n: int = max(owners) + 1,
                        mamba: bool = mamba_groups,
                    ) -> Any:
                        if not mamba:
                            return draw_ids(rng, pool, blocks, n, ids)
                        # Every request's attention ids; one SSM state block.
                        drawn = draw_ids(rng, pool, blocks + 1, 1, ids)[0]
                        return [drawn[:blocks], drawn[blocks:]]

                    calls = call_pair(
                        vllm,
                        regions,
                        owners,
                        side(remote_pool),
                        side(local_pool),
                        remote_pool,
                        local_pool,
                    )
                    found.append(
                        Case(model, regions, groups, ids, blocks, worker, (calls,))
                    )
    return found


def trace_cases(vllm: Vllm, per_bucket: int) -> list[Case]:
    """The shipped traces' transfers, one group, both models: GPU ids as the
    local side's, CPU positions (chunks expanded to blocks) as the remote's;
    one cell per trace and size bucket."""
    from ptrres.bench import TRACES, load_trace
    from ptrres.bench.traces import paired_positions, spread

    buckets = ((1, 16), (16, 256), (256, 1 << 30))
    found = []
    for model, regions, _, local_pool in MODELS:
        owners = [0] * regions
        worker = bare_worker(vllm, regions, owners, vllm.specs)
        for name in TRACES:
            trace = load_trace(name)
            remote_pool = trace.num_cpu_blocks * trace.blocks_per_chunk
            sizes = np.diff(trace.gpu_offsets)
            for low, high in buckets:
                members = np.flatnonzero((sizes >= low) & (sizes < high))
                calls = []
                for j in spread(len(members), per_bucket):
                    t = trace.transfer(int(members[j]))
                    gpu, cpu = paired_positions(
                        t.gpu_ids, t.cpu_ids, trace.blocks_per_chunk, t.block_index
                    )
                    calls.append(
                        call_pair(
                            vllm,
                            regions,
                            owners,
                            [cpu.tolist()],
                            [gpu.tolist()],
                            remote_pool,
                            local_pool,
                        )
                    )
                bucket = f">= {low}" if high >= 1 << 30 else f"{low}-{high - 1}"
                most = int(sizes[members].max()) if len(members) else 0
                found.append(
                    Case(model, regions, name, bucket, most, worker, tuple(calls))
                )
    return found


def contenders(vllm: Vllm) -> dict[str, Callable[..., Any]]:
    """vLLM's _compute_desc_ids, the plugin's compiled one (and its wrap)."""
    vllm_method = vars(vllm.cls)["_compute_desc_ids"]
    if vllm.pairs:
        from ptrres.vllm._nixl_pairs import patched_compute_desc_ids

        compiled = patched_compute_desc_ids(vllm.base_worker, vllm_method, lambda: True)
        return {"vllm": vllm_method, "compiled": compiled}
    from ptrres.vllm._nixl import NixlPatch, patched_functions

    def patched(compiled: bool) -> Callable[..., Any]:
        method, _ = patched_functions(
            NixlPatch(vllm.base_worker, vllm_method, lambda: True, compiled=compiled)
        )
        return method

    return {"vllm": vllm_method, "compiled": patched(True), "wrap": patched(False)}


def transfer(method: Callable[..., Any], case: Case) -> Callable[[], Any]:
    """The index path of the cell's _read_blocks (one, or a trace bucket's in
    turn): the remote call, then the local."""
    worker, calls = case.worker, case.calls

    def both() -> Any:
        return [
            (method(worker, **remote), method(worker, **local))
            for remote, local in calls
        ]

    return both


def check_equal(methods: dict[str, Callable[..., Any]], case: Case) -> int:
    """Every contender's output is vLLM's (values and dtype); the indices of
    one side of a transfer (on average, for a trace bucket)."""
    outputs = {name: transfer(m, case)() for name, m in methods.items()}
    for name, transfers in outputs.items():
        for sides, expected_sides in zip(transfers, outputs["vllm"]):
            for side, expected in zip(sides, expected_sides):
                assert side.dtype == expected.dtype, (name, case.model, side.dtype)
                assert np.array_equal(side, expected), (name, case.model, case.ids)
    sizes = [len(sides[0]) for sides in outputs["vllm"]]
    return round(sum(sizes) / max(len(sizes), 1))


def peak_bytes(fn: Callable[[], Any]) -> int:
    """The most memory one call holds at once, over what it returns nothing
    (tracemalloc: Python's and numpy's allocations)."""
    fn()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def page_faults(fn: Callable[[], Any], calls: int = 16) -> float:
    """The minor page faults of one call (the pages its arrays touch first)."""
    import resource

    fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def index_table(
    all_cases: list[Case],
    methods: dict[str, Callable[..., Any]],
    seconds: float,
    rounds: int,
) -> dict[str, list[float]]:
    """One table: every cell, the contenders interleaved; for each contender
    but vLLM, vLLM's time over its own, cell by cell: the medians' ratio
    (``name``) and the best rounds' (``name, best``), which a machine shared
    with other work disturbs less."""
    from ptrres.bench import compare

    names = list(methods)
    others = names[1:]
    slash = " / ".join(names)
    print(
        "| model | regions | groups | ids | blocks | indices/side | "
        + " | ".join(f"{n} us" for n in names)
        + " | "
        + " | ".join(f"vLLM/{n}" for n in others)
        + f" | best of {rounds} us ({slash}) | page faults | peak KiB |"
    )
    print("|---|---:|---|---|---:|---:|" + "---:|" * (len(names) + len(others) + 3))
    ratios: dict[str, list[float]] = {
        label: [] for n in others for label in (n, f"{n}, best of rounds")
    }
    for case in all_cases:
        n = check_equal(methods, case)
        calls = {name: transfer(m, case) for name, m in methods.items()}
        timing = compare(calls, seconds=seconds, rounds=rounds)
        # Per transfer (a trace bucket's cell times several in turn).
        per = len(case.calls)
        us = {name: t.seconds * 1e6 / per for name, t in timing.items()}
        for other in others:
            ratios[other].append(us["vllm"] / us[other])
            ratios[f"{other}, best of rounds"].append(
                min(timing["vllm"].rounds) / min(timing[other].rounds)
            )
        best = " / ".join(f"{min(timing[c].rounds) * 1e6 / per:.1f}" for c in names)
        faults = " / ".join(f"{page_faults(calls[c]) / per:.0f}" for c in names)
        peaks = " / ".join(f"{peak_bytes(calls[c]) / 1024:.0f}" for c in names)
        print(
            f"| {case.model} | {case.regions} | {case.groups} | {case.ids} "
            f"| {case.blocks} | {n} | "
            + " | ".join(f"{us[c]:.1f}" for c in names)
            + " | "
            + " | ".join(f"{us['vllm'] / us[c]:.2f}x" for c in others)
            + f" | {best} | {faults} | {peaks} |",
            flush=True,
        )
    return ratios


def summary(ratios: dict[str, list[float]], label: str) -> None:
    """Geometric means and lowest ratios, and whether "never slower" held."""
    from ptrres.bench import geometric_mean

    parts = [
        f"{name}: geometric mean {geometric_mean(found):.2f}x vLLM's speed, lowest "
        f"{min(found):.2f}x, {sum(r < 1 for r in found)} of {len(found)} cells "
        "slower"
        for name, found in ratios.items()
    ]
    print(f"\n{label}: " + "; ".join(parts))


def positional(vllm: Vllm, call: dict[str, Any]) -> tuple[Any, ...]:
    """A call's arguments after the worker, in the order of vLLM's
    _compute_desc_ids, its defaults where the call leaves them."""
    signature = inspect.signature(vars(vllm.cls)["_compute_desc_ids"])
    bound = signature.bind(None, **call)
    bound.apply_defaults()
    return bound.args[1:]


@dataclass(frozen=True)
class Side:
    """One call's keyword arguments, with what the compiled path makes of
    them: the worker's layout, the flat ids, the output's length."""

    arguments: dict[str, Any]
    # The same, positional, in the order of vLLM's _compute_desc_ids.
    positional: tuple[Any, ...]
    layout: Any
    flat: Any  # flat_ids(): the ids and where each group starts, first
    size: int


def sides(case: Case, vllm: Vllm) -> list[Side]:
    """The remote call's and the local call's Side (of the cell's first
    transfer)."""
    from ptrres.vllm import _nixl_pairs
    from ptrres.vllm._nixl_regions import CompiledLayout, compiled_layout, flat_ids

    found = []
    for call in case.calls[0]:
        arguments = positional(vllm, call)
        flat = flat_ids(arguments[0])
        assert flat is not None, "ids that are no int64"
        lengths = [len(ids) for ids in arguments[0]]
        layout: Any
        if vllm.pairs:
            layout = _nixl_pairs.cached_layout(case.worker, arguments, vllm.base_worker)
            assert layout is not None, "not the compiled path"
            size = sum(n * lengths[key] for key, n in layout.per_key)
        else:
            layout = compiled_layout(case.worker, arguments, vllm.base_worker)
            assert isinstance(layout, CompiledLayout), "not the compiled path"
            size = layout.all_groups * sum(lengths) + sum(
                m * k for m, k in zip(layout.per_group, lengths)
            )
        found.append(Side(call, arguments, layout, flat, size))
    return found


def breakdown(all_cases: list[Case], vllm: Vllm, seconds: float) -> None:
    """Where the patched path's time goes, per transfer (both calls): the
    worker's layout (looked up by its key), the lists made one array
    (flat_ids; vLLM's own conversion, np.asarray(group) per group, beside
    it), the kernel with its output's allocation, and (0.30 to 0.33) the
    range check the wrap does instead of the kernel (all_in_range)."""
    from ptrres import _kernels
    from ptrres.bench import compare
    from ptrres.vllm import _nixl_pairs
    from ptrres.vllm._nixl_regions import all_in_range, compiled_layout, flat_ids

    dtype = np.int64 if vllm.pairs else np.int32
    print(
        "\nWhere the time goes, per transfer (both calls), scattered ids:\n\n"
        "| model | groups | blocks | layout lookup us | flat_ids us "
        "| vLLM's np.asarray us | kernel + np.empty us | all_in_range us |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for case in all_cases:
        if case.ids != "scattered":
            continue
        both = sides(case, vllm)
        worker = case.worker

        def lookup(both: list[Side] = both, worker: Any = worker) -> None:
            for side in both:
                if vllm.pairs:
                    _nixl_pairs.cached_layout(worker, side.positional, vllm.base_worker)
                else:
                    compiled_layout(worker, side.positional, vllm.base_worker)

        def flatten(both: list[Side] = both) -> None:
            for side in both:
                flat_ids(side.arguments["block_ids"])

        def vllm_arrays(both: list[Side] = both) -> None:
            for side in both:
                for group in side.arguments["block_ids"]:
                    np.asarray(group, dtype=dtype)

        def kernel(both: list[Side] = both) -> None:
            for side in both:
                out = np.empty(side.size, np.int64)
                ids, starts = side.flat[0], side.flat[1]
                _kernels.desc_ids_kernel(ids, starts, side.layout.segments, out)

        def check(both: list[Side] = both) -> None:
            for side in both:
                all_in_range(side.flat, side.layout.layout)

        steps: dict[str, Callable[[], object]] = {
            "lookup": lookup,
            "flat": flatten,
            "vllm": vllm_arrays,
            "kernel": kernel,
        }
        if not vllm.pairs:
            steps["check"] = check
        timing = compare(steps, seconds=seconds)
        us = {name: t.seconds * 1e6 for name, t in timing.items()}
        checked = f"{us['check']:.1f}" if "check" in us else "-"
        print(
            f"| {case.model} | {case.groups} | {case.blocks} | {us['lookup']:.1f} "
            f"| {us['flat']:.1f} | {us['vllm']:.1f} | {us['kernel']:.1f} "
            f"| {checked} |",
            flush=True,
        )


def index_path(seconds: float, rounds: int, fresh: bool, traces: bool) -> None:
    """The tables of the index path: on this process's heap (with the
    traces' table and where the time goes), or, ``fresh``, on fresh pages
    (in a child that FRESH_MALLOC configures)."""
    import numba
    import vllm as vllm_package

    import ptrres

    vllm = load_vllm()
    methods = contenders(vllm)
    all_cases = cases(vllm, BLOCKS)
    if fresh:
        print(
            "\nFresh pages: glibc's malloc maps every block of 64 KiB or more "
            "anew and keeps no free memory at its heap's top "
            f"(`{' '.join(f'{k}={v}' for k, v in FRESH_MALLOC.items())}`), so "
            "that each large array is faulted in as it is first written; load "
            f"average {load()}:\n"
        )
        summary(index_table(all_cases, methods, seconds, rounds), "fresh pages")
        print(f"\nload average {load()}")
        return
    print(
        f"vLLM {vllm_package.__version__}, ptrres {ptrres.__version__}, numba "
        f"{numba.__version__}, numpy {np.__version__}; {os.cpu_count()} CPUs, "
        f"load average {load()}\n"
    )
    print(
        "The index path of one `_read_blocks` (remote call, then local), on "
        "the benchmark's warm heap: the median per transfer over the rounds; "
        "best of the rounds, minor page faults per transfer and the most "
        "memory a transfer holds at once (tracemalloc) as "
        f"{' / '.join(methods)}:\n"
    )
    summary(index_table(all_cases, methods, seconds, rounds), "warm heap")
    print(f"\nload average {load()}")
    if traces:
        print(
            "\nThe shipped traces (vLLM 0.33's allocators), one group: "
            f"{TRACE_TRANSFERS} transfers of each size bucket, timed in turn; "
            "per transfer (blocks: the bucket's largest):\n"
        )
        found = trace_cases(vllm, TRACE_TRANSFERS)
        summary(index_table(found, methods, seconds, rounds), "traces")
        print(f"\nload average {load()}")
    breakdown(all_cases, vllm, seconds)


def fresh_pages(argv: list[str]) -> None:
    """The fresh-pages table, from a child started with FRESH_MALLOC."""
    sys.stdout.flush()
    done = subprocess.run(
        [sys.executable, __file__, "--fresh-pages", *argv],
        env={**os.environ, **FRESH_MALLOC},
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"the fresh-pages child exited with {done.returncode}")


# What a process has imported when patch() triggers: vLLM's CPU offloading
# worker alone (the brief's case), and with what a GPU worker that offloads
# has imported before it (its model runner, OffloadingConnector).
GPU_WORKER = "vllm.v1.kv_offload.cpu.gpu_worker"
SCENARIOS = (
    ("only vLLM's offloading worker imported", (GPU_WORKER,)),
    (
        "a GPU worker's modules imported (model runner, OffloadingConnector)",
        (
            "vllm.v1.worker.gpu_model_runner",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
            GPU_WORKER,
        ),
    ),
)
NIXL_WORKERS = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"

# A fresh interpreter: the scenario's modules imported, then
# ptrres.vllm.patch() timed; with "then-nixl", vLLM's own import of its NIXL
# worker modules timed after it (what the before tree's patch() left out).
CHILD = f"""
import importlib, json, sys, time
for name in sys.argv[2].split(","):
    importlib.import_module(name)
import ptrres, ptrres.vllm as plugin
assert not plugin.is_patched()
modules = len(sys.modules)
start = time.perf_counter()
names = plugin.patch()
report = {{"seconds": time.perf_counter() - start, "ptrres": ptrres.__file__,
    "modules": len(sys.modules) - modules,
    "nixl": any("_compute_desc_ids" in n for n in names)}}
assert names, "patch() patched nothing"
if sys.argv[1] == "then-nixl":
    start = time.perf_counter()
    for name in ("base_worker", "pull_worker", "push_worker"):
        importlib.import_module("{NIXL_WORKERS}." + name)
    report["vllm_nixl"] = time.perf_counter() - start
print(json.dumps(report))
"""


@dataclass(frozen=True)
class Variant:
    """One kind of fresh interpreter of the patch-cost table."""

    name: str
    env: dict[str, str]
    root: str  # where its ptrres must come from
    then_nixl: bool = False  # then time vLLM's import of its NIXL workers


def run_child(variant: Variant, imports: tuple[str, ...], cwd: str) -> dict[str, Any]:
    """One fresh interpreter's report."""
    how = "then-nixl" if variant.then_nixl else "patch"
    done = subprocess.run(
        [sys.executable, "-c", CHILD, how, ",".join(imports)],
        cwd=cwd,
        env=variant.env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    assert result["ptrres"].startswith(variant.root), (variant.name, result)
    return result


def patch_cost(rounds: int, before: str, quick: bool) -> None:
    """patch() where it triggers, fresh interpreters, alternating: this tree
    (and with PTRRES_VLLM_NIXL=0) against the tree before the NIXL patch."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PTRRES_VLLM")}
    env.pop("VLLM_PLUGINS", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: bytecode cached
    path = [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    here = {**env, "PYTHONPATH": os.pathsep.join(path)}
    print(
        "\n`ptrres.vllm.patch()` in fresh interpreters, right after what "
        f"triggers it ({rounds} of each, alternating; medians):"
    )
    # The children run in an empty directory: `python -c` puts the working
    # directory first on sys.path, where a checkout's ptrres would win.
    with tempfile.TemporaryDirectory() as old, tempfile.TemporaryDirectory() as cwd:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", before, "ptrres"],
            capture_output=True,
            check=False,
        )
        variants = [Variant("this tree", here, str(ROOT))]
        if archive.returncode == 0:
            subprocess.run(["tar", "-x", "-C", old], input=archive.stdout, check=True)
            old_path = os.pathsep.join([old, *path])
            variants.append(
                Variant(
                    f"before the NIXL patch ({before})",
                    {**env, "PYTHONPATH": old_path},
                    old,
                    then_nixl=True,
                )
            )
        else:
            print(f"\n(`git archive {before}` failed: no before rows)")
        if len(variants) > 1 and not _patches(variants[1], SCENARIOS[0][1], cwd):
            # A tree that predates the installed vLLM's release patches none
            # of it (before issue 39, a release was tested by its version).
            print(
                f"\n(the tree at {before} patches nothing of this vLLM: no before rows)"
            )
            variants.pop()
        for number, (scenario, imports) in enumerate(SCENARIOS):
            if quick and number:
                break
            kinds = list(variants)
            if not number and not quick:  # the switch, once
                switch = {**here, "PTRRES_VLLM_NIXL": "0"}
                name = "this tree, PTRRES_VLLM_NIXL=0"
                kinds.insert(1, Variant(name, switch, str(ROOT)))
            patch_table(scenario, imports, kinds, rounds, cwd)


def _patches(variant: Variant, imports: tuple[str, ...], cwd: str) -> bool:
    """Whether ``variant``'s patch() patches anything of the installed vLLM."""
    try:
        run_child(variant, imports, cwd)
    except RuntimeError as error:
        if "patch() patched nothing" in str(error):
            return False
        raise
    return True


def patch_table(
    scenario: str, imports: tuple[str, ...], kinds: list[Variant], rounds: int, cwd: str
) -> None:
    """One scenario's table: every variant, alternating."""
    try:
        run_child(kinds[0], imports, cwd)  # bytecode cached, imports checked
    except RuntimeError as error:
        print(f"\n{scenario}: its modules do not import here ({error})")
        return
    results: dict[str, list[dict[str, Any]]] = {v.name: [] for v in kinds}
    for _ in range(rounds):
        for variant in kinds:
            results[variant.name].append(run_child(variant, imports, cwd))
    print(f"\n{scenario} (`{'`, `'.join(imports)}`); load average {load()}:\n")
    print("| ptrres | patch() ms | modules it imports | NIXL path patched |")
    print("|---|---:|---:|---|")
    for variant in kinds:
        found = results[variant.name]
        ms = statistics.median(r["seconds"] for r in found) * 1e3
        modules = statistics.median(r["modules"] for r in found)
        print(f"| {variant.name} | {ms:.0f} | {modules:.0f} | {found[0]['nixl']} |")
    then = [r["vllm_nixl"] for r in results[kinds[-1].name] if "vllm_nixl" in r]
    if then:
        print(
            "\nvLLM's own import of its three NIXL worker modules there, "
            "after the before tree's patch(): "
            f"{statistics.median(then) * 1e3:.0f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter timings")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per cell")
    parser.add_argument(
        "--patch-cost",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="only patch()'s cost (--no-patch-cost: only the index path)",
    )
    parser.add_argument(
        "--before", default=BEFORE_NIXL, help="the commit patch() is compared with"
    )
    # The child that prints the fresh-pages table.
    parser.add_argument("--fresh-pages", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    rounds = args.rounds or (5 if args.quick else 15)
    seconds = 0.03 if args.quick else 0.3
    if args.fresh_pages:
        index_path(seconds, rounds, fresh=True, traces=False)
        return
    if args.patch_cost is not True:
        index_path(seconds, rounds, fresh=False, traces=True)
        fresh_pages(["--quick"] if args.quick else ["--rounds", str(rounds)])
    if args.patch_cost is not False:
        patch_cost(1 if args.quick else 9, args.before, args.quick)


if __name__ == "__main__":
    main()
