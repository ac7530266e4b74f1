"""A trace's transfers planned and timed on a model layout.

``descriptor_counts`` plans every transfer of a trace on a preset and counts
its descriptors: plain, coalesced ascending only and both ways (SPEC 6, by
count_coalesced), by ptrres' own ``coalesce=True``, and as strided plans;
``trace_timings`` times resolve and plan over the transfers, ptrres against
the numpy reference, as ``ptrres bench --trace`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .. import reference
from .._offloaded import OffloadedLayout
from .._table import PointerTable
from .._types import GPULoadStoreSpec
from ._runs import count_coalesced
from ._trace_files import Trace, TraceTransfer
from .presets import CanonicalPreset, Preset
from .timing import compare

# CPU cost of submitting one descriptor to cuMemcpyBatchAsync (SPEC 6).
SECONDS_PER_DESCRIPTOR = 0.5e-6


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
