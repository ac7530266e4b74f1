"""ptrres.push_mapping against vLLM's own push worker (issue 40, SPEC 15),
with the head oracle (tests/head_oracle.py) as the judge.

vLLM's NIXL connector pushes in ``nixl/push_worker.py``: a prefill rank
handshakes with the decode ranks ``TransferTopology.handshake_target_ranks``
names, validates each (``_validate_remote_agent_handshake``), maps them with
``compute_tp_mapping`` seen from its own side, prepares its local list
(``_build_fa_local``, split per target rank by
``_build_local_splits_from_plan`` where decode TP is larger) and each decode
rank's list (``_build_fa_remote``), as ``add_remote_agent`` does; then per
request ``_do_start_push_kv`` takes the decode engine's registration and
``_xfer_blocks_for_req`` WRITEs every target rank (every handshaked decode
rank with MLA: "otherwise the rest decode stale KV"), each through
``_xfer_blocks``: ``_apply_prefix_caching`` (the prefill ids end-trimmed to
the decode engine's uncached blocks), ``_compute_desc_ids`` on both sides,
``make_prepped_xfer("WRITE", ...)``. This file runs that code of the
installed release on a bare push worker (``object.__new__``, the attributes
its code reads) whose NIXL is a recorder: the prepared lists it is given and
each WRITE it is asked for, which this file reads back as byte copies (target
rank, prefill block, decode block, offset in each page, lengths).

Releases 0.30 to 0.34 all have this push path at different TP: the same
``_do_start_push_kv``, the same write-rank and split-handle choice in
``_xfer_blocks_for_req``; they differ in how ``_xfer_blocks`` pairs regions
(``region_group_ids`` up to 0.33, ``_RegionPairs`` in 0.34). So nothing is
skipped on any of them.

The grid is issue 34's: prefill TP and decode TP in {1, 2, 4, 8}, total KV
heads in {1, 2, 4, 8, 16}, every prefill rank, MLA or not; each push is a
partial prefix hit (5 prefill blocks of the request, the decode engine
holding the first 2). Per case both sides' copies are compared, and per
engine pair the oracle executes every prefill rank's copies on pages that
hold the shards of one logical KV and judges every decode rank's pages. The
test encodes what holds (test_summary prints the figures): vLLM's handshake
refuses a decode TP above both the prefill TP and the KV heads (decode
replicas of a head), which ptrres writes, every replica; where a prefill
replica holds a head another prefill rank writes (prefill TP above the heads,
or MLA with prefill TP above decode TP), vLLM writes it again, the same bytes
into the same place, where ptrres writes it once; everywhere else the copies
are equal.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import pytest

# Where vLLM is missing, "vllm" would be found as tests/vllm (a namespace
# package): skip there; where it is installed, its NIXL modules must import.
pytest.importorskip("vllm.v1")
import vllm
from head_oracle import logical_kv, rank_pages, shard
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

import ptrres
import ptrres.vllm

# vLLM's modules, untyped: what they hold differs between the releases.
NIXL_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
base_worker: Any = importlib.import_module(f"{NIXL_PACKAGE}.base_worker")
push_worker: Any = importlib.import_module(f"{NIXL_PACKAGE}.push_worker")
vllm_mapping: Any = importlib.import_module(f"{NIXL_PACKAGE}.tp_mapping")
connector_utils: Any = importlib.import_module(
    "vllm.distributed.kv_transfer.kv_connector.utils"
)

# The tested release series of the installed vLLM ("0.34" for 0.34.0).
RELEASE = ".".join(vllm.__version__.split(".")[:2])
# 0.34 pairs regions by layer (_RegionPairs); before, by region_group_ids.
PAIRS_REGIONS = RELEASE not in ("0.30", "0.31", "0.32", "0.33")

TP_SIZES = (1, 2, 4, 8)
KV_HEADS = (1, 2, 4, 8, 16)
TOKENS = 2  # tokens per block
HEAD_BYTES = 24  # bytes of one head of one token
PAGE_HEAD = TOKENS * HEAD_BYTES  # bytes of one head in a page (HND)
NUM_BLOCKS = 6  # blocks per region, on both engines
BLOCK_SIZE = 16  # vLLM's block size (tokens), the same on both engines
LOCAL_BASE = 1 << 20  # the prefill rank's region
REMOTE_BASE = 1 << 24  # each decode rank's region
DECODE, PREFILL = "decode-engine", "prefill-engine"
# The request's blocks on the prefill engine, and the decode engine's blocks
# of the part it has not cached (it holds the first 2 of the 5): a prefix hit.
REQUEST = [4, 3, 0, 1, 2]
UNCACHED = [2, 5, 1]
# vLLM's refusal this file encodes, as _validate_remote_agent_handshake
# asserts it (the prefill rank local, the decode engine remote).
VLLM_REFUSAL = "tp_ratio < 0 and self.transfer_topo.is_kv_replicated(remote_engine_id)"


class Case(NamedTuple):
    """Prefill rank ``tp_rank`` of ``prefill_tp`` pushing to a decode engine
    at ``decode_tp``, for a model of ``num_kv_heads`` KV heads."""

    prefill_tp: int
    decode_tp: int
    num_kv_heads: int
    mla: bool
    tp_rank: int

    def __str__(self) -> str:
        kind = "MLA" if self.mla else f"{self.num_kv_heads} KV heads"
        return (
            f"prefill TP {self.prefill_tp} rank {self.tp_rank} -> decode TP "
            f"{self.decode_tp}, {kind}"
        )


class Copy(NamedTuple):
    """One byte copy of a WRITE: ``local_len`` bytes of prefill block
    ``block``'s page at ``local_offset`` into ``remote_len`` bytes of decode
    rank ``target_rank``'s block ``remote_block`` at ``remote_offset``."""

    target_rank: int
    block: int
    remote_block: int
    local_offset: int
    remote_offset: int
    local_len: int
    remote_len: int


