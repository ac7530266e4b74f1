"""NIXL transfers between engines of different TP (issue 34, item 6; the
push, issue 40): per prefill -> decode TP pair, the descriptors one decode
rank posts, building them with ptrres against vLLM's own code into the same
prepared lists, a prefill rank's push against vLLM's push worker, and
building plus posting over UCX.

Models: llama-3.1-8b and llama-3.1-70b (the presets' 32 and 80 layers, 8 KV
heads of 128 values, 16-token blocks, bf16), K and V as separate refs of
each layer (64 and 160 refs), HND pages: a rank of an engine at TP ``T``
holds ``8 / T`` heads, a page of ``8 / T * 16 * 128 * 2`` B per ref (32 KiB
at TP 1, 4 KiB at TP 8). Pairs: prefill TP -> decode TP 1->2, 2->1, 1->4,
4->1, 2->8, 8->2. One decode rank is measured, the last (``D - 1``: where
the decode TP is larger, the one whose heads lie furthest into its source's
page); it gathers its heads from ``max(1, P / D)`` source ranks
(ptrres.tp_mapping), one prepared list (or one Nx3 descriptor list) and one
transfer per source rank. Ids: the shipped vLLM traces' (GPU ids local, CPU
ids as remote block positions, as benchmarks/nixl_transfer.py takes them),
a few transfers of each size bucket, spread over each trace.

1. Setup, once per peer engine, from the handshake's numbers (a
   NixlAgentMetadata per source rank, duck-typed) to both sides' prepared
   lists of every source rank: vLLM's own ``compute_tp_mapping``,
   ``_build_fa_local``, ``_build_fa_remote`` per source rank and, where the
   prefill TP is larger, ``_build_local_splits_from_plan``, called on a bare
   worker (``object.__new__``, only the attributes they read); against
   ``PeerLayout.from_nixl_metadata`` per source rank, ``ptrres.tp_mapping``
   and ``ptrres.nixl.prepped_pair`` per source rank. The two sides' rows are
   checked equal first.
2. Building, per transfer, ids to what NIXL takes, interleaved in one
   process (ptrres.bench.compare), on layouts over tensors never allocated
   (the pointer math does not touch the pages), from the same int32 arrays:
   ``vllm``: vLLM's own ``_compute_desc_ids``, remote then local side, once
   per source rank as ``_read_blocks`` calls it; ``ptrres``:
   ``prepped_indices`` of the local ids once (the same for every source
   rank's list) and of the remote ids once per source rank (each checked
   against that rank's layout), into buffers allocated once; ``ptrres/read``:
   both sides per source rank, as vLLM does; ``plan`` and ``plan+c``:
   ``plan_peer_transfer(heads=...)`` and ``peer_xfer_descs`` per source rank
   (Nx3 arrays), plain and coalesced. The indices are checked equal to
   vLLM's first.
3. Build plus post over UCX: the decode rank's agent here, one agent per
   source rank in a second process (the prefill engine, started with
   multiprocessing's "spawn"), host memory, loopback only
   (UCX_NET_DEVICES=lo), no progress threads. From the ids to every
   transfer of the decode rank DONE: (a) vLLM's indices and
   ``make_prepped_xfer``, (b) ptrres's indices and ``make_prepped_xfer``
   (the same prepared lists: ptrres's prepped_pair), (c) Nx3 rows and
   ``initialize_xfer``, (d) the same coalesced; the ways take turns, medians
   over rounds. UCX's RMA on tcp/lo needs the target to progress: before each
   timed transfer the prefill process is told to spin (``get_new_notifs`` on
   each of its agents) until the notifications come, and says it spins;
   only then the clock starts. Only the source ranks of the measured decode
   rank are started. Pages are divided by ``--page-divisor`` (64: 32 KiB
   becomes 512 B), so the times are per-descriptor costs, not bandwidth.
   Each way is first checked to move the right bytes (every head of every
   page of the moved blocks, against the prefill process's bytes).

4. A push (issue 40), per transfer: prefill rank P-1 WRITEs its heads to
   every decode rank it writes, from the request's ids (Python lists, as
   vLLM's scheduler and the decode engine's registration give them) to what
   NIXL takes, interleaved in one process: ``vllm``: the installed vLLM's
   own push path, ``_do_start_push_kv`` through ``_xfer_blocks_for_req`` and
   ``_xfer_blocks`` (its prefix-hit trim, ``_compute_desc_ids`` on both
   sides) to ``make_prepped_xfer``, on a bare push worker whose NIXL wrapper
   posts nothing, its lists built by its own add_remote_agent code (split
   per target where decode TP is larger); ``ptrres``: ``uncached_suffix``,
   ``prepped_indices`` of the local ids once and of the remote ids per
   target rank (ptrres.push_mapping); ``plan``: ``uncached_suffix``, then
   ``plan_peer_transfer(heads=)`` and ``peer_xfer_descs`` per target rank.
   vLLM's indices and lists are checked equal to ptrres's first.

The descriptor ids are vLLM 0.33's ``_compute_desc_ids`` or 0.34's (which
pairs regions, ``pairs=``), whichever is installed.

By default the setup, building and push run on every trace, two transfers
per size bucket, 5 rounds; the UCX part on one trace (vllm033-lru), one
transfer per bucket, 3 rounds (a 2-core machine moves the 70B transfers
for minutes otherwise).

Run: python benchmarks/nixl_tp.py [--quick] [--only setup|build|push|ucx]...
     [--per-bucket N] [--rounds N] [--seconds S] [--ucx-trace NAME]...
     [--ucx-per-bucket N] [--ucx-rounds N] [--page-divisor N]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import multiprocessing
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

# Loopback only, before NIXL (and its UCX) is loaded.
os.environ["UCX_NET_DEVICES"] = "lo"

import numpy as np
import numpy.typing as npt
from nixl_transfer import (
    BUCKETS,
    NOTIF,
    STUCK_SECONDS,
    HostCaches,
    bucket_name,
    count_notifs,
    host_caches,
    nixl_classes,
    touched,
    trace_ids,
    trace_transfers,
    us,
)

import ptrres
import ptrres.nixl as pn
from ptrres.bench import PRESETS, TRACES, Preset, VirtualTensor, compare, load_trace
from ptrres.bench.traces import Trace

MODELS = ("llama-3.1-8b", "llama-3.1-70b")
NUM_KV_HEADS = 8
# Bytes of one head of one token's K (or V): 128 values of bf16.
HEAD_TOKEN_BYTES = 128 * 2
BLOCK_TOKENS = 16
# (prefill TP, decode TP).
PAIRS = ((1, 2), (2, 1), (1, 4), (4, 1), (2, 8), (8, 2))
QUICK_PAIRS = ((1, 2), (4, 1))
PAGE_DIVISOR = 64
# The decode rank's pool (every trace's GPU ids are below 3072).
NUM_LOCAL_BLOCKS = 8192
CONTENDERS = ("vllm", "ptrres", "ptrres/read", "plan", "plan+c")
WAYS = ("a", "b", "c", "d")
WAY_NAMES = {
    "a": "(a) vLLM 0.33's _compute_desc_ids + make_prepped_xfer",
    "b": "(b) ptrres prepped_indices + make_prepped_xfer",
    "c": "(c) ptrres plan_peer_transfer(heads=) Nx3 rows + initialize_xfer",
    "d": "(d) the same, coalesced",
}
NIXL_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"

IdArray = npt.NDArray[np.int32]


class HostVirtualTensor(VirtualTensor):
    """A virtual tensor said to be in host memory (ptrres.nixl names its
    memory DRAM); never allocated."""

    device = SimpleNamespace(type="cpu", index=None)


# --- Geometry -------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """One model at one TP pair, seen from the measured decode rank."""

    model: str
    prefill_tp: int
    decode_tp: int
    num_refs: int  # K and V of every layer
    mapping: ptrres.TPMapping

    @property
    def decode_rank(self) -> int:
        return self.decode_tp - 1

    def page(self, tp: int) -> int:
        """Bytes of a page of one ref on a rank of an engine at TP ``tp``."""
        return NUM_KV_HEADS // tp * BLOCK_TOKENS * HEAD_TOKEN_BYTES

    @property
    def local_page(self) -> int:
        return self.page(self.decode_tp)

    @property
    def remote_page(self) -> int:
        return self.page(self.prefill_tp)

    @property
    def sources(self) -> tuple[int, ...]:
        return self.mapping.source_ranks

    def label(self) -> str:
        return f"{self.prefill_tp}->{self.decode_tp}"


def geometry(model: str, prefill_tp: int, decode_tp: int) -> Geometry:
    preset: Preset = PRESETS[model]
    mapping = ptrres.tp_mapping(decode_tp - 1, decode_tp, prefill_tp, NUM_KV_HEADS)
    # The preset's K+V page per layer, as K and V apart: two refs a layer.
    assert preset.group_page_sizes == (2 * NUM_KV_HEADS * BLOCK_TOKENS * 256,)
    return Geometry(model, prefill_tp, decode_tp, 2 * preset.refs_per_group, mapping)


def virtual_table(refs: int, page: int, blocks: int, base: int) -> ptrres.PointerTable:
    """``refs`` refs of one group, each its own tensor, never allocated."""
    tensors = [
        ptrres.CanonicalKVCacheTensor(
            HostVirtualTensor(base + i * (1 << 36), blocks, page), page
        )
        for i in range(refs)
    ]
    refs_list = [ptrres.CanonicalKVCacheRef(i, page) for i in range(refs)]
    return ptrres.PointerTable(ptrres.CanonicalKVCaches(tensors, [refs_list]))


def handshake(table: ptrres.PointerTable, engine_id: str) -> SimpleNamespace:
    """What a source rank's NixlAgentMetadata says of its KV caches (the
    fields vLLM 0.33's _build_fa_remote and PeerLayout.from_nixl_metadata
    read): one region a ref, host memory, HND pages."""
    rows = pn.prepped_rows(table).xfer_list
    n = len(rows)
    return SimpleNamespace(
        engine_id=engine_id,
        kv_caches_base_addr=[int(r[0]) for r in rows],
        block_lens=[int(r[1]) for r in rows],
        block_strides=[int(r[3]) for r in rows],
        num_blocks=int(rows[0][4]),
        region_num_blocks=[int(r[4]) for r in rows],
        region_group_ids=[0] * n,
        region_mem_types=["DRAM"] * n,
        device_id=0,
        kv_cache_layout="HND",
    )


# --- vLLM's own code, on a bare worker --------------------------------------


@dataclass
class VllmSide:
    """vLLM 0.33's NIXL worker code for one decode rank: a bare worker, its
    topology, and the functions timed."""

    worker: Any
    topology: Any
    compute_tp_mapping: Callable[..., Any]
    specs: tuple[type, ...]
    local_bases: list[int]


def vllm_side(geo: Geometry, table: ptrres.PointerTable) -> VllmSide:
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)  # "NIXL is not available"
    base_worker = importlib.import_module(f"{NIXL_PACKAGE}.base_worker")
    tp_mapping = importlib.import_module(f"{NIXL_PACKAGE}.tp_mapping")
    utils = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.utils")
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    topology = utils.TransferTopology(
        tp_rank=geo.decode_rank,
        tp_size=geo.decode_tp,
        block_size=BLOCK_TOKENS,
        engine_id="decode",
        is_mla=False,
        is_mamba=False,
        total_num_kv_heads=NUM_KV_HEADS,
        attn_backends=[],
    )
    cls = base_worker.NixlBaseConnectorWorker
    # vLLM's __del__ shuts NIXL down, which a bare worker never started.
    bare = type("BareWorker", (cls,), {"__del__": lambda self: None})
    worker: Any = object.__new__(bare)
    rows = pn.prepped_rows(table).xfer_list
    regions = geo.num_refs
    for name, value in {
        "transfer_topo": topology,
        "device_id": 0,
        "num_regions": regions,
        "block_len_per_layer": [int(r[1]) for r in rows],
        "block_stride_per_layer": [int(r[3]) for r in rows],
        "region_num_blocks": [int(r[4]) for r in rows],
        "region_group_ids": [0] * regions,
        "_uses_region_group_mapping": False,
        "_group_spec_types": (FullAttentionSpec,),
        "_region_is_mla": [False] * regions,
        "_transfer_layer_region_indices": [],
        "_transfer_layer_group_ids": (),
        "_head_sharded_draft_regions": set(),
        "draft_tp_mappings": {},
        "_logical_num_blocks": None,
        "_ple_region_index": None,
        "_ple_group_index": None,
        "_has_mamba": False,
        "_conv_decomp": None,
        "_ssm_region_indices": [],
        "_scratch_region_indices": [],
    }.items():
        setattr(worker, name, value)
    return VllmSide(
        worker,
        topology,
        tp_mapping.compute_tp_mapping,
        (FullAttentionSpec,),
        [int(r[0]) for r in rows],
    )


def vllm_prepared_lists(
    vllm: VllmSide, geo: Geometry, metas: dict[int, Any]
) -> dict[int, tuple[Any, Any]]:
    """vLLM's setup for one peer engine: per source rank, (local rows,
    remote rows), as add_remote_agent builds them."""
    worker = vllm.worker
    plan = vllm.compute_tp_mapping(vllm.topology, geo.prefill_tp, vllm.specs)
    local = worker._build_fa_local(vllm.local_bases, 1)
    remote = {
        s: worker._build_fa_remote(plan, metas[s], 1) for s in plan.all_source_ranks
    }
    if geo.prefill_tp > geo.decode_tp:
        num_fa_descs = int(local[:, 4].sum())
        splits = worker._build_local_splits_from_plan(plan, local, num_fa_descs, 1)
        locals_ = dict(zip(plan.all_source_ranks, splits))
    else:
        locals_ = dict.fromkeys(plan.all_source_ranks, local)
    return {s: (locals_[s], remote[s]) for s in plan.all_source_ranks}


def ptrres_prepared_lists(
    table: ptrres.PointerTable, geo: Geometry, metas: dict[int, Any]
) -> dict[int, tuple[pn.PreppedRows, pn.PreppedRows]]:
    """ptrres's setup for one peer engine: the mapping, each source rank's
    layout from its handshake, both sides' prepared lists per source rank."""
    mapping = ptrres.tp_mapping(
        geo.decode_rank, geo.decode_tp, geo.prefill_tp, NUM_KV_HEADS
    )
    return {
        s.source_rank: pn.prepped_pair(
            table, ptrres.PeerLayout.from_nixl_metadata(metas[s.source_rank]), s
        )
        for s in mapping.slices
    }


