"""``ptrres bench`` on two checkouts, in alternating fresh processes.

Each round runs ``python -m ptrres bench --json`` once in checkout A, then once
in checkout B (each with its own PYTHONPATH and a warm Numba cache; the order
alternates between rounds). A cell's figure is ptrres's time in it, the median
over rounds. (Dividing by the reference's time, measured beside it, was
tried: numpy's large-array timings swing up to 5x between processes, more
than ptrres's.) The table gives, per operation, the geometric mean over cells
of B's figure over A's: below 1.00 B is faster.

Run: python benchmarks/ab_bench.py A_DIR B_DIR [--rounds 3] [--operation plan]
     [-- extra ptrres bench arguments, e.g. --quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict

Cells = dict[tuple[str, str, int], float]


def bench(checkout: str, operation: str, extra: list[str]) -> Cells:
    """One ``ptrres bench`` run in ``checkout``: ptrres's time in each cell."""
    with tempfile.TemporaryDirectory() as out:
        path = os.path.join(out, "bench.json")
        command = [sys.executable, "-m", "ptrres", "bench", "--operation", operation]
        env = dict(os.environ, PYTHONPATH=checkout)
        env.pop("NUMBA_DISABLE_JIT", None)
        subprocess.run(
            [*command, *extra, "--json", path],
            cwd=checkout,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        cells: Cells = {}
        if operation == "canonical":
            with open(path.replace(".json", "") + "-canonical.json") as f:
                for row in json.load(f)["results"]:
                    for kind in ("flat", "strided"):
                        key = (
                            row["preset"],
                            f"canonical-{kind}",
                            row["blocks_per_group"],
                        )
                        cells[key] = row[f"{kind}_seconds"]
            return cells
        with open(path) as f:
            for row in json.load(f)["results"]:
                key = (row["preset"], row["operation"], row["blocks_per_group"])
                cells[key] = row["ptrres_seconds"]
        return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worst", type=int, default=0, help="cells to list")
    parser.add_argument(
        "--operation",
        action="append",
        choices=["resolve", "plan", "coalesce", "files", "canonical"],
    )
    parser.add_argument("extra", nargs="*", help="after --: ptrres bench arguments")
    args = parser.parse_args()
    operations = args.operation or ["resolve", "plan", "coalesce", "files", "canonical"]
    samples: dict[str, dict[tuple[str, str, int], list[float]]] = {
        "a": defaultdict(list),
        "b": defaultdict(list),
    }
    for round_ in range(args.rounds):
        for operation in operations:
            for side in ("a", "b") if round_ % 2 == 0 else ("b", "a"):
                checkout = os.path.abspath(getattr(args, side))
                for key, value in bench(checkout, operation, args.extra).items():
                    samples[side][key].append(value)
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    ratios: dict[str, list[float]] = defaultdict(list)
    cells = []
    for key, values in samples["a"].items():
        if key in samples["b"]:
            ratio = statistics.median(samples["b"][key]) / statistics.median(values)
            ratios[key[1]].append(ratio)
            cells.append((ratio, key))
    for ratio, key in sorted(cells, reverse=True)[: args.worst]:
        print(f"  {ratio:5.2f}  {key[1]} {key[0]} {key[2]} blocks", file=sys.stderr)
    print(f"B = {args.b} over A = {args.a}, {args.rounds} alternating rounds")
    print(f"{'operation':<18} {'cells':>5} {'geomean':>8} {'min':>6} {'max':>6}")
    everything = []
    for operation, values in sorted(ratios.items()):
        everything += values
        mean = math.exp(statistics.fmean(math.log(v) for v in values))
        print(
            f"{operation:<18} {len(values):>5} {mean:>8.3f} "
            f"{min(values):>6.2f} {max(values):>6.2f}"
        )
    mean = math.exp(statistics.fmean(math.log(v) for v in everything))
    print(f"{'all':<18} {len(everything):>5} {mean:>8.3f}")


if __name__ == "__main__":
    main()
