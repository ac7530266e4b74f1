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
# # NIXL: blocks between two engines
#
# [NIXL](https://github.com/ai-dynamo/nixl) moves KV-cache blocks between
# engines: it is the transfer library under vLLM's `NixlConnector`, SGLang's
# disaggregated serving, Dynamo and llm-d. A decode engine READs a finished
# prompt's blocks out of the prefill engine's KV caches, block id against
# block id, layer by layer. NIXL takes the copies in two forms:
#
# - **descriptor lists**: two Nx3 arrays `(addr, len, devId)`, one per side,
#   row i of one going with row i of the other (`initialize_xfer`);
# - **prepared lists**: each side's descriptors registered once, up front
#   (`prep_xfer_dlist`), then per transfer two int32 arrays of indices into
#   them (`make_prepped_xfer`). NIXL checks an index only against the whole
#   list, so an index one past a layer's blocks is the next layer's first
#   block.
#
# `ptrres` builds both (SPEC 14): `PointerTable.plan_peer_transfer` plans
# every copy between this engine's blocks and a peer's, known only by the
# numbers of a handshake (`PeerLayout`); `ptrres.nixl` turns a plan into the
# Nx3 arrays (`peer_xfer_descs`), a layout into the strided rows of a
# prepared list (`prepped_rows`), and block ids into indices
# (`prepped_indices`), with **every id checked against its own layer's
# blocks** on both sides. This notebook runs two NIXL agents in one process,
# moves real bytes and checks them, then times the four ways side by side.

# %%
import os

# Loopback only: UCX otherwise also uses the machine's network interfaces.
os.environ["UCX_NET_DEVICES"] = "lo"
# NIXL logs every agent and backend it starts at INFO.
os.environ["NIXL_LOG_LEVEL"] = "WARN"

import time
import timeit
from collections.abc import Callable
from functools import partial
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch

try:
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError:  # nixl-cu12 alone, without the meta package
    from nixl_cu12._api import nixl_agent, nixl_agent_config

import ptrres
import ptrres.nixl


def agent(name: str) -> nixl_agent:
    """An agent on UCX, without NIXL's progress thread (it spins a core)."""
    config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    return nixl_agent(name, config)


prefill, decode = agent("prefill"), agent("decode")
notifications: list[bytes] = []


def wait(handle: Any, state: str = "PROC") -> None:
    """Wait for a posted decode-side transfer. Without a progress thread the
    prefill agent moves only when called, so it is driven here (and its
    notifications kept)."""
    while state == "PROC":
        for messages in prefill.get_new_notifs().values():
            notifications.extend(messages)
        state = decode.check_xfer_state(handle)
    assert state == "DONE", state


def post(handle: Any) -> None:
    """Post a decode-side transfer and wait for it."""
    wait(handle, decode.transfer(handle))


# %% [markdown]
# ## Two engines, one plan
#
# Each engine has a hybrid model's KV caches: group 0 (full attention) and
# group 1 (sliding window), two layers each, one tensor per layer of
# `(num_blocks, page)` bytes. The prefill engine holds 16 blocks a layer,
# the decode engine 12. Each registers its own memory with its own agent
# (`ptrres.nixl.register`: one region per allocation), and the decode agent
# learns the prefill agent's metadata.

# %%
PAGE = 256
torch.manual_seed(0)


def kv_caches(
    num_blocks: int, fill: bool
) -> tuple[list[torch.Tensor], ptrres.PointerTable]:
    """Four layers' tensors and their PointerTable: layers 0-1 are group 0,
    layers 2-3 group 1."""
    shape = (num_blocks, PAGE)
    tensors = [
        torch.randint(0, 256, shape, dtype=torch.uint8)
        if fill
        else torch.zeros(shape, dtype=torch.uint8)
        for _ in range(4)
    ]
    caches = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(t, PAGE) for t in tensors],
        [
            [ptrres.CanonicalKVCacheRef(d, PAGE) for d in refs]
            for refs in ((0, 1), (2, 3))
        ],
    )
    return tensors, ptrres.PointerTable(caches)


