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
# # The file tier: blocks to (file, offset)
#
# vLLM's file-tier offloading workers (GPUDirect Storage, POSIX, NIXL; vLLM
# PR #56076) store **one chunk of one group per file**: a file holds
# `blocks_per_chunk` (bpc) slots, and block k of a group (`j = skip + k`)
# lands in slot `s = j % bpc` of the group's file `j // bpc` (SPEC
# section 11). Two layouts place the refs (layers) inside a file, with pages
# `P[d]` and `before(d) = P[0] + ... + P[d-1]`:
#
#     ref-major (PR #56076):  file_offset = bpc * before(d) + s * P[d]
#     block-major (llm-d):    file_offset = s * sum(P) + before(d)
#
# `ptrres.plan_file_ops` turns resolved device pointers into every file's
# `(dev_ptr, file_offset, size)` ops in one compiled pass. This notebook
# draws where each block lands, stores to real files and loads back, and
# counts ops before and after coalescing.

# %%
import ctypes
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.patches import Rectangle

import ptrres

# %% [markdown]
# A group of three refs whose pages differ (48, 48 and 16 bytes, in one
# tensor each), and a transfer of 6 blocks that starts at block 2 of the
# request: with bpc = 4 the first chunk is partial (slots 0 and 1 stay
# untouched), so the 6 blocks span 2 files.

# %%
BPC = 4
PAGES = [48, 48, 16]
torch.manual_seed(0)
tensors = [torch.randint(0, 256, (16, page), dtype=torch.uint8) for page in PAGES]
kv_caches = ptrres.CanonicalKVCaches(
    [ptrres.CanonicalKVCacheTensor(t, t.shape[1]) for t in tensors],
    [[ptrres.CanonicalKVCacheRef(d, page) for d, page in enumerate(PAGES)]],
)
block_ids = np.array([3, 4, 5, 9, 12, 13])
spec = ptrres.GPULoadStoreSpec(block_ids, [len(block_ids)], [2])
device_ptrs = ptrres.resolve_device_pointers(spec, kv_caches)
plans = {
    layout: ptrres.plan_file_ops(device_ptrs, BPC, layout=layout)
    for layout in ("ref-major", "block-major")
}
plan = plans["ref-major"]
print(f"{plan.num_files} files of {plan.file_bytes.tolist()} bytes")
print("file_starts:", plan.file_starts.tolist())
print("offsets of file 0:", plan.file_offsets[: plan.file_starts[1]].tolist())

# %% [markdown]
# Each op drawn at its place in its file, colored by ref and labeled with its
# block id. Ref-major gives each ref a region of bpc slots; block-major gives
# each slot every ref. The grey part of file 0 (slots 0 and 1) is not written.


# %%
def block_of(ptr: int) -> tuple[int, int]:
    """The (ref, block id) behind a device pointer of this layout."""
    for d, t in enumerate(tensors):
        offset = ptr - t.data_ptr()
        if 0 <= offset < t.numel():
            return d, offset // t.stride(0)
    raise ValueError(ptr)


colors = ["tab:blue", "tab:orange", "tab:green"]
fig, axes = plt.subplots(2, 1, figsize=(10, 3.6), sharex=True)
for ax, (layout, p) in zip(axes, plans.items()):
    for f in range(p.num_files):
        ax.add_patch(Rectangle((0, f - 0.4), p.file_bytes[f], 0.8, color="0.9"))
        for i in range(p.file_starts[f], p.file_starts[f + 1]):
            d, block = block_of(int(p.dev_ptrs[i]))
            offset, size = int(p.file_offsets[i]), int(p.sizes[i])
            ax.add_patch(
                Rectangle((offset, f - 0.4), size, 0.8, color=colors[d], ec="white")
            )
            ax.text(offset + size / 2, f, str(block), ha="center", va="center")
    ax.set_xlim(0, int(p.file_bytes.max()))
    ax.set_ylim(-0.6, p.num_files - 0.4)
    ax.set_yticks(range(p.num_files), [f"file {f}" for f in range(p.num_files)])
    ax.set_title(f"{layout}: ops by ref (blue, orange, green), labeled by block id")
