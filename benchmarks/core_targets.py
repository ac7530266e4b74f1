"""Issue-2 speed targets: ptrres's resolver against ptrres.reference.

Every figure is a ratio of medians of interleaved rounds, in one process.
Run: python benchmarks/core_targets.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

import ptrres
from ptrres import reference
from ptrres.bench import (
    PRESETS,
    compare,
    geometric_mean,
    make_spec,
    vllm_style_resolve,
)

SMALL_LAYOUTS = ["llama-3.1-8b-split", "llama-3.1-70b-tp4", "hybrid-4x12"]

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


def time_small(name: str, blocks: int, seconds: float) -> dict[str, float]:
    """Seconds per call of the reference, vLLM's shape, and ptrres' two paths."""
    preset = PRESETS[name]
    kv = preset.kv_caches()
    table = ptrres.PointerTable(kv)
    spec = make_spec(preset, blocks)
    n_ops = blocks * preset.num_refs
    out = (np.empty(n_ops, np.int64), np.empty(n_ops, np.int64))
    timings = compare(
        {
            "reference": lambda: reference.resolve_device_pointers(spec, kv),
            "vllm": lambda: vllm_style_resolve(spec, kv),
            "out": lambda: table.resolve(spec, out=out),
            "dropin": lambda: ptrres.resolve_device_pointers(spec, kv),
        },
        seconds=seconds,
    )
    return {key: timing.seconds for key, timing in timings.items()}


def time_large(blocks: int, seconds: float) -> dict[str, float]:
    """Seconds per call into out= buffers, and of numpy filling the same bytes."""
    preset = PRESETS["llama-3.1-8b-split"]
    kv = preset.kv_caches()
    table = ptrres.PointerTable(kv)
    spec = make_spec(preset, blocks)
    n_ops = blocks * preset.num_refs
    ptrs, sizes = np.empty(n_ops, np.int64), np.empty(n_ops, np.int64)
    timings = compare(
        {
            "reference": lambda: reference.resolve_device_pointers(spec, kv),
            "out": lambda: table.resolve(spec, out=(ptrs, sizes)),
            "fill": lambda: (ptrs.fill(1), sizes.fill(2)),
        },
        seconds=seconds,
    )
    return {key: timing.seconds for key, timing in timings.items()}


def startup_seconds(cache_dir: str) -> tuple[float, int, int]:
    """Import, warmup() and a first resolve, in a fresh process."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    out = subprocess.run(
        [sys.executable, "-c", STARTUP],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return float(out[0]), int(out[1]), int(out[2])


class Verdicts:
    """Prints each target with its figure; counts the ones met."""

    def __init__(self) -> None:
        self.met: list[bool] = []

    def check(self, name: str, value: float, target: str, ok: bool) -> None:
        self.met.append(ok)
        print(f"  {name:<54} {value:8.2f}  {target:<8} {'PASS' if ok else 'FAIL'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter timings")
    args = parser.parse_args()
    seconds = 0.1 if args.quick else 0.4
    ptrres.warmup()
    verdicts = Verdicts()

    print(
        "resolve, us per call; x = reference / ptrres; x vllm = vLLM's shape / drop-in"
    )
    print(
        f"  {'layout':<20}{'blocks':>7}{'ops':>7}{'reference':>11}{'vllm':>9}"
        f"{'out=':>8}{'drop-in':>9}{'x out=':>8}{'x drop':>8}{'x vllm':>8}"
    )
    speedups: dict[tuple[str, int], tuple[float, float]] = {}
    for name in SMALL_LAYOUTS:
        for blocks in (1, 16, 256):
            t = time_small(name, blocks, seconds)
            speedups[name, blocks] = (
                t["reference"] / t["out"],
                t["reference"] / t["dropin"],
            )
            print(
                f"  {name:<20}{blocks:>7}{blocks * PRESETS[name].num_refs:>7}"
                f"{t['reference'] * 1e6:>11.1f}{t['vllm'] * 1e6:>9.1f}"
                f"{t['out'] * 1e6:>8.2f}{t['dropin'] * 1e6:>9.2f}"
                f"{speedups[name, blocks][0]:>8.1f}{speedups[name, blocks][1]:>8.1f}"
                f"{t['vllm'] / t['dropin']:>8.1f}"
            )
    small = [(name, b) for name in SMALL_LAYOUTS for b in (1, 16)]
    table_x = geometric_mean([speedups[k][0] for k in small])
    dropin_x = geometric_mean([speedups[k][1] for k in small])
    verdicts.check(
        "1 and 16 blocks: resolve(out=), geomean x", table_x, ">= 50", table_x >= 50
    )
    verdicts.check(
        "1 and 16 blocks: resolve_device_pointers, geomean x",
        dropin_x,
        ">= 30",
        dropin_x >= 30,
    )
    for name in SMALL_LAYOUTS:
        x = speedups[name, 256][0]
        verdicts.check(f"256 blocks, {name}: resolve(out=) x", x, ">= 10", x >= 10)

    print("\nlarge transfers into out= buffers, 64 refs, ms per call")
    for blocks in (4096, 16384):
        t = time_large(blocks, seconds * 3)
        print(
            f"  {blocks} blocks: reference {t['reference'] * 1e3:.2f}"
            f"  ptrres {t['out'] * 1e3:.2f}  numpy fill {t['fill'] * 1e3:.2f}"
        )
        fill_ratio = t["out"] / t["fill"]
        speedup = t["reference"] / t["out"]
        verdicts.check(
            f"{blocks} blocks: ptrres / numpy fill",
            fill_ratio,
            "<= 1.5",
            fill_ratio <= 1.5,
        )
        verdicts.check(
            f"{blocks} blocks: reference / ptrres", speedup, ">= 3", speedup >= 3
        )

    print("\nstart-up in a fresh process: import, warmup(), first resolve, s")
    with tempfile.TemporaryDirectory() as cache_dir:
        cold, _, compiled = startup_seconds(cache_dir)
        warm, loaded, _ = min(startup_seconds(cache_dir) for _ in range(3))
    verdicts.check(
        f"empty Numba cache ({compiled} signatures compiled)", cold, "<= 3", cold <= 3
    )
    verdicts.check(
        f"warm Numba cache ({loaded} signatures loaded)", warm, "<= 0.6", warm <= 0.6
    )
    print(f"\n{sum(verdicts.met)}/{len(verdicts.met)} targets met")


if __name__ == "__main__":
    main()
