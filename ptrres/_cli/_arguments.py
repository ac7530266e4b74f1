"""The `ptrres` command's arguments: one subcommand each, one function each.

`ptrres bench` (with `--trace`), `ptrres explain`, and the operators'
`ptrres warmup` and `ptrres check`; ``ptrres._cli.main`` runs the one given.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ..bench import (
    BENCH_BLOCKS_PER_CHUNK,
    CANONICAL_PRESETS,
    DEFAULT_OPERATIONS,
    OPERATIONS,
    PRESETS,
)
from ..bench.traces import TRACES
from ._bench import CANONICAL, CANONICAL_BLOCKS
from ._trace import (
    QUICK_TRACE_TIMED_TRANSFERS,
    QUICK_TRACE_TRANSFERS,
    TRACE_TIMED_TRANSFERS,
)

# The add_parser method of add_subparsers()'s result: it adds a subcommand.
AddParser = Callable[..., argparse.ArgumentParser]


def parser() -> argparse.ArgumentParser:
    """The `ptrres` command's arguments: one subcommand each."""
    ptrres = argparse.ArgumentParser(
        prog="ptrres",
        description="KV-cache block ids to pointers and copy descriptors, compiled.",
    )
    commands = ptrres.add_subparsers(dest="command", required=True)
    _bench_arguments(commands.add_parser)
    _explain_arguments(commands.add_parser)
    _warmup_arguments(commands.add_parser)
    _check_arguments(commands.add_parser)
    return ptrres


def _bench_arguments(add_parser: AddParser) -> None:
    """`ptrres bench`: the layouts, sizes and operations to time, or traces."""
    bench = add_parser(
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
        type=int_list,
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


def _explain_arguments(add_parser: AddParser) -> None:
    """`ptrres explain`: a preset and the block ids of a tiny transfer."""
    explain = add_parser(
        "explain",
        help="print the descriptors of a tiny transfer, to learn a layout",
    )
    explain.add_argument("--preset", required=True, choices=sorted(PRESETS))
    explain.add_argument(
        "--blocks",
        type=int_list,
        default=[3, 7, 9],
        help="block ids each group transfers, comma-separated (default: 3,7,9)",
    )


def _warmup_arguments(add_parser: AddParser) -> None:
    """`ptrres warmup`: how many processes may compile at once."""
    warm = add_parser(
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


def _check_arguments(add_parser: AddParser) -> None:
    """`ptrres check`: whether to make the kernels ready too."""
    check = add_parser(
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


def int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list: {text!r}"
        ) from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"need non-negative integers: {text!r}")
    return values