def vllm_indices(
    worker: Any,
    local_ids: IdArray,
    remote_ids: IdArray,
    local_blocks: int,
    remote_blocks: int,
    regions: int,
) -> tuple[Any, Any]:
    """One _read_blocks' two _compute_desc_ids calls, as vLLM makes them
    (0.34 pairs the regions, ``pairs=(regions, groups)``; before, the
    regions' groups say)."""
    if "pairs" in inspect.signature(worker._compute_desc_ids).parameters:
        grouping: dict[str, Any] = {"pairs": (range(regions), [0] * regions)}
    else:
        grouping = {
            "region_group_ids": [0] * regions,
            "uses_region_group_mapping": False,
        }
    remote = worker._compute_desc_ids(
        block_ids=[remote_ids],
        dst_num_blocks=remote_blocks,
        block_size_ratio=None,
        physical_blocks_per_logical=1,
        region_num_blocks=[remote_blocks] * regions,
        **grouping,
    )
    local = worker._compute_desc_ids(
        block_ids=[local_ids],
        dst_num_blocks=local_blocks,
        block_size_ratio=1,
        physical_blocks_per_logical=1,
        region_num_blocks=[local_blocks] * regions,
        **grouping,
    )
    return local, remote


# --- One decode rank and its source ranks -----------------------------------


