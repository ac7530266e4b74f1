"""Issue-3 speed targets: transfer plans and coalescing against numpy.

Every figure is a ratio of medians of interleaved rounds, in one process.
Run: python benchmarks/plan_targets.py [--quick]
"""

from __future__ import annotations

import argparse

import numpy as np

import ptrres
from ptrres import reference
from ptrres.bench import (
    PRESETS,
    compare,
    make_offloaded_ids,
    make_spec,
    vllm_style_plan,
)

LAYOUTS = ["llama-3.1-8b-split", "hybrid-4x12"]
BLOCKS_PER_CHUNK = 4


def time_plans(name: str, blocks: int, seconds: float) -> dict[str, float]:
    """Seconds per call of each way of building one store's descriptors."""
    preset = PRESETS[name]
    kv = preset.kv_caches()
    offloaded_tensors = preset.offloaded_tensors(BLOCKS_PER_CHUNK)
    offloaded = ptrres.OffloadedLayout(offloaded_tensors, BLOCKS_PER_CHUNK)
    table = ptrres.PointerTable(kv)
    spec = make_spec(preset, blocks)
    ids = make_offloaded_ids(spec, BLOCKS_PER_CHUNK)
    n_ops = blocks * preset.num_refs
    out = tuple(np.empty(n_ops, np.int64) for _ in range(3))

    def numpy_plan_and_coalesce() -> object:
        src, dst, sizes = vllm_style_plan(
            spec, kv, offloaded_tensors, BLOCKS_PER_CHUNK, ids, True
        )
        return reference.coalesce(src, dst, sizes)

    timings = compare(
        {
            "vllm": lambda: vllm_style_plan(
                spec, kv, offloaded_tensors, BLOCKS_PER_CHUNK, ids, True
            ),
            "reference": lambda: reference.plan_transfer(
                spec, kv, offloaded_tensors, BLOCKS_PER_CHUNK, ids, store=True
            ),
            "numpy+coalesce": numpy_plan_and_coalesce,
            "plan": lambda: table.plan_transfer(
                spec, offloaded, ids, store=True, out=out
            ),
            "plan+coalesce": lambda: table.plan_transfer(
                spec, offloaded, ids, store=True, out=out, coalesce=True
            ),
        },
        seconds=seconds,
    )
    plan = table.plan_transfer(spec, offloaded, ids, store=True, coalesce=True)
    result = {key: timing.seconds for key, timing in timings.items()}
    result["descriptors"] = len(plan.sizes)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter timings")
    args = parser.parse_args()
    seconds = 0.15 if args.quick else 0.6
    ptrres.warmup()
    met = []
    print(f"store plans, bpc {BLOCKS_PER_CHUNK}, us per call")
    print(
        f"  {'layout':<20}{'blocks':>7}{'ops':>7}{'merged':>7}{'vllm':>9}{'ref':>9}"
        f"{'np+coal':>9}{'plan':>8}{'+coal':>8}{'x vllm':>8}{'x ref':>7}"
        f"{'coal+%':>8}{'x np+c':>8}"
    )
    for name in LAYOUTS:
        for blocks in (16, 256):
            t = time_plans(name, blocks, seconds)
            x_vllm = t["vllm"] / t["plan"]
            extra = t["plan+coalesce"] / t["plan"] - 1
            x_both = t["numpy+coalesce"] / t["plan+coalesce"]
            print(
                f"  {name:<20}{blocks:>7}{blocks * PRESETS[name].num_refs:>7}"
                f"{t['descriptors']:>7.0f}{t['vllm'] * 1e6:>9.1f}"
                f"{t['reference'] * 1e6:>9.1f}{t['numpy+coalesce'] * 1e6:>9.1f}"
                f"{t['plan'] * 1e6:>8.2f}{t['plan+coalesce'] * 1e6:>8.2f}"
                f"{x_vllm:>8.1f}{t['reference'] / t['plan']:>7.1f}"
                f"{extra * 100:>7.0f}%{x_both:>8.1f}"
            )
            met.append(x_vllm >= 20)
            met.append(extra <= 0.30)
            if blocks == 256:
                met.append(x_both >= 10)
    print(
        "\ntargets: plan >= 20x vLLM's numpy fill; coalescing adds <= 30%;"
        " at 256 blocks plan+coalesce >= 10x numpy plan + numpy coalesce"
    )
    print(f"{sum(met)}/{len(met)} targets met")


if __name__ == "__main__":
    main()
