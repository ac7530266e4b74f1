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
# # Transfer plans: chunks, skips, groups, coalescing
#
# Offloaded memory (CPU, say) holds *chunks*: one offloaded block spans
# `blocks_per_chunk` (bpc) device blocks, so row `c` of an offloaded tensor
# splits into bpc sub-blocks. A transfer plan pairs every device block with its
# sub-block and gives one `(src, dst, size)` copy descriptor per group, ref and
# block (SPEC section 5):
#
#     j       = skip(g) + k            # k-th block of group g
#     chunk   = offloaded_ids_of_g[j // bpc]
#     sub     = j % bpc
#     skip(g) = block_indices[g] % bpc # where the group starts in its chunk
#
# A *store* copies device -> offloaded, a *load* offloaded -> device. This
# notebook draws a plan, runs a store and a load on real CPU tensors, and shows
# what coalescing does to the number of descriptors.

# %%
import ctypes

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

import ptrres
from ptrres import reference
from ptrres.bench import PRESETS, make_offloaded_ids, make_spec

plt.rcParams.update({"figure.dpi": 80, "savefig.dpi": 80})
generator = torch.Generator().manual_seed(0)
print(ptrres.warmup())

# %% [markdown]
# ## A two-group layout
#
# Two layer tensors of 16 blocks with 32-byte rows, shared by two KV-cache
# groups as in hybrid models (layer i of every group lives in tensor i). The
# offloaded side mirrors them: one CPU tensor per device tensor, 8 chunks of
# bpc = 4 sub-blocks of 32 bytes.
#
# - group 0 copies blocks 3, 4, 5, 6, 11 from the start of the request
#   (block index 0, so no skip): 5 blocks over 2 chunks;
# - group 1 copies blocks 9, 10, 12 starting at block index 6 of the request:
#   `skip = 6 % 4 = 2`, so it starts at sub-block 2 of its first chunk and spans
#   2 chunks.

# %%
NUM_BLOCKS, ROW, BPC, NUM_CHUNKS = 16, 32, 4, 8


def random_bytes(*shape: int) -> torch.Tensor:
    """An int8 tensor of random bytes (seeded)."""
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=generator)


device = [random_bytes(NUM_BLOCKS, ROW) for _ in range(2)]
original = [tensor.clone() for tensor in device]
offloaded_tensors = [
    torch.zeros(NUM_CHUNKS, BPC * ROW, dtype=torch.int8) for _ in device
]

kv_caches = ptrres.CanonicalKVCaches(
    tensors=[ptrres.CanonicalKVCacheTensor(tensor, ROW) for tensor in device],
    group_data_refs=[
        [ptrres.CanonicalKVCacheRef(0, ROW), ptrres.CanonicalKVCacheRef(1, ROW)],
        [ptrres.CanonicalKVCacheRef(0, ROW), ptrres.CanonicalKVCacheRef(1, ROW)],
    ],
)
spec = ptrres.GPULoadStoreSpec(
    np.array([3, 4, 5, 6, 11, 9, 10, 12]), group_sizes=[5, 3], block_indices=[0, 6]
)
offloaded = ptrres.OffloadedLayout(offloaded_tensors, blocks_per_chunk=BPC)
table = ptrres.PointerTable(kv_caches)
print(offloaded)

# %% [markdown]
# `iter_pointer_groups` (vLLM's helper) says where each group sits: its skip,
# how many chunks it spans, and where its ops start in the resolved pointers.
# The offloaded chunk ids are consumed group by group: group 0 takes the first
# 2, group 1 the next 2.

# %%
device_ptrs = ptrres.resolve_device_pointers(spec, kv_caches)
for info in ptrres.iter_pointer_groups(device_ptrs, BPC):
    print(info)
offloaded_ids = np.array([5, 1, 2, 6])

# %% [markdown]
# ## The plan, drawn
#
# Left: the 16 blocks of device tensor 0. Right: the 8 chunks of offloaded
# tensor 0, each split into its 4 sub-blocks. An arrow per descriptor of the
# store plan on tensor 0, placed from its pointers alone (row and sub-block are
# read back from `src - base` and `dst - base`), coloured by group. Tensor 1
# gets the same picture at its own addresses. Hatched: the sub-blocks group 1
# skips.

# %%
store = table.plan_transfer(spec, offloaded, offloaded_ids, store=True)
print(len(store.sizes), "descriptors,", store.num_bytes, "bytes")
oracle = reference.plan_transfer(
    spec, kv_caches, offloaded_tensors, BPC, offloaded_ids, store=True
)
print(
    "same as the numpy reference:",
    all(
        np.array_equal(a, b)
        for a, b in zip(
            (store.src, store.dst, store.sizes), (oracle.src, oracle.dst, oracle.sizes)
        )
    ),
)

# The group of each descriptor: ops are ordered group -> ref -> block.
op_groups = np.repeat(
    np.arange(len(spec.group_sizes)),
    [n * len(r) for n, r in zip(spec.group_sizes, kv_caches.group_data_refs)],
)

