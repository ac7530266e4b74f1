"""ptrres.tp_mapping against vLLM's own different-TP math (issue 34, SPEC 15),
with the head oracle (tests/head_oracle.py) as the judge.

vLLM's NIXL connector (0.30 to 0.34) maps a decode rank to the prefill ranks
it reads in ``nixl/tp_mapping.py``'s ``compute_tp_mapping`` (0.33 moves the
offset into ``compute_head_offset``) and turns the mapping into descriptors
in ``base_worker``: the local page (``_build_fa_local``), split per source
rank at its head slot where the prefill TP is larger
(``_build_local_splits_from_plan``), and the remote page read at
``rank_offset_factor * local_page`` for ``local_page / reads`` bytes
(``_build_fa_remote``). This file runs those functions of the installed
release, on its real ``TransferTopology``, over the grid of issue 34: decode
TP and prefill TP in {1, 2, 4, 8}, total KV heads in {1, 2, 4, 8, 16}, every
decode rank, MLA or not.

Per case, each side's answer is a list of byte copies (source rank, block,
local offset, remote offset, lengths), and the oracle executes it: every
prefill rank's pages are its shard of one logical KV of random bytes, and the
decode rank's pages must come out as its own shard, every byte written once,
no copy outside a page. The test encodes what holds: ptrres always agrees
with the oracle; vLLM's copies equal ptrres's exactly where the oracle
accepts vLLM's, and each case where they differ is listed with the oracle's
verdict. Combinations either side refuses are listed as such: vLLM's
handshake (``_validate_remote_agent_handshake``) refuses a prefill TP larger
than both the decode TP and the KV heads for a model that is neither MLA nor
hybrid with Mamba; ptrres refuses none of this grid. test_summary prints the
figures.

Then the handshakes each release writes (issue 40), one per KV-cache layout,
built by the release's own code (tests/vllm/handshakes.py): read by
PeerLayout.from_nixl_metadata as sent, and the bytes they describe moved
between engines of different TP where a run of heads is one byte range of a
page (LBHNC, BLHNC), refused elsewhere, and moved whole at equal TP on every
layout.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import pytest

# Where vLLM is missing, "vllm" would be found as tests/vllm (a namespace
# package): skip there; where it is installed, its NIXL modules must import.
pytest.importorskip("vllm.v1")
import handshakes
import torch
import vllm
from head_oracle import logical_kv, rank_pages, shard
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

import ptrres
from ptrres import reference

# vLLM's modules, untyped: what they hold differs between the releases.
NIXL_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
vllm_mapping: Any = importlib.import_module(f"{NIXL_PACKAGE}.tp_mapping")
base_worker: Any = importlib.import_module(f"{NIXL_PACKAGE}.base_worker")
connector_utils: Any = importlib.import_module(
    "vllm.distributed.kv_transfer.kv_connector.utils"
)

# The tested release series of the installed vLLM ("0.33" for 0.33.0).
RELEASE = ".".join(vllm.__version__.split(".")[:2])

# compute_tp_mapping's parameters in each release; compute_head_offset is
# 0.33's (before, compute_tp_mapping computes the same offset inline).
MAPPING_PARAMETERS = {
    "0.30": ["transfer_topology", "remote_tp_size", "group_spec_types"],
    "0.31": ["transfer_topology", "remote_tp_size", "group_spec_types"],
    "0.32": ["transfer_topology", "remote_tp_size", "group_spec_types"],
    "0.33": [
        "transfer_topology",
        "remote_tp_size",
        "group_spec_types",
        "head_sharded_kv_heads",
    ],
}
# 0.34's tp_mapping.py is 0.33's, unchanged.
MAPPING_PARAMETERS["0.34"] = MAPPING_PARAMETERS["0.33"]
HAS_HEAD_OFFSET = {
    "0.30": False,
    "0.31": False,
    "0.32": False,
    "0.33": True,
    "0.34": True,
}

TP_SIZES = (1, 2, 4, 8)
KV_HEADS = (1, 2, 4, 8, 16)
TOKENS = 2  # tokens per block
HEAD_BYTES = 24  # bytes of one head of one token
PAGE_HEAD = TOKENS * HEAD_BYTES  # bytes of one head in a page (HND)
NUM_BLOCKS = 3  # blocks per region, on both engines
BLOCK_SIZE = 16  # vLLM's block size (tokens), the same on both engines
LOCAL_BASE = 1 << 20  # the decode rank's region
REMOTE_BASE = 1 << 24  # each prefill rank's region
DECODE, PREFILL = "decode-engine", "prefill-engine"
# vLLM's refusal this file encodes, as _validate_remote_agent_handshake
# asserts it.
VLLM_REFUSAL = "tp_ratio < 0 and self.transfer_topo.is_kv_replicated(remote_engine_id)"


class Case(NamedTuple):
    """A decode rank (``tp_rank`` of ``tp_size``) reading from a prefill
    engine at ``remote_tp_size``, for a model of ``num_kv_heads`` KV heads."""

    tp_size: int
    remote_tp_size: int
    num_kv_heads: int
    tp_rank: int
    mla: bool

    def __str__(self) -> str:
        kind = "MLA" if self.mla else f"{self.num_kv_heads} KV heads"
        return (
            f"prefill TP {self.remote_tp_size} -> decode TP {self.tp_size} "
            f"rank {self.tp_rank}, {kind}"
        )


class Copy(NamedTuple):
    """One byte copy: ``remote_len`` bytes of block ``block`` of prefill rank
    ``source_rank``'s page, at ``remote_offset``, into ``local_len`` bytes of
    the decode rank's page, at ``local_offset`` (a NIXL descriptor pair)."""

    source_rank: int
    block: int
    local_offset: int
    remote_offset: int
    local_len: int
    remote_len: int


