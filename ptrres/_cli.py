"""The `ptrres` command: `bench`, `explain`, and for operators `warmup`, `check`
(which live in `ptrres._operator`; this module parses and dispatches)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, TextIO

import numpy as np

from ._operator import check_command, cpu_model, warmup_command
from .bench import (
    BENCH_BLOCKS_PER_CHUNK,
    CANONICAL_PRESETS,
    DEFAULT_OPERATIONS,
    OPERATIONS,
    PRESETS,
    BenchRow,
    CanonicalBenchRow,
    CanonicalPreset,
    Preset,
    bench_cell,
    canonical_bench_cell,
    geometric_mean,
    make_spec,
)
from .bench.traces import (
    SECONDS_PER_DESCRIPTOR,
    TRACES,
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

DEFAULT_BLOCKS = (1, 16, 256, 4096)
# `--operation canonical` (SPEC 10), timed only when asked for.
CANONICAL = "canonical"
CANONICAL_BLOCKS = (16, 256, 2048)
QUICK_PRESETS = ("llama-3.1-8b", "hybrid-4x12")
# Seconds of timing per (layout, operation, size) cell, shared by the
# reference and ptrres.
CELL_SECONDS = 0.4
QUICK_CELL_SECONDS = 0.15
# `--trace`: transfers counted (None: all) and timed, spread over the trace.
QUICK_TRACE_TRANSFERS = 24
TRACE_TIMED_TRANSFERS = 64
QUICK_TRACE_TIMED_TRANSFERS = 8


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `ptrres` command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "bench":
            return _bench(args)
        if args.command == "warmup":
            return warmup_command(args.processes, sys.stdout)
        if args.command == "check":
            return check_command(sys.stdout, kernels=not args.no_kernels)
        return _explain(args.preset, args.blocks, sys.stdout)
    except BrokenPipeError:  # `ptrres explain ... | head`: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _parser() -> argparse.ArgumentParser:
    """The `ptrres` command's arguments: one subcommand each."""
    parser = argparse.ArgumentParser(
        prog="ptrres",
        description="KV-cache block ids to pointers and copy descriptors, compiled.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser(
        "bench",
        help="time ptrres against the numpy reference on model layouts",
        description=(
            "Time resolve, plan (a store, blocks_per_chunk "
            f"{BENCH_BLOCKS_PER_CHUNK}) and coalesce against ptrres.reference, "
            "interleaved in this process, on model-shaped layouts whose "
            "tensors are never allocated."
        ),
    )
    bench.add_argument(
        "--preset",
        action="append",
        choices=sorted(PRESETS) + sorted(CANONICAL_PRESETS),
        help="a layout to time (repeatable; default: all, or two with --quick); "
        f"{', '.join(CANONICAL_PRESETS)} are canonical layouts, for "
        f"--operation {CANONICAL}",
    )
    bench.add_argument(
        "--blocks",
        type=_int_list,
        help="blocks per group, comma-separated (default: 1,16,256,4096)",
    )
    bench.add_argument(
        "--operation",
        action="append",
        choices=(*OPERATIONS, CANONICAL),
        help="an operation to time (repeatable; default: "
        f"{', '.join(DEFAULT_OPERATIONS)}). files: plan_file_ops against vLLM PR "
        f"#56076's Python op building. {CANONICAL}: canonical-layout plans, flat "
        "and strided, against a numpy transcription of vLLM 0.33's canonical fill "
        f"(default blocks {','.join(map(str, CANONICAL_BLOCKS))})",
    )
    bench.add_argument(
        "--quick", action="store_true", help="two layouts, short timings (~10 s)"
    )
    bench.add_argument(
        "--trace",
        action="append",
        choices=TRACES,
        help="a recorded vLLM 0.33 block-id trace to run instead (repeatable): "
        "run lengths, resolve and plan times over its transfers, and descriptor "
        "counts plain, coalesced ascending only, both ways, by ptrres, strided",
    )
    bench.add_argument(
        "--transfers",
        type=int,
        metavar="N",
        help=f"with --trace: count over N transfers spread over the trace "
        f"(default: all, or {QUICK_TRACE_TRANSFERS} with --quick); time over at "
        f"most {TRACE_TIMED_TRANSFERS} ({QUICK_TRACE_TIMED_TRANSFERS} with --quick)",
    )
    bench.add_argument("--json", metavar="PATH", help="write the results as JSON")
    bench.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG of speedup against transfer size (needs matplotlib)",
    )

    explain = commands.add_parser(
        "explain",
        help="print the descriptors of a tiny transfer, to learn a layout",
    )
    explain.add_argument("--preset", required=True, choices=sorted(PRESETS))
    explain.add_argument(
        "--blocks",
        type=_int_list,
        default=[3, 7, 9],
        help="block ids each group transfers, comma-separated (default: 3,7,9)",
    )

    warm = commands.add_parser(
        "warmup",
        help="compile or load every kernel into Numba's cache (for image builds)",
        description=(
            "Compile every ptrres kernel, or load it from Numba's on-disk cache, "
            "so that later processes (vLLM's workers) load it from there. Exits "
            "non-zero when Numba cannot cache here. The cache is keyed by CPU "
            "model: one filled on another CPU model recompiles."
        ),
    )
    warm.add_argument(
        "--processes",
        type=int,
        metavar="N",
        help="processes that may compile at once (default: the usable CPUs)",
    )

    check = commands.add_parser(
        "check",
        help="say whether the vLLM plugin will patch vLLM here, and why",
        description=(
            "What an operator asks before turning the vLLM plugin on: the vLLM "
            "found and whether it is tested, whether vLLM sees the plugin's "
            "entry point, the switches, numba, and Numba's cache (where, "
            "writable, warm). Exits 0 when the plugin will patch vLLM. Whether "
            "the cache is warm is found by a fresh interpreter making every "
            "kernel ready, as a vLLM worker would: a cold check fills the cache."
        ),
    )
    check.add_argument(
        "--no-kernels",
        action="store_true",
        help="skip making the kernels ready (and so the warm or cold verdict)",
    )

    return parser


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list: {text!r}"
        ) from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"need non-negative integers: {text!r}")
    return values


