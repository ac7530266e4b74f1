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
# # Canonical layouts: one offloaded copy for every parallelism
#
# With vLLM 0.33's `canonical_layout`, offloaded pages are stored in a
# *canonical* form: the page a TP=1 worker would hold, whatever the tensor
# parallelism of the worker that stores or loads it (SPEC section 10). Each
# ref carries a `CanonicalPageMapping`, whose `CopyRun`s say which fragments of
# the worker's page go where in the canonical page:
#
#     fragment i:  local     [local_offset + i * local_stride, + fragment_size)
#                  canonical [canonical_offset + i * canonical_stride, + same)
#
# A plan then has one descriptor per (kept block, ref, fragment); a *strided*
# plan has one 2-D descriptor per (kept block, ref, run), the arguments of
# `cudaMemcpy2DAsync`. This notebook draws a mapping, stores from two TP=2
# ranks into one canonical CPU tensor, loads it into four TP=4 ranks, and
# counts descriptors, flat against strided.

# %%
import ctypes

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.patches import ConnectionPatch, Rectangle

import ptrres
from ptrres import CanonicalPageMapping, CopyRun
from ptrres.bench import CANONICAL_PRESETS, canonical_bench_cell

plt.rcParams.update({"figure.dpi": 80, "savefig.dpi": 80})
print(ptrres.warmup())

# %% [markdown]
# ## vLLM's packed NHD mapping
#
# A packed NHD page holds, token after token, K and V of every KV head the
# worker has. With 8 KV heads of `head_bytes` bytes (K and V) and TP = tp,
# rank r holds heads `[r * 8/tp, (r+1) * 8/tp)`: a token row of
# `row = 8/tp * head_bytes` bytes. Its token t sits at `t * row` in its page
# and at `t * tp * row + r * row` in the canonical page: one run of
# `block_size` fragments.

# %%
HEADS, HEAD_BYTES, BLOCK_SIZE = 8, 8, 16


def nhd_mapping(rank: int, tp: int) -> CanonicalPageMapping:
    """Rank ``rank`` of ``tp``: one run, a fragment per token."""
    row = HEADS // tp * HEAD_BYTES
    return CanonicalPageMapping(
        canonical_page_size_bytes=BLOCK_SIZE * tp * row,
        local_page_size_bytes=BLOCK_SIZE * row,
        runs=(CopyRun(0, rank * row, row, BLOCK_SIZE, row, tp * row),),
        num_writers=1,
        writer_index=0,
        parallelism_agnostic=True,
    )


print(nhd_mapping(1, 2))

# %% [markdown]
# Drawn for the first four tokens: the two TP=2 ranks' pages (top) fill
# alternate halves of each canonical token row (bottom).

# %%
fig, ax = plt.subplots(figsize=(10, 3.2))
tokens, colors = 4, ["tab:blue", "tab:orange"]
scale = 1 / 8  # one unit per 8 bytes
for rank in range(2):
    mapping = nhd_mapping(rank, 2)
    run = mapping.runs[0]
    x0 = rank * 40
    for i in range(tokens):
        local = x0 + (run.local_offset + i * run.local_stride) * scale
        canonical = (run.canonical_offset + i * run.canonical_stride) * scale
        width = run.fragment_size * scale
        ax.add_patch(Rectangle((local, 2), width, 0.6, color=colors[rank], alpha=0.5))
        ax.add_patch(
            Rectangle((canonical, 0), width, 0.6, color=colors[rank], alpha=0.5)
        )
        ax.text(local + width / 2, 2.3, f"t{i}", ha="center", va="center", fontsize=8)
        ax.text(
            canonical + width / 2, 0.3, f"t{i}", ha="center", va="center", fontsize=8
        )
        ax.add_artist(
            ConnectionPatch(
                (local + width / 2, 2), (canonical + width / 2, 0.6), "data", "data",
                arrowstyle="->", color=colors[rank], alpha=0.6,
            )
        )  # fmt: skip
    ax.text(x0, 2.8, f"TP=2 rank {rank} page (first {tokens} tokens)", fontsize=9)
ax.text(0, -0.4, f"canonical page (first {tokens} tokens)", fontsize=9)
ax.set_xlim(-1, 75)
ax.set_ylim(-0.7, 3.2)
ax.set_xlabel("bytes / 8")
ax.set_yticks([])
plt.show()

# %% [markdown]
# ## Store from TP=2, load into TP=4
#
# The TP=1 pages of 10 blocks, cut into the TP=2 ranks' pages. Both ranks store
# blocks 7, 2, 5 (positions 1..3 of a request, bpc = 2) into chunks 3 and 0 of
# one canonical CPU tensor; then four TP=4 ranks load those chunks into blocks
# 4, 0, 9 of their own caches. A plan is checked by moving its bytes with
# `ctypes.memmove`.

# %%
num_blocks, bpc = 10, 2
generator = torch.Generator().manual_seed(0)
full = torch.randint(
    0, 256, (num_blocks, BLOCK_SIZE, HEADS, HEAD_BYTES), dtype=torch.uint8,
    generator=generator,
)  # fmt: skip
canonical = torch.zeros((4, bpc * BLOCK_SIZE * HEADS * HEAD_BYTES), dtype=torch.uint8)
layout = ptrres.OffloadedLayout([canonical], bpc, canonical=True)
blocks, chunks = [7, 2, 5], np.array([3, 0])