@dataclass
class DecodeRank:
    """The measured decode rank's table, its source ranks' layouts, vLLM's
    bare worker over the same numbers, and the buffers each way writes into
    (allocated once and written, as a server's are)."""

    geo: Geometry
    table: ptrres.PointerTable
    peers: dict[int, ptrres.PeerLayout]
    vllm: VllmSide
    local_blocks: int
    remote_blocks: int
    local_memory: pn.Memory
    remote_memory: dict[int, pn.Memory]
    local_out: IdArray
    read_out: dict[int, tuple[IdArray, IdArray]]
    plan_out: tuple[npt.NDArray[np.uint64], ...]
    rows_out: dict[int, tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]]

    @property
    def slices(self) -> tuple[ptrres.HeadSlice, ...]:
        return self.geo.mapping.slices

    def build(self, contender: str, local_ids: IdArray, remote_ids: IdArray) -> Any:
        """What one contender hands NIXL for one transfer: per source rank
        (in the mapping's order), (local indices, remote indices) or the
        XferDescs of a plan."""
        if contender == "vllm":
            return [
                vllm_indices(
                    self.vllm.worker,
                    local_ids,
                    remote_ids,
                    self.local_blocks,
                    self.remote_blocks,
                    self.geo.num_refs,
                )
                for _ in self.slices
            ]
        if contender == "ptrres":
            local = pn.prepped_indices(self.table, local_ids, out=self.local_out)
            return [
                (
                    local,
                    pn.prepped_indices(
                        self.peers[s.source_rank],
                        remote_ids,
                        out=self.read_out[s.source_rank][1],
                    ),
                )
                for s in self.slices
            ]
        if contender == "ptrres/read":
            return [
                (
                    pn.prepped_indices(
                        self.table, local_ids, out=self.read_out[s.source_rank][0]
                    ),
                    pn.prepped_indices(
                        self.peers[s.source_rank],
                        remote_ids,
                        out=self.read_out[s.source_rank][1],
                    ),
                )
                for s in self.slices
            ]
        spec = ptrres.GPULoadStoreSpec(local_ids)
        built = []
        for s in self.slices:
            plan = self.table.plan_peer_transfer(
                spec,
                self.peers[s.source_rank],
                remote_ids,
                heads=s,
                coalesce=contender == "plan+c",
                out=self.plan_out,
            )
            built.append(
                pn.peer_xfer_descs(
                    plan,
                    local=self.local_memory,
                    remote=self.remote_memory[s.source_rank],
                    out=self.rows_out[s.source_rank],
                )
            )
        return built


def decode_rank(
    geo: Geometry,
    table: ptrres.PointerTable,
    peers: dict[int, ptrres.PeerLayout],
    remote_blocks: int,
    max_ids: int,
) -> DecodeRank:
    n_ops = max_ids * geo.num_refs

    def indices() -> IdArray:
        return touched(np.zeros(n_ops, np.int32))

    def rows() -> npt.NDArray[np.uint64]:
        return touched(np.zeros((n_ops, 3), np.uint64))

    return DecodeRank(
        geo,
        table,
        peers,
        vllm_side(geo, table),
        NUM_LOCAL_BLOCKS,
        remote_blocks,
        pn.memory_of(table),
        {s: pn.memory_of(peer) for s, peer in peers.items()},
        indices(),
        {s: (indices(), indices()) for s in peers},
        tuple(touched(np.zeros(n_ops, np.uint64)) for _ in range(3)),
        {s: (rows(), rows()) for s in peers},
    )


def check_indices(rank: DecodeRank, local_ids: IdArray, remote_ids: IdArray) -> None:
    """ptrres's indices are vLLM's, for every source rank."""
    expected = rank.build("vllm", local_ids, remote_ids)
    for contender in ("ptrres", "ptrres/read"):
        for (local, remote), (vllm_local, vllm_remote) in zip(
            rank.build(contender, local_ids, remote_ids), expected
        ):
            assert np.array_equal(local, vllm_local), (rank.geo, contender)
            assert np.array_equal(remote, vllm_remote), (rank.geo, contender)


def descriptor_count(built: Any, contender: str) -> int:
    """Descriptors (or indices, per side) handed to NIXL, over the sources."""
    if contender in ("vllm", "ptrres", "ptrres/read"):
        return sum(len(local) for local, _ in built)
    return sum(len(descs) for descs in built)


# --- Transfers ------------------------------------------------------------


@dataclass(frozen=True)
class Transfer:
    trace: str
    bucket: str
    local_ids: IdArray
    remote_ids: IdArray


def transfers(traces: Sequence[str], per_bucket: int) -> list[Transfer]:
    found = []
    for name in traces:
        trace: Trace = load_trace(name)
        for bucket, i in trace_transfers(trace, per_bucket):
            local_ids, remote_ids = trace_ids(trace, i)
            found.append(Transfer(name, bucket, local_ids, remote_ids))
    return found


def remote_pool(traces: Sequence[str]) -> int:
    return max(
        load_trace(n).num_cpu_blocks * load_trace(n).blocks_per_chunk for n in traces
    )


def virtual_rank(geo: Geometry, remote_blocks: int, max_ids: int) -> DecodeRank:
    """The decode rank over tensors never allocated, full-size pages."""
    table = virtual_table(geo.num_refs, geo.local_page, NUM_LOCAL_BLOCKS, 1 << 44)
    peers = {
        s: ptrres.PeerLayout.from_nixl_metadata(
            handshake(
                virtual_table(
                    geo.num_refs, geo.remote_page, remote_blocks, (2 + s) << 44
                ),
                f"prefill-{s}",
            )
        )
        for s in geo.sources
    }
    return decode_rank(geo, table, peers, remote_blocks, max_ids)


# --- Sections -------------------------------------------------------------


