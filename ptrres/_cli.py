"""The `ptrres` command: `bench`, `explain`, and for operators `warmup`, `check`."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, TextIO

import numpy as np

from .bench import (
    BENCH_BLOCKS_PER_CHUNK,
    CANONICAL_PRESETS,
    DEFAULT_OPERATIONS,
    OPERATIONS,
    PRESETS,
    BenchRow,
    CanonicalBenchRow,
    bench_cell,
    canonical_bench_cell,
    geometric_mean,
    make_spec,
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `ptrres` command line; returns the exit status."""
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

    args = parser.parse_args(argv)
    try:
        if args.command == "bench":
            return _bench(args)
        if args.command == "warmup":
            return _warmup(args.processes, sys.stdout)
        if args.command == "check":
            return _check(sys.stdout, kernels=not args.no_kernels)
        return _explain(args.preset, args.blocks, sys.stdout)
    except BrokenPipeError:  # `ptrres explain ... | head`: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


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
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "jit_disabled": os.environ.get("NUMBA_DISABLE_JIT", "0") not in ("", "0"),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


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


# --- `ptrres warmup` and `ptrres check`: for operators --------------------------


def _warmup(processes: int | None, out: TextIO) -> int:
    """`ptrres warmup`: every kernel into Numba's cache; 1 where none can be."""
    from . import warmup
    from .vllm import _describe_warmup

    if processes is not None and processes < 1:
        raise SystemExit("ptrres warmup: --processes must be at least 1")
    if _jit_disabled():
        out.write(
            "ptrres warmup: NUMBA_DISABLE_JIT is set, so the kernels run as "
            "Python: there is nothing to compile or cache.\n"
        )
        return 1
    refused = _cache_refused()
    if refused is not None:
        out.write(
            f"ptrres warmup: Numba cannot cache here ({refused}), so every "
            "process would compile the kernels again. Set NUMBA_CACHE_DIR to a "
            "writable directory.\n"
        )
        return 1
    report = warmup(processes=processes)
    out.write(_describe_warmup(report) + "\n")
    for how in ("compiled", "loaded", "ready", "interpreted"):
        kernels = [k.kernel for k in report.kernels if k.how == how]
        if kernels:
            names = ", ".join(
                f"{name} ({kernels.count(name)})" if kernels.count(name) > 1 else name
                for name in dict.fromkeys(kernels)
            )
            out.write(f"  {how:<8} {len(kernels):>3}  {names}\n")
    out.write(f"Numba's cache: {_cache_location(_cache_paths())}\n")
    out.write(
        f"Compiled for this CPU ({_cpu_model()}): on another CPU model the "
        "kernels compile again.\n"
    )
    return 0


def _jit_disabled() -> bool:
    import numba

    return bool(numba.config.DISABLE_JIT)  # type: ignore[attr-defined]


def _cache_refused() -> str | None:
    """Why Numba cannot cache ptrres's kernels in this process (None if it can)."""
    from . import _config

    return _config.cache_refused


def _cache_paths() -> list[str]:
    """Where Numba caches ptrres's kernels (one folder, unless they differ)."""
    from ._config import KERNELS

    paths = (getattr(getattr(d, "stats", None), "cache_path", None) for d, _ in KERNELS)
    return list(dict.fromkeys(str(path) for path in paths if path))


def _cache_location(paths: list[str]) -> str:
    """The cache folder(s), and what chose them."""
    chosen = os.environ.get("NUMBA_CACHE_DIR")
    why = f"NUMBA_CACHE_DIR={chosen}" if chosen else "NUMBA_CACHE_DIR unset"
    return f"{', '.join(paths) or 'none'} ({why})"


def _inside(path: str, folder: str) -> bool:
    """Whether path is folder or inside it."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def _writable(path: str) -> str | None:
    """Why a cache folder cannot be written (None when a file can be made in
    it, which is what Numba does; the folder is made first, as Numba would)."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        return error.strerror or str(error)
    return None


