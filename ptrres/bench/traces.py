"""Block-id streams recorded from vLLM 0.33's own allocators, and what they cost.

``benchmarks/vllm_traces.py`` runs vLLM 0.33's scheduler, block pool and CPU
offloading connector over a multi-turn workload and records every store
(GPU -> CPU) and load (CPU -> GPU) job the connector hands its worker. The
traces ship in ``ptrres/bench/traces/*.npz``; reading one needs numpy only
(not vLLM). Format, one entry per transfer unless said otherwise:

- ``store``: bool, True for a GPU -> CPU store, False for a load.
- ``gpu_offsets`` (int64, n + 1) into ``gpu_ids`` (int32): the transfer's GPU
  block ids, in ``GPULoadStoreSpec`` order (one KV-cache group).
- ``cpu_offsets`` (int64, n + 1) into ``cpu_ids`` (int64): its CPU chunk ids,
  in ``CPULoadStoreSpec`` order.
- ``block_indices`` (int64): the index, within the request, of the first GPU
  block (vLLM's ``block_indices``; with ``blocks_per_chunk`` > 1 the first
  chunk may be entered part-way).
- ``metadata``: a 0-d str array of JSON: the vLLM version, eviction policy,
  ``blocks_per_chunk``, ``num_gpu_blocks``, ``num_cpu_blocks``, seed, every
  workload parameter and counts.

Then what the ids cost: ``run_lengths`` (runs of paired ids stepping +1 or -1
on both sides) and ``descriptor_counts`` (a trace's transfers planned on a
model layout, counted plain, coalesced ascending only, coalesced both ways
(SPEC 6), by ptrres' own ``coalesce=True``, and as strided plans).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .. import reference
from .._offloaded import OffloadedLayout
from .._table import PointerTable
from .._types import GPULoadStoreSpec
from .presets import CanonicalPreset, Preset
from .timing import compare

TRACE_DIR = Path(__file__).resolve().parent / "traces"
# The traces that ship with ptrres, by name (the file stem).
TRACES: tuple[str, ...] = tuple(sorted(p.stem for p in TRACE_DIR.glob("*.npz")))
# CPU cost of submitting one descriptor to cuMemcpyBatchAsync (SPEC 6).
SECONDS_PER_DESCRIPTOR = 0.5e-6

_ARRAYS = {
    "store": np.bool_,
    "gpu_offsets": np.int64,
    "gpu_ids": np.int32,
    "cpu_offsets": np.int64,
    "cpu_ids": np.int64,
    "block_indices": np.int64,
}


class TraceTransfer(NamedTuple):
    """One recorded transfer."""

    store: bool
    gpu_ids: npt.NDArray[np.int32]
    cpu_ids: npt.NDArray[np.int64]
    block_index: int


@dataclass(frozen=True, eq=False)
class Trace:
    """A recorded stream of transfers (the module docstring gives the format)."""

    name: str
    metadata: dict[str, Any]
    store: npt.NDArray[np.bool_]
    gpu_offsets: npt.NDArray[np.int64]
    gpu_ids: npt.NDArray[np.int32]
    cpu_offsets: npt.NDArray[np.int64]
    cpu_ids: npt.NDArray[np.int64]
    block_indices: npt.NDArray[np.int64]

    @property
    def blocks_per_chunk(self) -> int:
        return int(self.metadata["blocks_per_chunk"])

    @property
    def num_gpu_blocks(self) -> int:
        return int(self.metadata["num_gpu_blocks"])

    @property
    def num_cpu_blocks(self) -> int:
        return int(self.metadata["num_cpu_blocks"])

    def __len__(self) -> int:
        return len(self.store)

    def transfer(self, i: int) -> TraceTransfer:
        """TraceTransfer i: (store, gpu_ids, cpu_ids, block_index)."""
        return TraceTransfer(
            bool(self.store[i]),
            self.gpu_ids[self.gpu_offsets[i] : self.gpu_offsets[i + 1]],
            self.cpu_ids[self.cpu_offsets[i] : self.cpu_offsets[i + 1]],
            int(self.block_indices[i]),
        )

    def transfers(self) -> Iterator[TraceTransfer]:
        """Every transfer, in the order vLLM's worker submits them."""
        return (self.transfer(i) for i in range(len(self)))