def _bench(args: argparse.Namespace) -> int:
    from ._warmup import warmup

    if args.trace:
        return _bench_traces(args)
    if args.plot:
        _require_matplotlib()
    operations = list(dict.fromkeys(args.operation or DEFAULT_OPERATIONS))
    seconds = QUICK_CELL_SECONDS if args.quick else CELL_SECONDS
    warmup()
    if CANONICAL in operations:
        _bench_canonical(args, seconds)
        operations.remove(CANONICAL)
        if not operations:
            return 0
        print()
    presets = [p for p in args.preset or () if p in PRESETS] or list(
        QUICK_PRESETS if args.quick else PRESETS
    )
    blocks = sorted(set(args.blocks or DEFAULT_BLOCKS))

    cells = [(p, o, b) for p in presets for o in operations for b in blocks]
    rows: list[BenchRow] = []
    start = time.perf_counter()
    for i, (preset, operation, n_blocks) in enumerate(cells, 1):
        _progress(f"[{i}/{len(cells)}] {preset} {operation} {n_blocks} blocks")
        rows.append(
            bench_cell(
                PRESETS[preset],
                operation,
                n_blocks,
                seconds=seconds,
                with_fill=n_blocks == blocks[-1],
            )
        )
    _progress("")
    elapsed = time.perf_counter() - start

    print(_table(rows))
    speedups = [row.speedup for row in rows]
    print(
        f"\n{len(rows)} cells in {elapsed:.1f} s; speedup over the reference: "
        f"geometric mean {geometric_mean(speedups):.1f}x, "
        f"min {min(speedups):.1f}x, max {max(speedups):.1f}x"
    )
    print(
        "x fill: ptrres time / a numpy fill of the same output bytes "
        "(the physical limit), at the largest size"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "environment": environment(),
                    "settings": {
                        "presets": presets,
                        "blocks": blocks,
                        "operations": operations,
                        "seconds_per_cell": seconds,
                        "blocks_per_chunk": BENCH_BLOCKS_PER_CHUNK,
                    },
                    "results": [
                        dict(asdict(row), speedup=row.speedup, ns_per_op=row.ns_per_op)
                        for row in rows
                    ],
                },
                f,
                indent=2,
            )
        print(f"wrote {args.json}")
    if args.plot:
        _plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _bench_canonical(args: argparse.Namespace, seconds: float) -> None:
    """`ptrres bench --operation canonical`: flat and strided canonical plans
    against vLLM 0.33's numpy canonical fill, all into preallocated buffers."""
    presets = [p for p in args.preset or () if p in CANONICAL_PRESETS] or list(
        CANONICAL_PRESETS
    )
    blocks = sorted(set(args.blocks or CANONICAL_BLOCKS))
    cells = [(p, b) for p in presets for b in blocks]
    rows: list[CanonicalBenchRow] = []
    for i, (preset, n_blocks) in enumerate(cells, 1):
        _progress(f"[{i}/{len(cells)}] {preset} canonical {n_blocks} blocks")
        rows.append(
            canonical_bench_cell(
                CANONICAL_PRESETS[preset],
                n_blocks,
                seconds=seconds,
                with_fill=n_blocks == blocks[-1],
            )
        )
    _progress("")
    header = (
        f"{'layout':<22} {'blocks':>6} {'flat descr':>10} {'2-D descr':>9} "
        f"{'vLLM fill':>10} {'flat':>9} {'speedup':>7} {'x fill':>6} "
        f"{'strided':>9} {'speedup':>7}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        fill = (
            f"{row.flat_seconds / row.fill_seconds:>6.2f}"
            if row.fill_seconds
            else f"{'':>6}"
        )
        lines.append(
            f"{row.preset:<22} {row.blocks_per_group:>6} {row.descriptors:>10} "
            f"{row.strided_descriptors:>9} {_duration(row.peer_seconds):>10} "
            f"{_duration(row.flat_seconds):>9} {row.flat_speedup:>6.1f}x {fill} "
            f"{_duration(row.strided_seconds):>9} {row.strided_speedup:>6.1f}x"
        )
    print("\n".join(lines))
    print(
        "speedup: over a numpy transcription of vLLM 0.33's _fill_canonical_ops; "
        "x fill: flat plan time / a numpy fill of its output bytes"
    )
    if args.json:
        path = args.json.replace(".json", "") + "-canonical.json"
        with open(path, "w") as f:
            json.dump(
                {
                    "environment": environment(),
                    "results": [
                        dict(
                            asdict(row),
                            flat_speedup=row.flat_speedup,
                            strided_speedup=row.strided_speedup,
                        )
                        for row in rows
                    ],
                },
                f,
                indent=2,
            )
        print(f"wrote {path}")