axes[-1].set_xlabel("byte offset in the file")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Store to real files, load back
#
# `ptrres.write_files` runs one task per file in a thread pool, with one
# `os.pwritev` per run of ops that follow each other in the file; it works on
# host memory only (CPU tensors, pinned buffers). Here we store, zero the KV
# cache, load, and check every page, and that bytes outside the pages (the
# other blocks) stayed zero.

# %%
original = [t.clone() for t in tensors]
for layout, p in plans.items():
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"chunk{f}.bin" for f in range(p.num_files)]
        ptrres.write_files(p, paths, max_workers=2)
        sizes_on_disk = [path.stat().st_size for path in paths]
        for t in tensors:
            t.zero_()
        ptrres.read_files(p, paths)
    for t, before in zip(tensors, original):
        assert torch.equal(t[block_ids], before[block_ids])
        others = np.setdiff1d(np.arange(len(t)), block_ids)
        assert not t[others].any()
        t.copy_(before)
    print(f"{layout}: files of {sizes_on_disk} bytes; every page came back")

# %% [markdown]
# The file bytes themselves, checked op by op against the device memory:

# %%
with tempfile.TemporaryDirectory() as tmp:
    paths = [Path(tmp) / f"chunk{f}.bin" for f in range(plan.num_files)]
    ptrres.write_files(plan, paths)
    contents = [path.read_bytes() for path in paths]
for f in range(plan.num_files):
    for i in range(plan.file_starts[f], plan.file_starts[f + 1]):
        offset, size = int(plan.file_offsets[i]), int(plan.sizes[i])
        page = ctypes.string_at(int(plan.dev_ptrs[i]), size)
        assert contents[f][offset : offset + size] == page
print("every op's page is at its offset")

# %% [markdown]
# ## Coalescing
#
# Op i + 1 merges into op i only inside one file and only when **both** its
# device pointer and its file offset continue op i. Consecutive block ids
# continue on the device; in ref-major files consecutive slots of one ref
# continue too, so a ref's blocks of one chunk become one op. In block-major
# files a ref's slots are `sum(P)` apart: nothing merges unless the refs'
# pages lie back to back on the device too. (vLLM PR #56076 once merged on
# device contiguity alone, which in ref-major writes one ref's bytes into
# the next ref's region.)

# %%
contiguous = ptrres.GPULoadStoreSpec(np.arange(2, 10), [8], [0])
pointers = ptrres.resolve_device_pointers(contiguous, kv_caches)
print(f"{'layout':<12} {'ops':>4} {'coalesced':>10} {'capped at 96 B':>15}")
for layout in ("ref-major", "block-major"):
    counts = [
        len(ptrres.plan_file_ops(pointers, BPC, layout=layout, **kwargs).sizes)
        for kwargs in ({}, {"coalesce": True}, {"coalesce": True, "max_run_bytes": 96})
    ]
    print(f"{layout:<12} {counts[0]:>4} {counts[1]:>10} {counts[2]:>15}")
merged = ptrres.plan_file_ops(pointers, BPC, coalesce=True)
assert len(merged.sizes) == 2 * len(PAGES)  # one op per ref and file
assert merged.num_bytes == plans["ref-major"].num_bytes * 8 // 6

# %% [markdown]
# `PointerTable.plan_file_ops` resolves and plans in one pass, checking every
# block id against its tensor like `resolve()`:

# %%
table = ptrres.PointerTable(kv_caches)
same = table.plan_file_ops(contiguous, BPC, coalesce=True)
assert (same.file_offsets == merged.file_offsets).all()
try:
    table.plan_file_ops(ptrres.GPULoadStoreSpec(np.array([2, 99]), [2], [0]), BPC)
except ptrres.BlockIdError as exc:
    print(exc)