def run_setup(pairs: Sequence[tuple[int, int]], seconds: float, rounds: int) -> None:
    print(
        "\n### Setup, once per peer engine: handshake numbers to both sides' "
        "prepared lists of every source rank\n"
    )
    print(
        "| model | prefill->decode | decode rank | source ranks | refs "
        "| page local / remote B | rows per list | vLLM us | ptrres us "
        "| vLLM / ptrres |"
    )
    print("|---|---|---:|---|---:|---|---:|---:|---:|---:|")
    ratios = []
    for model in MODELS:
        for prefill_tp, decode_tp in pairs:
            geo = geometry(model, prefill_tp, decode_tp)
            table = virtual_table(
                geo.num_refs, geo.local_page, NUM_LOCAL_BLOCKS, 1 << 44
            )
            metas = {
                s: handshake(
                    virtual_table(geo.num_refs, geo.remote_page, 12288, (2 + s) << 44),
                    f"prefill-{s}",
                )
                for s in geo.sources
            }
            vllm = vllm_side(geo, table)
            theirs = vllm_prepared_lists(vllm, geo, metas)
            ours = ptrres_prepared_lists(table, geo, metas)
            assert sorted(theirs) == sorted(ours) == sorted(geo.sources), geo
            for s, (local, remote) in ours.items():
                assert np.array_equal(local.xfer_list, theirs[s][0]), (geo, s)
                assert np.array_equal(remote.xfer_list, theirs[s][1]), (geo, s)
            timing = compare(
                {
                    "vllm": partial(vllm_prepared_lists, vllm, geo, metas),
                    "ptrres": partial(ptrres_prepared_lists, table, geo, metas),
                },
                seconds=seconds,
                rounds=rounds,
            )
            t = {name: timing[name].seconds * 1e6 for name in timing}
            ratios.append(t["vllm"] / t["ptrres"])
            print(
                f"| {model} | {geo.label()} | {geo.decode_rank} "
                f"| {', '.join(map(str, geo.sources))} | {geo.num_refs} "
                f"| {geo.local_page} / {geo.remote_page} | {geo.num_refs} "
                f"| {t['vllm']:.0f} | {t['ptrres']:.0f} "
                f"| {t['vllm'] / t['ptrres']:.2f}x |",
                flush=True,
            )
    print(
        f"\nSetup: vLLM / ptrres geometric mean {geomean(ratios):.2f}x, lowest "
        f"{min(ratios):.2f}x (rows checked equal on every pair).\n"
    )


def run_build(
    pairs: Sequence[tuple[int, int]],
    traces: Sequence[str],
    per_bucket: int,
    seconds: float,
    rounds: int,
) -> None:
    found = transfers(traces, per_bucket)
    remote_blocks = remote_pool(traces)
    max_ids = max(len(t.local_ids) for t in found)
    print(
        "\n### Building, per transfer: ids to what NIXL takes, for every "
        "source rank of the decode rank\n"
    )
    print(
        f"{len(found)} transfers ({per_bucket} per size bucket of each of "
        f"{len(traces)} traces); medians of {rounds} interleaved rounds, "
        "then means per transfer over the bucket's transfers; ratios are sums "
        "over the same transfers. `descr`: descriptors per transfer over the "
        "source ranks, plain / coalesced; `indices`: prepared-list indices per "
        "transfer and side, over the source ranks.\n"
    )
    print(
        "| model | prefill->decode | sources | blocks/transfer | transfers "
        "| blocks | descr plain / coalesced | indices | vllm us | ptrres us "
        "| ptrres/read us | plan us | plan+c us | vllm / ptrres "
        "| vllm / ptrres/read | vllm / plan |"
    )
    print("|---|---|---:|---|---:|---:|---|---:|" + "---:|" * 8)
    ratios: dict[str, list[float]] = {"ptrres": [], "ptrres/read": [], "plan": []}
    slowest: list[str] = []
    for model in MODELS:
        for prefill_tp, decode_tp in pairs:
            geo = geometry(model, prefill_tp, decode_tp)
            rank = virtual_rank(geo, remote_blocks, max_ids)
            cells: dict[str, list[dict[str, float]]] = {}
            for t in found:
                check_indices(rank, t.local_ids, t.remote_ids)
                timing = compare(
                    {
                        c: partial(rank.build, c, t.local_ids, t.remote_ids)
                        for c in CONTENDERS
                    },
                    seconds=seconds,
                    rounds=rounds,
                )
                cell = {c: timing[c].seconds * 1e6 for c in CONTENDERS}
                cell["blocks"] = len(t.local_ids)
                for c in ("plan", "plan+c"):
                    cell[f"n {c}"] = descriptor_count(
                        rank.build(c, t.local_ids, t.remote_ids), c
                    )
                cell["indices"] = descriptor_count(
                    rank.build("ptrres", t.local_ids, t.remote_ids), "ptrres"
                )
                cells.setdefault(t.bucket, []).append(cell)
            for bucket, values in sorted(cells.items(), key=bucket_order):

                def mean(k: str, values: list[dict[str, float]] = values) -> float:
                    return statistics.fmean(v[k] for v in values)

                def total(k: str, values: list[dict[str, float]] = values) -> float:
                    return sum(v[k] for v in values)

                row = {c: total("vllm") / total(c) for c in ratios}
                for c, r in row.items():
                    ratios[c].append(r)
                    if r < 1:
                        slowest.append(f"{model} {geo.label()} {bucket} {c} {r:.2f}x")
                print(
                    f"| {model} | {geo.label()} | {len(geo.sources)} | {bucket} "
                    f"| {len(values)} | {mean('blocks'):.0f} "
                    f"| {mean('n plan'):.0f} / {mean('n plan+c'):.0f} "
                    f"| {mean('indices'):.0f} | {mean('vllm'):.1f} "
                    f"| {mean('ptrres'):.1f} | {mean('ptrres/read'):.1f} "
                    f"| {mean('plan'):.1f} | {mean('plan+c'):.1f} "
                    f"| {row['ptrres']:.2f}x | {row['ptrres/read']:.2f}x "
                    f"| {row['plan']:.2f}x |",
                    flush=True,
                )
    print()
    for c, found_ratios in ratios.items():
        print(
            f"- vllm / {c}: geometric mean {geomean(found_ratios):.2f}x, lowest "
            f"{min(found_ratios):.2f}x over {len(found_ratios)} rows"
        )
    print(
        "\nBuilding slower than vLLM's way: "
        + (", ".join(slowest) if slowest else "none")
        + ".\n"
    )


def bucket_order(item: tuple[str, Any]) -> int:
    names = [bucket_name(low, high) for low, high in BUCKETS]
    return names.index(item[0])


def geomean(values: Sequence[float]) -> float:
    return float(np.exp(np.mean(np.log(values))))


# --- A push: one prefill rank WRITEs its heads to the decode ranks ------------

PUSH_CONTENDERS = ("vllm", "ptrres", "plan")


class NoRecord(dict[str, list[int]]):
    """The push worker's _sending_transfers, keeping nothing: each request's
    handles go to a list of its own, dropped (the benchmark repeats one
    request)."""

    def __missing__(self, key: str) -> list[int]:
        return []


