"""`ptrres bench`: ptrres against ptrres.reference on model-shaped layouts,
a cell per (layout, operation, size), and `--operation canonical`; and what
`--trace` (`ptrres._cli._trace`) shares with it: the progress line,
durations, the environment written with the JSON results.
"""

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
from typing import Any

import numpy as np

from .._operator import cpu_model
from ..bench import (
    BENCH_BLOCKS_PER_CHUNK,
    CANONICAL_PRESETS,
    DEFAULT_OPERATIONS,
    PRESETS,
    BenchRow,
    CanonicalBenchRow,
    bench_cell,
    canonical_bench_cell,
    geometric_mean,
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


def bench_command(args: argparse.Namespace) -> int:
    """`ptrres bench`: ptrres against the reference, a cell per (layout,
    operation, size); `--trace` is `ptrres._cli._trace`'s."""
    from .._warmup import warmup

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
        progress(f"[{i}/{len(cells)}] {preset} {operation} {n_blocks} blocks")
        rows.append(
            bench_cell(
                PRESETS[preset],
                operation,
                n_blocks,
                seconds=seconds,
                with_fill=n_blocks == blocks[-1],
            )
        )
    progress("")
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
        progress(f"[{i}/{len(cells)}] {preset} canonical {n_blocks} blocks")
        rows.append(
            canonical_bench_cell(
                CANONICAL_PRESETS[preset],
                n_blocks,
                seconds=seconds,
                with_fill=n_blocks == blocks[-1],
            )
        )
    progress("")
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
            f"{row.strided_descriptors:>9} {duration(row.peer_seconds):>10} "
            f"{duration(row.flat_seconds):>9} {row.flat_speedup:>6.1f}x {fill} "
            f"{duration(row.strided_seconds):>9} {row.strided_speedup:>6.1f}x"
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


def progress(message: str) -> None:
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
            f"{duration(row.reference_seconds):>11} "
            f"{duration(row.ptrres_seconds):>10} {row.speedup:>7.1f}x "
            f"{row.ns_per_op:>7.2f} {fill}"
        )
    return "\n".join(lines)


def duration(seconds: float) -> str:
    """Seconds as ms or us, two decimals."""
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.2f} us"


def environment() -> dict[str, Any]:
    """Versions and machine, for the JSON results."""
    import numba

    from .. import __version__

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