def engine_pairs() -> list[tuple[int, int, int, bool]]:
    """(prefill TP, decode TP, KV heads, MLA) of issue 34's grid."""
    return list(itertools.product(TP_SIZES, TP_SIZES, KV_HEADS, (False, True)))


def page(rank: int, tp_size: int, heads: int, mla: bool) -> int:
    """Bytes of one page of ``rank`` at ``tp_size``: its heads (the oracle's
    shard), HND; with MLA the whole latent page on every rank."""
    return len(shard(rank, tp_size, heads, mla)) * PAGE_HEAD


@pytest.fixture(autouse=True)
def _vllms_own_code() -> Iterator[None]:
    """vLLM as it ships: ptrres's patch off (its NIXL descriptor ids are
    ptrres's own when on), and the functions driven vLLM's."""
    ptrres.vllm.unpatch()
    for cls, name in (
        (base_worker.NixlBaseConnectorWorker, "_compute_desc_ids"),
        (push_worker.NixlPushConnectorWorker, "_xfer_blocks"),
        (push_worker.NixlPushConnectorWorker, "_xfer_blocks_for_req"),
    ):
        assert getattr(cls, name).__module__.startswith(NIXL_PACKAGE), name
    yield
    ptrres.vllm.unpatch()


# --- vLLM: a bare push worker and a recording NIXL -----------------------------


class RecordingNixl:
    """What the push worker's NIXL wrapper is asked: prepared lists (their
    rows kept, a handle each) and prepared WRITEs (recorded)."""

    def __init__(self) -> None:
        self.lists: list[tuple[str, Any]] = []
        self.writes: list[tuple[str, int, Any, int, Any]] = []

    def prep_xfer_dlist(self, agent_name: str, rows: Any, **_: Any) -> int:
        self.lists.append((agent_name, np.asarray(rows, dtype=np.uint64)))
        return len(self.lists) - 1

    def make_prepped_xfer(
        self,
        op: str,
        local_handle: int,
        local_ids: Any,
        remote_handle: int,
        remote_ids: Any,
        notif_msg: Any = None,
    ) -> int:
        self.writes.append((op, local_handle, local_ids, remote_handle, remote_ids))
        return len(self.writes)

    def transfer(self, handle: int) -> str:
        return "PROC"


