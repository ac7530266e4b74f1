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
# # Resolving block ids to pointers
#
# A KV cache is a set of tensors whose first dimension is the block: block `b`
# of a layer lives in row `b` of that layer's tensor. A transfer names blocks
# by id, grouped by KV-cache group; `resolve_device_pointers` turns them into
# one `(ptr, size)` copy op per group, ref (layer) and block
# (SPEC section 3):
#
#     ptr  = tensor.data_ptr() + block_id * row_stride_bytes
#     size = ref.page_size_bytes
#
# This notebook builds a tiny layout from torch tensors, resolves a spec, draws
# which bytes each op covers, reads the bytes back through the pointers, and
# shows what a bad block id gets.

# %%
import ctypes

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.patches import Patch, Rectangle

import ptrres
from ptrres import reference
from ptrres.bench import vllm_style_resolve

plt.rcParams.update({"figure.dpi": 80, "savefig.dpi": 80})
generator = torch.Generator().manual_seed(0)
print(ptrres.warmup())

# %% [markdown]
# ## A small layout
#
# Two KV-cache groups over three tensors of 8 blocks each:
#
# - group 0 (full attention) has two refs: K in tensor 0 and V in tensor 1,
#   48-byte pages in 48-byte rows (int8, as vLLM views them);
# - group 1 (say, a sliding-window layer) has one ref in tensor 2, a bfloat16
#   tensor whose rows are padded: 20 elements (40 bytes) used out of a row
#   stride of 32 elements (64 bytes). ptrres reads the stride in bytes
#   (`stride(0) * element_size()`), so any dtype works.
#
# Every byte is random (seeded), so a read-back proves the right row was hit.

# %%
NUM_BLOCKS = 8


def random_bytes(rows: int, row_bytes: int) -> torch.Tensor:
    """An int8 tensor of random bytes (seeded)."""
    return torch.randint(
        -128, 128, (rows, row_bytes), dtype=torch.int8, generator=generator
    )


k_layer = random_bytes(NUM_BLOCKS, 48)
v_layer = random_bytes(NUM_BLOCKS, 48)
padded = random_bytes(NUM_BLOCKS, 64).view(torch.bfloat16)[:, :20]
tensors = [k_layer, v_layer, padded]
for t, tensor in enumerate(tensors):
    row_stride = tensor.stride(0) * tensor.element_size()
    print(
        f"tensor {t}: {tensor.dtype!s:<15} shape {tuple(tensor.shape)}, "
        f"row stride {tensor.stride(0)} elements = {row_stride} bytes"
    )

kv_caches = ptrres.CanonicalKVCaches(
    tensors=[
        ptrres.CanonicalKVCacheTensor(k_layer, 48),
        ptrres.CanonicalKVCacheTensor(v_layer, 48),
        ptrres.CanonicalKVCacheTensor(padded, 64),
    ],
    group_data_refs=[
        [ptrres.CanonicalKVCacheRef(0, 48), ptrres.CanonicalKVCacheRef(1, 48)],
        [ptrres.CanonicalKVCacheRef(2, 40)],
    ],
)

# %% [markdown]
# ## Resolve a spec
#
# Group 0 copies blocks 5, 2 and 6; group 1 copies blocks 1 and 7. Ops are
# ordered group -> ref -> block: 3 blocks x 2 refs + 2 blocks x 1 ref = 8 ops.

# %%
spec = ptrres.GPULoadStoreSpec(
    np.array([5, 2, 6, 1, 7], dtype=np.int32), group_sizes=[3, 2], block_indices=[0, 0]
)
device_ptrs = ptrres.resolve_device_pointers(spec, kv_caches)
oracle = reference.resolve_device_pointers(spec, kv_caches)
print(device_ptrs.ptrs.dtype, len(device_ptrs.ptrs), "ops")
print("same as the numpy reference:", np.array_equal(device_ptrs.ptrs, oracle.ptrs))
print(
    "group_block_counts",
    device_ptrs.group_block_counts,
    "group_data_ref_counts",
    device_ptrs.group_data_ref_counts,
)

