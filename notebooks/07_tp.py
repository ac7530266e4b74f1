# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Prefill and decode at different TP
#
# A disaggregated deployment rarely runs its prefill and decode engines at
# one tensor parallelism (TP). Each TP rank holds a shard of every layer's
# KV heads, so when the two sides differ, a decode rank must read **only its
# heads** out of each prefill page, or **gather** them from several prefill
# ranks, and when TP exceeds the model's KV heads, several ranks hold the
# same head (GQA replication). That arithmetic is where connectors keep
# failing: SGLang #31295 built descriptors for 4 head groups where a model
# had 2, past the registered memory, and every first request failed.
#
# `ptrres.tp_mapping` gives, for one decode rank, the prefill ranks that
# hold its heads and one `HeadSlice` per such rank; peer plans and prepared
# lists take the slice (`heads=`). This notebook shows the mapping on a
# grid of TP pairs, then moves real bytes with NIXL agents (three in this
# process: two prefill ranks, and decode ranks that gather or split), and
# checks every decode rank's pages **head by head** against a logical model
# of the KV that knows nothing of the mapping.

# %%
import os

os.environ["UCX_NET_DEVICES"] = "lo"  # loopback only
os.environ["NIXL_LOG_LEVEL"] = "WARN"

from typing import Any

import numpy as np

try:
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError:  # nixl-cu12 alone, without the meta package
    from nixl_cu12._api import nixl_agent, nixl_agent_config

import ptrres
import ptrres.nixl

# %% [markdown]
# ## The mapping
#
# Rank `r` of TP `T`, for `H` KV heads, holds heads `[r*H/T, (r+1)*H/T)`
# when `T <= H`, else the one head `r*H//T`. For each decode rank, a slice
# says which prefill rank gives which heads, at which head slot of each
# side's page. Below, a model of 8 KV heads and one of 2 (SGLang #31295's
# case: decode TP 4 over 2 heads).


# %%
def show(tp_size: int, peer_tp_size: int, heads: int, mla: bool = False) -> None:
    print(
        f"decode TP {tp_size} <- prefill TP {peer_tp_size}, {heads} KV heads"
        + (", MLA" if mla else "")
    )
    for rank in range(tp_size):
        mapping = ptrres.tp_mapping(rank, tp_size, peer_tp_size, heads, mla=mla)
        mine = ptrres.rank_heads(rank, tp_size, heads)
        parts = [
            f"rank {s.source_rank} gives {s.num_heads} head(s) from slot "
            f"{s.remote_head} of its {s.remote_heads} to slot {s.local_head}"
            for s in mapping.slices
        ]
        print(f"  rank {rank} (heads {list(mine)}): " + "; ".join(parts))


show(1, 2, 8)  # gather: two sources fill one page
show(2, 1, 8)  # split: each decode rank reads half of a page
show(4, 1, 2)  # replication: ranks 0-1 share head 0, ranks 2-3 head 1
show(1, 4, 2)  # dedup: prefill ranks 0-1 hold head 0, ranks 2-3 head 1
show(4, 1, 1, mla=True)  # MLA: the whole latent page, from one rank

# %% [markdown]
# What cannot be is refused with the numbers that make it so, before any
# descriptor exists:

# %%
for args, kwargs in [
    ((0, 3, 2, 8), {}),  # TP 3 and TP 2: neither divides the other
    ((0, 4, 1, 6), {}),  # 6 heads over TP 4
    ((4, 4, 1, 8), {}),  # no rank 4 at TP 4
    ((0, 2, 1, 8), {"kv_layout": "NHD"}),  # a head slice of NHD pages
]:
    try:
        ptrres.tp_mapping(*args, **kwargs)
    except ptrres.LayoutError as error:
        print(f"{args}: {error}")