def topology(case: Case) -> Any:
    """The prefill rank's TransferTopology, as register_kv_caches builds it
    (one KV head for MLA), the decode engine registered as add_remote_agent
    registers it."""
    topo = connector_utils.TransferTopology(
        tp_rank=case.tp_rank,
        tp_size=case.prefill_tp,
        block_size=BLOCK_SIZE,
        engine_id=PREFILL,
        is_mla=case.mla,
        is_mamba=False,
        total_num_kv_heads=1 if case.mla else case.num_kv_heads,
        attn_backends=[],
    )
    topo.register_remote_engine(
        DECODE,
        connector_utils.EngineTransferInfo(
            remote_tp_size=case.decode_tp,
            remote_block_len=page(0, case.decode_tp, case.num_kv_heads, case.mla),
            remote_block_size=BLOCK_SIZE,
            remote_physical_blocks_per_logical=1,
        ),
    )
    return topo


def handshake(case: Case, rank: int) -> Any:
    """Decode rank ``rank``'s NixlAgentMetadata fields: one region (one
    attention layer) of NUM_BLOCKS pages, HND (vLLM's LBHNC)."""
    decode_page = page(rank, case.decode_tp, case.num_kv_heads, case.mla)
    return SimpleNamespace(
        engine_id=DECODE,
        agent_metadata=b"",
        kv_caches_base_addr=[REMOTE_BASE],
        device_id=0,
        num_blocks=NUM_BLOCKS,
        block_lens=[decode_page],
        block_strides=[decode_page],
        kv_cache_layout="LBHNC",
        block_size=BLOCK_SIZE,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=[NUM_BLOCKS],
        region_group_ids=[0],
        region_names=["layer.0"],
        region_mem_types=["DRAM"],
        dcp_size=1,
        pcp_size=1,
        ple_block_len=None,
        region_members=[["layer.0"]],
        layer_group_ids={"layer.0": 0},
        packed_member_layouts={},
    )


def push_worker_of(case: Case, topo: Any, nixl: RecordingNixl) -> Any:
    """A never-initialised push worker of the release holding what its
    handshake checks, descriptor builders and push path read (each release
    reads some of these), for one region of NUM_BLOCKS pages."""
    cls = push_worker.NixlPushConnectorWorker
    # vLLM's __del__ shuts NIXL down, which a bare worker never started.
    bare = type("BarePushWorker", (cls,), {"__del__": lambda self: None})
    w: Any = object.__new__(bare)
    local_page = page(case.tp_rank, case.prefill_tp, case.num_kv_heads, case.mla)
    attributes: dict[str, Any] = {
        "transfer_topo": topo,
        "engine_id": PREFILL,
        "world_size": case.prefill_tp,
        "tp_rank": case.tp_rank,
        "nixl_wrapper": nixl,
        "use_mla": case.mla,
        "_has_mamba": False,
        "_is_csa_linear": False,
        "_group_spec_types": (MLAAttentionSpec,) if case.mla else (FullAttentionSpec,),
        "_region_is_mla": [case.mla],
        "block_len_per_layer": [local_page],
        "block_stride_per_layer": [local_page],
        "region_num_blocks": [NUM_BLOCKS],
        "num_regions": 1,
        "num_blocks": NUM_BLOCKS,
        "num_descs": NUM_BLOCKS,
        "_logical_num_blocks": NUM_BLOCKS,
        "device_id": 0,
        "block_size": BLOCK_SIZE,
        "_physical_blocks_per_logical_kv_block": 1,
        # Regions and groups: one region of group 0 on both sides.
        "region_group_ids": [0],
        "region_names": ["layer.0"],
        "_uses_region_group_mapping": False,
        "_transfer_layer_group_ids": [],
        "_transfer_layer_region_indices": [],
        "_transfer_layer_names": [],
        "_scratch_region_indices": [],
        "_ssm_region_indices": [],
        "_conv_decomp": None,
        "_ple_region_index": None,
        "_ple_group_index": None,
        "_head_sharded_draft_regions": set(),
        "_head_sharded_draft_kv_heads": None,
        "draft_tp_mappings": {},
        "_dcp_replicated_groups": set(),
        "_is_hma_required": False,
        "_layer_specs": {},
        "dcp_size": 1,
        "pcp_size": 1,
        "use_host_buffer": False,
        "kv_cache_layout": "LBHNC",
        "host_buffer_kv_cache_layout": "LBHNC",
        "kv_transfer_config": SimpleNamespace(enable_permute_local_kv=False),
        "enable_permute_local_kv": False,
        "backend_name": "FLASH_ATTN",
        "vllm_config": SimpleNamespace(
            cache_config=SimpleNamespace(enable_prefix_caching=True)
        ),
        # The decode engine, as add_remote_agent records it.
        "tp_mappings": {},
        "dst_num_blocks": {DECODE: NUM_BLOCKS, PREFILL: NUM_BLOCKS},
        "dst_region_num_blocks": {DECODE: [NUM_BLOCKS], PREFILL: [NUM_BLOCKS]},
        "dst_region_group_ids": {DECODE: [0]},
        "dst_uses_region_group_mapping": {DECODE: False},
        "dst_xfer_side_handles": defaultdict(dict),
        "src_xfer_handles_by_block_size": {},
        "src_xfer_handles_by_tp_ratio": {},
        # The handshake done, the engine fresh: _ensure_handshake passes.
        "_remote_agents": {DECODE: {}},
        "_handshake_lock": threading.Lock(),
        "_handshake_futures": {},
        "_engine_ttl": 0,
        "_engine_last_active": {},
        "_recving_transfers": {},
        "_recving_metadata": {},
        # Where the push path files its WRITE handles.
        "_sending_transfers": defaultdict(list),
        "_sending_transfers_lock": threading.Lock(),
        "_send_failures": set(),
    }
    if PAIRS_REGIONS:
        attributes["_dst_pairs"] = {
            DECODE: base_worker._RegionPairs(
                remote=[0], local=[0], group=[0], remote_regions=[0], partner=[0]
            )
        }
    w.__dict__.update(attributes)
    return w