# %%
GROUP_COLOURS = ["tab:blue", "tab:orange"]
dev_base = device[0].data_ptr()
off_base = offloaded_tensors[0].data_ptr()
off_stride, sub_bytes = BPC * ROW, ROW
DEV_X, DEV_W, OFF_X = 0.0, 1.4, 4.0  # where the two columns start


def sub_block_cell(chunk: int, sub: int, **style: object) -> Rectangle:
    """The cell of sub-block ``sub`` of chunk ``chunk`` (2 units high)."""
    return Rectangle((OFF_X + sub, 2 * chunk + 0.1), 0.95, 1.8, **style)


fig, ax = plt.subplots(figsize=(8, 3.5))
for block in range(NUM_BLOCKS):  # device tensor 0: one cell per block
    ax.add_patch(Rectangle((DEV_X, block + 0.05), DEV_W, 0.9, facecolor="0.92"))
    ax.text(DEV_X - 0.1, block + 0.5, str(block), ha="right", va="center", fontsize=7)
for chunk in range(NUM_CHUNKS):  # offloaded tensor 0: bpc cells per chunk row
    for sub in range(BPC):
        ax.add_patch(sub_block_cell(chunk, sub, facecolor="0.92"))
    ax.text(OFF_X + BPC + 0.1, 2 * chunk + 1, f"chunk {chunk}", va="center", fontsize=7)

for i in range(len(store.sizes)):
    dev_offset = int(store.src[i]) - dev_base
    off_offset = int(store.dst[i]) - off_base
    if not (0 <= dev_offset < NUM_BLOCKS * ROW):
        continue  # a descriptor of tensor 1
    block = dev_offset // ROW
    chunk, sub = divmod(off_offset, off_stride)
    sub //= sub_bytes
    colour = GROUP_COLOURS[op_groups[i]]
    ax.add_patch(Rectangle((DEV_X, block + 0.05), DEV_W, 0.9, color=colour))
    ax.add_patch(sub_block_cell(chunk, sub, color=colour))
    ax.text(
        OFF_X + sub + 0.47,
        2 * chunk + 1,
        f"block {block}",
        ha="center",
        va="center",
        color="white",
        fontsize=7,
    )
    ax.add_patch(
        FancyArrowPatch(
            (DEV_X + DEV_W, block + 0.5),
            (OFF_X, 2 * chunk + 0.4 + 0.4 * sub),
            arrowstyle="-|>",
            mutation_scale=8,
            color=colour,
            lw=1,
        )
    )

# The skipped sub-blocks: the first skip(g) of each group's first chunk.
first_chunk = 0
for info in ptrres.iter_pointer_groups(device_ptrs, BPC):
    chunk = int(offloaded_ids[first_chunk])
    for sub in range(info.skip):
        ax.add_patch(
            sub_block_cell(
                chunk,
                sub,
                facecolor="white",
                edgecolor=GROUP_COLOURS[info.group_idx],
                hatch="///",
            )
        )
    first_chunk += info.n_chunks

ax.set(xlim=(-0.6, OFF_X + BPC + 0.9), ylim=(2 * NUM_CHUNKS, -1.6))
ax.set_axis_off()
ax.text(DEV_X + DEV_W / 2, -0.3, "device tensor 0 (block = row)", ha="center")
ax.text(OFF_X + BPC / 2, -0.3, "offloaded tensor 0 (chunk = row)", ha="center")
fig.legend(
    handles=[Patch(color=c, label=f"group {g}") for g, c in enumerate(GROUP_COLOURS)]
    + [Patch(facecolor="white", edgecolor="0.4", hatch="///", label="skipped")],
    loc="lower center",
    ncol=3,
    frameon=False,
)
fig.tight_layout(rect=(0, 0.08, 1, 1))
plt.show()

# %% [markdown]
# ## A store, then a load, with real bytes
#
# Run the store's descriptors with `ctypes.memmove` (what a copy engine would
# do), then check every offloaded sub-block against the SPEC formula, written
# out independently here.


# %%
def execute(plan: ptrres.TransferPlan) -> None:
    """Copy sizes[i] bytes from src[i] to dst[i], for every descriptor."""
    for src, dst, size in zip(
        plan.src.tolist(), plan.dst.tolist(), plan.sizes.tolist()
    ):
        ctypes.memmove(dst, src, size)


execute(store)

