"""Side-by-side timing in one process, and the cells of `ptrres bench`.

compare() interleaves its contenders so that a noisy neighbour slows every
one alike; bench_cell() and canonical_bench_cell() time ptrres against its
baselines (peers) on a preset layout (presets).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .. import reference
from .._coalesce import coalesce
from .._files import plan_file_ops
from .._offloaded import OffloadedLayout
from .._table import PointerTable
from .peers import (
    pr_worker_file_ops,
    vllm_canonical_copy_plans,
    vllm_style_canonical_plan,
)
from .presets import (
    _ONE_GROUP,
    CanonicalPreset,
    Preset,
    make_offloaded_ids,
    make_spec,
)


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one contender: the median of interleaved rounds."""

    seconds: float
    rounds: tuple[float, ...]


def compare(
    contenders: dict[str, Callable[[], object]],
    *,
    seconds: float = 0.3,
    rounds: int = 7,
) -> dict[str, Timing]:
    """Time several functions side by side, interleaved, in this process.

    Each contender is calibrated to a batch of calls that takes about
    ``seconds / (rounds * len(contenders))``; then the rounds run the batches in
    turn, so that a noisy neighbour slows every contender alike.
    """
    batch_seconds = seconds / (rounds * len(contenders))
    batches = {name: _calibrate(fn, batch_seconds) for name, fn in contenders.items()}
    per_call: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            per_call[name].append(_time_batch(fn, batches[name]))
    return {
        name: Timing(statistics.median(times), tuple(times))
        for name, times in per_call.items()
    }


def _calibrate(fn: Callable[[], object], batch_seconds: float) -> int:
    fn()  # warm caches, compile if needed
    n = 1
    while True:
        elapsed = _time_batch(fn, n) * n
        if elapsed >= batch_seconds / 4 or n >= 1 << 20:
            return max(1, int(n * batch_seconds / max(elapsed, 1e-9)))
        n *= 4