class PushNixl:
    """The push worker's NIXL wrapper: prepared lists by handle, and the last
    WRITE's handles and indices per remote list (read by the check); posts
    nothing."""

    def __init__(self) -> None:
        self.lists: list[tuple[str, Any]] = []
        self.writes: dict[int, tuple[int, Any, Any]] = {}

    def prep_xfer_dlist(self, agent_name: str, rows: Any, **_: Any) -> int:
        self.lists.append((agent_name, rows))
        return len(self.lists) - 1

    def make_prepped_xfer(
        self,
        op: str,
        local: int,
        local_ids: Any,
        remote: int,
        remote_ids: Any,
        notif_msg: Any = None,
    ) -> int:
        self.writes[remote] = (local, local_ids, remote_ids)
        return remote

    def transfer(self, handle: int) -> str:
        return "PROC"


@dataclass
class PrefillRank:
    """The measured prefill rank (P - 1) of one pair: its table, the decode
    ranks it writes (their layouts from their handshakes), its push mapping,
    vLLM's bare push worker over the same numbers, and the buffers ptrres
    writes into."""

    model: str
    prefill_tp: int
    decode_tp: int
    num_refs: int
    mapping: ptrres.PushMapping
    table: ptrres.PointerTable
    peers: dict[int, ptrres.PeerLayout]
    worker: Any
    nixl: PushNixl
    local_out: IdArray
    remote_out: dict[int, IdArray]
    plan_out: tuple[npt.NDArray[np.uint64], ...]
    rows_out: dict[int, tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]]

    def label(self) -> str:
        return f"{self.prefill_tp}->{self.decode_tp}"

    def build(self, contender: str, local_ids: list[int], remote_ids: list[int]) -> Any:
        """One push of a request's blocks (Python lists, as vLLM's scheduler
        and the decode engine's registration give them): vLLM's whole push
        path from the registration to its WRITEs, or ptrres's indices (or
        plans) for every target rank."""
        if contender == "vllm":
            self.worker._do_start_push_kv(
                "request",
                [local_ids],
                {
                    "decode_engine_id": "decode",
                    "local_block_ids": [remote_ids],
                    "request_id": "request-at-decode",
                    "decode_host": "127.0.0.1",
                    "decode_port": 0,
                    "decode_tp_size": self.decode_tp,
                },
            )
            return self.nixl.writes
        suffix = ptrres.uncached_suffix(
            ptrres.GPULoadStoreSpec(local_ids), (len(remote_ids),)
        )
        remote = np.asarray(remote_ids, np.int64)
        if contender == "ptrres":
            local = pn.prepped_indices(self.table, suffix, out=self.local_out)
            return {
                s.source_rank: (
                    local,
                    pn.prepped_indices(
                        self.peers[s.source_rank],
                        remote,
                        out=self.remote_out[s.source_rank],
                    ),
                )
                for s in self.mapping.slices
            }
        built = {}
        for s in self.mapping.slices:
            plan = self.table.plan_peer_transfer(
                suffix, self.peers[s.source_rank], remote, heads=s, out=self.plan_out
            )
            built[s.source_rank] = pn.peer_xfer_descs(
                plan, local=self.table, remote=self.peers[s.source_rank],
                out=self.rows_out[s.source_rank],
            )  # fmt: skip
        return built

    def check(self, local_ids: list[int], remote_ids: list[int]) -> int:
        """vLLM's WRITEs go to the mapping's target ranks, with ptrres's
        indices, into the lists ptrres's prepped_pair makes; returns the
        indices per side over the targets."""
        self.nixl.writes.clear()
        theirs = self.build("vllm", local_ids, remote_ids)
        ours = self.build("ptrres", local_ids, remote_ids)
        names = {h: name for h, (name, _) in enumerate(self.nixl.lists)}
        by_target = {int(names[h].split("-")[1]): w for h, w in theirs.items()}
        assert sorted(by_target) == sorted(ours), (self.label(), sorted(by_target))
        for target, (local_handle, local_ids_v, remote_ids_v) in by_target.items():
            local, remote = ours[target]
            assert np.array_equal(local_ids_v, local), (self.label(), target)
            assert np.array_equal(remote_ids_v, remote), (self.label(), target)
            heads = self.mapping.slice_of(target)
            rows = pn.prepped_pair(self.table, self.peers[target], heads)
            remote_handle = next(
                h for h, name in names.items() if name == f"decode-{target}"
            )
            assert np.array_equal(self.nixl.lists[local_handle][1], rows[0].xfer_list)
            assert np.array_equal(self.nixl.lists[remote_handle][1], rows[1].xfer_list)
        return sum(len(local) for local, _ in ours.values())


def vllm_push_worker(
    prefill_tp: int,
    decode_tp: int,
    rank: int,
    table: ptrres.PointerTable,
    metas: dict[int, Any],
    remote_blocks: int,
) -> tuple[Any, PushNixl]:
    """vLLM's push worker for prefill rank ``rank``, never initialised
    (``object.__new__``), holding what its push path reads, with the lists
    its add_remote_agent builds for the decode ranks it handshakes with (its
    own code: compute_tp_mapping, _build_fa_local, _build_local_splits_from_plan
    where decode TP is larger, _build_fa_remote)."""
    import logging
    import threading

    logging.getLogger("vllm").setLevel(logging.ERROR)
    base_worker = importlib.import_module(f"{NIXL_PACKAGE}.base_worker")
    push_worker = importlib.import_module(f"{NIXL_PACKAGE}.push_worker")
    tp_mapping = importlib.import_module(f"{NIXL_PACKAGE}.tp_mapping")
    utils = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.utils")
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    topology = utils.TransferTopology(
        tp_rank=rank,
        tp_size=prefill_tp,
        block_size=BLOCK_TOKENS,
        engine_id="prefill",
        is_mla=False,
        is_mamba=False,
        total_num_kv_heads=NUM_KV_HEADS,
        attn_backends=[],
    )
    rows = pn.prepped_rows(table).xfer_list
    regions = len(rows)
    topology.register_remote_engine(
        "decode",
        utils.EngineTransferInfo(
            remote_tp_size=decode_tp,
            remote_block_len=metas[min(metas)].block_lens[0],
            remote_block_size=BLOCK_TOKENS,
            remote_physical_blocks_per_logical=1,
        ),
    )
    nixl = PushNixl()
    cls = push_worker.NixlPushConnectorWorker
    bare = type("BarePushWorker", (cls,), {"__del__": lambda self: None})
    worker: Any = object.__new__(bare)
    worker.__dict__.update(
        transfer_topo=topology,
        engine_id="prefill",
        world_size=prefill_tp,
        nixl_wrapper=nixl,
        use_mla=False,
        _has_mamba=False,
        _is_csa_linear=False,
        _group_spec_types=(FullAttentionSpec,),
        _region_is_mla=[False] * regions,
        block_len_per_layer=[int(r[1]) for r in rows],
        block_stride_per_layer=[int(r[3]) for r in rows],
        region_num_blocks=[int(r[4]) for r in rows],
        num_regions=regions,
        num_blocks=NUM_LOCAL_BLOCKS,
        _logical_num_blocks=NUM_LOCAL_BLOCKS,
        device_id=0,
        _physical_blocks_per_logical_kv_block=1,
        region_group_ids=[0] * regions,
        _uses_region_group_mapping=False,
        _transfer_layer_group_ids=[],
        _transfer_layer_region_indices=[],
        _scratch_region_indices=[],
        _ssm_region_indices=[],
        _conv_decomp=None,
        _ple_region_index=None,
        _ple_group_index=None,
        _head_sharded_draft_regions=set(),
        draft_tp_mappings={},
        tp_mappings={},
        dst_num_blocks={"decode": remote_blocks, "prefill": NUM_LOCAL_BLOCKS},
        dst_region_num_blocks={
            "decode": [remote_blocks] * regions,
            "prefill": [NUM_LOCAL_BLOCKS] * regions,
        },
        dst_region_group_ids={"decode": [0] * regions},
        dst_uses_region_group_mapping={"decode": False},
        dst_xfer_side_handles={"decode": {}},
        src_xfer_handles_by_block_size={},
        src_xfer_handles_by_tp_ratio={},
        _remote_agents={"decode": {}},
        _handshake_lock=threading.Lock(),
        _handshake_futures={},
        _engine_ttl=0,
        _engine_last_active={},
        _sending_transfers=NoRecord(),
        _sending_transfers_lock=threading.Lock(),
        _send_failures=set(),
    )
    if hasattr(base_worker, "_RegionPairs"):  # 0.34 pairs regions by layer
        every = list(range(regions))
        worker._dst_pairs = {
            "decode": base_worker._RegionPairs(
                remote=every, local=every, group=[0] * regions,
                remote_regions=every, partner=every,
            )
        }  # fmt: skip
    # add_remote_agent's lists, as it builds them.
    plan = tp_mapping.compute_tp_mapping(topology, decode_tp, (FullAttentionSpec,))
    worker.tp_mappings["decode"] = plan
    local = worker._build_fa_local([int(r[0]) for r in rows], 1)
    worker.src_xfer_handles_by_block_size[BLOCK_TOKENS] = nixl.prep_xfer_dlist(
        "NIXL_INIT_AGENT", local
    )
    tp_ratio = topology.tp_ratio(decode_tp)
    if worker._needs_split_local_xfer_handles(tp_ratio, plan):
        num_descs = int(local[:, 4].sum())
        worker.src_xfer_handles_by_tp_ratio[tp_ratio, BLOCK_TOKENS] = [
            nixl.prep_xfer_dlist("NIXL_INIT_AGENT", split)
            for split in worker._build_local_splits_from_plan(plan, local, num_descs, 1)
        ]
    for d in topology.handshake_target_ranks(decode_tp):
        worker._remote_agents["decode"][0, d] = f"decode-{d}"
        worker.dst_xfer_side_handles["decode"][d] = nixl.prep_xfer_dlist(
            f"decode-{d}", worker._build_fa_remote(plan, metas[d], 1)
        )
    return worker, nixl