def _bench_traces(args: argparse.Namespace) -> int:
    """`ptrres bench --trace NAME`: what vLLM 0.33's own block ids cost."""
    from ._warmup import warmup

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
            _progress(f"[{i}/{len(presets)}] {name} {preset.name} timing")
            timings += trace_timings(trace, preset, timed_indices, seconds=seconds)
        _progress("")
        if timings:
            print(_trace_timing_table(timings))
        counts: list[DescriptorCounts] = []
        layouts: list[Preset | CanonicalPreset] = [*presets, *canonical]
        for i, layout in enumerate(layouts, 1):
            _progress(f"[{i}/{len(layouts)}] {name} {layout.name}")
            counts.append(descriptor_counts(trace, layout, indices))
        _progress("")
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
            f"{_duration(row.reference_seconds):>11} "
            f"{_duration(row.ptrres_seconds):>10} {row.speedup:>7.1f}x "
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


def _progress(message: str) -> None:
    """One line of progress on stderr, overwritten in place on a terminal."""
    if sys.stderr.isatty():
        sys.stderr.write(f"\r\033[K{message}")
    elif message:
        sys.stderr.write(message + "\n")
    sys.stderr.flush()


def _table(rows: Sequence[BenchRow]) -> str:
    header = (
        f"{'layout':<20} {'operation':<9} {'blocks':>6} {'ops':>8} {'descr':>8} "
        f"{'reference':>11} {'ptrres':>10} {'speedup':>8} {'ns/op':>7} {'x fill':>7}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        fill = (
            f"{row.ptrres_seconds / row.fill_seconds:>7.2f}"
            if row.fill_seconds
            else f"{'':>7}"
        )
        lines.append(
            f"{row.preset:<20} {row.operation:<9} {row.blocks_per_group:>6} "
            f"{row.ops:>8} {row.descriptors:>8} "
            f"{_duration(row.reference_seconds):>11} "
            f"{_duration(row.ptrres_seconds):>10} {row.speedup:>7.1f}x "
            f"{row.ns_per_op:>7.2f} {fill}"
        )
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.2f} us"


