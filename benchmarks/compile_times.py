"""Compile time of every kernel signature, and start-up time, cold and warm.

Each figure comes from fresh processes whose NUMBA_CACHE_DIR is a new temporary
directory, so nothing is loaded from an earlier compilation:

- per kernel: one process compiles every signature of ptrres._config.KERNELS
  in turn (after compiling a trivial function, so that Numba's own start-up is
  not charged to the first kernel), ``--rounds`` times; the median is shown.
  Inline helpers are compiled into the first kernel that calls them.
- start-up: ``import ptrres; ptrres.warmup(); first resolve`` in a fresh
  process, on an empty cache (cold) and on the cache a first process filled
  (warm), median of ``--rounds`` processes each.
- ranks: ``--ranks`` such processes started at once on one empty cache, as
  tensor-parallel workers start: the wall time until the last is done, how
  many kernels each compiled (each should be compiled once in all), and a
  further process on the cache they filled, which should load every kernel.

Run: PYTHONPATH=$PWD python benchmarks/compile_times.py [--rounds 5] [--ranks 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ptrres._config import KERNELS

PER_KERNEL = """
import json, time
import numba
numba.njit(lambda x: x + 1)(1)  # Numba's own start-up, not a kernel's
from ptrres._config import KERNELS
times = []
for dispatcher, signatures in KERNELS:
    for signature in signatures:
        start = time.perf_counter()
        dispatcher.compile(signature)
        elapsed = time.perf_counter() - start
        times.append([dispatcher.__name__, signature, elapsed])
print(json.dumps(times))
"""

STARTUP = """
import time
start = time.perf_counter()
import numpy as np
import ptrres
report = ptrres.warmup()
tensor = ptrres.CanonicalKVCacheTensor(np.zeros((4, 8), np.int8), 8)
kv = ptrres.CanonicalKVCaches([tensor], [[ptrres.CanonicalKVCacheRef(0, 8)]])
ptrres.resolve_device_pointers(ptrres.GPULoadStoreSpec([1, 2]), kv)
print(time.perf_counter() - start, report.count("loaded"), report.count("compiled"))
"""


def run(code: str, cache_dir: str, processes: int = 1) -> list[str]:
    """Run ``code`` in ``processes`` fresh interpreters started at once,
    caching into ``cache_dir``; the last line each printed."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    env.pop("NUMBA_DISABLE_JIT", None)
    started = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    lines = []
    for process in started:
        out, err = process.communicate()
        if process.returncode:
            raise SystemExit(err)
        lines.append(out.strip().splitlines()[-1])
    return lines


def per_kernel(rounds: int) -> list[tuple[str, str, float]]:
    """Median compile seconds of each kernel signature, cold cache."""
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as cache:
            for name, signature, seconds in json.loads(run(PER_KERNEL, cache)[0]):
                samples.setdefault((name, signature), []).append(seconds)
    return [(n, s, statistics.median(t)) for (n, s), t in samples.items()]


def startup(rounds: int) -> tuple[float, float]:
    """Median start-up seconds on a cold cache, then on a warm one."""
    cold = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as cache:
            cold.append(float(run(STARTUP, cache)[0].split()[0]))
    with tempfile.TemporaryDirectory() as cache:
        run(STARTUP, cache)  # fills the cache
        warm = [float(run(STARTUP, cache)[0].split()[0]) for _ in range(rounds)]
    return statistics.median(cold), statistics.median(warm)


def ranks(count: int) -> tuple[float, list[int], int]:
    """``count`` processes at once on one empty cache, then one more: the
    wall time of the first ``count``, what each compiled, and what the last
    compiled."""
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        lines = run(STARTUP, cache, count)
        seconds = time.perf_counter() - start
        after = int(run(STARTUP, cache)[0].split()[2])
    return seconds, [int(line.split()[2]) for line in lines], after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    rows = per_kernel(args.rounds)
    width = max(len(name) for name, _, _ in rows)
    print(f"compile time per kernel signature (cold cache, median of {args.rounds}):")
    for name, signature, seconds in rows:
        print(f"  {name:<{width}}  {seconds:6.3f} s  {signature}")
    print(f"  {'all':<{width}}  {sum(s for _, _, s in rows):6.3f} s")
    cold, warm = startup(args.rounds)
    print(
        f"import + warmup() + first resolve, median of {args.rounds} processes: "
        f"cold cache {cold:.3f} s, warm cache {warm:.3f} s"
    )
    if args.ranks:
        seconds, compiled, after = ranks(args.ranks)
        print(
            f"{args.ranks} processes at once on one empty cache: {seconds:.3f} s "
            f"until the last was ready; signatures each compiled {compiled} "
            f"(of {sum(len(s) for _, s in KERNELS)}); a process after them "
            f"compiled {after}"
        )


if __name__ == "__main__":
    main()