class VllmPush(NamedTuple):
    """A prefill rank's push as vLLM makes it: its copies, or why its
    handshake refuses the decode engine."""

    copies: tuple[Copy, ...]
    refusal: str
    plan: Any


def vllm_push(case: Case) -> VllmPush:
    """The release's handshake and push path for one prefill rank: the
    copies its WRITEs make, read back from the recorded lists and ids."""
    topo = topology(case)
    nixl = RecordingNixl()
    w = push_worker_of(case, topo, nixl)
    targets = topo.handshake_target_ranks(case.decode_tp)
    try:
        for rank in targets:
            w._validate_remote_agent_handshake(handshake(case, rank), case.decode_tp)
    except (AssertionError, RuntimeError, NotImplementedError) as error:
        return VllmPush((), f"{type(error).__name__}: {error}", None)
    plan = vllm_mapping.compute_tp_mapping(topo, case.decode_tp, w._group_spec_types)
    w.tp_mappings[DECODE] = plan
    # add_remote_agent's lists: the local one (split per target where the
    # decode TP is larger), then each decode rank's.
    local = w._build_fa_local([LOCAL_BASE], 1)
    w.src_xfer_handles_by_block_size[BLOCK_SIZE] = nixl.prep_xfer_dlist(
        "NIXL_INIT_AGENT", local
    )
    tp_ratio = topo.tp_ratio(case.decode_tp)
    if w._needs_split_local_xfer_handles(tp_ratio, plan):
        w.src_xfer_handles_by_tp_ratio[tp_ratio, BLOCK_SIZE] = [
            nixl.prep_xfer_dlist("NIXL_INIT_AGENT", rows)
            for rows in w._build_local_splits_from_plan(plan, local, NUM_BLOCKS, 1)
        ]
    for rank in targets:
        w._remote_agents[DECODE][0, rank] = f"decode-{rank}"
        w.dst_xfer_side_handles[DECODE][rank] = nixl.prep_xfer_dlist(
            f"decode-{rank}", w._build_fa_remote(plan, handshake(case, rank), 1)
        )
    # The decode engine's registration (PUSH_REG), for the request's blocks.
    registration = {
        "decode_engine_id": DECODE,
        "local_block_ids": [list(UNCACHED)],
        "request_id": "request-at-decode",
        "decode_host": "127.0.0.1",
        "decode_port": 0,
        "decode_tp_size": case.decode_tp,
    }
    w._do_start_push_kv("request", [list(REQUEST)], registration)
    handles = w._sending_transfers.get("request", [])
    assert len(handles) == len(nixl.writes), case
    return VllmPush(tuple(read_back(case, nixl)), "", plan)


