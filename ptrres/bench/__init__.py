"""Model-shaped layouts and side-by-side timing, for benchmarks and notebooks.

Three rooms: ``presets`` (model layouts over tensors that are never
allocated, and the ids of transfers on them), ``peers`` (vLLM's numpy code as
it stands: the baselines) and ``timing`` (interleaved timing in one process,
and the cells of ``ptrres bench``). Every name is importable from here.
"""

from .peers import (
    pr_worker_file_ops,
    vllm_canonical_copy_plans,
    vllm_style_canonical_plan,
    vllm_style_plan,
    vllm_style_resolve,
)
from .presets import _ONE_GROUP as _ONE_GROUP  # tests make one-group specs
from .presets import (
    CANONICAL_PRESETS,
    PRESETS,
    VIRTUAL_ALIGN,
    VIRTUAL_BASE,
    CanonicalPreset,
    KiB,
    Preset,
    VirtualTensor,
    make_offloaded_ids,
    make_spec,
)
from .timing import (
    BENCH_BLOCKS_PER_CHUNK,
    DEFAULT_OPERATIONS,
    OPERATIONS,
    BenchRow,
    CanonicalBenchRow,
    Timing,
    bench_cell,
    canonical_bench_cell,
    compare,
    geometric_mean,
)
from .traces import (
    TRACES,
    CoalescedCounts,
    DescriptorCounts,
    RunLengths,
    Trace,
    TraceTransfer,
    count_coalesced,
    descriptor_counts,
    load_trace,
    run_lengths,
    trace_run_lengths,
)

__all__ = [
    "BENCH_BLOCKS_PER_CHUNK",
    "CANONICAL_PRESETS",
    "DEFAULT_OPERATIONS",
    "OPERATIONS",
    "PRESETS",
    "TRACES",
    "VIRTUAL_ALIGN",
    "VIRTUAL_BASE",
    "BenchRow",
    "CanonicalBenchRow",
    "CanonicalPreset",
    "CoalescedCounts",
    "DescriptorCounts",
    "KiB",
    "Preset",
    "RunLengths",
    "Timing",
    "Trace",
    "TraceTransfer",
    "VirtualTensor",
    "bench_cell",
    "canonical_bench_cell",
    "compare",
    "count_coalesced",
    "descriptor_counts",
    "geometric_mean",
    "load_trace",
    "make_offloaded_ids",
    "make_spec",
    "pr_worker_file_ops",
    "run_lengths",
    "trace_run_lengths",
    "vllm_canonical_copy_plans",
    "vllm_style_canonical_plan",
    "vllm_style_plan",
    "vllm_style_resolve",
]
