"""vLLM's simple CPU offload path: copy_blocks, vLLM's own against the patched
one (issue 27); and what loading the plugin costs a process that never
offloads.

``vllm/v1/simple_kv_offload/cuda_mem_ops.copy_blocks(src_ids, dst_ids,
params)`` is what SimpleCPUOffloadConnector's DMA backend calls for every
transfer and its disk backend for every block. Both contenders run on the same
params (built by the patched ``build_params``, over tensors that are never
allocated: ``ptrres.bench.VirtualTensor``), in one process, in interleaved
rounds (``ptrres.bench.compare``), the driver function
(``cuda_mem_ops._batch_memcpy``) stubbed to a no-op: what is timed is turning
two lists of ids into the descriptor arrays and handing them over, which vLLM
does on the CPU for every copy. Their driver calls are checked equal first.

Layouts: ``ptrres.bench.PRESETS`` (one layer per ref, a ref's page as its
bytes per block) and a MiniMax-M3-like rank (118 KV regions of 32 KiB per
block: vLLM PR #56110 counted 30,208 descriptors, 0.99 GB, for 256 blocks).
Ids are random, distinct, on each side. The disk backend's rows are its calls:
one block between the GPU tensors and two staging slots.

The table runs on two heaps, each in children whose glibc malloc is set from
the start (``--repeats`` children a heap, alternating; per cell the median over
them, and each child's speedup), since what vLLM's own copy costs at 4096
blocks depends on it (its numpy arrays are 1 to 5 MiB each): on a warm heap
(WARM_MALLOC: the thresholds glibc sets itself once a process has freed a block
of 32 MiB, as a worker that has loaded a model has; what one call frees, the
next reuses), then on fresh pages (FRESH_MALLOC, as ``nixl_desc_ids.py`` has
it: every large array mapped anew and faulted in as it is first written). Each
cell gives the minor page faults of one call of each side, which say which heap
it ran on. In a process left to itself, either can happen: it depends on what
the process allocated and freed before.

``--plugin-cost`` (part of the default run) times fresh interpreters,
alternating: vLLM's ``load_general_plugins()`` with ptrres's entry point and
with ``VLLM_PLUGINS`` naming another plugin, after ``import vllm.plugins``;
then, with the plugin, what the process pays when vLLM imports its simple
offload backend (the patch), builds params (the kernels, from Numba's cache)
and copies for the first time.

Run: python benchmarks/simple_copy_blocks.py [--quick] [--rounds 9]
     [--copy-rounds 15] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

BLOCKS = [1, 16, 256, 4096]
NUM_GPU_BLOCKS = 16384
NUM_CPU_BLOCKS = 32768
# The disk backend's staging slots per direction (its default).
NUM_STAGING_SLOTS = 2
MINIMAX = ("minimax-m3-tp4", 118, 32 * 1024)
# glibc's malloc, set in the child that runs each table (from the start: in
# a process that has run a while, its bins and thresholds already decide).
# Warm heap: the thresholds glibc reaches by itself once a process has freed
# a block of 32 MiB (its dynamic maximum: blocks under 32 MiB come from the
# heap, and free memory at the heap's top goes back to the system only past
# 64 MiB), so that the memory one call frees, the next reuses.
WARM_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024),
    "MALLOC_TRIM_THRESHOLD_": str(64 * 1024 * 1024),
}
# Fresh pages (nixl_desc_ids.py's): every block of 64 KiB or more mapped anew
# and unmapped when freed, no free memory kept at the heap's top: every
# large array is faulted in page by page as it is first written.
FRESH_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(64 * 1024),
    "MALLOC_TRIM_THRESHOLD_": str(64 * 1024),
    "MALLOC_TOP_PAD_": "0",
}
HEAPS = {
    "warm heap": (
        WARM_MALLOC,
        "glibc's malloc serves every block under 32 MiB from its heap and "
        "returns free memory at the heap's top only past 64 MiB, the "
        "thresholds it sets itself once a process has freed a 32 MiB block "
        "(as a worker that has loaded a model has): what one call frees, the "
        "next reuses",
    ),
    "fresh pages": (
        FRESH_MALLOC,
        "glibc's malloc maps every block of 64 KiB or more anew and keeps no "
        "free memory at its heap's top, so that each large array is faulted "
        "in as it is first written",
    ),
}


class Stream:
    """What build_params reads of a stream."""

    cuda_stream = 0


def layouts() -> list[tuple[str, list[int]]]:
    """(name, bytes per block of each layer) of every layout timed."""
    from ptrres.bench import PRESETS

    found = [
        (
            name,
            [
                page
                for page in preset.group_page_sizes
                for _ in range(preset.refs_per_group)
            ],
        )
        for name, preset in PRESETS.items()
    ]
    name, regions, bpb = MINIMAX
    return [*found, (name, [bpb] * regions)]


def caches(block_bytes: list[int], num_blocks: int, base: int) -> dict[str, Any]:
    """One never-allocated (num_blocks, bpb) tensor per layer, named alike on
    both sides, as vLLM's worker names its regions."""
    from ptrres.bench import VIRTUAL_ALIGN, VirtualTensor

    return {
        f"layer.{i}": VirtualTensor(base + i * VIRTUAL_ALIGN, num_blocks, bpb)
        for i, bpb in enumerate(block_bytes)
    }


