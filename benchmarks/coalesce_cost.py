"""What coalescing costs: coalesced plans against plain ones, coalesce() against a fill.

Issue-14 targets, every figure a ratio of medians of interleaved rounds timed in
one process:
- ``plan_transfer(coalesce=True)`` within 1.2x of ``plan_transfer()`` (store
  plans, bpc 4, into out= buffers) for every layout, kind of block ids and size;
- the same bound for canonical plans (``ptrres bench``'s canonical presets,
  loads and stores) and for file op lists (``PointerTable.plan_file_ops``);
- the standalone ``coalesce()`` within 1.5x of a numpy fill of its output, at
  4096 blocks on every bench preset.

Issue-26 target: what a transfer costs on the CPU is its plan plus the
submission of its descriptors (about 0.5 us each to cuMemcpyBatchAsync, SPEC
6). The ``+ submit`` column is (coalesced plan + 0.5 us x merged) over (plain
plan + 0.5 us x descriptors): at most 1.01x in every cell, even where nothing
merges, with descending runs detected.

Run: python benchmarks/coalesce_cost.py [--quick] [--only SECTION]...
(sections: plans, canonical, files, coalesce)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

import ptrres
from ptrres.bench import (
    CANONICAL_PRESETS,
    PRESETS,
    compare,
    make_offloaded_ids,
    make_spec,
)

LAYOUTS = ["llama-3.1-8b", "llama-3.1-70b-tp4", "hybrid-4x12"]
SIZES = [16, 256, 4096]
BLOCKS_PER_CHUNK = 4
NUM_BLOCKS = 32768
PLAN_TARGET = 1.2
FILL_TARGET = 1.5
SUBMIT_TARGET = 1.01
SUBMIT_SECONDS = 0.5e-6  # CPU time to submit one descriptor (SPEC 6)


def random_ids(n: int, rng: np.random.Generator) -> npt.NDArray[np.int64]:
    """Distinct ids in random order, the first two adjacent.

    One pair that continues is enough to make a group worth merging: the
    costliest case for a merge that is paid per group.
    """
    ids = rng.choice(NUM_BLOCKS - 1, size=n, replace=False).astype(np.int64)
    if n > 1 and ids[0] + 1 not in ids:
        ids[1] = ids[0] + 1
    return ids


def short_runs(
    n: int, rng: np.random.Generator, down: bool = False
) -> npt.NDArray[np.int64]:
    """Runs of 1-8 consecutive ids from random places: a churned free list.
    ``down``: each run counts down (eviction order); the chunks still ascend,
    so only the device side descends: what looking for descending runs costs
    where none merges."""
    ids: list[int] = []
    while len(ids) < n:
        run = min(int(rng.integers(1, 9)), n - len(ids))
        start = int(rng.integers(0, NUM_BLOCKS - run))
        steps = (
            range(start + run - 1, start - 1, -1) if down else range(start, start + run)
        )
        ids.extend(steps)
    return np.array(ids, np.int64)


def consecutive(n: int, rng: np.random.Generator) -> npt.NDArray[np.int64]:
    """One run of consecutive ids: a fresh pool."""
    start = int(rng.integers(0, NUM_BLOCKS - n))
    return np.arange(start, start + n, dtype=np.int64)


ID_KINDS: dict[str, Callable[[int, np.random.Generator], npt.NDArray[np.int64]]] = {
    "random": random_ids,
    "runs of 1-8": short_runs,
    "runs of 1-8 down": lambda n, rng: short_runs(n, rng, down=True),
    "consecutive": consecutive,
}


def spec_for(
    n: int, kind: str, num_groups: int, seed: int = 0
) -> ptrres.GPULoadStoreSpec:
    rng = np.random.default_rng(seed)
    groups = [ID_KINDS[kind](n, rng) for _ in range(num_groups)]
    return ptrres.GPULoadStoreSpec(
        np.concatenate(groups), [n] * num_groups, [0] * num_groups
    )


# What each section times, plain and coalesced, for a layout, a size and a
# kind of ids: (one plan, taking out= and coalesce=; descriptors unmerged).
Setup = tuple[Callable[..., Any], int]


def direct_plans(name: str, n: int, kind: str) -> Setup:
    preset = PRESETS[name]
    table = ptrres.PointerTable(preset.kv_caches(NUM_BLOCKS))
    offloaded = ptrres.OffloadedLayout(
        preset.offloaded_tensors(BLOCKS_PER_CHUNK), BLOCKS_PER_CHUNK
    )
    spec = spec_for(n, kind, preset.num_groups)
    chunk_ids = make_offloaded_ids(spec, BLOCKS_PER_CHUNK)
    return (
        lambda **kw: table.plan_transfer(spec, offloaded, chunk_ids, store=True, **kw),
        n * preset.num_refs,
    )


def canonical_plans(label: str, n: int, kind: str) -> Setup:
    name, direction = label.split()
    preset = CANONICAL_PRESETS[name]
    table = ptrres.PointerTable(preset.kv_caches(NUM_BLOCKS))
    offloaded = ptrres.OffloadedLayout(
        preset.offloaded_tensors(BLOCKS_PER_CHUNK), BLOCKS_PER_CHUNK, canonical=True
    )
    spec = spec_for(n, kind, 1)
    chunk_ids = make_offloaded_ids(spec, BLOCKS_PER_CHUNK)
    store = direction == "store"
    n_ops = n * preset.num_layers * preset.run[3]
    return (
        lambda **kw: table.plan_transfer(spec, offloaded, chunk_ids, store=store, **kw),
        n_ops,
    )


def file_ops(name: str, n: int, kind: str) -> Setup:
    preset = PRESETS[name]
    table = ptrres.PointerTable(preset.kv_caches(NUM_BLOCKS))
    spec = spec_for(n, kind, preset.num_groups)
    return (
        lambda **kw: table.plan_file_ops(spec, BLOCKS_PER_CHUNK, **kw),
        n * preset.num_refs,
    )


SECTIONS: dict[str, tuple[str, Callable[[str, int, str], Setup], list[str]]] = {
    "plans": (
        f"store plans, bpc {BLOCKS_PER_CHUNK}, out= buffers",
        direct_plans,
        LAYOUTS,
    ),
    "canonical": (
        f"canonical plans (ptrres bench's presets, both directions), bpc "
        f"{BLOCKS_PER_CHUNK}, out= buffers",
        canonical_plans,
        [f"{name} {way}" for name in CANONICAL_PRESETS for way in ("load", "store")],
    ),
    "files": (
        f"file op lists (ref-major), bpc {BLOCKS_PER_CHUNK}, out= buffers",
        file_ops,
        LAYOUTS,
    ),
}


def plan_cost(setup: Setup, seconds: float) -> tuple[float, float, int]:
    """(plain seconds, coalesced seconds, descriptors after merging)."""
    plan, n_ops = setup
    out = tuple(np.empty(n_ops, np.int64) for _ in range(3))
    timings = compare(
        {
            "plan": lambda: plan(out=out),
            "coalesced": lambda: plan(out=out, coalesce=True),
        },
        seconds=seconds,
    )
    merged = plan(coalesce=True)
    return timings["plan"].seconds, timings["coalesced"].seconds, len(merged.sizes)


def fill_cost(name: str, n: int, seconds: float) -> tuple[float, float, float, int]:
    """(coalesce() seconds, numpy fill seconds, floor seconds, descriptors
    after merging).

    The fill is that of ``ptrres bench``: 1 into every entry of the three out=
    buffers, which are as long as the input (the most coalesce() may write).
    The floor is what any coalesce() must do, in numpy: read every input
    (contiguity needs each src, dst and size) and write as many descriptors
    as survive (np.copyto of that many, and max() of the rest).
    """
    preset = PRESETS[name]
    table = ptrres.PointerTable(preset.kv_caches(NUM_BLOCKS))
    offloaded = ptrres.OffloadedLayout(
        preset.offloaded_tensors(BLOCKS_PER_CHUNK), BLOCKS_PER_CHUNK
    )
    spec = make_spec(preset, n)
    plan = table.plan_transfer(
        spec, offloaded, make_offloaded_ids(spec, BLOCKS_PER_CHUNK), store=True
    )
    n_ops = len(plan.sizes)
    out = tuple(np.empty(n_ops, np.uint64) for _ in range(3))
    written = len(ptrres.coalesce(plan.src, plan.dst, plan.sizes).sizes)

    def numpy_fill() -> None:
        for buffer in out:
            buffer.fill(1)

    def floor() -> None:
        for source, buffer in zip((plan.src, plan.dst, plan.sizes), out):
            np.copyto(buffer[:written], source[:written])
            if written < n_ops:
                source[written:].max()

    timings = compare(
        {
            "coalesce": lambda: ptrres.coalesce(
                plan.src, plan.dst, plan.sizes, out=out
            ),
            "fill": numpy_fill,
            "floor": floor,
        },
        seconds=seconds,
    )
    return (
        timings["coalesce"].seconds,
        timings["fill"].seconds,
        timings["floor"].seconds,
        written,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter timings")
    parser.add_argument(
        "--only",
        action="append",
        choices=[*SECTIONS, "coalesce"],
        help="one section (repeat for several); all by default",
    )
    args = parser.parse_args()
    seconds = 0.1 if args.quick else 0.4
    ptrres.warmup()

    for section in args.only or SECTIONS:
        if section == "coalesce":
            continue
        title, setup, layouts = SECTIONS[section]
        print(f"{title} (target <= {PLAN_TARGET}x)")
        print(
            "| layout | block ids | blocks | descriptors | merged | plan | + coalesce "
            "| + submit |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
        )
        worst = worst_submitted = 0.0
        for name in layouts:
            for kind in ID_KINDS:
                for n in SIZES:
                    made = setup(name, n, kind)
                    plain, merged, written = plan_cost(made, seconds)
                    ratio = merged / plain
                    worst = max(worst, ratio)
                    submitted = (merged + SUBMIT_SECONDS * written) / (
                        plain + SUBMIT_SECONDS * made[1]
                    )
                    worst_submitted = max(worst_submitted, submitted)
                    print(
                        f"| {name} | {kind} | {n} | {made[1]} | {written} "
                        f"| {plain * 1e6:.1f} us | {merged * 1e6:.1f} us "
                        f"({ratio:.2f}x) | {submitted:.3f}x |"
                    )
        print(f"worst coalesced/plain: {worst:.2f}x (target {PLAN_TARGET}x)")
        print(
            f"worst with submission: {worst_submitted:.3f}x (target {SUBMIT_TARGET}x)\n"
        )
    if args.only and "coalesce" not in args.only:
        return

    blocks = 4096
    print(f"coalesce() at {blocks} blocks against a numpy fill of its output")
    print("(floor: numpy reading every input, writing only what survives)")
    print("| preset | descriptors | merged | coalesce | fill | x fill | floor x fill |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    worst = 0.0
    for name in PRESETS:
        coalesce_s, fill_s, floor_s, written = fill_cost(name, blocks, seconds)
        ratio = coalesce_s / fill_s
        worst = max(worst, ratio)
        print(
            f"| {name} | {blocks * PRESETS[name].num_refs} | {written} "
            f"| {coalesce_s * 1e6:.0f} us | {fill_s * 1e6:.0f} us "
            f"| {ratio:.2f}x | {floor_s / fill_s:.2f}x |"
        )
    print(f"worst coalesce/fill: {worst:.2f}x (target {FILL_TARGET}x)")


if __name__ == "__main__":
    main()