def _time_batch(fn: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def geometric_mean(values: Sequence[float]) -> float:
    """The geometric mean of positive numbers."""
    return float(np.exp(np.mean(np.log(values))))


# The operations `ptrres bench` times, each against its numpy reference (the
# file tier against the PR worker's op building), and those it times unless
# told which.
OPERATIONS = ("resolve", "plan", "coalesce", "files")
DEFAULT_OPERATIONS = OPERATIONS[:3]
BENCH_BLOCKS_PER_CHUNK = 4


@dataclass(frozen=True)
class BenchRow:
    """One cell of `ptrres bench`: an operation on a layout at one size."""

    preset: str
    operation: str
    blocks_per_group: int
    # Copy ops of the transfer (descriptors before coalescing).
    ops: int
    # Descriptors ptrres returned (fewer than ops when coalescing merged some).
    descriptors: int
    reference_seconds: float
    ptrres_seconds: float
    # A plain numpy fill of the same output bytes (measured at the largest
    # size only, else None): the physical limit of any implementation.
    fill_seconds: float | None

    @property
    def speedup(self) -> float:
        return self.reference_seconds / self.ptrres_seconds

    @property
    def ns_per_op(self) -> float:
        return self.ptrres_seconds / max(self.ops, 1) * 1e9


def bench_cell(
    preset: Preset,
    operation: str,
    blocks_per_group: int,
    *,
    seconds: float,
    with_fill: bool,
) -> BenchRow:
    """Time one operation of ptrres and of the reference, side by side.

    ptrres writes into preallocated int64 out= buffers (as a server does with
    pinned ones); the reference allocates, as vLLM's numpy code does.
    """
    bpc = BENCH_BLOCKS_PER_CHUNK
    kv = preset.kv_caches()
    table = PointerTable(kv)
    spec = make_spec(preset, blocks_per_group)
    offloaded_tensors = preset.offloaded_tensors(bpc)
    offloaded = OffloadedLayout(offloaded_tensors, bpc)
    chunk_ids = make_offloaded_ids(spec, bpc)
    n_ops = blocks_per_group * preset.num_refs
    out = (
        np.empty(n_ops, np.int64),
        np.empty(n_ops, np.int64),
        np.empty(n_ops, np.int64),
    )

    def fill(n_outputs: int) -> None:
        for buffer in out[:n_outputs]:
            buffer.fill(1)

    contenders: dict[str, Callable[[], object]]
    if operation == "resolve":
        contenders = {
            "reference": lambda: reference.resolve_device_pointers(spec, kv),
            "ptrres": lambda: table.resolve(spec, out=out[:2]),
        }
        n_outputs = 2
        descriptors = n_ops
    elif operation == "plan":
        contenders = {
            "reference": lambda: reference.plan_transfer(
                spec, kv, offloaded_tensors, bpc, chunk_ids, store=True
            ),
            "ptrres": lambda: table.plan_transfer(
                spec, offloaded, chunk_ids, store=True, out=out
            ),
        }
        n_outputs = 3
        descriptors = n_ops
    elif operation == "coalesce":
        plan = table.plan_transfer(spec, offloaded, chunk_ids, store=True)
        contenders = {
            "reference": lambda: reference.coalesce(plan.src, plan.dst, plan.sizes),
            "ptrres": lambda: coalesce(plan.src, plan.dst, plan.sizes, out=out),
        }
        n_outputs = 3
        descriptors = len(coalesce(plan.src, plan.dst, plan.sizes).sizes)
    elif operation == "files":
        device_ptrs = table.resolve(spec)
        contenders = {
            "reference": lambda: pr_worker_file_ops(device_ptrs, bpc),
            "ptrres": lambda: plan_file_ops(device_ptrs, bpc, out=out),
        }
        n_outputs = 3
        descriptors = n_ops
    else:
        raise ValueError(f"unknown operation {operation!r}; one of {OPERATIONS}")
    if with_fill:
        contenders["fill"] = lambda: fill(n_outputs)
    timings = compare(contenders, seconds=seconds, rounds=5)
    return BenchRow(
        preset=preset.name,
        operation=operation,
        blocks_per_group=blocks_per_group,
        ops=n_ops,
        descriptors=descriptors,
        reference_seconds=timings["reference"].seconds,
        ptrres_seconds=timings["ptrres"].seconds,
        fill_seconds=timings["fill"].seconds if with_fill else None,
    )


@dataclass(frozen=True)
class CanonicalBenchRow:
    """One cell of `ptrres bench --operation canonical`."""

    preset: str
    blocks_per_group: int
    # Descriptors of the flat plan (after writer filtering), and of the
    # strided plan.
    descriptors: int
    strided_descriptors: int
    peer_seconds: float  # vLLM 0.33's numpy canonical fill, into buffers
    flat_seconds: float  # ptrres' flat plan, into out= buffers
    strided_seconds: float  # ptrres' strided plan, into out= buffers
    # A numpy fill of the flat plan's output bytes (the largest size only).
    fill_seconds: float | None

    @property
    def flat_speedup(self) -> float:
        return self.peer_seconds / self.flat_seconds

    @property
    def strided_speedup(self) -> float:
        return self.peer_seconds / self.strided_seconds


def canonical_bench_cell(
    preset: CanonicalPreset,
    blocks_per_group: int,
    *,
    seconds: float,
    with_fill: bool,
) -> CanonicalBenchRow:
    """Time vLLM's canonical fill, ptrres' flat and strided plans, side by side.

    Every contender writes into buffers allocated once, as vLLM's pooled
    pinned buffers and ptrres' out= are; vLLM's fragment templates are built
    beforehand, as its handler does at start-up.
    """
    bpc = BENCH_BLOCKS_PER_CHUNK
    kv = preset.kv_caches()
    table = PointerTable(kv)
    spec = make_spec(_ONE_GROUP, blocks_per_group)
    tensors = preset.offloaded_tensors(bpc)
    layout = OffloadedLayout(tensors, bpc, canonical=True)
    chunk_ids = make_offloaded_ids(spec, bpc)
    store = preset.store
    copy_plans = vllm_canonical_copy_plans(kv, store)
    max_ops = blocks_per_group * preset.num_layers * preset.run[3]
    out = tuple(np.empty(max_ops, np.int64) for _ in range(3))
    max_rows = blocks_per_group * preset.num_layers
    out_2d = tuple(np.empty(max_rows, np.int64) for _ in range(6))
    contenders: dict[str, Callable[[], object]] = {
        "peer": lambda: vllm_style_canonical_plan(
            spec, kv, copy_plans, tensors, bpc, chunk_ids, store, out
        ),
        "flat": lambda: table.plan_transfer(
            spec, layout, chunk_ids, store=store, out=out
        ),
        "strided": lambda: table.plan_strided_transfer(
            spec, layout, chunk_ids, store=store, out=out_2d
        ),
    }
    descriptors = len(table.plan_transfer(spec, layout, chunk_ids, store=store).src)
    if with_fill:

        def fill() -> None:
            for buffer in out:
                buffer[:descriptors].fill(1)

        contenders["fill"] = fill
    timings = compare(contenders, seconds=seconds, rounds=5)
    strided = table.plan_strided_transfer(spec, layout, chunk_ids, store=store)
    return CanonicalBenchRow(
        preset=preset.name,
        blocks_per_group=blocks_per_group,
        descriptors=descriptors,
        strided_descriptors=len(strided.src),
        peer_seconds=timings["peer"].seconds,
        flat_seconds=timings["flat"].seconds,
        strided_seconds=timings["strided"].seconds,
        fill_seconds=timings["fill"].seconds if with_fill else None,
    )