def same_calls(
    vllm_copy: Callable[..., None], patched: Callable[..., None], *args: Any
) -> int:
    """Both contenders hand the driver the same arrays; how many descriptors."""
    import ctypes

    from vllm.v1.simple_kv_offload import cuda_mem_ops

    calls: list[list[tuple[bytes, ...]]] = [[], []]

    def record(which: int) -> Callable[..., int]:
        def driver(dsts: int, srcs: int, sizes: int, count: int, *rest: Any) -> int:
            attrs, _, num_attrs, _, stream = rest  # (the others are byrefs)
            arrays = [
                bytes((ctypes.c_uint64 * count).from_address(address))
                for address in (srcs, dsts, sizes)
            ]
            calls[which].append((*arrays, repr((attrs, num_attrs, stream))))
            return 0

        return driver

    noop = cuda_mem_ops._batch_memcpy
    for which, copy in enumerate((vllm_copy, patched)):
        cuda_mem_ops._batch_memcpy = (record(which), 1)
        copy(*args)
    cuda_mem_ops._batch_memcpy = noop
    assert calls[0] == calls[1], "ptrres's driver calls differ from vLLM's"
    return sum(len(call[0]) // 8 for call in calls[0])


def page_faults(fn: Callable[[], Any], calls: int = 16) -> float:
    """The minor page faults of one call (the pages its arrays touch first)."""
    import resource

    fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def measure_cells(seconds: float, rounds: int) -> dict[str, Any]:
    """Every cell, both contenders interleaved, in this process (a child that
    one of HEAPS configured): vLLM's and ptrres's median us and page faults
    per call; the versions; the load average before and after."""
    import numpy as np
    import vllm
    from vllm.v1.simple_kv_offload import cuda_mem_ops

    import ptrres
    import ptrres.vllm as plugin
    from ptrres.bench import compare

    vllm_copy = cuda_mem_ops.copy_blocks
    cuda_mem_ops._batch_memcpy = (lambda *args: 0, 1)  # the driver: a no-op
    assert plugin.patch(), "ptrres.vllm did not patch vLLM"
    patched = cuda_mem_ops.copy_blocks
    report: dict[str, Any] = {
        "versions": f"vLLM {vllm.__version__}, ptrres {ptrres.__version__}",
        "load": [load()],
        "cells": [],
    }
    rng = np.random.default_rng(27)
    for name, block_bytes in layouts():
        gpu = caches(block_bytes, NUM_GPU_BLOCKS, 0x7F00_0000_0000)
        cpu = caches(block_bytes, NUM_CPU_BLOCKS, 0x3F00_0000_0000)
        staging = caches(block_bytes, NUM_STAGING_SLOTS, 0x1F00_0000_0000)
        store = cuda_mem_ops.build_params(gpu, cpu, Stream())
        cases: list[tuple[int, str, Any, list[int], list[int]]] = []
        for blocks in BLOCKS:
            src = rng.choice(NUM_GPU_BLOCKS, blocks, replace=False).tolist()
            dst = rng.choice(NUM_CPU_BLOCKS, blocks, replace=False).tolist()
            cases.append((blocks, "DMA store", store, src, dst))
        gpu_block = int(rng.integers(NUM_GPU_BLOCKS))
        disk_store = cuda_mem_ops.build_params(gpu, staging, Stream())
        disk_load = cuda_mem_ops.build_params(staging, gpu, Stream())
        cases.append((1, "disk store", disk_store, [gpu_block], [1]))
        cases.append((1, "disk load", disk_load, [0], [gpu_block]))
        for blocks, call, params, src, dst in cases:
            descriptors = same_calls(vllm_copy, patched, src, dst, params)
            calls = {
                "vllm": lambda: vllm_copy(src, dst, params),  # noqa: B023
                "ptrres": lambda: patched(src, dst, params),  # noqa: B023
            }
            timing = compare(calls, seconds=seconds, rounds=rounds)
            cell = {
                "layout": name,
                "layers": len(block_bytes),
                "blocks": blocks,
                "call": call,
                "descriptors": descriptors,
                **{f"{k} us": t.seconds * 1e6 for k, t in timing.items()},
                **{f"{k} faults": page_faults(fn) for k, fn in calls.items()},
            }
            report["cells"].append(cell)
            print(cell, file=sys.stderr, flush=True)  # progress
    plugin.unpatch()
    report["load"].append(load())
    return report


def heap_child(heap: str, argv: list[str]) -> dict[str, Any]:
    """measure_cells() in a child started with its heap's malloc settings."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cells.json")
        done = subprocess.run(
            [sys.executable, __file__, "--heap", heap, "--json", path, *argv],
            env={**os.environ, **HEAPS[heap][0]},
            stdout=subprocess.DEVNULL,
            check=False,
        )
        if done.returncode:
            raise SystemExit(f"the {heap} child exited with {done.returncode}")
        with open(path) as file:
            result: dict[str, Any] = json.load(file)
            return result


def copy_tables(seconds: float, rounds: int, repeats: int, quick: bool) -> None:
    """Both heaps' tables: ``repeats`` children of each, alternating; per
    cell the median over them of each contender's median and of the
    speedups, with each child's speedup beside it."""
    from ptrres.bench import geometric_mean

    argv = ["--copy-rounds", str(rounds), *(["--quick"] if quick else [])]
    runs: dict[str, list[dict[str, Any]]] = {heap: [] for heap in HEAPS}
    for _ in range(repeats):
        for heap in HEAPS:
            runs[heap].append(heap_child(heap, argv))
    print(f"{runs['warm heap'][0]['versions']}\n")
    for heap, (malloc, how) in HEAPS.items():
        loads = "; ".join(" to ".join(run["load"]) for run in runs[heap])
        print(
            f"{heap.capitalize()}: {how} "
            f"(`{' '.join(f'{k}={v}' for k, v in malloc.items())}`). Per cell "
            f"the median over {repeats} processes (each the median of {rounds} "
            f"interleaved rounds), each process's speedup beside; load "
            f"averages {loads}:\n"
        )
        print(
            "| layout | layers | blocks | call | descriptors | vLLM us | ptrres us "
            "| speedup | each process | page faults vLLM / ptrres |"
        )
        print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
        speedups: list[float] = []
        one_block: list[float] = []
        for cells in zip(*(run["cells"] for run in runs[heap]), strict=True):
            cell = cells[0]
            each = [c["vllm us"] / c["ptrres us"] for c in cells]
            speedup = statistics.median(each)
            speedups.append(speedup)
            if cell["blocks"] == 1:
                one_block.append(speedup)

            def median(key: str, cells: tuple[dict[str, Any], ...] = cells) -> float:
                return float(statistics.median(c[key] for c in cells))

            print(
                f"| {cell['layout']} | {cell['layers']} | {cell['blocks']} "
                f"| {cell['call']} | {cell['descriptors']} "
                f"| {median('vllm us'):.1f} | {median('ptrres us'):.1f} "
                f"| {speedup:.1f}x | {' / '.join(f'{x:.1f}' for x in each)} "
                f"| {median('vllm faults'):.0f} / {median('ptrres faults'):.0f} |"
            )
        print(
            f"\n{heap}: geometric mean {geometric_mean(speedups):.1f}x (target >= "
            f"3x), lowest {min(speedups):.1f}x; at one block (the disk backend's "
            f"calls) lowest {min(one_block):.1f}x (target: never slower, > 1x)\n"
        )


# A fresh interpreter: vllm.plugins imported, then load_general_plugins()
# timed; with ptrres loaded, then vLLM's simple backend imported (patch), params
# built (the kernels) and a first copy, each timed.
CHILD = """
import json, sys, time
import vllm.plugins
start = time.perf_counter()
vllm.plugins.load_general_plugins()
report = {"load": time.perf_counter() - start, "numba": "numba" in sys.modules}
if sys.argv[1] == "with":
    import ptrres.vllm as plugin
    start = time.perf_counter()
    from vllm.v1.simple_kv_offload import copy_backend, cuda_mem_ops
    report["import"] = time.perf_counter() - start
    assert plugin.is_patched()
    sys.path.insert(0, sys.argv[2])
    from simple_copy_blocks import Stream, caches
    cuda_mem_ops._batch_memcpy = (lambda *args: 0, 1)
    gpu = caches([65536] * 32, 16384, 0x7F0000000000)
    cpu = caches([65536] * 32, 32768, 0x3F0000000000)
    start = time.perf_counter()
    params = copy_backend.build_params(gpu, cpu, Stream())
    report["build"] = time.perf_counter() - start
    start = time.perf_counter()
    copy_backend.copy_blocks([5, 9, 2], [7, 1, 3], params)
    report["first"] = time.perf_counter() - start
    report["checked"] = hasattr(params, "_ptrres_copy_plan")
print(json.dumps(report))
"""


def plugin_cost(rounds: int) -> None:
    import importlib.metadata

    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PTRRES_VLLM")}
    env.pop("VLLM_PLUGINS", None)
    # Python's bytecode cache on, as for an installed package (pip compiles
    # it): without it, every import compiles ptrres's sources (10 ms).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    # Without ptrres: vLLM's loader still finds every entry point, and loads
    # the others (vLLM ships two), as VLLM_PLUGINS names them.
    others = [
        ep.name
        for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
        if ep.value != "ptrres.vllm:register"
    ]
    envs = {"with": env, "without": {**env, "VLLM_PLUGINS": ",".join(others)}}
    results: dict[str, list[dict[str, Any]]] = {"with": [], "without": []}
    for round_ in range(rounds + 1):  # the first writes the bytecode caches
        for how in ("with", "without"):
            result = subprocess.run(
                [sys.executable, "-c", CHILD, how, here],
                env=envs[how],
                capture_output=True,
                text=True,
                check=False,
            )
            if result.returncode != 0:
                raise SystemExit(result.stderr)
            if round_:
                results[how].append(json.loads(result.stdout.splitlines()[-1]))

    def median_ms(how: str, key: str) -> float:
        return statistics.median(r[key] for r in results[how]) * 1e3

    added = median_ms("with", "load") - median_ms("without", "load")
    print(
        f"\nLoading the plugin, in fresh interpreters after `import vllm.plugins` "
        f"({rounds} of each, alternating; medians):\n"
    )
    print("| load_general_plugins(), plugins loaded | ms | numba imported |")
    print("|---|---:|---|")
    without = f"VLLM_PLUGINS={','.join(others)}" if others else "VLLM_PLUGINS="
    for how, label in (("without", without), ("with", "with ptrres")):
        numba = sorted({str(r["numba"]) for r in results[how]})
        print(f"| {label} | {median_ms(how, 'load'):.1f} | {', '.join(numba)} |")
    print(
        f"\nthe plugin adds {added:.1f} ms to a process that never offloads "
        "(target <= 20 ms)"
    )
    assert all(r["checked"] for r in results["with"])
    print(
        "\nWhere it offloads, with the plugin (warm Numba cache): vLLM's import "
        f"of its simple backend {median_ms('with', 'import'):.0f} ms (the patch "
        "included), the first build_params "
        f"{median_ms('with', 'build'):.0f} ms (the kernels loaded), the first "
        f"copy_blocks {median_ms('with', 'first'):.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter timings")
    parser.add_argument(
        "--rounds", type=int, default=None, help="fresh processes of each kind"
    )
    parser.add_argument(
        "--copy-rounds",
        type=int,
        default=None,
        help="interleaved rounds per cell of the copy tables (their median)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="processes per heap for the copy tables (the median over them)",
    )
    parser.add_argument(
        "--plugin-cost", action="store_true", help="only the plugin's cost"
    )
    # The child that measures one heap's cells, into a JSON file.
    parser.add_argument("--heap", choices=HEAPS, help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 9)
    copy_rounds = args.copy_rounds or (5 if args.quick else 15)
    repeats = args.repeats or (1 if args.quick else 3)
    seconds = 0.1 if args.quick else 0.6
    if args.heap:
        with open(args.json, "w") as file:
            json.dump(measure_cells(seconds, copy_rounds), file)
        return
    if not args.plugin_cost:
        copy_tables(seconds, copy_rounds, repeats, args.quick)
    plugin_cost(rounds)


if __name__ == "__main__":
    main()