prefill_kv, prefill_table = kv_caches(16, fill=True)
decode_kv, decode_table = kv_caches(12, fill=False)
prefill_registration = ptrres.nixl.register(prefill, prefill_table)
decode_registration = ptrres.nixl.register(decode, decode_table)
decode.add_remote_agent(prefill.get_agent_metadata())
print(prefill_registration, decode_registration)
print(
    "prefill's regions:",
    [(hex(a), n, m.mem_type) for a, n, m in prefill_registration.regions],
)

# %% [markdown]
# The decode engine knows the prefill engine's KV caches only by numbers:
# per layer its base address, row stride, page and block count. In vLLM they
# come through the handshake (`NixlAgentMetadata`: `kv_caches_base_addr`,
# `block_strides`, `block_lens`, `region_num_blocks`...); here
# `PeerLayout.of` reads them off the prefill engine's table. A
# `PeerLayout` can equally be built from those numbers (tuples of
# `PeerRef`'s fields).

# %%
peer = ptrres.PeerLayout.of(prefill_table)
for g, refs in enumerate(peer.groups):
    for ref in refs:
        print(
            f"group {g}: base {ref.base_ptr:#x}, stride {ref.row_stride_bytes}, "
            f"page {ref.page_size_bytes}, {ref.num_blocks} blocks"
        )
assert (
    ptrres.PeerLayout([[tuple(ref) for ref in refs] for refs in peer.groups]).groups
    == peer.groups
)

# %% [markdown]
# A request of three blocks in group 0 and two in group 1 (the sliding
# window keeps fewer): the decode engine has allocated its own ids, the
# prefill engine's ids came with the request. The plan holds one copy per
# block and layer, group by group, layer by layer; `peer_xfer_descs` writes
# NIXL's two Nx3 arrays.

# %%
local_ids = np.array([1, 2, 3, 9, 0], np.int32)
remote_ids = np.array([4, 5, 6, 11, 3], np.int32)
group_sizes = [3, 2]
spec = ptrres.GPULoadStoreSpec(local_ids, group_sizes)
plan = decode_table.plan_peer_transfer(spec, peer, remote_ids)
descs = ptrres.nixl.peer_xfer_descs(plan, local=decode_table, remote=peer)
print(
    f"{len(descs)} descriptors, {descs.num_bytes} bytes, "
    f"{descs.local_mem_type} <- {descs.remote_mem_type}"
)
header = ("layer", "local id", "remote id", "local addr", "remote addr", "len")
print(" ".join(f"{h:>{w}}" for h, w in zip(header, (5, 8, 9, 16, 16, 4))))
copies = [
    (layer, local, remote)
    for g, layers in enumerate(((0, 1), (2, 3)))
    for layer in layers
    for local, remote in zip(np.split(local_ids, [3])[g], np.split(remote_ids, [3])[g])
]
for (layer, local, remote), (la, ln, _), (ra, _, _) in zip(
    copies, descs.local, descs.remote
):
    print(f"{layer:>5} {local:>8} {remote:>9} {la:#16x} {ra:#16x} {ln:>4}")
    assert la == decode_kv[layer][local].data_ptr()
    assert ra == prefill_kv[layer][remote].data_ptr()
assert len(descs) == 3 * 2 + 2 * 2

# %% [markdown]
# The decode agent READs: the prefill engine's blocks into its own. The
# prefill agent gets the notification (in vLLM, its cue to free the blocks).
# Then every block is compared with the peer's, and the rest of the decode
# cache is still zero.

# %%
handle = descs.initialize_xfer(decode, "READ", "prefill", b"request-0 read")
post(handle)
handle.release()