def prefill_rank(
    model: str, prefill_tp: int, decode_tp: int, remote_blocks: int, max_ids: int
) -> PrefillRank:
    """Prefill rank P - 1 over tensors never allocated, full-size pages."""
    preset: Preset = PRESETS[model]
    refs = 2 * preset.refs_per_group
    rank = prefill_tp - 1
    mapping = ptrres.push_mapping(rank, prefill_tp, decode_tp, NUM_KV_HEADS)
    page = NUM_KV_HEADS // prefill_tp * BLOCK_TOKENS * HEAD_TOKEN_BYTES
    decode_page = NUM_KV_HEADS // decode_tp * BLOCK_TOKENS * HEAD_TOKEN_BYTES
    table = virtual_table(refs, page, NUM_LOCAL_BLOCKS, 1 << 44)
    metas = {
        d: handshake(
            virtual_table(refs, decode_page, remote_blocks, (2 + d) << 44),
            f"decode-{d}",
        )
        for d in mapping.target_ranks
    }
    worker, nixl = vllm_push_worker(
        prefill_tp, decode_tp, rank, table, metas, remote_blocks
    )
    n_ops = max_ids * refs

    def indices() -> IdArray:
        return touched(np.zeros(n_ops, np.int32))

    def descriptors() -> npt.NDArray[np.uint64]:
        return touched(np.zeros((n_ops, 3), np.uint64))

    targets = mapping.target_ranks
    return PrefillRank(
        model,
        prefill_tp,
        decode_tp,
        refs,
        mapping,
        table,
        {d: ptrres.PeerLayout.from_nixl_metadata(metas[d]) for d in targets},
        worker,
        nixl,
        indices(),
        {d: indices() for d in targets},
        tuple(touched(np.zeros(n_ops, np.uint64)) for _ in range(3)),
        {d: (descriptors(), descriptors()) for d in targets},
    )


def run_push(
    pairs: Sequence[tuple[int, int]],
    traces: Sequence[str],
    per_bucket: int,
    seconds: float,
    rounds: int,
) -> None:
    found = transfers(traces, per_bucket)
    remote_blocks = remote_pool(traces)
    max_ids = max(len(t.local_ids) for t in found)
    vllm = importlib.import_module("vllm")
    print(
        "\n### A push, per transfer: one prefill rank's WRITEs to every decode "
        "rank it writes, from the request's ids to what NIXL takes\n"
    )
    print(
        f"Prefill rank P-1; {len(found)} transfers ({per_bucket} per size bucket "
        f"of each of {len(traces)} traces), the ids as Python lists (as vLLM's "
        "scheduler and the decode engine's registration give them); medians of "
        f"{rounds} interleaved rounds, then means per transfer over the "
        f"bucket's transfers; ratios are sums over the same transfers. `vllm`: "
        f"vLLM {vllm.__version__}'s push path on a bare push worker, "
        "_do_start_push_kv to make_prepped_xfer (its NIXL posts nothing); "
        "`ptrres`: uncached_suffix, then prepped_indices of the local ids once "
        "and of the remote ids once per target rank; `plan`: uncached_suffix, "
        "then plan_peer_transfer(heads=) and peer_xfer_descs per target rank. "
        "The indices and lists are checked equal to vLLM's first.\n"
    )
    print(
        "| model | prefill->decode | targets | blocks/transfer | transfers "
        "| blocks | indices | vllm us | ptrres us | plan us | vllm / ptrres "
        "| vllm / plan |"
    )
    print("|---|---|---:|---|---:|---:|---:|" + "---:|" * 5)
    ratios: dict[str, list[float]] = {"ptrres": [], "plan": []}
    slowest: list[str] = []
    for model in MODELS:
        for prefill_tp, decode_tp in pairs:
            rank = prefill_rank(model, prefill_tp, decode_tp, remote_blocks, max_ids)
            cells: dict[str, list[dict[str, float]]] = {}
            for t in found:
                local_ids, remote_ids = t.local_ids.tolist(), t.remote_ids.tolist()
                cell: dict[str, float] = {
                    "indices": rank.check(local_ids, remote_ids),
                    "blocks": len(local_ids),
                }
                timing = compare(
                    {
                        c: partial(rank.build, c, local_ids, remote_ids)
                        for c in PUSH_CONTENDERS
                    },
                    seconds=seconds,
                    rounds=rounds,
                )
                cell.update({c: timing[c].seconds * 1e6 for c in PUSH_CONTENDERS})
                cells.setdefault(t.bucket, []).append(cell)
            for bucket, values in sorted(cells.items(), key=bucket_order):

                def mean(k: str, values: list[dict[str, float]] = values) -> float:
                    return statistics.fmean(v[k] for v in values)

                def total(k: str, values: list[dict[str, float]] = values) -> float:
                    return sum(v[k] for v in values)

                row = {c: total("vllm") / total(c) for c in ratios}
                for c, r in row.items():
                    ratios[c].append(r)
                    if r < 1:
                        slowest.append(f"{model} {rank.label()} {bucket} {c} {r:.2f}x")
                print(
                    f"| {model} | {rank.label()} | {len(rank.mapping.slices)} "
                    f"| {bucket} | {len(values)} | {mean('blocks'):.0f} "
                    f"| {mean('indices'):.0f} | {mean('vllm'):.1f} "
                    f"| {mean('ptrres'):.1f} | {mean('plan'):.1f} "
                    f"| {row['ptrres']:.2f}x | {row['plan']:.2f}x |",
                    flush=True,
                )
    print()
    for c, found_ratios in ratios.items():
        print(
            f"- vllm / {c}: geometric mean {geomean(found_ratios):.2f}x, lowest "
            f"{min(found_ratios):.2f}x over {len(found_ratios)} rows"
        )
    print(
        "\nA push slower than vLLM's: "
        + (", ".join(slowest) if slowest else "none")
        + ".\n"
    )