def copy(plan: ptrres.TransferPlan) -> None:
    for src, dst, size in zip(
        plan.src.tolist(), plan.dst.tolist(), plan.sizes.tolist()
    ):
        ctypes.memmove(dst, src, size)


def rank_table(
    cache: torch.Tensor, mapping: CanonicalPageMapping
) -> ptrres.PointerTable:
    return ptrres.PointerTable(
        ptrres.CanonicalKVCaches(
            [ptrres.CanonicalKVCacheTensor(cache, cache.shape[1])],
            [[ptrres.CanonicalKVCacheRef(0, mapping.local_page_size_bytes, mapping)]],
        )
    )


store = ptrres.GPULoadStoreSpec(blocks, [3], [1])
for rank in range(2):
    shard = full[:, :, rank * 4 : rank * 4 + 4].reshape(num_blocks, -1).clone()
    plan = rank_table(shard, nhd_mapping(rank, 2)).plan_transfer(
        store, layout, chunks, store=True
    )
    print(f"TP=2 rank {rank}: {len(plan.src)} descriptors of {plan.sizes[0]} B")
    copy(plan)

pages = canonical.view(4 * bpc, -1)  # canonical page id = chunk * bpc + sub
for block, page_id in zip(blocks, [3 * bpc + 1, 0 * bpc, 0 * bpc + 1]):
    assert torch.equal(pages[page_id], full[block].reshape(-1))
print("the canonical pages are the TP=1 pages of blocks", blocks)

# %%
load = ptrres.GPULoadStoreSpec([4, 0, 9], [3], [1])
for rank in range(4):
    cache = torch.zeros((num_blocks, BLOCK_SIZE * 2 * HEAD_BYTES), dtype=torch.uint8)
    table = rank_table(cache, nhd_mapping(rank, 4))
    copy(table.plan_transfer(load, layout, chunks, store=False))
    for block, target in zip(blocks, [4, 0, 9]):
        heads = full[block, :, rank * 2 : rank * 2 + 2].reshape(-1)
        assert torch.equal(cache[target], heads)
    assert not cache[[1, 2, 3, 5, 6, 7, 8]].any()
    strided = table.plan_strided_transfer(load, layout, chunks, store=False)
    print(
        f"TP=4 rank {rank}: loaded its 2 heads of each block; "
        f"{len(strided.src)} 2-D descriptors of {strided.height[0]} rows x "
        f"{strided.width[0]} B, pitches {strided.src_pitch[0]} -> "
        f"{strided.dst_pitch[0]}"
    )

# %% [markdown]
# ## Writer rotation (MLA)
#
# MLA pages are replicated under TP: every rank holds the same bytes. The
# mapping says so with `num_writers = tp`, and a store keeps only the blocks
# whose canonical page id is the rank's (`page_id % num_writers ==
# writer_index`), so that each page is written once. Loads keep every block.

# %%
tp, page = 4, 24
mla_canonical = torch.zeros((5, 4 * page), dtype=torch.uint8)
mla_layout = ptrres.OffloadedLayout([mla_canonical], 4, canonical=True)
spec = ptrres.GPULoadStoreSpec(np.arange(1, 11), [10], [3])
mla_chunks = np.array([2, 4, 0, 3])
for rank in range(tp):
    cache = torch.full((12, page), rank + 1, dtype=torch.uint8)  # marked by rank
    mapping = CanonicalPageMapping(
        page, page, (CopyRun(0, 0, page, 1, page, page),), tp, rank, False
    )
    plan = rank_table(cache, mapping).plan_transfer(
        spec, mla_layout, mla_chunks, store=True
    )
    print(f"rank {rank} stores {len(plan.src)} of the 10 blocks")
    copy(plan)
written = mla_canonical.view(-1, page)[:, 0].tolist()
print("writer of each canonical page (0: not in the transfer):", written)

# %% [markdown]
# ## Descriptors: flat against strided
#
# Fragments multiply descriptors: Llama-3.1-70B at TP=4 in packed NHD has 16
# per block and layer. A strided plan needs one per run instead. The bench
# (`ptrres bench --operation canonical`) times both against a numpy
# transcription of vLLM 0.33's canonical fill; here, briefly, at two sizes.

# %%
rows = [
    canonical_bench_cell(CANONICAL_PRESETS[name], n, seconds=0.1, with_fill=False)
    for name in CANONICAL_PRESETS
    for n in (16, 256)
]
for row in rows:
    print(
        f"{row.preset:<22} {row.blocks_per_group:>4} blocks: "
        f"{row.descriptors:>7} flat, {row.strided_descriptors:>6} strided descriptors"
    )
fig, ax = plt.subplots(figsize=(7, 3))
labels = [f"{r.preset}\n{r.blocks_per_group} blocks" for r in rows]
x = np.arange(len(rows))
ax.bar(x - 0.2, [r.descriptors for r in rows], 0.4, label="flat")
ax.bar(x + 0.2, [r.strided_descriptors for r in rows], 0.4, label="strided (2-D)")
ax.set_xticks(x, labels, fontsize=7)
ax.set_yscale("log")
ax.set_ylabel("descriptors per transfer")
ax.legend()
plt.show()
