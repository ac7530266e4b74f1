# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Performance: ptrres against numpy
#
# Every number below is measured when the notebook runs, side by side in this
# process: `ptrres.bench.compare` calibrates a batch of calls per contender,
# then runs the batches in turn for several rounds and keeps the medians, so a
# noisy neighbour slows every contender alike. Absolute times depend on the
# machine and its load; the ratios are the figures (SPEC section 9).
#
# Contenders:
#
# - **reference**: `ptrres.reference`, plain numpy with the same checks (one
#   vectorised expression per group and ref), the oracle of the tests;
# - **vLLM-style**: vLLM's numpy code as it stands, without checks;
# - **ptrres**: the compiled path, writing into `out=` buffers (as a server
#   does with its pinned buffers), and the vLLM drop-in, which allocates;
# - **numpy fill**: `fill()` of output buffers of the same length. No resolver
#   can write its output faster than that: it is the physical limit.
#
# The layouts are virtual (`ptrres.bench.PRESETS`): pointer math only, no
# memory behind them. `SECONDS` sets how long each comparison runs; raise it
# for smoother curves.

# %%
import matplotlib.pyplot as plt
import numpy as np

import ptrres
from ptrres import reference
from ptrres.bench import (
    PRESETS,
    compare,
    geometric_mean,
    make_offloaded_ids,
    make_spec,
    vllm_style_plan,
    vllm_style_resolve,
)

plt.rcParams.update({"figure.dpi": 80, "savefig.dpi": 80})
SECONDS = 0.15  # per comparison
BLOCKS = [1, 4, 16, 64, 256, 1024, 4096]  # blocks per group
LAYOUTS = ["llama-3.1-8b-split", "llama-3.1-70b-tp4", "hybrid-4x12"]
BPC = 4  # blocks per chunk, for transfer plans
print(ptrres.warmup())

# %% [markdown]
# ## Resolving block ids


# %%
def time_resolve(name: str, blocks: int) -> dict[str, float]:
    """Seconds per call of each contender resolving one spec."""
    preset = PRESETS[name]
    kv = preset.kv_caches()
    table = ptrres.PointerTable(kv)
    spec = make_spec(preset, blocks, seed=0)
    n_ops = blocks * preset.num_refs
    ptrs, sizes = np.empty(n_ops, np.int64), np.empty(n_ops, np.int64)
    timings = compare(
        {
            "reference": lambda: reference.resolve_device_pointers(spec, kv),
            "vLLM-style": lambda: vllm_style_resolve(spec, kv),
            "ptrres drop-in": lambda: ptrres.resolve_device_pointers(spec, kv),
            "ptrres out=": lambda: table.resolve(spec, out=(ptrs, sizes)),
            "numpy fill": lambda: (ptrs.fill(1), sizes.fill(2)),
        },
        seconds=SECONDS,
    )
    return {key: timing.seconds for key, timing in timings.items()}


def ops_of(name: str, blocks: int) -> int:
    """Copy ops of a transfer of ``blocks`` blocks per group."""
    return blocks * PRESETS[name].num_refs


resolve_times = {(n, b): time_resolve(n, b) for n in LAYOUTS for b in BLOCKS}


# %%
def print_table(times: dict[tuple[str, int], dict[str, float]], fast: str) -> None:
    """Microseconds per call; x ref is the speedup of ``fast`` over the reference."""
    contenders = list(next(iter(times.values())))
    print(f"{'layout':<20}{'ops':>8}" + "".join(f"{c:>18}" for c in contenders), end="")
    print(f"{'x ref':>8}")
    for (name, blocks), t in times.items():
        row = "".join(f"{t[c] * 1e6:>18.2f}" for c in contenders)
        speedup = t["reference"] / t[fast]
        print(f"{name:<20}{ops_of(name, blocks):>8}{row}{speedup:>8.1f}")


print("us per call")
print_table(resolve_times, "ptrres out=")

# %% [markdown]
# Left: time per call against the number of copy ops, for one layout. Right:
# the speedup of `ptrres out=` over the reference for every layout (solid),
# and the ceiling no resolver can pass, reference / numpy fill (dashed).

# %%
COLOURS = dict(zip(LAYOUTS, ["tab:blue", "tab:orange", "tab:green"]))