def rows_of(rows: Any, index: int) -> tuple[int, int]:
    """``(address, length)`` of descriptor ``index`` of a release's list:
    Nx3 ``(addr, len, dev)`` one a block (0.30 to 0.32), or Nx5 strided
    ``(addr, len, dev, stride, count)`` (0.33 on)."""
    if rows.shape[1] == 3:
        return int(rows[index][0]), int(rows[index][1])
    for addr, length, _, stride, count in rows.tolist():
        if index < count:
            return addr + index * stride, length
        index -= count
    raise IndexError(index)


def read_back(case: Case, nixl: RecordingNixl) -> list[Copy]:
    """The copies of the recorded WRITEs: each index pair's descriptors,
    as offsets into the two pages of their blocks."""
    local_page = page(case.tp_rank, case.prefill_tp, case.num_kv_heads, case.mla)
    copies = []
    for op, local_handle, local_ids, remote_handle, remote_ids in nixl.writes:
        assert op == "WRITE"
        target = int(nixl.lists[remote_handle][0].split("-")[1])
        remote_page = page(target, case.decode_tp, case.num_kv_heads, case.mla)
        local_rows, remote_rows = (
            nixl.lists[local_handle][1],
            nixl.lists[remote_handle][1],
        )
        for i, j in zip(
            np.asarray(local_ids).tolist(), np.asarray(remote_ids).tolist()
        ):
            la, ln = rows_of(local_rows, i)
            ra, rn = rows_of(remote_rows, j)
            block, remote_block = (
                (la - LOCAL_BASE) // local_page,
                (ra - REMOTE_BASE) // remote_page,
            )
            copies.append(
                Copy(
                    target,
                    block,
                    remote_block,
                    la - LOCAL_BASE - block * local_page,
                    ra - REMOTE_BASE - remote_block * remote_page,
                    ln,
                    rn,
                )
            )
    return copies


# --- ptrres -----------------------------------------------------------------


def ptrres_push(case: Case) -> tuple[Copy, ...]:
    """ptrres's copies: per slice of push_mapping(), HeadSlice.byte_range of
    the two ranks' pages, for the request's uncached_suffix() against the
    decode engine's blocks."""
    mapping = ptrres.push_mapping(
        case.tp_rank, case.prefill_tp, case.decode_tp, case.num_kv_heads, mla=case.mla
    )
    suffix = ptrres.uncached_suffix(ptrres.GPULoadStoreSpec(REQUEST), [len(UNCACHED)])
    local_page = page(case.tp_rank, case.prefill_tp, case.num_kv_heads, case.mla)
    copies = []
    for s in mapping.slices:
        remote_page = page(s.source_rank, case.decode_tp, case.num_kv_heads, case.mla)
        local_offset, remote_offset, size = s.byte_range(local_page, remote_page)
        copies += [
            Copy(s.source_rank, block, remote, local_offset, remote_offset, size, size)
            for block, remote in zip(suffix.block_ids.tolist(), UNCACHED)
        ]
    return tuple(copies)


# --- the oracle -------------------------------------------------------------