expected = [torch.zeros_like(t) for t in offloaded_tensors]
first_id = first_chunk = 0
for n_blocks, block_index in zip(spec.group_sizes, spec.block_indices):
    skip = block_index % BPC
    for k in range(n_blocks):
        j = skip + k
        block = int(spec.block_ids[first_id + k])
        chunk = int(offloaded_ids[first_chunk + j // BPC])
        sub = j % BPC
        for t in range(len(device)):
            expected[t][chunk, sub * ROW : (sub + 1) * ROW] = original[t][block]
    first_id += n_blocks
    first_chunk += -(-(n_blocks + skip) // BPC)
print(
    "offloaded bytes as SPEC says:",
    all(torch.equal(a, b) for a, b in zip(offloaded_tensors, expected)),
)

# %% [markdown]
# Now wipe the device tensors and load the blocks back: the 8 blocks come back
# byte for byte, and nothing else is written.

# %%
for tensor in device:
    tensor.zero_()
load = table.plan_transfer(spec, offloaded, offloaded_ids, store=False)
print("a load swaps src and dst:", np.array_equal(load.src, store.dst))
execute(load)

blocks = spec.block_ids
for t, tensor in enumerate(device):
    untouched = np.setdiff1d(np.arange(NUM_BLOCKS), blocks)
    print(
        f"tensor {t}: blocks {sorted(blocks.tolist())} restored:",
        torch.equal(tensor[blocks], original[t][blocks]),
        "| other blocks still zero:",
        bool((tensor[untouched] == 0).all()),
    )

# %% [markdown]
# ## Coalescing
#
# Descriptor i+1 can join descriptor i when it continues it on *both* sides
# (`src[i] + size[i] == src[i+1]` and the same for dst). Here the page fills the
# row on both sides, so consecutive device blocks that land in consecutive
# sub-blocks merge: blocks 3-6 of group 0 fill chunk 5 and become one copy per
# ref; blocks 9-10 of group 1 fill sub-blocks 2-3 of chunk 2. Each copy
# submitted to `cuMemcpyBatchAsync` costs CPU time, and the driver never merges
# neighbours, so fewer is better. `max_run_bytes` caps a merged run.

# %%
merged = table.plan_transfer(spec, offloaded, offloaded_ids, store=True, coalesce=True)
capped = table.plan_transfer(
    spec, offloaded, offloaded_ids, store=True, coalesce=True, max_run_bytes=2 * ROW
)
standalone = ptrres.coalesce(store.src, store.dst, store.sizes)
print(f"{'plan':<28}{'descriptors':>12}{'bytes':>7}  sizes")
for name, plan in [
    ("plain", store),
    ("coalesce=True", merged),
    ("max_run_bytes=64", capped),
    ("ptrres.coalesce(plain)", standalone),
]:
    print(f"{name:<28}{len(plan.sizes):>12}{plan.num_bytes:>7}  {plan.sizes.tolist()}")

# %% [markdown]
# Coalescing keeps the byte mapping: a load through the merged plan restores
# the same bytes as the plain one.

# %%
for tensor in device:
    tensor.zero_()
execute(table.plan_transfer(spec, offloaded, offloaded_ids, store=False, coalesce=True))
print(
    "merged load restores the blocks:",
    all(torch.equal(d[blocks], o[blocks]) for d, o in zip(device, original)),
)

# %% [markdown]
# ## Coalescing at model scale
#
# The model-shaped layouts of `ptrres.bench` are virtual (pointer math only,
# no memory), so a 70B model's plan costs nothing to build here. Block ids come
# in runs of up to 16 consecutive blocks, as an allocator hands them out after
# some churn; each group's chunks are consecutive. Runs then merge up to 16
# blocks per descriptor, or fewer under a 256 KiB cap. The hybrid layout's
# attention groups copy 32 KiB pages out of 64 KiB rows (tensor i is shared by
# every group, its rows as wide as the largest page): their blocks are not
# contiguous, and only the linear-attention group merges.

# %%
LAYOUTS = ["llama-3.1-8b", "llama-3.1-8b-split", "llama-3.1-70b-tp4", "hybrid-4x12"]
BLOCKS_PER_GROUP, MODEL_BPC = 256, 4
counts = {}
print(f"{'layout':<20}{'groups x refs':>14}{'plain':>9}{'merged':>9}{'capped':>9}")
for name in LAYOUTS:
    preset = PRESETS[name]
    model_table = ptrres.PointerTable(preset.kv_caches())
    model_offloaded = ptrres.OffloadedLayout(
        preset.offloaded_tensors(MODEL_BPC), MODEL_BPC
    )
    model_spec = make_spec(preset, BLOCKS_PER_GROUP, seed=0)
    ids = make_offloaded_ids(model_spec, MODEL_BPC)
    counts[name] = [
        len(
            model_table.plan_transfer(
                model_spec, model_offloaded, ids, store=False, **options
            ).sizes
        )
        for options in (
            {},
            {"coalesce": True},
            {"coalesce": True, "max_run_bytes": 256 << 10},
        )
    ]
    shape = f"{preset.num_groups} x {preset.refs_per_group}"
    print(f"{name:<20}{shape:>14}" + "".join(f"{c:>9}" for c in counts[name]))

# %%
fig, ax = plt.subplots(figsize=(8, 3.5))
x = np.arange(len(LAYOUTS))
for i, label in enumerate(["plain", "coalesced", "coalesced, 256 KiB cap"]):
    ax.bar(x + (i - 1) * 0.27, [counts[n][i] for n in LAYOUTS], width=0.27, label=label)
ax.set_xticks(x, LAYOUTS)
ax.set_yscale("log")
ax.set_ylabel("descriptors per load")
ax.set_title(f"{BLOCKS_PER_GROUP} blocks per group, bpc {MODEL_BPC}")
ax.legend(frameon=False)
fig.tight_layout()
plt.show()