def environment() -> dict[str, Any]:
    """Versions and machine, for the JSON results."""
    import numba

    from . import __version__

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "ptrres": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "jit_disabled": os.environ.get("NUMBA_DISABLE_JIT", "0") not in ("", "0"),
    }


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: pip install 'ptrres[plot]'"
        ) from None


def _plot(rows: Sequence[BenchRow], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    operations = list(dict.fromkeys(row.operation for row in rows))
    fig, axes = plt.subplots(
        1, len(operations), figsize=(4.2 * len(operations), 3.6), squeeze=False
    )
    for ax, operation in zip(axes[0], operations):
        for preset in dict.fromkeys(row.preset for row in rows):
            cells = [r for r in rows if r.operation == operation and r.preset == preset]
            ax.plot(
                [r.ops for r in cells],
                [r.speedup for r in cells],
                marker="o",
                label=preset,
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.axhline(1, color="grey", linewidth=0.8)
        ax.set_title(operation)
        ax.set_xlabel("copy ops per transfer")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("speedup over the numpy reference")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _explain(preset_name: str, block_ids: Sequence[int], out: TextIO) -> int:
    from ._table import PointerTable

    preset = PRESETS[preset_name]
    kv = preset.kv_caches(num_blocks=max(max(block_ids) + 1, 16))
    spec = make_spec(preset, len(block_ids))
    spec.block_ids = np.array(list(block_ids) * preset.num_groups, np.int64)
    device_ptrs = PointerTable(kv).resolve(spec)
    out.write(
        f"{preset.name}: {preset.description}\n"
        f"{preset.num_groups} group(s) x {preset.refs_per_group} refs; "
        f"each group transfers blocks {', '.join(map(str, block_ids))}\n"
        "ptr = base(tensor) + block_id * row_stride; offset = ptr - base\n\n"
    )
    header = (
        f"{'group':>5} {'ref':>4} {'tensor':>6} {'block':>6} "
        f"{'row stride':>11} {'offset':>14} {'size':>8}"
    )
    out.write(header + "\n" + "-" * len(header) + "\n")
    op = 0
    for group, refs in enumerate(kv.group_data_refs):
        for d, ref in enumerate(refs):
            tensor = kv.tensors[ref.tensor_idx].tensor
            for block in block_ids:
                offset = int(device_ptrs.ptrs[op]) - tensor.data_ptr()
                out.write(
                    f"{group:>5} {d:>4} {ref.tensor_idx:>6} {block:>6} "
                    f"{tensor.stride(0):>11,} {offset:>14,} "
                    f"{int(device_ptrs.sizes[op]):>8,}\n"
                )
                op += 1
    out.write(f"\n{op} descriptors\n")
    return 0