def judge_engines(
    pair: tuple[int, int, int, bool], pushes: dict[int, tuple[Copy, ...]]
) -> str:
    """The oracle on one engine pair: every prefill rank's copies (by rank),
    run on pages that hold the oracle's shards of one logical KV; ``"ok"``
    where every decode rank's uncached blocks hold exactly its own shard of
    the request's last blocks, each byte written once; ``"ok, N B written
    more than once"`` where some bytes are written again (the same bytes
    into the same place); else what goes wrong."""
    prefill_tp, decode_tp, heads, mla = pair
    logical = logical_kv(NUM_BLOCKS, heads, TOKENS, HEAD_BYTES, seed=sum(pair))
    sources = [
        rank_pages(logical, shard(p, prefill_tp, heads, mla)) for p in range(prefill_tp)
    ]
    kept = REQUEST[len(REQUEST) - len(UNCACHED) :]
    problems: list[str] = []
    again = 0
    for d in range(decode_tp):
        want_heads = shard(d, decode_tp, heads, mla)
        expected = rank_pages(logical, want_heads)
        got = np.zeros((NUM_BLOCKS, expected.shape[1]), np.uint8)
        writes = np.zeros(got.shape, np.int64)
        for p, copies in pushes.items():
            for c in copies:
                if c.target_rank != d:
                    continue
                source = sources[p]
                end, stop = c.local_offset + c.local_len, c.remote_offset + c.remote_len
                if (
                    c.local_len != c.remote_len
                    or end > source.shape[1]
                    or (stop > got.shape[1])
                ):
                    problems.append(f"prefill rank {p}: a copy outside a page: {c}")
                    continue
                got[c.remote_block, c.remote_offset : stop] = source[
                    c.block, c.local_offset : end
                ]
                writes[c.remote_block, c.remote_offset : stop] += 1
        for block, source_block in zip(UNCACHED, kept):
            if (writes[block] == 0).any():
                problems.append(f"decode rank {d}: block {block} not all written")
            elif not np.array_equal(got[block], expected[source_block]):
                problems.append(f"decode rank {d}: block {block} holds other bytes")
        again += int(np.clip(writes - 1, 0, None).sum())
        others = [b for b in range(NUM_BLOCKS) if b not in UNCACHED]
        if writes[others].any():
            problems.append(f"decode rank {d}: a block outside the request written")
    if problems:
        return "; ".join(problems[:3])
    return f"ok, {again} B written more than once" if again else "ok"


# --- the grid ---------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One engine pair, every prefill rank on both sides, and the oracle."""

    pair: tuple[int, int, int, bool]
    vllm: dict[int, VllmPush]
    ptrres: dict[int, tuple[Copy, ...]]
    vllm_verdict: str  # "" where vLLM refuses
    ptrres_verdict: str

    @property
    def vllm_refuses(self) -> bool:
        return any(push.refusal for push in self.vllm.values())

    def agreeing_ranks(self) -> list[int]:
        return [
            p
            for p, push in self.vllm.items()
            if not push.refusal and sorted(push.copies) == sorted(self.ptrres[p])
        ]

    @property
    def agree(self) -> bool:
        return len(self.agreeing_ranks()) == len(self.vllm)


def judge(pair: tuple[int, int, int, bool]) -> Outcome:
    prefill_tp, decode_tp, heads, mla = pair
    cases = [Case(prefill_tp, decode_tp, heads, mla, p) for p in range(prefill_tp)]
    theirs = {case.tp_rank: vllm_push(case) for case in cases}
    ours = {case.tp_rank: ptrres_push(case) for case in cases}
    refused = any(push.refusal for push in theirs.values())
    return Outcome(
        pair,
        theirs,
        ours,
        ""
        if refused
        else judge_engines(pair, {p: t.copies for p, t in theirs.items()}),
        judge_engines(pair, ours),
    )


@functools.cache
def outcomes() -> tuple[Outcome, ...]:
    return tuple(judge(pair) for pair in engine_pairs())