def grid() -> list[Case]:
    """Issue 34's grid: every decode rank of every combination."""
    return [
        Case(tp, remote, heads, rank, mla)
        for tp, remote, heads, mla in itertools.product(
            TP_SIZES, TP_SIZES, KV_HEADS, (False, True)
        )
        for rank in range(tp)
    ]


def page(rank: int, tp_size: int, case: Case) -> int:
    """Bytes of one page of ``rank`` at ``tp_size``: its heads (the oracle's
    shard), HND; with MLA, the whole latent page on every rank."""
    return len(shard(rank, tp_size, case.num_kv_heads, case.mla)) * PAGE_HEAD


# --- vLLM -------------------------------------------------------------------


def topology(case: Case) -> Any:
    """The decode rank's TransferTopology, as register_kv_caches builds it
    (one KV head for MLA), with the prefill engine registered as
    add_remote_agent registers it."""
    topo = connector_utils.TransferTopology(
        tp_rank=case.tp_rank,
        tp_size=case.tp_size,
        block_size=BLOCK_SIZE,
        engine_id=DECODE,
        is_mla=case.mla,
        is_mamba=False,
        total_num_kv_heads=1 if case.mla else case.num_kv_heads,
        attn_backends=[],
    )
    topo.register_remote_engine(
        PREFILL,
        connector_utils.EngineTransferInfo(
            remote_tp_size=case.remote_tp_size,
            remote_block_len=page(0, case.remote_tp_size, case),
            remote_block_size=BLOCK_SIZE,
            remote_physical_blocks_per_logical=1,
        ),
    )
    return topo


def spec_types(case: Case) -> tuple[type, ...]:
    """The model's one KV-cache group."""
    return (MLAAttentionSpec,) if case.mla else (FullAttentionSpec,)


def vllm_plan(case: Case) -> Any:
    """vLLM's TPMapping for the case."""
    return vllm_mapping.compute_tp_mapping(
        transfer_topology=topology(case),
        remote_tp_size=case.remote_tp_size,
        group_spec_types=spec_types(case),
    )


def vllm_refuses(case: Case) -> bool:
    """Whether vLLM's handshake refuses the case (the assertion of
    _validate_remote_agent_handshake, on the topology's own tp_ratio and
    is_kv_replicated)."""
    topo = topology(case)
    return (
        not case.mla
        and topo.tp_ratio(case.remote_tp_size) < 0
        and topo.is_kv_replicated(PREFILL)
    )