# %% [markdown]
# The descriptors as a table. Pointers are real addresses, so they change from
# run to run; the offset from the tensor's base does not, and it is
# `block * row_stride_bytes`.

# %%
# Which (group, ref, tensor, block) each op is, in op order.
ops = []
first_id = 0
for group, (n_blocks, refs) in enumerate(
    zip(spec.group_sizes, kv_caches.group_data_refs)
):
    for d, ref in enumerate(refs):
        for k in range(n_blocks):
            block = int(spec.block_ids[first_id + k])
            ops.append((group, d, ref.tensor_idx, block))
    first_id += n_blocks

bases = [tensor.data_ptr() for tensor in tensors]
print(
    f"{'op':>3} {'group':>5} {'ref':>3} {'tensor':>6} {'block':>5} "
    f"{'ptr':>16} {'ptr - base':>10} {'size':>5}"
)
for i, (group, d, t, block) in enumerate(ops):
    ptr, size = int(device_ptrs.ptrs[i]), int(device_ptrs.sizes[i])
    print(
        f"{i:>3} {group:>5} {d:>3} {t:>6} {block:>5} "
        f"{ptr:>#16x} {ptr - bases[t]:>10} {size:>5}"
    )

# %% [markdown]
# ## Which bytes each op covers
#
# One panel per tensor: a row per block, a column per byte of the row stride.
# Each op is drawn where its pointer lands (`(ptr - base) // stride` is the
# row, `(ptr - base) % stride` the first byte), as wide as its size. Padding
# (bytes of the stride beyond the row's elements) is hatched: no op touches it.

# %%
GROUP_COLOURS = ["tab:blue", "tab:orange"]
fig, axes = plt.subplots(1, len(tensors), figsize=(8, 3.5), sharey=True)
for t, (ax, tensor) in enumerate(zip(axes, tensors)):
    stride = tensor.stride(0) * tensor.element_size()
    row_bytes = tensor.shape[1] * tensor.element_size()
    ax.add_patch(Rectangle((0, 0), row_bytes, NUM_BLOCKS, color="0.92"))
    if stride > row_bytes:
        ax.add_patch(
            Rectangle(
                (row_bytes, 0),
                stride - row_bytes,
                NUM_BLOCKS,
                facecolor="white",
                edgecolor="0.6",
                hatch="///",
            )
        )
    for i, (group, _, op_tensor, _) in enumerate(ops):
        if op_tensor != t:
            continue
        offset = int(device_ptrs.ptrs[i]) - bases[t]
        row, start = divmod(offset, stride)
        size = int(device_ptrs.sizes[i])
        ax.add_patch(
            Rectangle((start, row + 0.1), size, 0.8, color=GROUP_COLOURS[group])
        )
        ax.text(
            start + size / 2,
            row + 0.5,
            f"op {i}",
            ha="center",
            va="center",
            color="white",
            fontsize=8,
        )
    ax.set(
        xlim=(0, stride),
        ylim=(NUM_BLOCKS, 0),
        xlabel="byte in row",
        title=f"tensor {t} ({stride} B rows)",
    )
    ax.set_yticks(np.arange(NUM_BLOCKS) + 0.5, labels=range(NUM_BLOCKS))
axes[0].set_ylabel("block (row)")
fig.legend(
    handles=[Patch(color=c, label=f"group {g}") for g, c in enumerate(GROUP_COLOURS)]
    + [Patch(facecolor="white", edgecolor="0.6", hatch="///", label="padding")],
    loc="lower center",
    ncol=3,
    frameon=False,
)
fig.tight_layout(rect=(0, 0.08, 1, 1))
plt.show()

# %% [markdown]
# ## Reading the bytes back
#
# `ctypes.string_at(ptr, size)` reads `size` bytes at `ptr`. Each op must read
# exactly the first `size` bytes of row `block` of its tensor.