def check_arrived(local_ids: np.ndarray, remote_ids: np.ndarray) -> None:
    """Every layer's blocks on the decode side equal the prefill side's."""
    for g, layers in enumerate(((0, 1), (2, 3))):
        local, remote = np.split(local_ids, [3])[g], np.split(remote_ids, [3])[g]
        for layer in layers:
            assert torch.equal(decode_kv[layer][local], prefill_kv[layer][remote])


check_arrived(local_ids, remote_ids)
untouched = np.setdiff1d(np.arange(12), local_ids[:3])
assert not decode_kv[0][untouched].any()
deadline = time.monotonic() + 10
while not notifications and time.monotonic() < deadline:
    for messages in prefill.get_new_notifs().values():
        notifications.extend(messages)
assert notifications == [b"request-0 read"]
print("the prefill agent was told:", notifications)
print(f"{descs.num_bytes} bytes arrived, block for block")

# %% [markdown]
# ## Prepared lists and checked indices
#
# vLLM's `NixlConnector` prepares each side once, at the handshake: one
# strided row `(base, page, devId, stride, count)` per layer, standing for
# `count` descriptors (`prepped_rows`). A transfer is then two arrays of
# indices: layer by layer, `first index of the layer + block id`
# (`prepped_indices`), every id checked against its own layer.

# %%
local_rows = ptrres.nixl.prepped_rows(decode_table)
remote_rows = ptrres.nixl.prepped_rows(peer)
print(f"the prefill side's rows ({remote_rows.mem_type}):")
print(f"{'base':>16} {'page':>5} {'devId':>5} {'stride':>6} {'count':>5}")
for base, page, dev_id, stride, count in remote_rows.xfer_list:
    print(f"{base:#16x} {page:>5} {dev_id:>5} {stride:>6} {count:>5}")
local_dlist = decode.prep_xfer_dlist("NIXL_INIT_AGENT", *local_rows)
remote_dlist = decode.prep_xfer_dlist("prefill", *remote_rows)

local_indices = ptrres.nixl.prepped_indices(decode_table, local_ids, group_sizes)
remote_indices = ptrres.nixl.prepped_indices(peer, remote_ids, group_sizes)
print("local indices: ", local_indices)
print("remote indices:", remote_indices)
# Layer 1's blocks start at 12 on the decode side, 16 on the prefill side.
assert local_indices.tolist() == [1, 2, 3, 13, 14, 15, 33, 24, 45, 36]
assert remote_indices.tolist() == [4, 5, 6, 20, 21, 22, 43, 35, 59, 51]

for t in decode_kv:
    t.zero_()
handle = decode.make_prepped_xfer(
    "READ", local_dlist, local_indices, remote_dlist, remote_indices, b"request-1 read"
)
post(handle)
handle.release()
check_arrived(local_ids, remote_ids)
print("the same blocks arrived through the prepared lists")

# %% [markdown]
# ### A bad remote id
#
# Say a bug sends remote id 16 for group 0: one past the prefill engine's 16
# blocks. vLLM computes the indices as `region_offset + id` and checks
# nothing, so layer 0's index lands on layer 1's block 0 and layer 1's on
# layer 2's block 0. NIXL checks only that an index is inside the whole list:
# the transfer completes, and the decode engine holds other layers' bytes.

# %%
bad_remote_ids = np.array([4, 5, 16, 11, 3], np.int32)
region_offsets = np.cumsum([0, *[16] * 3])  # vLLM's, from region_num_blocks
vllm_remote = np.concatenate(
    [
        (region_offsets[regions, None] + np.asarray(group, np.int32)[None, :]).ravel()
        for regions, group in zip(([0, 1], [2, 3]), np.split(bad_remote_ids, [3]))
    ]
)
print("vLLM's remote indices:", vllm_remote)
handle = decode.make_prepped_xfer(
    "READ", local_dlist, local_indices, remote_dlist, vllm_remote
)
post(handle)
handle.release()
assert torch.equal(decode_kv[0][3], prefill_kv[1][0])  # layer 0 got layer 1's block
assert torch.equal(decode_kv[1][3], prefill_kv[2][0])  # layer 1 got layer 2's block
print("completed without an error: decode's layer 0 block 3 holds prefill's", end="")
print(" layer 1 block 0")