# %% [markdown]
# ## A logical model to check against
#
# Each layer's KV is a logical array `[blocks, heads, tokens, head_bytes]`.
# A rank's page of a block is its heads of it, heads outermost (HND),
# flattened. The prefill ranks' caches are cut from one logical array; after
# the transfers, each decode rank's received blocks must be **its** heads of
# the prefill blocks it read, and every other byte unchanged. The model's
# `holds` is written here from the sentence above, not from ptrres.

# %%
HEADS, TOKENS, HEAD_BYTES, LAYERS = 8, 16, 32, 2
rng = np.random.default_rng(0)


def holds(rank: int, tp: int, heads: int) -> list[int]:
    if tp <= heads:
        return list(range(rank * heads // tp, (rank + 1) * heads // tp))
    return [rank // (tp // heads)]


def engine(tp: int, heads: int, num_blocks: int, logical: list[np.ndarray] | None):
    """Every rank's layers (one uint8 array per layer, a page per row) and
    PointerTable: cut from `logical` per rank, or random where None."""
    ranks = []
    for rank in range(tp):
        mine = holds(rank, tp, heads)
        page = len(mine) * TOKENS * HEAD_BYTES
        if logical is None:
            layers = [
                rng.integers(0, 256, (num_blocks, page), np.uint8)
                for _ in range(LAYERS)
            ]
        else:
            layers = [
                np.ascontiguousarray(kv[:, mine].reshape(num_blocks, -1))
                for kv in logical
            ]
        caches = ptrres.CanonicalKVCaches(
            [ptrres.CanonicalKVCacheTensor(layer, page) for layer in layers],
            [[ptrres.CanonicalKVCacheRef(i, page) for i in range(LAYERS)]],
        )
        ranks.append((layers, ptrres.PointerTable(caches)))
    return ranks


config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
agents: dict[str, Any] = {}


def agent(name: str) -> Any:
    if name not in agents:
        agents[name] = nixl_agent(name, config)
    return agents[name]


def post(reader: Any, handle: Any) -> None:
    """Post a READ and drive every agent until it is done."""
    state = reader.transfer(handle)
    while state == "PROC":
        for other in agents.values():
            if other is not reader:
                other.get_new_notifs()
        state = reader.check_xfer_state(handle)
    assert state == "DONE", state
    handle.release()


# %% [markdown]
# ## Prefill TP 2 to decode TP 1: gathering
#
# Two prefill ranks, 4 heads each, and one decode rank of all 8. The decode
# rank posts one READ per prefill agent, each filling its slot of the local
# pages: first with peer plans (descriptor arrays), then with prepared lists
# (`prepped_pair`: both sides' rows cut to the slice; indices as always).

# %%
NUM_PREFILL, NUM_DECODE = 24, 12
logical = [
    rng.integers(0, 256, (NUM_PREFILL, HEADS, TOKENS, HEAD_BYTES), np.uint8)
    for _ in range(LAYERS)
]


def run(
    prefill_tp: int,
    decode_tp: int,
    heads: int,
    local_ids: list[int],
    remote_ids: list[int],
    prepared: bool,
) -> None:
    """Move remote_ids into local_ids on every decode rank, then check every
    decode rank's bytes against the logical model."""
    model = [kv[:, :heads] for kv in logical]
    prefill = engine(prefill_tp, heads, NUM_PREFILL, model)
    decode = engine(decode_tp, heads, NUM_DECODE, None)
    before = [[layer.copy() for layer in layers] for layers, _ in decode]
    tag = f"{prefill_tp}to{decode_tp}h{heads}{'p' if prepared else 'd'}"
    names = [f"prefill{r}-{tag}" for r in range(prefill_tp)]
    registrations = [
        ptrres.nixl.register(agent(n), t) for n, (_, t) in zip(names, prefill)
    ]
    peers = [ptrres.PeerLayout.of(table) for _, table in prefill]
    descriptors = 0
    for rank, (layers, table) in enumerate(decode):
        reader = agent(f"decode{rank}-{tag}")
        registrations.append(ptrres.nixl.register(reader, table))
        for name in names:
            reader.add_remote_agent(agent(name).get_agent_metadata())
        mapping = ptrres.tp_mapping(rank, decode_tp, prefill_tp, heads)
        spec = ptrres.GPULoadStoreSpec(np.array(local_ids, np.int32))
        for s in mapping.slices:
            peer, name = peers[s.source_rank], names[s.source_rank]
            if prepared:
                local_rows, remote_rows = ptrres.nixl.prepped_pair(table, peer, s)
                local_list = reader.prep_xfer_dlist("NIXL_INIT_AGENT", *local_rows)
                remote_list = reader.prep_xfer_dlist(name, *remote_rows)
                local_index = ptrres.nixl.prepped_indices(table, spec)
                post(
                    reader,
                    reader.make_prepped_xfer(
                        "READ",
                        local_list,
                        local_index,
                        remote_list,
                        ptrres.nixl.prepped_indices(peer, remote_ids),
                    ),
                )
                descriptors += len(local_index)
                local_list.release()
                remote_list.release()
            else:
                plan = table.plan_peer_transfer(
                    spec, peer, remote_ids, heads=s, coalesce=True
                )
                descs = ptrres.nixl.peer_xfer_descs(plan, local=table, remote=peer)
                post(reader, descs.initialize_xfer(reader, "READ", name))
                descriptors += len(descs)
        mine = holds(rank, decode_tp, heads)
        for layer, (after, old, kv) in enumerate(zip(layers, before[rank], model)):
            expected = old.copy()
            expected[local_ids] = kv[remote_ids][:, mine].reshape(len(local_ids), -1)
            assert (after == expected).all(), (rank, layer)
    for registration in registrations:
        registration.deregister()
    print(
        f"prefill TP {prefill_tp} -> decode TP {decode_tp}, {heads} heads, "
        f"{'prepared lists' if prepared else 'peer plans'}: {descriptors} "
        "descriptors posted, every decode rank's bytes as the model says"
    )


local_ids, remote_ids = [2, 3, 4, 9], [20, 21, 22, 5]
run(2, 1, 8, local_ids, remote_ids, prepared=False)
run(2, 1, 8, local_ids, remote_ids, prepared=True)

# %% [markdown]
# ## Prefill TP 1 to decode TP 2 and TP 4: splitting and replication
#
# One prefill rank; each decode rank reads its half (TP 2), or, with 2 KV
# heads at decode TP 4, two decode ranks read the same head: no descriptor
# reaches past a page, and each rank gets exactly its head.

# %%
run(1, 2, 8, local_ids, remote_ids, prepared=False)
run(1, 2, 8, local_ids, remote_ids, prepared=True)
run(1, 4, 2, local_ids, remote_ids, prepared=False)
run(1, 4, 2, local_ids, remote_ids, prepared=True)
run(4, 1, 2, local_ids, remote_ids, prepared=True)  # dedup: 2 of 4 ranks read

# %% [markdown]
# ## What the plans look like
#
# Decode TP 2 reading from prefill TP 1: each copy is half a prefill page
# (its 4 heads), at offset 0 for rank 0 and half a page in for rank 1, and
# the whole of the decode rank's page. A peer page of the wrong size for its
# heads is refused, naming the bytes of a head on each side:

# %%
prefill = engine(1, 8, NUM_PREFILL, [kv[:, :8] for kv in logical])
decode = engine(2, 8, NUM_DECODE, None)
peer = ptrres.PeerLayout.of(prefill[0][1])
spec = ptrres.GPULoadStoreSpec(np.array([1, 2], np.int32))
for rank, (_, table) in enumerate(decode):
    (s,) = ptrres.tp_mapping(rank, 2, 1, 8).slices
    plan = table.plan_peer_transfer(spec, peer, [7, 8], heads=s)
    refs = [peer.groups[0][d] for d in (0, 0, 1, 1)]  # group -> ref -> block
    starts = [
        ref.base_ptr + i * ref.row_stride_bytes for ref, i in zip(refs, (7, 8, 7, 8))
    ]
    offsets = plan.remote - np.array(starts, np.uint64)
    print(
        f"decode rank {rank}: remote offsets {offsets.tolist()}, "
        f"sizes {plan.sizes.tolist()} (prefill page "
        f"{peer.groups[0][0].page_size_bytes} B)"
    )

small = engine(2, 8, NUM_PREFILL, None)  # pages of 4 heads, posing as TP 1
try:
    decode[0][1].plan_peer_transfer(
        spec,
        ptrres.PeerLayout.of(small[0][1]),
        [7, 8],
        heads=ptrres.tp_mapping(0, 2, 1, 8).slices[0],
    )
except ptrres.LayoutError as error:
    print(error)

# %% [markdown]
# ## A push: prefill ranks write
#
# In push mode each prefill rank WRITEs its heads into the decode ranks.
# `ptrres.push_mapping` is `tp_mapping` seen from the writer: the decode
# ranks that hold its heads and one `HeadSlice` each (local: its own page;
# remote: theirs), the same copies as the reads, turned round. Where decode
# TP exceeds the heads, each decode rank holding a head is written it (every
# replica); where prefill TP does, the first prefill rank holding a head
# writes it and its replicas write nothing.


# %%
def push(
    prefill_tp: int,
    decode_tp: int,
    heads: int,
    local_ids: list[int],
    remote_ids: list[int],
) -> None:
    """Every prefill rank WRITEs local_ids into the decode ranks'
    remote_ids, then every decode rank's bytes are checked against the
    logical model."""
    model = [kv[:, :heads] for kv in logical]
    prefill = engine(prefill_tp, heads, NUM_PREFILL, model)
    decode = engine(decode_tp, heads, NUM_DECODE, None)
    before = [[layer.copy() for layer in layers] for layers, _ in decode]
    tag = f"push{prefill_tp}to{decode_tp}h{heads}"
    names = [f"decode{r}-{tag}" for r in range(decode_tp)]
    registrations = [
        ptrres.nixl.register(agent(n), t) for n, (_, t) in zip(names, decode)
    ]
    peers = [ptrres.PeerLayout.of(table) for _, table in decode]
    spec = ptrres.GPULoadStoreSpec(np.array(local_ids, np.int32))
    for rank, (_, table) in enumerate(prefill):
        writer = agent(f"prefill{rank}-{tag}")
        registrations.append(ptrres.nixl.register(writer, table))
        mapping = ptrres.push_mapping(rank, prefill_tp, decode_tp, heads)
        for s in mapping.slices:
            peer, name = peers[s.source_rank], names[s.source_rank]
            writer.add_remote_agent(agent(name).get_agent_metadata())
            plan = table.plan_peer_transfer(spec, peer, remote_ids, heads=s)
            descs = ptrres.nixl.peer_xfer_descs(plan, local=table, remote=peer)
            post(writer, descs.initialize_xfer(writer, "WRITE", name))
        print(f"  prefill rank {rank} writes decode ranks {list(mapping.target_ranks)}")
    for rank, (layers, _) in enumerate(decode):
        mine = holds(rank, decode_tp, heads)
        for after, old, kv in zip(layers, before[rank], model):
            expected = old.copy()
            expected[remote_ids] = kv[local_ids][:, mine].reshape(len(local_ids), -1)
            assert (after == expected).all(), rank
    for registration in registrations:
        registration.deregister()
    print(
        f"prefill TP {prefill_tp} -> decode TP {decode_tp}, {heads} heads: "
        "every decode rank's bytes as the model says"
    )


push(1, 4, 2, [2, 3, 4, 9], [10, 11, 0, 5])  # each head to both of its replicas
push(4, 1, 2, [2, 3, 4, 9], [10, 11, 0, 5])  # prefill ranks 1 and 3 write nothing