# --- Over UCX: the prefill engine's source ranks in a second process --------


def prefill_engine(
    conn: Connection, refs: int, page: int, blocks: int, divisor: int, ranks: list[int]
) -> None:
    """The source ranks: one agent and one set of KV caches each; serves
    the decode process's commands until told to close."""
    nixl_agent, nixl_agent_config = nixl_classes()
    engines: dict[int, tuple[Any, HostCaches, pn.Registration]] = {}
    for s in ranks:
        agent = nixl_agent(
            f"prefill-{s}-{os.getpid()}",
            nixl_agent_config(enable_prog_thread=False, backends=["UCX"]),
        )
        caches = host_caches(Preset(f"prefill-{s}", "", (page,), refs), blocks, divisor)
        engines[s] = (agent, caches, pn.register(agent, caches.table))
    conn.send(
        [
            (
                s,
                agent.name,
                agent.get_agent_metadata(),
                vars(handshake(c.table, str(s))),
            )
            for s, (agent, c, _) in engines.items()
        ]
    )
    rng = np.random.default_rng(34)
    while True:
        command, argument = conn.recv()
        if command == "drive":
            # Progress every agent until this many notifications came.
            conn.send("spinning")
            seen, deadline = 0, time.monotonic() + STUCK_SECONDS
            while seen < argument and time.monotonic() < deadline:
                for agent, _, _ in engines.values():
                    seen += count_notifs(agent.get_new_notifs())
            conn.send(seen)
        elif command == "fill":
            # Random bytes in these blocks of every ref; sent back.
            sent = {}
            for s, (_, caches, _) in engines.items():
                for tensor in caches.tensors:
                    tensor[argument] = rng.integers(
                        1, 256, (len(argument), tensor.shape[1]), dtype=np.uint8
                    )
                sent[s] = [tensor[argument].copy() for tensor in caches.tensors]
            conn.send(sent)
        else:
            for _, _, registration in engines.values():
                registration.deregister()
            conn.send("closed")
            return


@dataclass
class Sample:
    """One transfer of the decode rank moved one way: counts, nanoseconds."""

    descriptors: int  # handed to NIXL, over the source ranks
    posted: int  # NIXL's count after its merge (telemetry)
    build: int
    post: int  # make_prepped_xfer / initialize_xfer and transfer(), every source
    done: int  # from the last transfer() to every transfer DONE

    @property
    def total(self) -> int:
        return self.build + self.post + self.done


@dataclass
class UcxRank:
    """The decode rank over real host memory, its agent, its source ranks'
    agents (in the prefill process) and both sides' prepared lists."""

    rank: DecodeRank
    agent: Any
    local: HostCaches
    conn: Connection
    names: dict[int, str]
    local_prepped: dict[int, Any]
    remote_prepped: dict[int, Any]
    cleanup: list[Callable[[], Any]] = field(default_factory=list)

    def move(self, way: str, local_ids: IdArray, remote_ids: IdArray) -> Sample:
        contender = {"a": "vllm", "b": "ptrres", "c": "plan", "d": "plan+c"}[way]
        sources = [s.source_rank for s in self.rank.slices]
        self.conn.send(("drive", len(sources)))
        assert self.conn.recv() == "spinning"
        clock = time.perf_counter_ns
        t0 = clock()
        built = self.rank.build(contender, local_ids, remote_ids)
        t1 = clock()
        handles = []
        for s, side in zip(sources, built):
            if way in ("a", "b"):
                handle = self.agent.make_prepped_xfer(
                    "READ",
                    self.local_prepped[s],
                    side[0],
                    self.remote_prepped[s],
                    side[1],
                    notif_msg=NOTIF,
                )
            else:
                handle = side.initialize_xfer(self.agent, "READ", self.names[s], NOTIF)
            if self.agent.transfer(handle) == "ERR":
                raise RuntimeError(f"way {way}: transfer() failed")
            handles.append(handle)
        t2 = clock()
        deadline = time.monotonic() + STUCK_SECONDS
        for handle in handles:
            while (state := self.agent.check_xfer_state(handle)) == "PROC":
                if time.monotonic() > deadline:
                    raise RuntimeError("a transfer did not complete")
            if state != "DONE":
                raise RuntimeError(f"a transfer ended {state}")
        t3 = clock()
        posted = 0
        for handle in handles:
            posted += int(self.agent.get_xfer_telemetry(handle).descCount)
            handle.release()
        if self.conn.recv() < len(sources):
            raise RuntimeError("the prefill ranks missed a notification")
        return Sample(
            descriptor_count(built, contender), posted, t1 - t0, t2 - t1, t3 - t2
        )

    def check(self, local_ids: IdArray, remote_ids: IdArray) -> None:
        """Every way leaves, in each moved block of each ref, every head the
        decode rank holds, read from its source rank's page."""
        self.conn.send(("fill", remote_ids))
        remote = self.conn.recv()
        local_page = self.local.tensors[0].shape[1]
        for way in WAYS:
            for tensor in self.local.tensors:
                tensor[local_ids] = 0
            self.move(way, local_ids, remote_ids)
            for s in self.rank.slices:
                remote_page = remote[s.source_rank][0].shape[1]
                loff, roff, size = s.byte_range(local_page, remote_page)
                for tensor, source in zip(self.local.tensors, remote[s.source_rank]):
                    if not np.array_equal(
                        tensor[local_ids, loff : loff + size],
                        source[:, roff : roff + size],
                    ):
                        raise AssertionError(f"way {way} moved the wrong bytes")

    def close(self) -> None:
        for undo in reversed(self.cleanup):
            undo()