def plot(times: dict[tuple[str, int], dict[str, float]], fast: str, title: str) -> None:
    """Time per call for LAYOUTS[0], and speedups over the reference."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.5))
    name = LAYOUTS[0]
    ops = [ops_of(name, b) for b in BLOCKS]
    for contender in next(iter(times.values())):
        style = "k--" if contender == "numpy fill" else "o-"
        seconds = [times[name, b][contender] for b in BLOCKS]
        left.plot(ops, seconds, style, label=contender, ms=4)
    left.set(xscale="log", yscale="log", xlabel="copy ops", ylabel="seconds per call")
    left.set_title(name, fontsize=10)
    left.legend(fontsize=7, frameon=False)
    for name in LAYOUTS:
        ops = [ops_of(name, b) for b in BLOCKS]
        reference_s = np.array([times[name, b]["reference"] for b in BLOCKS])
        fast_s = np.array([times[name, b][fast] for b in BLOCKS])
        fill_s = np.array([times[name, b]["numpy fill"] for b in BLOCKS])
        right.plot(
            ops, reference_s / fast_s, "o-", color=COLOURS[name], ms=4, label=name
        )
        right.plot(ops, reference_s / fill_s, "--", color=COLOURS[name], lw=1)
    right.axhline(1, color="0.5", lw=0.8)
    right.set(xscale="log", yscale="log", xlabel="copy ops")
    right.set_ylabel(f"reference / {fast}")
    right.set_title("speedup (dashed: numpy fill)", fontsize=10)
    right.legend(fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    plt.show()


plot(resolve_times, "ptrres out=", "resolve_device_pointers")

# %% [markdown]
# ## Transfer plans
#
# A whole load plan (`src`, `dst`, `sizes` for every group, ref and block) with
# bpc 4, plain and coalesced, against the reference and vLLM's numpy descriptor
# fill. The physical limit is now three arrays to fill. A coalesced plan can
# beat it at large sizes: it writes fewer descriptors than there are ops (up to
# 16 times fewer here, where block ids come in runs of 16).


# %%
def time_plan(name: str, blocks: int) -> dict[str, float]:
    """Seconds per call of each contender building one load plan."""
    preset = PRESETS[name]
    kv = preset.kv_caches()
    offloaded_tensors = preset.offloaded_tensors(BPC)
    offloaded = ptrres.OffloadedLayout(offloaded_tensors, BPC)
    table = ptrres.PointerTable(kv)
    spec = make_spec(preset, blocks, seed=0)
    ids = make_offloaded_ids(spec, BPC)
    n_ops = blocks * preset.num_refs
    src, dst, sizes = (np.empty(n_ops, np.int64) for _ in range(3))
    out = (src, dst, sizes)
    timings = compare(
        {
            "reference": lambda: reference.plan_transfer(
                spec, kv, offloaded_tensors, BPC, ids, store=False
            ),
            "vLLM-style": lambda: vllm_style_plan(
                spec, kv, offloaded_tensors, BPC, ids, False
            ),
            "ptrres out=": lambda: table.plan_transfer(
                spec, offloaded, ids, store=False, out=out
            ),
            "ptrres coalesced": lambda: table.plan_transfer(
                spec, offloaded, ids, store=False, out=out, coalesce=True
            ),
            "numpy fill": lambda: (src.fill(1), dst.fill(2), sizes.fill(3)),
        },
        seconds=SECONDS,
    )
    return {key: timing.seconds for key, timing in timings.items()}


plan_times = {(n, b): time_plan(n, b) for n in LAYOUTS for b in BLOCKS}
print("us per call")
print_table(plan_times, "ptrres out=")

# %%
plot(plan_times, "ptrres out=", "plan_transfer (load, bpc 4)")

# %% [markdown]
# ## Summary
#
# Geometric means over layouts, for small transfers (up to 16 blocks per group:
# the stores of every engine step) and large ones (256 and more: prefix-hit
# loads), and how far the largest transfers are from the numpy fill.

# %%
SMALL = [b for b in BLOCKS if b <= 16]
LARGE = [b for b in BLOCKS if b >= 256]
for label, times, fast in [
    ("resolve", resolve_times, "ptrres out="),
    ("plan", plan_times, "ptrres out="),
]:
    for size_label, sizes in [("small", SMALL), ("large", LARGE)]:
        speedups = [
            times[n, b]["reference"] / times[n, b][fast] for n in LAYOUTS for b in sizes
        ]
        print(
            f"{label:<8} {size_label}: {fast} is "
            f"{geometric_mean(speedups):6.1f}x faster than the reference"
        )
    to_fill = [
        times[n, BLOCKS[-1]][fast] / times[n, BLOCKS[-1]]["numpy fill"] for n in LAYOUTS
    ]
    print(
        f"{label:<8} {BLOCKS[-1]} blocks: {fast} takes "
        f"{geometric_mean(to_fill):.2f}x the time of the numpy fill"
    )