@dataclass(frozen=True)
class Finding:
    """One line of `ptrres check`: what was looked at, and what was found."""

    # "ok"; "warn" (the plugin patches, but something costs time); "no" (the
    # plugin will not patch); "off" (a switch is off, by choice).
    status: str
    topic: str
    detail: str


def check_findings(*, kernels: bool = True) -> list[Finding]:
    """Everything `ptrres check` reports, in order; the plugin will patch vLLM
    when no finding says "no" or "off"."""
    findings = _vllm_findings()
    findings += _switch_findings()
    findings += _numba_findings(kernels=kernels)
    return findings


def _vllm_findings() -> list[Finding]:
    import importlib.metadata
    import importlib.util

    from . import vllm as plugin

    findings = []
    tested = ", ".join(f"{release}.x" for release in plugin.SUPPORTED_VLLM)
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is None:
        findings.append(Finding("no", "vLLM", f"not installed here (tested: {tested})"))
    elif plugin._SUPPORTED_VERSION.match(version) is None:
        findings.append(
            Finding("no", "vLLM", f"{version}, not a tested release ({tested})")
        )
    else:
        where = importlib.util.find_spec("vllm")
        place = f" ({os.path.dirname(where.origin)})" if where and where.origin else ""
        findings.append(Finding("ok", "vLLM", f"{version}, a tested release{place}"))

    group = "vllm.general_plugins"
    ours = [
        ep
        for ep in importlib.metadata.entry_points(group=group)
        if ep.value == "ptrres.vllm:register"
    ]
    if not ours:
        findings.append(
            Finding(
                "no",
                "entry point",
                f"none in {group}: install ptrres into vLLM's environment",
            )
        )
    else:
        ep = ours[0]
        dist = getattr(ep, "dist", None)
        source = f", from {dist.name} {dist.version}" if dist is not None else ""
        findings.append(
            Finding("ok", "entry point", f"{ep.name} = {ep.value} in {group}{source}")
        )
        allowed = os.environ.get("VLLM_PLUGINS")
        if allowed is None:
            findings.append(
                Finding("ok", "VLLM_PLUGINS", "unset: vLLM loads every general plugin")
            )
        elif ep.name in allowed.split(","):
            findings.append(Finding("ok", "VLLM_PLUGINS", f"{allowed}: includes it"))
        else:
            findings.append(
                Finding(
                    "no", "VLLM_PLUGINS", f"{allowed}: vLLM will not load {ep.name!r}"
                )
            )

    if version is not None and findings[0].status == "ok":
        replacements, refusal = plugin._plan_replacements()
        if refusal is None:
            names = ", ".join(r.qualified_name for r in replacements)
            findings.append(Finding("ok", "patches", names))
        else:
            findings.append(Finding("no", "patches", f"nothing: {refusal}"))
    return findings


def _switch_findings() -> list[Finding]:
    from . import vllm as plugin

    switch = os.environ.get("PTRRES_VLLM")
    off = switch is not None and switch.strip().lower() in plugin._OFF_VALUES
    findings = [
        Finding(
            "off" if off else "ok",
            "PTRRES_VLLM",
            f"{'unset' if switch is None else switch}: the plugin is "
            + ("off" if off else "on (PTRRES_VLLM=0 turns it off)"),
        )
    ]
    coalesce = os.environ.get("PTRRES_VLLM_COALESCE")
    findings.append(
        Finding(
            "ok",
            "PTRRES_VLLM_COALESCE",
            f"{'unset' if coalesce is None else coalesce}: coalescing "
            + (
                "on, where vLLM copies with cuMemcpyBatchAsync"
                if plugin._coalesce_requested()
                else "off (PTRRES_VLLM_COALESCE=1 turns it on)"
            ),
        )
    )
    return findings


def numba_probe(*, kernels: bool) -> dict[str, Any]:
    """What Numba does with ptrres's kernels in this process: its version,
    where it caches them (or why it cannot), and with ``kernels`` what
    warmup() did, by how. `ptrres check` runs this in a fresh interpreter."""
    import numba

    from . import warmup

    probe: dict[str, Any] = {
        "numba": numba.__version__,
        "jit_disabled": _jit_disabled(),
        "cache_refused": _cache_refused(),
        "cache_paths": _cache_paths(),
    }
    if kernels:
        report = warmup()
        probe["signatures"] = len(report.kernels)
        probe["counts"] = {k.how: report.count(k.how) for k in report.kernels}
        probe["seconds"] = report.seconds
    return probe


