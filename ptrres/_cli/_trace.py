"""`ptrres bench --trace NAME`: what a recorded vLLM 0.33 block-id trace
costs: its run lengths, resolve and plan times over its transfers against
ptrres.reference, and descriptor counts plain, coalesced ascending only, both
ways, by ptrres, strided.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from ..bench import CANONICAL_PRESETS, PRESETS, CanonicalPreset, Preset
from ..bench.traces import (
    SECONDS_PER_DESCRIPTOR,
    DescriptorCounts,
    RunLengths,
    Trace,
    TraceTiming,
    descriptor_counts,
    load_trace,
    spread,
    trace_run_lengths,
    trace_timings,
)
from ._bench import (
    CELL_SECONDS,
    QUICK_CELL_SECONDS,
    QUICK_PRESETS,
    duration,
    environment,
    progress,
)

# `--trace`: transfers counted (None: all) and timed, spread over the trace.
QUICK_TRACE_TRANSFERS = 24
TRACE_TIMED_TRANSFERS = 64
QUICK_TRACE_TIMED_TRANSFERS = 8


def trace_command(args: argparse.Namespace) -> int:
    """`ptrres bench --trace NAME`: what vLLM 0.33's own block ids cost."""
    from .._warmup import warmup

    warmup()
    seconds = QUICK_CELL_SECONDS if args.quick else CELL_SECONDS
    chosen = args.preset or ()
    presets = [PRESETS[p] for p in chosen if p in PRESETS]
    canonical = [CANONICAL_PRESETS[p] for p in chosen if p in CANONICAL_PRESETS]
    if not chosen:
        presets = [PRESETS[p] for p in (QUICK_PRESETS if args.quick else PRESETS)]
        canonical = list(CANONICAL_PRESETS.values())[: 1 if args.quick else None]
    counted = args.transfers or (QUICK_TRACE_TRANSFERS if args.quick else None)
    timed = QUICK_TRACE_TIMED_TRANSFERS if args.quick else TRACE_TIMED_TRANSFERS
    results = []
    for name in dict.fromkeys(args.trace):
        trace = load_trace(name)
        indices = spread(len(trace), counted)
        timed_indices = spread(len(trace), min(len(indices), timed))
        print(_trace_header(trace, len(indices), len(timed_indices)))
        runs = {
            direction: trace_run_lengths(
                trace, [i for i in indices if trace.store[i] in flags]
            )
            for direction, flags in (
                ("store", (True,)),
                ("load", (False,)),
                ("all", (True, False)),
            )
        }
        print(_runs_table(runs))
        timings: list[TraceTiming] = []
        for i, preset in enumerate(presets, 1):
            progress(f"[{i}/{len(presets)}] {name} {preset.name} timing")
            timings += trace_timings(trace, preset, timed_indices, seconds=seconds)
        progress("")
        if timings:
            print(_trace_timing_table(timings))
        counts: list[DescriptorCounts] = []
        layouts: list[Preset | CanonicalPreset] = [*presets, *canonical]
        for i, layout in enumerate(layouts, 1):
            progress(f"[{i}/{len(layouts)}] {name} {layout.name}")
            counts.append(descriptor_counts(trace, layout, indices))
        progress("")
        print(_counts_table(counts))
        results.append(
            {
                "trace": name,
                "metadata": trace.metadata,
                "transfers_counted": len(indices),
                "transfers_timed": len(timed_indices),
                "run_lengths": {k: _runs_summary(v) for k, v in runs.items()},
                "timings": [dict(asdict(t), speedup=t.speedup) for t in timings],
                "descriptor_counts": [asdict(c) for c in counts],
            }
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "environment": environment(),
                    "settings": {"seconds_per_cell": seconds},
                    "traces": results,
                },
                f,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 0


def _trace_header(trace: Trace, counted: int, timed: int) -> str:
    meta = trace.metadata
    n_store = int(trace.store.sum())
    return (
        f"\ntrace {trace.name}: vLLM {meta.get('vllm_version', '?')}, "
        f"{meta.get('policy', '?')} eviction, blocks_per_chunk "
        f"{trace.blocks_per_chunk}, {trace.num_gpu_blocks} GPU blocks, "
        f"{trace.num_cpu_blocks} CPU blocks\n"
        f"{len(trace)} transfers ({n_store} stores, {len(trace) - n_store} loads), "
        f"{len(trace.gpu_ids)} GPU blocks moved; counted over {counted} "
        f"transfers, timed over {timed}\n"
    )