def load_trace(name_or_path: str | Path) -> Trace:
    """A shipped trace by name (one of TRACES), or any trace file by path.

    Raises:
        ValueError: the file is not a well-formed trace.
        FileNotFoundError: no such trace.
    """
    path = Path(name_or_path)
    if str(name_or_path) in TRACES:
        path = TRACE_DIR / f"{name_or_path}.npz"
    elif not path.exists():
        raise FileNotFoundError(
            f"no trace {str(name_or_path)!r}: neither a file nor one of {TRACES}"
        )
    with np.load(path, allow_pickle=False) as data:
        missing = {*_ARRAYS, "metadata"} - set(data.files)
        if missing:
            raise ValueError(f"{path}: not a trace, missing {sorted(missing)}")
        arrays = {key: data[key] for key in _ARRAYS}
        metadata = json.loads(str(data["metadata"][()]))
    for key, dtype in _ARRAYS.items():
        if arrays[key].dtype != dtype or arrays[key].ndim != 1:
            raise ValueError(
                f"{path}: {key} is {arrays[key].ndim}-D {arrays[key].dtype}, "
                f"not 1-D {np.dtype(dtype)}"
            )
    n = len(arrays["store"])
    for side in ("gpu", "cpu"):
        offsets = arrays[f"{side}_offsets"]
        if (
            len(offsets) != n + 1
            or offsets[0] != 0
            or offsets[-1] != len(arrays[f"{side}_ids"])
            or (np.diff(offsets) < 0).any()
        ):
            raise ValueError(f"{path}: {side}_offsets do not index {side}_ids")
    if len(arrays["block_indices"]) != n:
        raise ValueError(f"{path}: {len(arrays['block_indices'])} block_indices")
    return Trace(name=str(metadata.get("name", path.stem)), metadata=metadata, **arrays)


def _run_starts(
    src: npt.NDArray[Any],
    dst: npt.NDArray[Any],
    sizes: npt.NDArray[Any],
    *,
    descending: bool,
    breaks: npt.NDArray[np.intp] | None = None,
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int8]]:
    """Where the runs of SPEC 6's greedy merge start, and each step's direction.

    Returns ``starts`` (bool per element: it starts a run) and ``step``
    (int8 per element: +1 when it continues the element before upwards on
    both sides, -1 downwards, 0 otherwise). Descriptor i continues i - 1
    upwards when ``src[i-1] + sizes[i-1] == src[i]`` and the same on dst;
    downwards (only with ``descending``) when ``src[i] + sizes[i] ==
    src[i-1]`` and the same on dst. A run keeps one direction: a descriptor
    whose step differs from the step before starts a run, unless the one
    before started a run itself (a run of one takes either direction).
    Positions in ``breaks`` always start a run.
    """
    n = len(src)
    step = np.zeros(n, np.int8)
    starts = np.ones(n, dtype=bool)
    if n < 2:
        return starts, step
    up = (src[:-1] + sizes[:-1] == src[1:]) & (dst[:-1] + sizes[:-1] == dst[1:])
    step[1:][up] = 1
    if descending:
        down = (src[1:] + sizes[1:] == src[:-1]) & (dst[1:] + sizes[1:] == dst[:-1])
        step[1:][down & ~up] = -1
    if breaks is not None:
        step[breaks] = 0
    # i turns when it and i - 1 both continue, in different directions: i - 1
    # then ended a run, so i starts one, unless i - 1 started a run itself,
    # which happens exactly at every other turn of a chain of turns in a row.
    turn = np.zeros(n, dtype=bool)
    turn[2:] = (step[2:] != 0) & (step[1:-1] != 0) & (step[2:] != step[1:-1])
    index = np.arange(n)
    chain_start = np.maximum.accumulate(
        np.where(turn & ~np.concatenate(([False], turn[:-1])), index, 0)
    )
    starts = (step == 0) | (turn & ((index - chain_start) % 2 == 0))
    starts[0] = True
    return starts, step