def ucx_rank(geo: Geometry, remote_blocks: int, max_ids: int, divisor: int) -> UcxRank:
    nixl_agent, nixl_agent_config = nixl_classes()
    agent = nixl_agent(
        f"decode-{geo.model}-{geo.label()}",
        nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"], capture_telemetry=True
        ),
    )
    local = host_caches(
        Preset("decode", "", (geo.local_page,), geo.num_refs), NUM_LOCAL_BLOCKS, divisor
    )
    cleanup: list[Callable[[], Any]] = [pn.register(agent, local.table).deregister]
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    process = context.Process(
        target=prefill_engine,
        args=(
            child_conn,
            geo.num_refs,
            geo.remote_page,
            remote_blocks,
            divisor,
            list(geo.sources),
        ),
        daemon=True,
    )
    process.start()

    def stop() -> None:
        conn.send(("close", None))
        conn.recv()
        process.join(STUCK_SECONDS)

    cleanup.append(stop)
    peers, names = {}, {}
    for s, name, metadata, numbers in conn.recv():
        agent.add_remote_agent(metadata)
        cleanup.append(partial(agent.remove_remote_agent, name))
        peers[s] = ptrres.PeerLayout.from_nixl_metadata(SimpleNamespace(**numbers))
        names[s] = name
    rank = decode_rank(geo, local.table, peers, remote_blocks, max_ids)
    local_prepped, remote_prepped = {}, {}
    for sl in rank.slices:
        s = sl.source_rank
        local_rows, remote_rows = pn.prepped_pair(local.table, peers[s], sl)
        local_prepped[s] = agent.prep_xfer_dlist("NIXL_INIT_AGENT", *local_rows)
        remote_prepped[s] = agent.prep_xfer_dlist(names[s], *remote_rows)
        cleanup.append(local_prepped[s].release)
        cleanup.append(remote_prepped[s].release)
    return UcxRank(
        rank, agent, local, conn, names, local_prepped, remote_prepped, cleanup
    )


def median_sample(samples: list[Sample]) -> Sample:
    def med(name: str) -> int:
        return int(statistics.median(getattr(s, name) for s in samples))

    return Sample(*(med(n) for n in Sample.__dataclass_fields__))


def run_ucx(
    pairs: Sequence[tuple[int, int]],
    traces: Sequence[str],
    per_bucket: int,
    rounds: int,
    divisor: int,
) -> None:
    found = transfers(traces, per_bucket)
    remote_blocks = remote_pool(traces)
    max_ids = max(len(t.local_ids) for t in found)
    print(
        "\n### Build plus post over UCX: ids to every transfer of the decode "
        "rank DONE\n"
    )
    print("\n".join(f"- {WAY_NAMES[w]}" for w in WAYS))
    print(
        f"\nPages 1/{divisor} of the model's; {len(found)} transfers ({per_bucket} "
        f"per size bucket of each of {len(traces)} traces), {rounds} rounds, the "
        "ways taking turns; medians, then means per transfer over the bucket's "
        "transfers; `x(a)`: sums over the same transfers against (a). `descr`: "
        "handed to NIXL, over the source ranks (indices per side for (a) and "
        "(b)); `posted`: NIXL's count after its own merge.\n"
    )
    print(
        "| model | prefill->decode | sources | blocks/transfer | transfers "
        "| blocks | descr a, c, d | posted a, c, d | build us a / b / c / d "
        "| all us (a) | all us (b) | all us (c) | all us (d) | all b, c, d x(a) |"
    )
    print("|---|---|---:|---|---:|---:|---|---|---|---:|---:|---:|---:|---|")
    for model in MODELS:
        for prefill_tp, decode_tp in pairs:
            geo = geometry(model, prefill_tp, decode_tp)
            ucx = ucx_rank(geo, remote_blocks, max_ids, divisor)
            try:
                first = found[0]
                n = min(16, len(first.local_ids))
                ucx.check(first.local_ids[:n], first.remote_ids[:n])
                cells: dict[str, list[tuple[int, dict[str, Sample]]]] = {}
                for t in found:
                    samples: dict[str, list[Sample]] = {w: [] for w in WAYS}
                    for r in range(rounds):
                        for k in range(len(WAYS)):
                            way = WAYS[(r + k) % len(WAYS)]
                            samples[way].append(
                                ucx.move(way, t.local_ids, t.remote_ids)
                            )
                    medians = {w: median_sample(s) for w, s in samples.items()}
                    cells.setdefault(t.bucket, []).append((len(t.local_ids), medians))
                for bucket, values in sorted(cells.items(), key=bucket_order):
                    print(ucx_row(geo, bucket, values), flush=True)
            finally:
                ucx.close()


def ucx_row(
    geo: Geometry, bucket: str, values: list[tuple[int, dict[str, Sample]]]
) -> str:
    def mean(way: str, name: str) -> float:
        return statistics.fmean(getattr(m[way], name) for _, m in values)

    def total(way: str) -> int:
        return sum(m[way].total for _, m in values)

    blocks = statistics.fmean(b for b, _ in values)
    descriptors = ", ".join(f"{mean(w, 'descriptors'):.0f}" for w in "acd")
    posted = ", ".join(f"{mean(w, 'posted'):.0f}" for w in "acd")
    builds = " / ".join(us(mean(w, "build")) for w in WAYS)
    totals = "".join(f"| {us(mean(w, 'total'))} " for w in WAYS)
    ratios = ", ".join(f"{total(w) / total('a'):.2f}" for w in "bcd")
    return (
        f"| {geo.model} | {geo.label()} | {len(geo.sources)} | {bucket} "
        f"| {len(values)} | {blocks:.0f} | {descriptors} | {posted} | {builds} "
        f"{totals}| {ratios} |"
    )


def load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="seconds: two pairs, one trace, one transfer per bucket, short timings",
    )
    parser.add_argument("--per-bucket", type=int, default=2)
    parser.add_argument("--ucx-per-bucket", type=int, default=1)
    parser.add_argument(
        "--ucx-trace",
        action="append",
        choices=TRACES,
        help="the traces of the UCX part (default: vllm033-lru)",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ucx-rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=0.2)
    parser.add_argument("--page-divisor", type=int, default=PAGE_DIVISOR)
    parser.add_argument(
        "--only", action="append", choices=("setup", "build", "push", "ucx")
    )
    args = parser.parse_args(argv)
    sections = set(args.only or ("setup", "build", "push", "ucx"))
    pairs = QUICK_PAIRS if args.quick else PAIRS
    traces = ["vllm033-lru"] if args.quick else list(TRACES)
    per_bucket = 1 if args.quick else args.per_bucket
    ucx_per_bucket = 1 if args.quick else args.ucx_per_bucket
    rounds = 3 if args.quick else args.rounds
    seconds = 0.01 if args.quick else args.seconds
    ptrres.warmup()
    started = time.monotonic()
    print(
        f"Load average {load_average()} ({os.cpu_count()} CPUs, shared with other "
        f"work), Python {platform.python_version()}. Decode rank D-1 of each "
        "pair (a push: prefill rank P-1); K and V separate refs, HND pages, 8 KV "
        "heads; times in us."
        + (" Quick run: two pairs, one trace, short timings." if args.quick else "")
    )
    if "setup" in sections:
        run_setup(pairs, seconds, rounds)
    if "build" in sections:
        run_build(pairs, traces, per_bucket, seconds, rounds)
    if "push" in sections:
        run_push(pairs, traces, per_bucket, seconds, rounds)
    if "ucx" in sections:
        ucx_traces = ["vllm033-lru"] if args.quick else args.ucx_trace
        ucx_rounds = 1 if args.quick else args.ucx_rounds
        run_ucx(
            pairs,
            ucx_traces or ["vllm033-lru"],
            ucx_per_bucket,
            ucx_rounds,
            args.page_divisor,
        )
    print(
        f"\nLoad average at the end {load_average()}; "
        f"{time.monotonic() - started:.0f} s."
    )


if __name__ == "__main__":
    main()