# %% [markdown]
# ptrres refuses the id before NIXL sees anything, and names the group, the
# position, the value and the layer's block count:

# %%
try:
    ptrres.nixl.prepped_indices(peer, bad_remote_ids, group_sizes)
except ptrres.RemoteBlockIdError as error:
    print(f"{type(error).__name__}: {error}")
else:
    raise AssertionError("the bad id went through")

try:
    decode_table.plan_peer_transfer(spec, peer, bad_remote_ids)
except ptrres.RemoteBlockIdError as error:
    print(f"{type(error).__name__}: {error}")
else:
    raise AssertionError("the bad id went through")

# %% [markdown]
# The agents are untouched: the next transfer goes through.

# %%
for t in decode_kv:
    t.zero_()
handle = decode.make_prepped_xfer(
    "READ", local_dlist, local_indices, remote_dlist, remote_indices
)
post(handle)
handle.release()
check_arrived(local_ids, remote_ids)
local_dlist.release()
remote_dlist.release()
print("the next transfer's bytes arrived")

# %% [markdown]
# ## The four ways, side by side
#
# One group of 8 layers, 1 KiB pages, and transfers of 16, 256 and 2048
# blocks, the ids scattered (no two neighbours on the decode side) or in
# runs of 16 consecutive blocks on both sides. Each way builds what NIXL
# takes, makes the transfer and posts it:
#
# - **vLLM indices**: vLLM 0.33's `(region_offsets[:, None] + ids[None,
#   :]).ravel()` on both sides, unchecked, then `make_prepped_xfer`;
# - **checked indices**: `ptrres.nixl.prepped_indices` on both sides, then
#   `make_prepped_xfer`;
# - **Nx3 plain**: `plan_peer_transfer` and `peer_xfer_descs`, then
#   `initialize_xfer` (NIXL checks each descriptor against the registered
#   memory);
# - **Nx3 coalesced**: the same with `coalesce=True`: blocks that continue
#   each other on both sides become one descriptor.
#
# Both sides prepare their lists once, at the handshake, as vLLM does; that
# is not timed.

# %%
LAYERS, BENCH_PAGE, SIZES, RUN, REPEATS = 8, 1024, (16, 256, 2048), 16, 7
rng = np.random.default_rng(0)


def one_group(num_blocks: int) -> tuple[list[np.ndarray], ptrres.PointerTable]:
    """8 layers of one group, each its own (num_blocks, 1 KiB) array (numpy
    here: its fancy indexing is quicker than torch's for the checks)."""
    tensors = [np.zeros((num_blocks, BENCH_PAGE), np.uint8) for _ in range(LAYERS)]
    caches = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(t, BENCH_PAGE) for t in tensors],
        [[ptrres.CanonicalKVCacheRef(d, BENCH_PAGE) for d in range(LAYERS)]],
    )
    return tensors, ptrres.PointerTable(caches)