def summary() -> str:
    """The figures: engine pairs and prefill ranks, refusals, agreement, and
    how the pairs that differ differ, with the oracle's verdicts."""
    all_ = outcomes()
    ranks = sum(len(o.vllm) for o in all_)
    refused = [o for o in all_ if o.vllm_refuses]
    accepted = [o for o in all_ if not o.vllm_refuses]
    differing = [o for o in accepted if not o.agree]
    lines = [
        f"vLLM {vllm.__version__} push: {len(all_)} engine pairs, {ranks} prefill "
        f"ranks (prefill TP x decode TP in {list(TP_SIZES)}^2, KV heads "
        f"{list(KV_HEADS)}, MLA or not; a prefix hit of 2 of 5 blocks)",
        f"ptrres refuses none; the oracle accepts ptrres's pushes on "
        f"{sum(o.ptrres_verdict == 'ok' for o in all_)} pairs, every byte once",
        f"vLLM's handshake refuses {len(refused)} pairs "
        f"({sum(len(o.vllm) for o in refused)} prefill ranks): decode TP above "
        "the prefill TP and the KV heads, not MLA; ptrres writes every replica",
        f"both push {len(accepted)} pairs ({sum(len(o.vllm) for o in accepted)} "
        f"prefill ranks): equal copies on {len(accepted) - len(differing)} pairs "
        f"({sum(len(o.agreeing_ranks()) for o in accepted)} ranks); differ on "
        f"{len(differing)}",
    ]
    by_tp: dict[tuple[int, int], list[Outcome]] = {}
    for o in differing:
        by_tp.setdefault(o.pair[:2], []).append(o)
    for (p_tp, d_tp), found in sorted(by_tp.items()):
        kinds = [f"{o.pair[2]} KV heads" for o in found if not o.pair[3]]
        kinds += ["MLA"] if any(o.pair[3] for o in found) else []
        verdicts = sorted({o.vllm_verdict.split(",")[0] for o in found})
        extra = sorted({len(o.vllm) - len(o.agreeing_ranks()) for o in found})
        lines.append(
            f"  prefill TP {p_tp} -> decode TP {d_tp} ({', '.join(kinds)}): "
            f"{'/'.join(map(str, extra))} of {p_tp} prefill ranks write heads "
            f"another rank writes; oracle on vLLM: {', '.join(verdicts)}, bytes "
            "written more than once; on ptrres: "
            + ", ".join(sorted({o.ptrres_verdict for o in found}))
        )
    return "\n".join(lines)


# --- tests ------------------------------------------------------------------


def test_release_has_the_push_path() -> None:
    """What this file drives is there, as it reads it, on every release:
    the push worker's entry points, MLA's write to every handshaked rank,
    the end-trim of a prefix hit, and the handshake's refusal."""
    cls = push_worker.NixlPushConnectorWorker
    source = " ".join(inspect.getsource(cls._xfer_blocks_for_req).split())
    assert "replicate_attn = self.use_mla and tp_ratio < 0" in source
    assert "write_ranks = sorted(self.dst_xfer_side_handles[engine_id])" in source
    assert "self.src_xfer_handles_by_tp_ratio[split_key][i]" in source
    trim = " ".join(inspect.getsource(cls._apply_prefix_caching).split())
    assert "prefill_group[-num_decode_blocks:]" in trim
    check = inspect.getsource(
        base_worker.NixlBaseConnectorWorker._validate_remote_agent_handshake
    )
    assert VLLM_REFUSAL in " ".join(check.split())


def test_the_copies_are_vllms_mapping() -> None:
    """vLLM's WRITEs follow its mapping: the ranks it writes are the
    mapping's source ranks (every handshaked decode rank with MLA and a
    larger decode TP), as this file reads them."""
    for o in outcomes():
        for p, push in o.vllm.items():
            if push.refusal:
                continue
            written = sorted({c.target_rank for c in push.copies})
            _, decode_tp, _, mla = o.pair
            if mla and decode_tp > o.pair[0]:
                expected = topology(Case(*o.pair, p)).handshake_target_ranks(decode_tp)
            else:
                expected = list(push.plan.all_source_ranks)
            assert written == sorted(expected), (o.pair, p)


def test_refusals() -> None:
    """ptrres refuses none of the grid; vLLM's handshake refuses exactly a
    decode TP above both the prefill TP and the KV heads, without MLA (the
    decode ranks that replicate a head), which ptrres writes, each replica,
    and the oracle accepts."""
    refused = {o.pair for o in outcomes() if o.vllm_refuses}
    assert refused == {
        (p, d, h, mla) for p, d, h, mla in engine_pairs() if not mla and d > max(p, h)
    }
    for o in outcomes():
        if o.vllm_refuses:
            assert all("AssertionError" in push.refusal for push in o.vllm.values()), (
                o.pair
            )
            assert o.ptrres_verdict == "ok", o.pair


def test_ptrres_agrees_with_the_oracle() -> None:
    """On every engine pair, ptrres's pushes leave every decode rank's
    uncached blocks holding exactly its shard of the request's last blocks,
    every byte written once."""
    wrong = [(o.pair, o.ptrres_verdict) for o in outcomes() if o.ptrres_verdict != "ok"]
    assert wrong == []


