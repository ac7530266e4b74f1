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

Every name is importable from here; three rooms hold them: ``_trace_files``
(the format above, ``Trace``, ``load_trace``), ``_runs`` (run lengths and
merged counts, in numpy) and ``_trace_plans`` (a trace planned and timed on
a model layout).
"""

from ._runs import (
    CoalescedCounts,
    RunLengths,
    count_coalesced,
    paired_positions,
    run_lengths,
    trace_run_lengths,
)
from ._trace_files import TRACE_DIR, TRACES, Trace, TraceTransfer, load_trace
from ._trace_plans import (
    SECONDS_PER_DESCRIPTOR,
    DescriptorCounts,
    TraceLayout,
    TraceTiming,
    descriptor_counts,
    spread,
    trace_layout,
    trace_timings,
    transfer_spec,
)

__all__ = [
    "SECONDS_PER_DESCRIPTOR",
    "TRACES",
    "TRACE_DIR",
    "CoalescedCounts",
    "DescriptorCounts",
    "RunLengths",
    "Trace",
    "TraceLayout",
    "TraceTiming",
    "TraceTransfer",
    "count_coalesced",
    "descriptor_counts",
    "load_trace",
    "paired_positions",
    "run_lengths",
    "spread",
    "trace_layout",
    "trace_run_lengths",
    "trace_timings",
    "transfer_spec",
]