def ids_of(pattern: str, n: int, spacing: int) -> np.ndarray:
    """n ids among n * spacing blocks: runs of RUN consecutive blocks at
    shuffled places, or single blocks ``spacing`` apart, shuffled."""
    if pattern == "runs":
        starts = rng.permutation(n // RUN) * RUN * spacing
        return (starts[:, None] + np.arange(RUN)).ravel().astype(np.int32)
    return (rng.permutation(n) * spacing).astype(np.int32)


# The decode side's ids lie among 2n blocks, the prefill side's among n.
N_MAX = max(SIZES)
bench_prefill_kv, bench_prefill_table = one_group(N_MAX)
bench_decode_kv, bench_decode_table = one_group(2 * N_MAX)
for t in bench_prefill_kv:
    t[:] = rng.integers(0, 256, t.shape, np.uint8)
bench_registrations = [
    ptrres.nixl.register(prefill, bench_prefill_table),
    ptrres.nixl.register(decode, bench_decode_table),
]
# A new handshake: the prefill agent's metadata now holds the new memory.
decode.remove_remote_agent("prefill")
decode.add_remote_agent(prefill.get_agent_metadata())
bench_peer = ptrres.PeerLayout.of(bench_prefill_table)

bench_local_dlist = decode.prep_xfer_dlist(
    "NIXL_INIT_AGENT", *ptrres.nixl.prepped_rows(bench_decode_table)
)
bench_remote_dlist = decode.prep_xfer_dlist(
    "prefill", *ptrres.nixl.prepped_rows(bench_peer)
)
# vLLM's region offsets, from each side's region_num_blocks.
local_offsets = np.cumsum([0, *[2 * N_MAX] * (LAYERS - 1)])
remote_offsets = np.cumsum([0, *[N_MAX] * (LAYERS - 1)])

# %% [markdown]
# Each way is two steps: build (numpy or ptrres, no NIXL) and make + post
# (NIXL). The build alone is timed over many calls (best of 3 times 20);
# build + post is the best of 7 runs, each timed from the start of the build
# until NIXL reports the transfer done (on loopback, UCX copies inside
# `transfer()`), the bytes checked after every run.

# %%
Indices = tuple[np.ndarray, np.ndarray]


def vllm_indices(local: np.ndarray, remote: np.ndarray) -> Indices:
    """vLLM 0.33's _compute_desc_ids, one group: every region, every id."""
    local_ids = np.asarray(local, np.int32)[None, :]
    remote_ids = np.asarray(remote, np.int32)[None, :]
    return (
        (local_offsets[:, None] + local_ids).ravel(),
        (remote_offsets[:, None] + remote_ids).ravel(),
    )


def checked_indices(local: np.ndarray, remote: np.ndarray) -> Indices:
    """ptrres's indices, every id checked against its own layer."""
    return (
        ptrres.nixl.prepped_indices(bench_decode_table, local),
        ptrres.nixl.prepped_indices(bench_peer, remote),
    )


def make_prepped(indices: Indices) -> Any:
    """The transfer of two index arrays into the prepared lists."""
    return decode.make_prepped_xfer(
        "READ", bench_local_dlist, indices[0], bench_remote_dlist, indices[1]
    )


def nx3(coalesce: bool) -> Callable[[np.ndarray, np.ndarray], ptrres.nixl.XferDescs]:
    """ptrres's plan and its Nx3 arrays, plain or coalesced."""

    def build(local: np.ndarray, remote: np.ndarray) -> ptrres.nixl.XferDescs:
        spec = ptrres.GPULoadStoreSpec(local)
        plan = bench_decode_table.plan_peer_transfer(
            spec, bench_peer, remote, coalesce=coalesce
        )
        return ptrres.nixl.peer_xfer_descs(
            plan, local=bench_decode_table, remote=bench_peer
        )

    return build


def initialize(descs: ptrres.nixl.XferDescs) -> Any:
    """The transfer of two Nx3 descriptor arrays."""
    return descs.initialize_xfer(decode, "READ", "prefill")


WAYS = {
    "vLLM indices": (vllm_indices, make_prepped),
    "checked indices": (checked_indices, make_prepped),
    "Nx3 plain": (nx3(coalesce=False), initialize),
    "Nx3 coalesced": (nx3(coalesce=True), initialize),
}


def run_once(
    build: Callable[..., Any], make: Callable[..., Any], local: Any, remote: Any
) -> tuple[float, int]:
    """One transfer, timed from the build to DONE, its bytes checked; and
    how many indices or descriptors NIXL was given."""
    for t in bench_decode_kv:
        t[local] = 0
    start = time.perf_counter()
    built = build(local, remote)
    handle = make(built)
    wait(handle, decode.transfer(handle))
    elapsed = time.perf_counter() - start
    handle.release()
    for d in range(LAYERS):
        assert np.array_equal(bench_decode_kv[d][local], bench_prefill_kv[d][remote])
    return elapsed, len(built[0]) if isinstance(built, tuple) else len(built)


results = []  # (ids, blocks, way, descriptors, build s, build + post s)
for pattern in ("scattered", "runs"):
    for n in SIZES:
        local, remote = ids_of(pattern, n, 2), ids_of(pattern, n, 1)
        # The ways take turns, so that a burst of noise hits them all.
        runs = [
            [run_once(*WAYS[way], local, remote) for way in WAYS]
            for _ in range(REPEATS)
        ]
        for i, (way, (build, _)) in enumerate(WAYS.items()):
            calls = timeit.repeat(partial(build, local, remote), number=20, repeat=3)
            best_total = min(run[i][0] for run in runs)
            count = runs[0][i][1]
            results.append((pattern, n, way, count, min(calls) / 20, best_total))

print(
    f"{'ids':<10} {'blocks':>6}  {'way':<16} {'descriptors':>11} {'build':>9} "
    f"{'+ post':>9}"
)
for pattern, n, way, count, t_build, t_total in results:
    print(
        f"{pattern:<10} {n:>6}  {way:<16} {count:>11} {t_build * 1e6:>7.0f}us "
        f"{t_total * 1e6:>7.0f}us"
    )

# The counts: one index or descriptor per block and layer, except coalesced
# runs (one descriptor per run and layer); scattered ids never merge.
for pattern, n, way, count, _, _ in results:
    merged = way == "Nx3 coalesced" and pattern == "runs"
    assert count == (n // RUN if merged else n) * LAYERS, (pattern, n, way, count)

# %% [markdown]
# Time against size, log scales: the build alone (dashed) and build + post
# (solid), for each way. The times are from this run, on whatever machine
# executed the notebook, and noisy; `docs/benchmarks.md` holds the measured
# figures, with the command, machine and versions that made them.

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
colors = dict(zip(WAYS, ["tab:red", "tab:blue", "tab:orange", "tab:green"]))
for ax, pattern in zip(axes, ("scattered", "runs")):
    for way in WAYS:
        points = [r for r in results if r[0] == pattern and r[2] == way]
        blocks = [r[1] for r in points]
        totals, builds = [r[5] * 1e6 for r in points], [r[4] * 1e6 for r in points]
        ax.plot(blocks, totals, "o-", color=colors[way], label=way)
        ax.plot(blocks, builds, "x--", color=colors[way])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(SIZES, [str(n) for n in SIZES])
    ax.set_xlabel(f"blocks ({LAYERS} layers each)")
    ax.set_title("scattered ids" if pattern == "scattered" else f"runs of {RUN} ids")
    ax.grid(True, which="both", alpha=0.3)
axes[0].set_ylabel("microseconds (solid: build + post, dashed: build)")
axes[0].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# What to read off it: building is microseconds for every way, and checking
# the ids costs about what vLLM's unchecked formula costs. The rest is NIXL
# making the request and UCX moving the bytes, which grows with the
# descriptors NIXL is given: coalesced runs of 16 give it 16 times fewer than
# plain Nx3 arrays. Prepared transfers of runs land with the coalesced ones
# or a little below, though NIXL is given one index per block (it appears to
# merge neighbouring prepared descriptors itself); scattered ids merge
# nowhere, and all four ways cost about the same.

# %% [markdown]
# ## Clean up
#
# Transfer handles are released after each transfer; the prepared lists go
# back, the memory is deregistered (`Registration.deregister()`, or leave a
# `with` block) and the decode agent forgets its peer.

# %%
for dlist in (bench_local_dlist, bench_remote_dlist):
    dlist.release()
for registration in (
    *bench_registrations,
    prefill_registration,
    decode_registration,
):
    registration.deregister()
decode.remove_remote_agent("prefill")
print(prefill_registration, decode_registration)