# %%
def row_bytes_of(tensor: torch.Tensor, block: int) -> bytes:
    """The bytes of one row's elements (padding excluded)."""
    return tensor[block].contiguous().view(torch.int8).numpy().tobytes()


for i, (_, _, t, block) in enumerate(ops):
    read = ctypes.string_at(int(device_ptrs.ptrs[i]), int(device_ptrs.sizes[i]))
    expected = row_bytes_of(tensors[t], block)[: len(read)]
    print(
        f"op {i}: tensor {t} block {block}: {read[:6].hex(' ')} ... "
        f"{'matches' if read == expected else 'DIFFERS'}"
    )

# %% [markdown]
# Consumers often want the ops in pinned int64 buffers (torch tensors handed to
# a copy kernel). A `PointerTable` flattens the layout once and writes straight
# into such buffers through their numpy views: nothing is allocated per call.

# %%
table = ptrres.PointerTable(kv_caches)
pinned = torch.zeros(2, 8, dtype=torch.int64)  # pin_memory=True on a GPU machine
table.resolve(spec, out=(pinned[0].numpy(), pinned[1].numpy()))
print(table)
print(
    "written in place:",
    pinned[0].numpy().view(np.uint64).tolist() == device_ptrs.ptrs.tolist(),
)
print("sizes:", pinned[1].tolist())

# %% [markdown]
# ## A bad block id gets a clear error
#
# vLLM's resolver checks nothing: id 8 (one past the last block) points just
# past the tensor, and id -1 wraps through uint64 to a pointer one row *before*
# the tensor. Handed to a GPU copy, either is an illegal memory access.

# %%
for bad_id in (8, -1):
    bad = ptrres.GPULoadStoreSpec([5, 2, bad_id, 1, 7], [3, 2], [0, 0])
    vllm_ptrs, _ = vllm_style_resolve(bad, kv_caches)
    offset = int(vllm_ptrs[2].astype(np.int64)) - bases[0]
    print(
        f"vLLM-style, id {bad_id:>2}: ptr - base(tensor 0) = {offset:>4}, "
        f"but tensor 0 spans bytes 0 .. {NUM_BLOCKS * 48 - 1}"
    )

# %% [markdown]
# vLLM also reads `stride(0)` as bytes, which holds only for int8 tensors: on
# the bfloat16 tensor 2 its good ids land in the wrong rows.

# %%
vllm_ptrs, _ = vllm_style_resolve(spec, kv_caches)
for i in (6, 7):
    ours, theirs = int(device_ptrs.ptrs[i]), int(vllm_ptrs[i])
    print(
        f"op {i}: block {ops[i][3]}: ptrres offset {ours - bases[2]}, "
        f"vLLM-style offset {theirs - bases[2]}"
    )

# %% [markdown]
# ptrres refuses both, naming the group, the position inside the group and the
# value. Every error is a `ptrres.PtrresError` and a `ValueError` (or
# `TypeError`), and the resolver keeps working afterwards.

# %%
for bad_ids in ([5, 2, 8, 1, 7], [5, 2, 6, -1, 7]):
    bad = ptrres.GPULoadStoreSpec(np.array(bad_ids), [3, 2], [0, 0])
    try:
        ptrres.resolve_device_pointers(bad, kv_caches)
    except ptrres.BlockIdError as error:
        print(f"{type(error).__name__}: {error}")
        print(f"  group={error.group} position={error.position} value={error.value}")

try:
    ptrres.resolve_device_pointers(
        ptrres.GPULoadStoreSpec([5, 2, 6, 1, 7], [3, 3], [0, 0]), kv_caches
    )
except ptrres.PtrresError as error:
    print(f"{type(error).__name__}: {error}")

again = ptrres.resolve_device_pointers(spec, kv_caches)
print("next call:", np.array_equal(again.ptrs, device_ptrs.ptrs))