def vllm_accepts_pages(case: Case) -> bool:
    """Whether the pages of this file pass the handshake's block-length
    check: equal where the KV is replicated (MLA, or prefill TP above the
    heads), else scaled by the ratio of heads per rank."""
    topo = topology(case)
    local, remote = (
        page(case.tp_rank, case.tp_size, case),
        page(0, case.remote_tp_size, case),
    )
    if case.mla or topo.is_kv_replicated(PREFILL):
        return bool(local == remote)
    remote_heads = max(1, topo.total_num_kv_heads // case.remote_tp_size)
    return bool(remote == local * remote_heads // topo.local_physical_heads)


def vllm_formula(case: Case, plan: Any) -> list[Copy]:
    """The copies as base_worker reads vLLM's mapping: per source rank of the
    attention group, ``local_page / reads`` bytes at ``rank_offset_factor *
    local_page`` of the remote page, into the local page at the rank's head
    slot (``rank_to_attention_slot``); MLA (replicated) reads the whole page
    at offset 0."""
    local_page = page(case.tp_rank, case.tp_size, case)
    ranks = plan.source_ranks_per_group[0]
    copies = []
    for rank in ranks:
        if case.mla:
            length, local_offset, remote_offset = local_page, 0, 0
        else:
            length = local_page // len(ranks)
            local_offset = plan.rank_to_attention_slot[rank] * length
            remote_offset = plan.rank_offset_factor * local_page
        copies += [
            Copy(rank, block, local_offset, remote_offset, length, length)
            for block in range(NUM_BLOCKS)
        ]
    return copies


def vllm_worker(case: Case, topo: Any) -> Any:
    """A never-initialised NIXL worker of the release holding what its
    descriptor builders read (each release reads some of these), for one
    region of NUM_BLOCKS pages."""
    w = object.__new__(base_worker.NixlBaseConnectorWorker)
    local_page = page(case.tp_rank, case.tp_size, case)
    w.__dict__.update(
        transfer_topo=topo,
        _group_spec_types=spec_types(case),
        use_mla=case.mla,
        _has_mamba=False,
        _region_is_mla=[case.mla],
        _transfer_layer_region_indices=[],
        block_len_per_layer=[local_page],
        block_stride_per_layer=[local_page],
        region_num_blocks=[NUM_BLOCKS],
        num_regions=1,
        num_blocks=NUM_BLOCKS,
        _logical_num_blocks=NUM_BLOCKS,
        _ple_region_index=None,
        device_id=0,
        draft_tp_mappings={},
        _head_sharded_draft_regions=set(),
    )
    return w


def per_block(rows: Any) -> list[tuple[int, int]]:
    """``(address, length)`` of each block of a release's descriptor rows:
    Nx3 ``(addr, len, dev)`` one a block (0.30 to 0.32), or Nx5 strided
    ``(addr, len, dev, stride, count)`` (0.33)."""
    array = np.asarray(rows, dtype=np.uint64)
    if array.shape[1] == 3:
        return [(int(a), int(n)) for a, n, _ in array]
    return [
        (int(a) + i * int(stride), int(n))
        for a, n, _, stride, count in array
        for i in range(int(count))
    ]


def vllm_copies(case: Case, plan: Any) -> list[Copy]:
    """The copies vLLM's own descriptor builders make of its mapping: the
    local list (split per source rank where the pull needs it), and each
    source rank's remote list, paired descriptor by descriptor as the pull
    worker pairs them (split ``i`` with ``all_source_ranks[i]``)."""
    topo = topology(case)
    w = vllm_worker(case, topo)
    local = w._build_fa_local([LOCAL_BASE], 1)
    tp_ratio = topo.tp_ratio(case.remote_tp_size)
    ranks = plan.all_source_ranks
    if w._needs_split_local_xfer_handles(tp_ratio, plan):
        splits = list(w._build_local_splits_from_plan(plan, local, NUM_BLOCKS, 1))
    else:
        splits = [local] * len(ranks)
    assert len(splits) == len(ranks), case
    local_page = page(case.tp_rank, case.tp_size, case)
    copies = []
    for rank, split in zip(ranks, splits):
        remote_page = page(rank, case.remote_tp_size, case)
        meta = SimpleNamespace(
            engine_id=PREFILL,
            kv_caches_base_addr=[REMOTE_BASE],
            block_lens=[remote_page],
            block_strides=[remote_page],
            num_blocks=NUM_BLOCKS,
            region_num_blocks=[NUM_BLOCKS],
            device_id=0,
        )
        local_rows = per_block(split)
        remote_rows = per_block(w._build_fa_remote(plan, meta, 1))
        assert len(local_rows) == len(remote_rows) == NUM_BLOCKS, case
        for block, ((la, ln), (ra, rn)) in enumerate(zip(local_rows, remote_rows)):
            copies.append(
                Copy(
                    rank,
                    block,
                    la - LOCAL_BASE - block * local_page,
                    ra - REMOTE_BASE - block * remote_page,
                    ln,
                    rn,
                )
            )
    return copies


# --- ptrres -----------------------------------------------------------------


def ptrres_copies(case: Case) -> list[Copy]:
    """ptrres's copies: one per slice and block, HeadSlice.byte_range of the
    two ranks' pages."""
    mapping = ptrres.tp_mapping(
        case.tp_rank,
        case.tp_size,
        case.remote_tp_size,
        case.num_kv_heads,
        mla=case.mla,
    )
    local_page = page(case.tp_rank, case.tp_size, case)
    copies = []
    for s in mapping.slices:
        remote_page = page(s.source_rank, case.remote_tp_size, case)
        local_offset, remote_offset, size = s.byte_range(local_page, remote_page)
        copies += [
            Copy(s.source_rank, block, local_offset, remote_offset, size, size)
            for block in range(NUM_BLOCKS)
        ]
    return copies


# --- the oracle -------------------------------------------------------------


def oracle_verdict(case: Case, copies: list[Copy]) -> str:
    """``"ok"`` when the copies, run on pages that hold the oracle's shards
    of one logical KV, leave the decode rank's pages holding exactly its own
    shard, each byte written once; else what goes wrong."""
    heads = case.num_kv_heads
    logical = logical_kv(NUM_BLOCKS, heads, TOKENS, HEAD_BYTES, seed=sum(case))
    want = shard(case.tp_rank, case.tp_size, heads, case.mla)
    expected = rank_pages(logical, want)
    peers = [
        rank_pages(logical, shard(rank, case.remote_tp_size, heads, case.mla))
        for rank in range(case.remote_tp_size)
    ]
    got = np.zeros_like(expected)
    writes = np.zeros(expected.shape, dtype=np.int64)
    outside, wrong = [], []
    for c in copies:
        if not 0 <= c.source_rank < case.remote_tp_size:
            outside.append(f"prefill rank {c.source_rank} does not exist")
            continue
        peer = peers[c.source_rank]
        if c.local_len != c.remote_len:
            outside.append(f"{c.remote_len} B read into {c.local_len} B")
            continue
        end = c.remote_offset + c.remote_len
        if c.remote_offset < 0 or end > peer.shape[1]:
            outside.append(
                f"reads [{c.remote_offset}, {end}) of prefill rank "
                f"{c.source_rank}'s {peer.shape[1]} B page"
            )
            continue
        stop = c.local_offset + c.local_len
        if c.local_offset < 0 or stop > expected.shape[1]:
            outside.append(
                f"writes [{c.local_offset}, {stop}) of its {expected.shape[1]} B page"
            )
            continue
        got[c.block, c.local_offset : stop] = peer[c.block, c.remote_offset : end]
        writes[c.block, c.local_offset : stop] += 1
        source_heads = shard(c.source_rank, case.remote_tp_size, heads, case.mla)
        read = source_heads[c.remote_offset // PAGE_HEAD : -(-end // PAGE_HEAD)]
        slot = want[c.local_offset // PAGE_HEAD : -(-stop // PAGE_HEAD)]
        if c.block == 0 and read != slot:
            wrong.append(
                f"reads heads {read} of prefill rank {c.source_rank} into the "
                f"slots of heads {slot}"
            )
    if outside:
        return "outside a page: " + "; ".join(sorted(set(outside)))
    if wrong:
        return "heads other than the rank's: " + "; ".join(wrong)
    if (writes == 0).any() or (writes > 1).any():
        return (
            f"{int((writes == 0).sum())} B never written, "
            f"{int((writes > 1).sum())} B written more than once"
        )
    if not np.array_equal(got, expected):
        return "the pages differ from the rank's shard"
    return "ok"


# --- the grid ---------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One case, on both sides, judged by the oracle."""

    case: Case
    vllm_refuses: bool
    vllm_plan: Any
    vllm: tuple[Copy, ...]
    vllm_verdict: str
    ptrres: tuple[Copy, ...] | None  # None: ptrres refuses (ptrres_error)
    ptrres_error: str
    ptrres_verdict: str

    @property
    def agree(self) -> bool:
        return self.ptrres is not None and sorted(self.vllm) == sorted(self.ptrres)

    def differences(self) -> list[str]:
        """What differs between vLLM's copies and ptrres's, by field."""
        assert self.ptrres is not None
        fields = (
            ("source ranks", "source_rank"),
            ("local offsets (head slots)", "local_offset"),
            ("remote offsets", "remote_offset"),
            ("read lengths", "remote_len"),
        )
        theirs, ours = sorted(self.vllm), sorted(self.ptrres)
        return [
            f"{name} {sorted({getattr(c, key) for c in theirs})} against "
            f"{sorted({getattr(c, key) for c in ours})}"
            for name, key in fields
            if [getattr(c, key) for c in theirs] != [getattr(c, key) for c in ours]
        ] or ["the pairing of the copies"]


def judge(case: Case) -> Outcome:
    """Both sides' copies of the case and the oracle's verdict on each."""
    plan = vllm_plan(case)
    theirs = vllm_copies(case, plan)
    ours: tuple[Copy, ...] | None
    try:
        ours, error = tuple(ptrres_copies(case)), ""
    except ptrres.LayoutError as exc:
        ours, error = None, str(exc)
    return Outcome(
        case,
        vllm_refuses(case),
        plan,
        tuple(theirs),
        oracle_verdict(case, theirs),
        ours,
        error,
        oracle_verdict(case, list(ours)) if ours is not None else "",
    )


@functools.cache
def outcomes() -> tuple[Outcome, ...]:
    return tuple(judge(case) for case in grid())


def summary() -> str:
    """The figures: cases, refusals, agreement, and each case that differs
    with the oracle's verdict."""
    all_ = outcomes()
    accepted = [o for o in all_ if not o.vllm_refuses and o.ptrres is not None]
    refused = [o for o in all_ if o.vllm_refuses]
    lines = [
        f"vLLM {vllm.__version__}: {len(all_)} cases (decode TP x prefill TP in "
        f"{list(TP_SIZES)}^2, KV heads {list(KV_HEADS)}, every decode rank, MLA "
        "or not)",
        f"ptrres refuses {sum(o.ptrres is None for o in all_)}; agrees with the "
        f"oracle on {sum(o.ptrres_verdict == 'ok' for o in all_)}",
        f"vLLM's handshake refuses {len(refused)} (prefill TP > decode TP and > "
        "KV heads, not MLA); its mapping on those agrees with ptrres on "
        f"{sum(o.agree for o in refused)}",
        f"both accept {len(accepted)}: vLLM agrees with ptrres on "
        f"{sum(o.agree for o in accepted)}, differs on "
        f"{sum(not o.agree for o in accepted)}",
    ]
    for o in all_:
        if o.ptrres is not None and not o.agree:
            status = "refused by vLLM; " if o.vllm_refuses else ""
            lines.append(
                f"  {o.case}: {status}{'; '.join(o.differences())}; "
                f"oracle on vLLM: {o.vllm_verdict}; on ptrres: {o.ptrres_verdict}"
            )
    return "\n".join(lines)


# --- tests ------------------------------------------------------------------


def test_release_has_the_mapping() -> None:
    """The release's compute_tp_mapping takes what this file passes (and
    DCP), and compute_head_offset is there exactly from 0.33."""
    params = list(inspect.signature(vllm_mapping.compute_tp_mapping).parameters)
    assert [p for p in params if p != "remote_dcp_size"] == MAPPING_PARAMETERS[RELEASE]
    assert hasattr(vllm_mapping, "compute_head_offset") == HAS_HEAD_OFFSET[RELEASE]
    # The refusal vLLM's handshake makes, as this file encodes it.
    worker = base_worker.NixlBaseConnectorWorker
    source = inspect.getsource(worker._validate_remote_agent_handshake)
    assert VLLM_REFUSAL in " ".join(source.split())


def test_vllm_descriptors_follow_its_mapping() -> None:
    """vLLM's descriptor builders make exactly the copies its mapping's
    fields give (source ranks, head slot x slice, rank_offset_factor x local
    page, local page / reads): what this file compares is vLLM's math."""
    for o in outcomes():
        assert sorted(o.vllm) == sorted(vllm_formula(o.case, o.vllm_plan)), o.case


def test_vllm_head_offset() -> None:
    """0.33's compute_head_offset is the mapping's rank_offset_factor
    (before 0.33 the offset is computed inline, and checked through the
    descriptors)."""
    if not HAS_HEAD_OFFSET[RELEASE]:
        assert not hasattr(vllm_mapping, "compute_head_offset")
        return
    for o in outcomes():
        c = o.case
        if not c.mla:
            offset = vllm_mapping.compute_head_offset(
                c.tp_rank, c.tp_size, c.remote_tp_size, c.num_kv_heads
            )
            assert offset == o.vllm_plan.rank_offset_factor, c


def test_pages_are_vllm_pages() -> None:
    """The pages of this file are the ones vLLM's handshake accepts, on
    every case it does not refuse."""
    bad = [
        o.case
        for o in outcomes()
        if not o.vllm_refuses and not vllm_accepts_pages(o.case)
    ]
    assert bad == []


def test_refusals() -> None:
    """ptrres refuses none of the grid (one TP size always divides the
    other, and the heads divide or are divided by each); vLLM's handshake
    refuses exactly a prefill TP above both the decode TP and the KV heads,
    without MLA."""
    assert [o.case for o in outcomes() if o.ptrres is None] == []
    refused = {o.case for o in outcomes() if o.vllm_refuses}
    assert refused == {
        c
        for c in grid()
        if not c.mla and c.remote_tp_size > max(c.tp_size, c.num_kv_heads)
    }
    assert refused


def test_ptrres_agrees_with_the_oracle() -> None:
    """On every case, ptrres's copies leave the decode rank's pages holding
    exactly its shard of the prefill engine's KV."""
    wrong = [(o.case, o.ptrres_verdict) for o in outcomes() if o.ptrres_verdict != "ok"]
    assert wrong == []


def test_vllm_against_ptrres_and_the_oracle() -> None:
    """Where vLLM's copies equal ptrres's, the oracle accepts them; on each
    case where they differ, the oracle rejects vLLM's (it never prefers vLLM
    to ptrres). The source ranks agree wherever the copies do."""
    for o in outcomes():
        assert o.ptrres is not None
        if o.agree:
            assert o.vllm_verdict == "ok", o.case
            ours = tuple(dict.fromkeys(c.source_rank for c in o.ptrres))
            assert o.vllm_plan.source_ranks_per_group[0] == ours, o.case
        else:
            assert o.vllm_verdict != "ok", (o.case, o.differences())
            assert o.ptrres_verdict == "ok", o.case


def test_the_oracle_rejects_wrong_copies() -> None:
    """The judge has teeth: copies one head off, SGLang #31295's (prefill TP
    1 to decode TP 4 with 2 KV heads, offsets counted for 4 head groups) and
    vLLM's gather without its GQA dedup (every prefill rank read, where
    several hold the same head) are each rejected."""
    for o in outcomes():
        c = o.case
        assert o.ptrres is not None
        if c.mla:
            continue
        shifted = [
            x._replace(remote_offset=x.remote_offset + PAGE_HEAD) for x in o.ptrres
        ]
        assert oracle_verdict(c, shifted) != "ok", c
    # SGLang #31295: rank r reads at r local pages; ranks 0 and 1 share head
    # 0, ranks 2 and 3 head 1, of a prefill page of two heads.
    verdicts = []
    for rank in range(4):
        c = Case(4, 1, 2, rank, False)
        local_page = page(rank, 4, c)
        copies = [
            Copy(0, block, 0, rank * local_page, local_page, local_page)
            for block in range(NUM_BLOCKS)
        ]
        verdicts.append(oracle_verdict(c, copies).split(":")[0])
    assert verdicts == [
        "ok",
        "heads other than the rank's",
        "outside a page",
        "outside a page",
    ]
    for o in outcomes():
        c = o.case
        if not o.vllm_refuses:
            continue
        ratio = c.remote_tp_size // c.tp_size
        length = page(c.tp_rank, c.tp_size, c) // ratio
        copies = [
            Copy(c.tp_rank * ratio + i, block, i * length, 0, length, length)
            for i in range(ratio)
            for block in range(NUM_BLOCKS)
        ]
        assert oracle_verdict(c, copies) != "ok", c


def test_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """The summary adds up, and is printed (in pytest's output, captured or
    not)."""
    text = summary()
    with capsys.disabled():
        print("\n" + text)
    all_ = outcomes()
    assert len(all_) == len(TP_SIZES) * sum(TP_SIZES) * len(KV_HEADS) * 2
    differing = [o for o in all_ if not o.agree]
    assert len(text.splitlines()) == 4 + len(differing)


# --- handshakes as each release writes them (issue 40) -----------------------
#
# tests/vllm/handshakes.py builds each engine with the release's own code:
# the layout asked for with VLLM_KV_CACHE_LAYOUT and resolved by the engine
# core, the cache planned and allocated for it, its regions registered and
# its NixlAgentMetadata built by the NIXL worker's register_kv_caches.

# Every KVCacheLayout member of vLLM 0.30 to 0.34, and those whose runs of
# heads ptrres slices as one byte range of a page.
VLLM_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
SLICEABLE = ("LBHNC", "BLHNC")
# Bytes of one KV head of one block: K and V of BLOCK_SIZE tokens, float16.
HEAD_PAGE = 2 * handshakes.BLOCK_SIZE * handshakes.HEAD_SIZE * 2
# Each decode block's prefill block (a permutation: a block mixed up shows).
LOCAL_IDS = [0, 1, 2, 3]
REMOTE_IDS = [2, 0, 3, 1]


def regions(layout: str, heads: int) -> list[tuple[int, int]]:
    """``(block_lens, block_strides)`` of each region a rank of ``heads``
    heads registers (what register_kv_caches makes of each layout): a
    region per layer, its page a block of it (LBHNC, LBNHC); a region per
    layer and head, its page one head of a block (LHBNC, heads outside
    blocks); a region per layer, its page inside the block row of every
    layer (BLHNC); one region of whole block rows (BLNHC, BHLNC, whose
    layer pages are not contiguous)."""
    page = heads * HEAD_PAGE
    row = handshakes.NUM_LAYERS * page
    if layout in ("LBHNC", "LBNHC"):
        return [(page, page)] * handshakes.NUM_LAYERS
    if layout == "LHBNC":
        return [(HEAD_PAGE, HEAD_PAGE)] * (handshakes.NUM_LAYERS * heads)
    if layout == "BLHNC":
        return [(page, row)] * handshakes.NUM_LAYERS
    return [(row, row)]


def test_every_layout_vllm_sends_is_read_as_sent() -> None:
    """The release's layouts are the six of issue 40; the handshake carries
    the name the engine core resolved (never "HND" or "NHD": those are
    vLLM's aliases of LBHNC and LBNHC), and ptrres reads it as sent, with
    the regions the worker registered."""
    assert handshakes.LAYOUTS == VLLM_LAYOUTS
    assert handshakes.worker_reads_the_resolved_layout()
    asked = [("HND", "LBHNC"), ("NHD", "LBNHC"), *zip(VLLM_LAYOUTS, VLLM_LAYOUTS)]
    for requested, sent in asked:
        with handshakes.engine(requested, 4) as prefill:
            message = prefill.handshake
            assert type(message) is handshakes.metadata.NixlAgentMetadata
            assert (prefill.layout, message.kv_cache_layout) == (sent, sent)
            peer = ptrres.PeerLayout.from_nixl_metadata(message)
            assert peer.kv_layout == sent
            (refs,) = peer.groups
            assert [(r.page_size_bytes, r.row_stride_bytes) for r in refs] == regions(
                sent, 4
            ), sent
            assert [(r.base_ptr, r.num_blocks, r.device) for r in refs] == [
                (base, handshakes.NUM_BLOCKS, -1)
                for base in message.kv_caches_base_addr
            ]


def fill(engine: handshakes.Engine, seed: int) -> list[torch.Tensor]:
    """The engine's KV, one logical [B, H, N, C] tensor per layer of exact
    float16 values, written through vLLM's own views."""
    generator = torch.Generator().manual_seed(seed)
    logical = []
    for cache in engine.caches:
        values = torch.randint(-2000, 2000, cache.shape, generator=generator)
        cache.copy_(values.to(cache.dtype))
        logical.append(values.to(cache.dtype))
    return logical


def read(plan: ptrres.PeerTransferPlan, *engines: handshakes.Engine) -> None:
    """A pull (NIXL READ): the peer's bytes into this rank's, each copy
    inside the engines' allocations."""
    reference.execute_descriptors(
        plan.remote,
        plan.local,
        plan.sizes,
        within=[engine.allocation() for engine in engines],
    )


def received(
    decode: handshakes.Engine, logical: list[torch.Tensor], heads: range
) -> bool:
    """Whether every decode block holds its prefill block's ``heads``, in
    every layer (vLLM's views, read logically)."""
    return all(
        torch.equal(cache[local], layer[remote, heads.start : heads.stop])
        for cache, layer in zip(decode.caches, logical)
        for local, remote in zip(LOCAL_IDS, REMOTE_IDS)
    )


def assert_refused(
    layout: str,
    table: ptrres.PointerTable,
    peer: ptrres.PeerLayout,
    heads: ptrres.HeadSlice,
) -> None:
    """tp_mapping, plans and prepared lists refuse a slice of some heads of
    the layout's pages, naming it and what works."""
    rank = heads.source_rank
    with pytest.raises(ptrres.LayoutError, match=f"{layout} pages"):
        ptrres.tp_mapping(rank, 2, 1, 4, kv_layout=layout)
    spec = ptrres.GPULoadStoreSpec(np.array(LOCAL_IDS), [len(LOCAL_IDS)])
    refusal = f"are {layout} .* LBHNC or BLHNC"
    with pytest.raises(ptrres.LayoutError, match=refusal):
        table.plan_peer_transfer(spec, peer, REMOTE_IDS, heads=heads)
    with pytest.raises(ptrres.LayoutError, match=refusal):
        ptrres.nixl.prepped_pair(table, peer, heads)
    with pytest.raises(ptrres.LayoutError, match=refusal):
        ptrres.nixl.prepped_rows(peer, heads=heads)


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
def test_head_slices_move_each_ranks_heads_or_are_refused(layout: str) -> None:
    """Prefill TP 1 (4 heads) to decode TP 2 (2 heads a rank), each engine
    allocated and registered by vLLM for the layout: where a run of heads is
    one byte range of a page (LBHNC, BLHNC), each decode rank's plan against
    the prefill handshake moves exactly its heads of every block and layer;
    elsewhere tp_mapping, plans and prepared lists refuse the slice, naming
    the layout and what works, and nothing moves. Read as "unknown" (issue
    40's defect), LBNHC's and BLNHC's slices would have moved other bytes;
    BHLNC's, of rows without padding as here, the right ones (it is refused
    because a row's padding lies in its page, which no handshake tells)."""
    spec = ptrres.GPULoadStoreSpec(np.array(LOCAL_IDS), [len(LOCAL_IDS)])
    with handshakes.engine(layout, 4) as prefill:
        logical = fill(prefill, seed=len(layout) + VLLM_LAYOUTS.index(layout))
        peer = ptrres.PeerLayout.from_nixl_metadata(prefill.handshake)
        for rank in range(2):
            (heads,) = ptrres.tp_mapping(rank, 2, 1, 4).slices
            mine = ptrres.rank_heads(rank, 2, 4)
            with handshakes.engine(layout, 2, tp_size=2) as decode:
                table = decode.table()
                if layout in SLICEABLE:
                    assert ptrres.tp_mapping(
                        rank, 2, 1, 4, kv_layout=layout
                    ).slices == (heads,)
                    plan = table.plan_peer_transfer(spec, peer, REMOTE_IDS, heads=heads)
                    read(plan, decode, prefill)
                    assert received(decode, logical, mine), (layout, rank)
                    continue
                assert_refused(layout, table, peer, heads)
                assert all(not cache.any() for cache in decode.caches)
                unknown = ptrres.PeerLayout(peer.groups, kv_layout=None)
                if layout == "LHBNC":  # a region per head: 8 here, 4 there
                    with pytest.raises(
                        ptrres.LayoutError, match=r"\(8,\), but .* \(4,\)"
                    ):
                        table.plan_peer_transfer(spec, unknown, REMOTE_IDS, heads=heads)
                    continue
                plan = table.plan_peer_transfer(spec, unknown, REMOTE_IDS, heads=heads)
                read(plan, decode, prefill)
                assert received(decode, logical, mine) == (layout == "BHLNC"), layout


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
def test_whole_pages_move_on_every_layout(layout: str) -> None:
    """At equal TP every page is whole: on every layout, a plan against the
    prefill handshake (without a slice, or with tp_mapping's whole-page
    one) moves every head of every block and layer."""
    spec = ptrres.GPULoadStoreSpec(np.array(LOCAL_IDS), [len(LOCAL_IDS)])
    (whole,) = ptrres.tp_mapping(0, 1, 1, 4, kv_layout=layout).slices
    assert whole.whole_page
    with handshakes.engine(layout, 4) as prefill:
        logical = fill(prefill, seed=7)
        peer = ptrres.PeerLayout.from_nixl_metadata(prefill.handshake)
        for heads in (None, whole):
            with handshakes.engine(layout, 4) as decode:
                plan = decode.table().plan_peer_transfer(
                    spec, peer, REMOTE_IDS, heads=heads
                )
                read(plan, decode, prefill)
                assert received(decode, logical, range(4)), (layout, heads)