def test_vllm_against_ptrres_and_the_oracle() -> None:
    """Where vLLM pushes, its copies equal ptrres's on every prefill rank,
    but where a prefill rank holds a head (or an MLA page) an earlier rank
    writes: vLLM writes it again (the same bytes into the same place), which
    ptrres leaves out. Those ranks' copies are duplicates of ptrres's, and
    the oracle accepts vLLM's bytes, with the bytes written more than once."""
    for o in outcomes():
        if o.vllm_refuses:
            continue
        prefill_tp, decode_tp, heads, mla = o.pair
        # Prefill ranks that write into one decode rank hold the same heads.
        replicas = prefill_tp > decode_tp and (mla or prefill_tp > heads)
        if not replicas:
            assert o.agree, o.pair
            assert o.vllm_verdict == "ok", o.pair
            continue
        ours = {c for copies in o.ptrres.values() for c in copies}
        for p, push in o.vllm.items():
            if p in o.agreeing_ranks():
                continue
            # What a replica writes is what the rank it replicates writes.
            assert o.ptrres[p] == (), (o.pair, p)
            assert set(push.copies) <= ours, (o.pair, p)
        assert o.vllm_verdict.startswith("ok, "), (o.pair, o.vllm_verdict)


def test_a_prefix_hit_is_end_trimmed_as_uncached_suffix_cuts() -> None:
    """vLLM's _apply_prefix_caching keeps the end of each prefill group, as
    uncached_suffix does; with no uncached block in a group (a full hit
    there) it keeps the whole group (``[-0:]``), and its own count check then
    fails the push, where uncached_suffix keeps none."""
    w = push_worker_of(
        Case(1, 1, 4, False, 0), topology(Case(1, 1, 4, False, 0)), RecordingNixl()
    )
    decode, prefill = [[7, 8], [9]], [[0, 1, 2, 3], [4, 5]]
    _, trimmed = w._apply_prefix_caching(decode, prefill, 1, 1)
    spec = ptrres.GPULoadStoreSpec([0, 1, 2, 3, 4, 5], [4, 2])
    suffix = ptrres.uncached_suffix(spec, [2, 1])
    assert [list(g) for g in trimmed] == [[2, 3], [5]]
    assert suffix.block_ids.tolist() == [2, 3, 5]
    _, whole = w._apply_prefix_caching([[], [9]], prefill, 1, 1)
    assert [list(g) for g in whole] == [[0, 1, 2, 3], [5]]
    assert ptrres.uncached_suffix(spec, [0, 1]).block_ids.tolist() == [5]


def test_the_oracle_rejects_wrong_pushes() -> None:
    """The judge has teeth: every prefill rank's copies at the first head
    slot of its decode page (MoRIIO #47764's kind), a push of the request's
    front (vLLM #48758's kind), and only the first replica of a decode head
    written, are each rejected."""
    for o in outcomes():
        prefill_tp, decode_tp, heads, mla = o.pair
        if mla or prefill_tp <= decode_tp or heads < prefill_tp:
            continue
        first_slot = {
            p: tuple(c._replace(remote_offset=0) for c in copies)
            for p, copies in o.ptrres.items()
        }
        assert judge_engines(o.pair, first_slot) != "ok", o.pair
    o = next(o for o in outcomes() if o.pair == (2, 1, 4, False))
    kept = REQUEST[len(REQUEST) - len(UNCACHED) :]
    front = {
        p: tuple(c._replace(block=REQUEST[kept.index(c.block)]) for c in copies)
        for p, copies in o.ptrres.items()
    }
    assert judge_engines(o.pair, front) != "ok"
    o = next(o for o in outcomes() if o.pair == (1, 4, 2, False))
    first_replica = {
        p: tuple(c for c in copies if c.target_rank % 2 == 0)
        for p, copies in o.ptrres.items()
    }
    assert "not all written" in judge_engines(o.pair, first_replica)


def test_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """The summary adds up, and is printed (in pytest's output, captured or
    not)."""
    text = summary()
    with capsys.disabled():
        print("\n" + text)
    all_ = outcomes()
    assert len(all_) == len(TP_SIZES) ** 2 * len(KV_HEADS) * 2
    differing = {o.pair[:2] for o in all_ if not o.vllm_refuses and not o.agree}
    assert len(text.splitlines()) == 4 + len(differing)