class CoalescedCounts(NamedTuple):
    """Descriptors left after merging runs (SPEC 6)."""

    ascending: int  # merging ascending runs only
    descending: int  # merging runs in either direction, each run one way


def count_coalesced(
    src: npt.ArrayLike,
    dst: npt.ArrayLike,
    sizes: npt.ArrayLike,
    *,
    breaks: npt.ArrayLike | None = None,
) -> CoalescedCounts:
    """How many descriptors a plan has once merged, both rules, in numpy.

    Args:
        src, dst, sizes: the plan's descriptors (unsigned or signed integers).
        breaks: positions where a run may not continue from the descriptor
            before (where the plan passes into another allocation).
    """
    s, d, z = (np.asarray(a).astype(np.uint64, copy=False) for a in (src, dst, sizes))
    cuts = None if breaks is None else np.asarray(breaks, dtype=np.intp)
    up, _ = _run_starts(s, d, z, descending=False, breaks=cuts)
    both, _ = _run_starts(s, d, z, descending=True, breaks=cuts)
    return CoalescedCounts(int(up.sum()), int(both.sum()))


class RunLengths(NamedTuple):
    """Runs of a paired id sequence, merged as SPEC 6 merges descriptors."""

    ascending: npt.NDArray[np.int64]  # lengths of runs stepping +1 on both sides
    descending: npt.NDArray[np.int64]  # lengths of runs stepping -1 on both sides
    singles: int  # pairs that continue no run

    @property
    def runs(self) -> int:
        return len(self.ascending) + len(self.descending) + self.singles