def _runs_summary(runs: RunLengths) -> dict[str, Any]:
    def stats(lengths: Any) -> dict[str, float]:
        if not len(lengths):
            return {"runs": 0, "blocks": 0, "mean": 0.0, "p90": 0.0, "max": 0}
        return {
            "runs": len(lengths),
            "blocks": int(lengths.sum()),
            "mean": float(lengths.mean()),
            "p90": float(np.percentile(lengths, 90)),
            "max": int(lengths.max()),
        }

    return {
        "ascending": stats(runs.ascending),
        "descending": stats(runs.descending),
        "singles": runs.singles,
        "runs": runs.runs,
    }


def _runs_table(runs: dict[str, RunLengths]) -> str:
    header = (
        f"{'pairs':<6} {'blocks':>7} {'runs':>7} {'single':>7} "
        f"{'asc runs':>8} {'blocks':>7} {'mean':>5} {'p90':>4} {'max':>4} "
        f"{'desc runs':>9} {'blocks':>7} {'mean':>5} {'p90':>4} {'max':>4}"
    )
    lines = [
        "runs of paired (GPU block, CPU sub-block) ids stepping +1 (asc) or -1 "
        "(desc) on both sides:",
        header,
        "-" * len(header),
    ]
    for direction, run in runs.items():
        summary = _runs_summary(run)
        up, down = summary["ascending"], summary["descending"]
        blocks = up["blocks"] + down["blocks"] + run.singles
        lines.append(
            f"{direction:<6} {blocks:>7} {run.runs:>7} {run.singles:>7} "
            f"{up['runs']:>8} {up['blocks']:>7} {up['mean']:>5.1f} "
            f"{up['p90']:>4.0f} {up['max']:>4} "
            f"{down['runs']:>9} {down['blocks']:>7} {down['mean']:>5.1f} "
            f"{down['p90']:>4.0f} {down['max']:>4}"
        )
    return "\n".join(lines) + "\n"


def _trace_timing_table(rows: Sequence[TraceTiming]) -> str:
    header = (
        f"{'layout':<20} {'operation':<9} {'ops':>9} {'reference':>11} "
        f"{'ptrres':>10} {'speedup':>8} {'ns/op':>7}"
    )
    lines = [
        "resolve and plan, one pass over the timed transfers, against "
        "ptrres.reference:",
        header,
        "-" * len(header),
    ]
    for row in rows:
        lines.append(
            f"{row.preset:<20} {row.operation:<9} {row.ops:>9} "
            f"{duration(row.reference_seconds):>11} "
            f"{duration(row.ptrres_seconds):>10} {row.speedup:>7.1f}x "
            f"{row.ptrres_seconds / max(row.ops, 1) * 1e9:>7.2f}"
        )
    return "\n".join(lines) + "\n"


def _counts_table(rows: Sequence[DescriptorCounts]) -> str:
    us = SECONDS_PER_DESCRIPTOR * 1e6
    header = (
        f"{'layout':<22} {'plain':>9} {'ascending':>9} {'descending':>10} "
        f"{'ptrres c=True':>13} {'strided':>8} {'us/transfer: plain':>18} "
        f"{'asc':>7} {'desc':>7} {'strided':>7}"
    )
    lines = [
        f"descriptors over the counted transfers; submission at {us} us each:",
        header,
        "-" * len(header),
    ]
    for row in rows:
        n = max(row.transfers, 1)
        strided = "-" if row.strided is None else str(row.strided)
        strided_us = "-" if row.strided is None else f"{row.strided * us / n:.1f}"
        lines.append(
            f"{row.preset:<22} {row.plain:>9} {row.ascending:>9} "
            f"{row.descending:>10} {row.ptrres:>13} {strided:>8} "
            f"{row.plain * us / n:>18.1f} {row.ascending * us / n:>7.1f} "
            f"{row.descending * us / n:>7.1f} {strided_us:>7}"
        )
    lines.append(
        "ascending: merging runs that ascend on both sides (the old rule); "
        "descending: runs either way (SPEC 6); ptrres c=True: "
        "plan_transfer(coalesce=True)"
    )
    return "\n".join(lines)