# `ptrres check`'s child: numba_probe() in a fresh interpreter, as JSON.
_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from ptrres._cli import numba_probe
print(json.dumps(numba_probe(kernels=sys.argv[2] == "1")))
"""


def _run_probe(*, kernels: bool) -> dict[str, Any]:
    """numba_probe() in a fresh interpreter with this environment: what a
    vLLM worker started now would find (this process may have compiled or
    loaded kernels already, which warmup() then reports as "ready")."""
    import subprocess

    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, package_parent, "1" if kernels else "0"],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"a fresh interpreter could not warm up ptrres: {last}")
    probe: dict[str, Any] = json.loads(lines[-1])
    return probe


def _numba_findings(*, kernels: bool) -> list[Finding]:
    try:
        probe = _run_probe(kernels=kernels)
    except (OSError, RuntimeError) as error:
        return [Finding("warn", "kernels", str(error))]
    return probe_findings(probe)


def probe_findings(probe: dict[str, Any]) -> list[Finding]:
    """`ptrres check`'s findings about Numba, from a numba_probe() report."""
    findings = [Finding("ok", "numba", probe["numba"])]
    if probe["jit_disabled"]:
        findings.append(
            Finding("warn", "Numba cache", "none: NUMBA_DISABLE_JIT is set, kernels "
                    "run as Python (slowly)")
        )  # fmt: skip
        return findings
    refused = probe["cache_refused"]
    if refused is not None:
        findings.append(
            Finding("warn", "Numba cache", f"none: {refused}; every process compiles")
        )
    else:
        paths = probe["cache_paths"]
        problems = [
            f"{p} is not writable: {why}" for p in paths if (why := _writable(p))
        ]
        chosen = os.environ.get("NUMBA_CACHE_DIR")
        if chosen and not all(_inside(p, chosen) for p in paths):
            # Numba passes over a NUMBA_CACHE_DIR it cannot use, silently.
            why = _writable(chosen) or "Numba did not use it"
            problems.append(f"NUMBA_CACHE_DIR is not used ({why})")
        findings.append(
            Finding(
                "warn" if problems else "ok",
                "Numba cache",
                _cache_location(paths)
                + "".join(f"; {problem}" for problem in problems)
                + ("" if problems else ", writable"),
            )
        )
    if "counts" in probe:  # the probe made the kernels ready
        counts, total = probe["counts"], probe["signatures"]
        compiled = counts.get("compiled", 0)
        if compiled == 0:
            detail = f"warm: {counts.get('loaded', 0)} of {total} signatures loaded"
        else:
            detail = f"cold: {compiled} of {total} signatures compiled" + (
                ", into the cache (a second check finds it warm)"
                if refused is None
                else ""
            )
        findings.append(
            Finding(
                "ok" if compiled == 0 else "warn",
                "kernels",
                f"{detail}, in {probe['seconds']:.2f} s by a fresh interpreter "
                f"(on {_cpu_model()}; another CPU model recompiles)",
            )
        )
    return findings


def _check(out: TextIO, *, kernels: bool = True) -> int:
    """`ptrres check`: the findings, one a line; 0 when the plugin will patch."""
    from . import __version__

    out.write(f"ptrres {__version__} ({os.path.dirname(__file__)})\n")
    findings = check_findings(kernels=kernels)
    width = max(len(f.topic) for f in findings)
    for f in findings:
        out.write(f"  {f.status:<4} {f.topic:<{width}}  {f.detail}\n")
    blocking = [f for f in findings if f.status in ("no", "off")]
    if blocking:
        out.write(
            "The plugin will not patch vLLM: "
            + "; ".join(f.topic for f in blocking)
            + ".\n"
        )
        return 1
    out.write("The plugin will patch vLLM in every process vLLM starts.\n")
    return 0