def paired_positions(
    gpu_ids: npt.ArrayLike,
    cpu_ids: npt.ArrayLike,
    blocks_per_chunk: int = 1,
    block_index: int = 0,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """GPU block k paired with its CPU sub-block, in GPU-block units.

    GPU block k sits in sub-block ``j % bpc`` of chunk ``cpu_ids[j // bpc]``,
    ``j = block_index % bpc + k`` (SPEC 5): its CPU position is
    ``chunk * bpc + j % bpc``.
    """
    gpu = np.asarray(gpu_ids, dtype=np.int64)
    cpu = np.asarray(cpu_ids, dtype=np.int64)
    j = block_index % blocks_per_chunk + np.arange(len(gpu))
    return gpu, cpu[j // blocks_per_chunk] * blocks_per_chunk + j % blocks_per_chunk


def run_lengths(
    gpu_ids: npt.ArrayLike,
    cpu_ids: npt.ArrayLike,
    blocks_per_chunk: int = 1,
    block_index: int = 0,
) -> RunLengths:
    """Runs of one transfer's (GPU block, CPU sub-block) pairs.

    Consecutive pairs continue an ascending run when both sides step +1, a
    descending one when both step -1; a run keeps one direction, greedily
    from the left (SPEC 6's rule with one-block descriptors, so the number of
    runs is the descriptor count of a one-ref layout whose page fills its
    row, merged both ways).
    """
    gpu, cpu = paired_positions(gpu_ids, cpu_ids, blocks_per_chunk, block_index)
    starts, step = _run_starts(gpu, cpu, np.ones(len(gpu), np.int64), descending=True)
    bounds = np.append(np.flatnonzero(starts), len(gpu))
    lengths = np.diff(bounds)
    # A run's direction is the step of its second element.
    direction = np.where(
        lengths > 1, step[np.minimum(bounds[:-1] + 1, len(gpu) - 1)], 0
    )
    return RunLengths(
        lengths[direction > 0].astype(np.int64),
        lengths[direction < 0].astype(np.int64),
        int((lengths == 1).sum()),
    )


def trace_run_lengths(
    trace: Trace, transfers: Sequence[int] | None = None
) -> RunLengths:
    """run_lengths() of every transfer of a trace (or those given), pooled."""
    parts = [
        run_lengths(t.gpu_ids, t.cpu_ids, trace.blocks_per_chunk, t.block_index)
        for t in (
            trace.transfers() if transfers is None else map(trace.transfer, transfers)
        )
    ]
    return RunLengths(
        np.concatenate([np.zeros(0, np.int64), *(p.ascending for p in parts)]),
        np.concatenate([np.zeros(0, np.int64), *(p.descending for p in parts)]),
        sum(p.singles for p in parts),
    )


@dataclass(frozen=True)
class DescriptorCounts:
    """A trace's transfers planned on one layout: descriptors, summed.

    ``strided`` is None for direct layouts (Preset), where a strided plan
    is the plain one.
    """

    preset: str
    transfers: int
    blocks: int
    plain: int  # one per (block, ref), or per fragment on canonical layouts
    ascending: int  # plain, merged in ascending runs only (the old rule)
    descending: int  # plain, merged in runs either way (SPEC 6)
    ptrres: int  # ptrres' own plan_transfer(coalesce=True)
    strided: int | None  # plan_strided_transfer(), on canonical layouts

    def submission_seconds(self, count: int) -> float:
        """The CPU time ``count`` descriptors take to submit (0.5 us each)."""
        return count * SECONDS_PER_DESCRIPTOR


class TraceLayout(NamedTuple):
    """A model layout sized for a trace's ids."""

    table: PointerTable
    offloaded: OffloadedLayout
    offloaded_tensors: list[Any]
    kv_caches: Any
    num_groups: int
    refs: int  # refs per group


def trace_layout(trace: Trace, preset: Preset | CanonicalPreset) -> TraceLayout:
    """The preset's layout over as many GPU blocks and CPU chunks as the trace."""
    bpc = trace.blocks_per_chunk
    kv = preset.kv_caches(num_blocks=trace.num_gpu_blocks)
    tensors = preset.offloaded_tensors(bpc, num_chunks=trace.num_cpu_blocks)
    if isinstance(preset, CanonicalPreset):
        canonical, groups, refs = True, 1, preset.num_layers
    else:
        canonical, groups, refs = False, preset.num_groups, preset.refs_per_group
    return TraceLayout(
        PointerTable(kv),
        OffloadedLayout(tensors, bpc, canonical=canonical),
        tensors,
        kv,
        groups,
        refs,
    )


def transfer_spec(
    transfer: TraceTransfer, num_groups: int
) -> tuple[GPULoadStoreSpec, npt.NDArray[np.int64]]:
    """A transfer as a spec and chunk ids: every group moves the trace's ids.

    The traces have one KV-cache group; on a layout of several groups (the
    hybrid preset) each group takes the same ids, an approximation (vLLM's
    hybrid allocator gives each group blocks of its own).
    """
    n = len(transfer.gpu_ids)
    spec = GPULoadStoreSpec(
        np.tile(transfer.gpu_ids, num_groups),
        [n] * num_groups,
        [transfer.block_index] * num_groups,
    )
    return spec, np.tile(transfer.cpu_ids, num_groups)


def descriptor_counts(
    trace: Trace,
    preset: Preset | CanonicalPreset,
    transfers: Sequence[int] | None = None,
) -> DescriptorCounts:
    """Plan every transfer (or those given) on the preset and count descriptors.

    ``ascending`` and ``descending`` come from count_coalesced() over the
    plain plan (never across two refs: each ref is an allocation of its
    own); ``ptrres`` from ptrres' ``plan_transfer(coalesce=True)``.
    """
    layout = trace_layout(trace, preset)
    canonical = isinstance(preset, CanonicalPreset)
    indices = range(len(trace)) if transfers is None else transfers
    totals = dict(blocks=0, plain=0, ascending=0, descending=0, ptrres=0, strided=0)
    for i in indices:
        transfer = trace.transfer(i)
        spec, chunk_ids = transfer_spec(transfer, layout.num_groups)
        plan = layout.table.plan_transfer(
            spec, layout.offloaded, chunk_ids, store=transfer.store
        )
        n = len(plan.sizes)
        per_ref = n // max(layout.num_groups * layout.refs, 1)
        breaks = np.arange(per_ref, n, per_ref) if per_ref else None
        counts = count_coalesced(plan.src, plan.dst, plan.sizes, breaks=breaks)
        merged = layout.table.plan_transfer(
            spec, layout.offloaded, chunk_ids, store=transfer.store, coalesce=True
        )
        totals["blocks"] += len(transfer.gpu_ids)
        totals["plain"] += n
        totals["ascending"] += counts.ascending
        totals["descending"] += counts.descending
        totals["ptrres"] += len(merged.sizes)
        if canonical:
            strided_plan = layout.table.plan_strided_transfer(
                spec, layout.offloaded, chunk_ids, store=transfer.store
            )
            totals["strided"] += len(strided_plan.src)
    strided = totals.pop("strided")
    return DescriptorCounts(
        preset=preset.name,
        transfers=len(indices),
        strided=strided if canonical else None,
        **totals,
    )


@dataclass(frozen=True)
class TraceTiming:
    """One pass over a trace's transfers on a layout: reference and ptrres."""

    preset: str
    operation: str  # "resolve" or "plan"
    transfers: int
    ops: int  # descriptors the pass writes (before any merging)
    reference_seconds: float
    ptrres_seconds: float

    @property
    def speedup(self) -> float:
        return self.reference_seconds / self.ptrres_seconds


def trace_timings(
    trace: Trace,
    preset: Preset,
    transfers: Sequence[int] | None = None,
    *,
    seconds: float = 0.4,
) -> list[TraceTiming]:
    """Time resolve and plan over the transfers, ptrres against the reference.

    One call of a contender is a pass over every transfer given, in trace
    order, each with its own direction; ptrres writes into int64 out=
    buffers allocated once (as a server does with pinned ones), the numpy
    reference allocates (as vLLM's numpy code does). Interleaved by
    compare(), as ``ptrres bench`` times its cells.
    """
    layout = trace_layout(trace, preset)
    indices = range(len(trace)) if transfers is None else transfers
    work = []
    for i in indices:
        transfer = trace.transfer(i)
        spec, chunk_ids = transfer_spec(transfer, layout.num_groups)
        work.append((spec, chunk_ids, transfer.store))
    ops = sum(len(spec.block_ids) for spec, _, _ in work) * layout.refs
    longest = max((len(spec.block_ids) for spec, _, _ in work), default=0)
    out = tuple(np.empty(longest * layout.refs, np.int64) for _ in range(3))
    table, offloaded, kv = layout.table, layout.offloaded, layout.kv_caches
    bpc = trace.blocks_per_chunk

    def reference_resolve() -> None:
        for spec, _, _ in work:
            reference.resolve_device_pointers(spec, kv)

    def ptrres_resolve() -> None:
        for spec, _, _ in work:
            table.resolve(spec, out=out[:2])

    def reference_plan() -> None:
        for spec, chunk_ids, store in work:
            reference.plan_transfer(
                spec, kv, layout.offloaded_tensors, bpc, chunk_ids, store=store
            )

    def ptrres_plan() -> None:
        for spec, chunk_ids, store in work:
            table.plan_transfer(spec, offloaded, chunk_ids, store=store, out=out)

    passes: dict[str, dict[str, Callable[[], object]]] = {
        "resolve": {"reference": reference_resolve, "ptrres": ptrres_resolve},
        "plan": {"reference": reference_plan, "ptrres": ptrres_plan},
    }
    rows = []
    for operation, contenders in passes.items():
        timings = compare(contenders, seconds=seconds, rounds=5)
        rows.append(
            TraceTiming(
                preset.name,
                operation,
                len(work),
                ops,
                timings["reference"].seconds,
                timings["ptrres"].seconds,
            )
        )
    return rows


def spread(n: int, k: int | None) -> list[int]:
    """k transfer indices spread evenly over n (all of them when k is None)."""
    if k is None or k >= n:
        return list(range(n))
    return sorted({int(i) for i in np.linspace(0, n - 1, k)})
