"""The `ptrres` command: its arguments, and which command runs.

One module a command: `bench` (`ptrres._cli._bench`; `--trace` in
`ptrres._cli._trace`), `explain` (`ptrres._cli._explain`), and for operators
`warmup` and `check` (`ptrres._operator`); their arguments in
`ptrres._cli._arguments`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from .._operator import check_command, warmup_command
from ._arguments import parser
from ._bench import bench_command
from ._explain import explain_command
from ._trace import trace_command


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `ptrres` command line; returns the exit status."""
    args = parser().parse_args(argv)
    try:
        if args.command == "bench":
            return trace_command(args) if args.trace else bench_command(args)
        if args.command == "warmup":
            return warmup_command(args.processes, sys.stdout)
        if args.command == "check":
            return check_command(sys.stdout, kernels=not args.no_kernels)
        return explain_command(args.preset, args.blocks, sys.stdout)
    except BrokenPipeError:  # `ptrres explain ... | head`: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
