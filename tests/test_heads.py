"""Different TP on prefill and decode (SPEC 15, issue 34), without NIXL.

The mapping against the reference's head-by-head one over the whole grid,
and against the head oracle (tests/head_oracle.py, which shares nothing with
either); sliced peer plans, plain and coalesced, and prepared lists against
the reference's; then the bytes: every prefill and decode rank's KV caches
built in host memory from one logical KV per layer, every decode rank's
slices planned and executed (ptrres.reference.execute_descriptors), and each
rank's pages checked against the oracle's shard of the prefill KV, every
other byte (other blocks, padding, guard zones, the prefill side)
unchanged. Then every impossible input, and vLLM's NIXL handshake as a peer
layout. tests/nixl moves the same slices with real NIXL agents.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import as_tensor, row_stride, with_torch
from head_oracle import expected_pages, logical_kv, rank_pages, shard
from hypothesis import example, given
from test_peer import (
    FIELDS,
    assert_same_plan,
    boundary_ids,
    ref_allocations,
    runs_of_ids,
)

import ptrres
import ptrres.nixl
from ptrres import reference
from ptrres.reference._heads import rank_heads as reference_rank_heads

TP_SIZES = (1, 2, 4, 8)
KV_HEADS = (1, 2, 4, 8, 16)
# Every page layout ptrres reads (ptrres's names, then vLLM's KVCacheLayout
# members), and those whose runs of heads are one byte range of a page.
LAYOUTS = ("HND", "NHD", "LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
SLICEABLE_LAYOUTS = ("HND", "LBHNC", "BLHNC")


def grid() -> list[tuple[int, int, int, bool]]:
    """Every (this TP, the peer's TP, KV heads, MLA) of the issue's grid."""
    return [
        (tp, peer_tp, heads, mla)
        for tp in TP_SIZES
        for peer_tp in TP_SIZES
        for heads in KV_HEADS
        for mla in (False, True)
    ]


# The mapping -----------------------------------------------------------------


def assert_mapping_holds(
    mapping: ptrres.TPMapping, rank: int, tp: int, peer_tp: int, heads: int, mla: bool
) -> None:
    """What the oracle's shard() says a rank's slices must be: each of its
    heads given once, by a peer rank that holds it, at the slots both sides'
    pages hold it, inside both pages."""
    mine = shard(rank, tp, heads, mla)
    filled: list[int] = []
    for s in mapping.slices:
        assert all(type(value) is int for value in s)
        assert 0 <= s.source_rank < peer_tp
        theirs = shard(s.source_rank, peer_tp, heads, mla)
        if mla:
            # The latent page is one piece: every rank holds all of it.
            assert theirs == mine
            assert s.whole_page
            assert s.local_heads == 1
        else:
            assert (s.local_heads, s.remote_heads) == (len(mine), len(theirs))
            given = theirs[s.remote_head : s.remote_head + s.num_heads]
            assert given == mine[s.local_head : s.local_head + s.num_heads]
            assert len(given) == s.num_heads >= 1
        filled += range(s.local_head, s.local_head + s.num_heads)
        for head_bytes in (1, 3, 64):
            local_page = s.local_heads * head_bytes
            remote_page = s.remote_heads * head_bytes
            local, remote, size = s.byte_range(local_page, remote_page)
            assert size == s.num_heads * head_bytes
            assert local >= 0
            assert local + size <= local_page
            assert remote >= 0
            assert remote + size <= remote_page
            assert s.local_range(local_page) == (local, size)
            assert s.remote_range(remote_page) == (remote, size)
    # Every slot of this rank's page filled once, in order of its heads.
    assert filled == list(range(1 if mla else len(mine)))
    assert len(set(mapping.source_ranks)) == len(mapping.slices)
    for s in mapping.slices:
        assert mapping.slice_of(s.source_rank) is s
    if tp >= peer_tp or mla:
        (only,) = mapping.slices
        assert only.source_rank == rank * peer_tp // tp
    if tp == peer_tp or mla:
        # Today's plan (equal TP), or the replicated latent page.
        assert mapping.slices[0].whole_page


def test_the_mapping_is_the_references_and_the_oracles_over_the_grid() -> None:
    """TP sizes {1, 2, 4, 8} on both sides, {1, 2, 4, 8, 16} KV heads (fewer
    than the TP on either side included), every rank, MLA or not: ptrres's
    mapping is the reference's, and holds what the oracle says."""
    checked = 0
    for tp, peer_tp, heads, mla in grid():
        for rank in range(tp):
            mapping = ptrres.tp_mapping(rank, tp, peer_tp, heads, mla=mla)
            assert mapping == reference.tp_mapping(rank, tp, peer_tp, heads, mla=mla)
            assert (mapping.tp_rank, mapping.tp_size, mapping.peer_tp_size) == (
                rank,
                tp,
                peer_tp,
            )
            assert (mapping.num_kv_heads, mapping.mla) == (heads, mla)
            assert_mapping_holds(mapping, rank, tp, peer_tp, heads, mla)
            # Pages whose heads are not one byte range (NHD, and vLLM's
            # layouts but LBHNC and BLHNC): the same answer where every slice
            # is a whole page, else refused by both.
            whole = all(s.whole_page for s in mapping.slices)
            for layout in LAYOUTS:
                if whole or layout in SLICEABLE_LAYOUTS:
                    assert mapping == ptrres.tp_mapping(
                        rank, tp, peer_tp, heads, mla=mla, kv_layout=layout
                    )
                    continue
                for mapping_of in (ptrres.tp_mapping, reference.tp_mapping):
                    with pytest.raises(ptrres.LayoutError, match=f"{layout} pages"):
                        mapping_of(rank, tp, peer_tp, heads, mla=mla, kv_layout=layout)
            checked += 1
    assert checked == 2 * len(KV_HEADS) * len(TP_SIZES) * sum(TP_SIZES)


@pytest.mark.parametrize(
    ("rank", "tp", "peer_tp", "heads", "expected"),
    [
        # SGLang #31295: prefill TP 1 to decode TP 4, 2 KV heads: decode
        # ranks 0, 1 hold head 0, ranks 2, 3 head 1; each reads one of the
        # prefill page's two heads.
        (0, 4, 1, 2, [(0, 0, 0, 1, 1, 2)]),
        (1, 4, 1, 2, [(0, 0, 0, 1, 1, 2)]),
        (2, 4, 1, 2, [(0, 0, 1, 1, 1, 2)]),
        (3, 4, 1, 2, [(0, 0, 1, 1, 1, 2)]),
        # Decode TP 1 gathers from prefill TP 2: each half of its page.
        (0, 1, 2, 8, [(0, 0, 0, 4, 8, 4), (1, 4, 0, 4, 8, 4)]),
        # Prefill TP 8 replicates 2 heads 4 times: decode TP 1 reads each
        # head once, from the first rank that holds it.
        (0, 1, 8, 2, [(0, 0, 0, 1, 2, 1), (4, 1, 0, 1, 2, 1)]),
        # Decode TP 2 of 4 heads from prefill TP 1: the second half.
        (1, 2, 1, 4, [(0, 0, 2, 2, 2, 4)]),
    ],
)
def test_the_issues_cases_by_hand(
    rank: int, tp: int, peer_tp: int, heads: int, expected: list[tuple[int, ...]]
) -> None:
    mapping = ptrres.tp_mapping(rank, tp, peer_tp, heads)
    assert [tuple(s) for s in mapping.slices] == expected
    assert mapping.source_ranks == tuple(s[0] for s in expected)


# Sliced plans against the reference -----------------------------------------


@dataclass
class SlicedCase:
    """A table and a peer rank whose pages hold their ranks' heads, a slice
    of one decode rank's mapping, and ids."""

    kv_caches: ptrres.CanonicalKVCaches
    peer_caches: ptrres.CanonicalKVCaches
    heads: ptrres.HeadSlice
    spec: ptrres.GPULoadStoreSpec
    remote_ids: np.ndarray
    out: bool


def byte_tensors(blocks: int, strides: list[int], shared: bool, seed: int) -> list[Any]:
    """One (blocks, stride) uint8 tensor of random bytes per stride: each its
    own allocation, or views back to back in one buffer (torch tensors, or
    numpy arrays of numpy's random bytes without torch)."""
    if not with_torch():
        rng = np.random.default_rng(seed)
        if not shared:
            return [rng.integers(0, 256, (blocks, s), np.uint8) for s in strides]
        flat = rng.integers(0, 256, blocks * sum(strides), np.uint8)
        ends = np.cumsum([0, *strides]) * blocks
        return [
            flat[int(a) : int(b)].reshape(blocks, s)
            for a, b, s in zip(ends[:-1], ends[1:], strides)
        ]
    import torch

    generator = torch.Generator().manual_seed(seed)
    if not shared:
        return [
            torch.randint(0, 256, (blocks, s), dtype=torch.uint8, generator=generator)
            for s in strides
        ]
    buffer = torch.randint(
        0, 256, (blocks * sum(strides),), dtype=torch.uint8, generator=generator
    )
    starts = np.cumsum([0, *strides]) * blocks
    return [
        buffer[int(a) : int(b)].view(blocks, s)
        for a, b, s in zip(starts[:-1], starts[1:], strides)
    ]


@st.composite
def sliced_cases(draw: Any) -> SlicedCase:
    tp, peer_tp = draw(st.sampled_from(TP_SIZES)), draw(st.sampled_from(TP_SIZES))
    num_heads, mla = draw(st.sampled_from(KV_HEADS)), draw(st.booleans())
    rank = draw(st.integers(0, tp - 1))
    heads = draw(
        st.sampled_from(ptrres.tp_mapping(rank, tp, peer_tp, num_heads, mla=mla).slices)
    )
    sides: tuple[tuple[list[Any], list[Any]], ...] = ([], []), ([], [])
    local_ids: list[int] = []
    remote_ids: list[int] = []
    sizes = []
    for g in range(draw(st.integers(1, 3))):
        n_refs = draw(st.integers(0, 3))
        head_bytes = [draw(st.sampled_from([1, 2, 4, 6])) for _ in range(n_refs)]
        blocks = draw(st.integers(1, 10)), draw(st.integers(1, 10))
        for side, (tensors, refs), held in zip(
            (0, 1), sides, (heads.local_heads, heads.remote_heads)
        ):
            pages = [held * b for b in head_bytes]
            strides = [p + draw(st.sampled_from([0, 0, 1, 8])) for p in pages]
            made = byte_tensors(
                blocks[side], strides, draw(st.booleans()), 10 * g + side
            )
            refs.append(
                [
                    ptrres.CanonicalKVCacheRef(len(tensors) + d, page)
                    for d, page in enumerate(pages)
                ]
            )
            tensors += [ptrres.CanonicalKVCacheTensor(t, row_stride(t)) for t in made]
        n = draw(st.integers(0, 6))
        ids, peer_ids = draw(runs_of_ids(n, *blocks))
        local_ids += ids
        remote_ids += peer_ids
        sizes.append(n)
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    kv, peer_kv = (ptrres.CanonicalKVCaches(t, r) for t, r in sides)
    spec = ptrres.GPULoadStoreSpec(np.array(local_ids, dtype), sizes)
    return SlicedCase(
        kv, peer_kv, heads, spec, np.array(remote_ids, dtype), draw(st.booleans())
    )


def expand(rows: ptrres.nixl.PreppedRows) -> tuple[np.ndarray, np.ndarray]:
    """A prepared list's descriptors: each strided row ``(base, page, devId,
    stride, count)`` as its ``count`` addresses and sizes."""
    addresses = [np.zeros(0, np.uint64)]
    sizes = [np.zeros(0, np.uint64)]
    for base, page, _, stride, count in rows.xfer_list.tolist():
        addresses.append(
            np.uint64(base) + np.arange(count, dtype=np.uint64) * np.uint64(stride)
        )
        sizes.append(np.full(count, page, np.uint64))
    return np.concatenate(addresses), np.concatenate(sizes)


def prepped_plan(
    table: ptrres.PointerTable,
    peer: ptrres.PeerLayout,
    heads: ptrres.HeadSlice,
    spec: ptrres.GPULoadStoreSpec,
    remote_ids: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(local, remote, sizes)`` that prepped_pair's lists and
    prepped_indices' indices name, as NIXL's make_prepped_xfer reads them."""
    local_rows, remote_rows = ptrres.nixl.prepped_pair(table, peer, heads)
    for rows, layout in ((local_rows, table), (remote_rows, peer)):
        np.testing.assert_array_equal(
            rows.xfer_list, ptrres.nixl.prepped_rows(layout, heads=heads).xfer_list
        )
    local_addresses, local_sizes = expand(local_rows)
    remote_addresses, remote_sizes = expand(remote_rows)
    local_indices = ptrres.nixl.prepped_indices(table, spec)
    remote_indices = ptrres.nixl.prepped_indices(peer, remote_ids, spec.group_sizes)
    sizes = local_sizes[local_indices]
    np.testing.assert_array_equal(sizes, remote_sizes[remote_indices])
    return local_addresses[local_indices], remote_addresses[remote_indices], sizes


@given(sliced_cases(), st.sampled_from([None, 8, 40]))
def test_sliced_plans_are_the_references(case: SlicedCase, cap: int | None) -> None:
    """Plain sliced plans equal the reference's; coalesced ones the
    reference's coalescing of the plain plan, never across allocations; the
    prepared lists and indices name the plain plan's descriptors."""
    table = ptrres.PointerTable(case.kv_caches)
    peer = ptrres.PeerLayout.of(ptrres.PointerTable(case.peer_caches))
    expected = reference.plan_peer_transfer(
        case.spec, case.kv_caches, peer.groups, case.remote_ids, heads=case.heads
    )
    n = len(expected.sizes)
    out = tuple(np.full(n + 2, 7, np.uint64) for _ in FIELDS) if case.out else None
    plan = table.plan_peer_transfer(
        case.spec, peer, case.remote_ids, heads=case.heads, out=out
    )
    assert_same_plan(plan, expected)
    # The bytes one block moves: each ref's slice, on both sides.
    per_ref = [
        case.heads.num_heads * ref.page_size_bytes // case.heads.local_heads
        for refs in case.kv_caches.group_data_refs
        for ref in refs
    ]
    counts = [len(refs) for refs in case.kv_caches.group_data_refs]
    assert plan.num_bytes == sum(
        np.repeat(per_ref, np.repeat(case.spec.group_sizes, counts))
    )
    pairs = list(
        zip(ref_allocations(case.kv_caches), ref_allocations(case.peer_caches))
    )
    keys = {pair: i for i, pair in enumerate(dict.fromkeys(pairs))}
    allocations = np.repeat(
        [keys[pair] for pair in pairs], np.repeat(case.spec.group_sizes, counts)
    )
    merged = reference.coalesce(
        expected.local, expected.remote, expected.sizes, max_run_bytes=cap,
        allocations=allocations,
    )  # fmt: skip
    coalesced = table.plan_peer_transfer(
        case.spec,
        peer,
        case.remote_ids,
        heads=case.heads,
        coalesce=True,
        max_run_bytes=cap,
    )
    for name, expected_name in zip(FIELDS, ("src", "dst", "sizes")):
        np.testing.assert_array_equal(
            getattr(coalesced, name), getattr(merged, expected_name), err_msg=name
        )
    assert coalesced.num_bytes == expected.num_bytes
    local, remote, sizes = prepped_plan(
        table, peer, case.heads, case.spec, case.remote_ids
    )
    for name, values in zip(FIELDS, (local, remote, sizes)):
        np.testing.assert_array_equal(values, getattr(expected, name), err_msg=name)


def sliced_engines(
    local_heads: int = 2, remote_heads: int = 4, head_bytes: int = 8
) -> tuple[ptrres.CanonicalKVCaches, ptrres.PointerTable, ptrres.PeerLayout]:
    """Two groups of two refs each side, 10 local and 12 remote blocks, pages
    of local_heads and remote_heads heads of head_bytes."""

    def caches(blocks: int, heads: int, seed: int) -> ptrres.CanonicalKVCaches:
        page = heads * head_bytes
        tensors = byte_tensors(blocks, [page + 4] * 4, False, seed)
        return ptrres.CanonicalKVCaches(
            [ptrres.CanonicalKVCacheTensor(t, row_stride(t)) for t in tensors],
            [
                [ptrres.CanonicalKVCacheRef(2 * g + d, page) for d in range(2)]
                for g in range(2)
            ],
        )

    local = caches(10, local_heads, 0)
    peer = ptrres.PeerLayout.of(ptrres.PointerTable(caches(12, remote_heads, 1)))
    return local, ptrres.PointerTable(local), peer


def test_a_rank_gathering_from_many_peers_in_turn_plans_each_right() -> None:
    """A table keeps the pairs of several peers and slices checked (a decode
    rank gathers from up to 8 prefill ranks in turn): planning against ten
    peers and their slices, round after round, in an order that returns to
    each after others, gives each one's own plan, never another's."""
    local, table, first = sliced_engines(4, 2)
    # Five peers of the same refs at other addresses (numbers only: nothing
    # is read through them).
    peers = [
        ptrres.PeerLayout(
            [
                [ref._replace(base_ptr=ref.base_ptr + k * 2**20) for ref in g]
                for g in first.groups
            ]
        )
        for k in range(5)
    ]
    slices = ptrres.tp_mapping(0, 1, 2, 4).slices  # two: heads 0-1, 2-3
    spec = ptrres.GPULoadStoreSpec(np.array([1, 2, 5, 0]), [2, 2])
    remote_ids = np.array([3, 4, 11, 7])
    pairs = [(peer, heads) for peer in peers for heads in slices]
    for order in (pairs, pairs[::-1], pairs[::3] + pairs[1::3] + pairs[2::3]):
        for peer, heads in order:
            expected = reference.plan_peer_transfer(
                spec, local, peer.groups, remote_ids, heads=heads
            )
            actual = table.plan_peer_transfer(spec, peer, remote_ids, heads=heads)
            for name in ("local", "remote", "sizes"):
                np.testing.assert_array_equal(
                    getattr(actual, name), getattr(expected, name)
                )


@pytest.mark.parametrize("side", ["local", "remote"])
@pytest.mark.parametrize("group", [0, 1])
def test_every_id_of_a_sliced_plan_is_checked_on_both_sides(
    side: str, group: int
) -> None:
    """-1, the ref's block count and ids past int32 and int64, in either
    group, on either side: the reference's error, nothing kept in out=, and
    the next plan works."""
    local, table, peer = sliced_engines()
    heads = ptrres.tp_mapping(1, 2, 1, 4).slices[0]  # heads 2, 3 of 4
    expected_type = (
        ptrres.BlockIdError if side == "local" else ptrres.RemoteBlockIdError
    )
    for bad in boundary_ids(10 if side == "local" else 12):
        local_ids = np.array([1, 2, 3, 4], np.int64)
        remote_ids = np.array([5, 6, 7, 8], np.int64)
        (local_ids if side == "local" else remote_ids)[2 * group + 1] = bad
        spec = ptrres.GPULoadStoreSpec(local_ids, [2, 2])
        for coalesce in (False, True):
            out = tuple(np.full(8, 7, np.uint64) for _ in FIELDS)
            with pytest.raises(expected_type) as error:
                table.plan_peer_transfer(
                    spec, peer, remote_ids, heads=heads, coalesce=coalesce, out=out
                )
            assert all((buffer == 0).all() for buffer in out)
            with pytest.raises(expected_type) as expected:
                reference.plan_peer_transfer(
                    spec, local, peer.groups, remote_ids, heads=heads
                )
            assert str(error.value) == str(expected.value)
            assert (error.value.group, error.value.position, error.value.value) == (
                group,
                1,
                bad,
            )
    spec = ptrres.GPULoadStoreSpec(np.array([1, 2, 3, 4]), [2, 2])
    plan = table.plan_peer_transfer(spec, peer, [5, 6, 7, 8], heads=heads)
    assert plan.sizes.tolist() == [16] * 8


# The head oracle -------------------------------------------------------------


@dataclass
class GroupShape:
    """One KV cache group: its blocks on each side, its layers (refs) and the
    ids a transfer moves."""

    local_blocks: int
    remote_blocks: int
    tokens: int
    # Bytes per token of a head, per layer.
    head_bytes: list[int]
    # Row padding past the page, per layer, on each side.
    local_pads: list[int]
    remote_pads: list[int]
    local_ids: list[int]
    remote_ids: list[int]


@dataclass
class Shape:
    """Both engines' KV caches, TP aside: groups, guard zones, whether a
    group's layers are views of one allocation, the ids, how to coalesce."""

    groups: list[GroupShape]
    guard: int = 16
    shared: tuple[bool, bool] = (False, False)
    max_run_bytes: int | None = None
    seed: int = 0


@st.composite
def paired_ids(draw: Any, n: int, local_limit: int, remote_limit: int) -> Any:
    """n local and remote ids in runs (test_peer.runs_of_ids), where a local
    id that repeats takes the remote id it had first: never two sources for
    one block (NIXL keeps no order between them)."""
    local, remote = draw(runs_of_ids(n, local_limit, remote_limit))
    first: dict[int, int] = {}
    return local, [first.setdefault(a, b) for a, b in zip(local, remote)]


@st.composite
def shapes(draw: Any) -> Shape:
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        layers = draw(st.integers(1, 3))
        blocks = draw(st.integers(1, 8)), draw(st.integers(1, 8))
        n = draw(st.integers(0, 6))
        local_ids, remote_ids = draw(paired_ids(n, *blocks))
        local_pads, remote_pads = (
            [draw(st.sampled_from([0, 0, 5, 16])) for _ in range(layers)] for _ in "lr"
        )
        groups.append(
            GroupShape(
                blocks[0],
                blocks[1],
                draw(st.integers(1, 3)),
                [draw(st.sampled_from([1, 2, 4, 5])) for _ in range(layers)],
                local_pads,
                remote_pads,
                local_ids,
                remote_ids,
            )
        )
    return Shape(
        groups,
        draw(st.sampled_from([1, 16, 64])),
        (draw(st.booleans()), draw(st.booleans())),
        draw(st.sampled_from([None, 8, 64])),
        draw(st.integers(0, 2**16)),
    )


@dataclass
class RankCaches:
    """One TP rank's KV caches in host memory: every allocation, with its
    guard zones, and where each ref's rows lie in them."""

    buffers: list[np.ndarray] = field(default_factory=list)
    tensors: list[ptrres.CanonicalKVCacheTensor] = field(default_factory=list)
    refs: list[list[ptrres.CanonicalKVCacheRef]] = field(default_factory=list)
    # Per group, per ref: (buffer, first byte of block 0, row stride, page).
    places: list[list[tuple[int, int, int, int]]] = field(default_factory=list)

    def table(self) -> ptrres.PointerTable:
        return ptrres.PointerTable(ptrres.CanonicalKVCaches(self.tensors, self.refs))

    def rows(
        self, buffers: list[np.ndarray], g: int, d: int, blocks: int
    ) -> np.ndarray:
        """Ref (g, d)'s pages in ``buffers`` (a view)."""
        b, start, stride, page = self.places[g][d]
        return buffers[b][start : start + blocks * stride].reshape(blocks, stride)[
            :, :page
        ]


def rank_caches(
    logical: list[list[np.ndarray]],
    heads: list[int],
    pads: list[list[int]],
    guard: int,
    shared: bool,
    rng: np.random.Generator,
) -> RankCaches:
    """A rank's KV caches: each layer's pages its heads of the logical KV
    (the oracle's rank_pages), rows padded, each allocation (a layer's, or
    a group's with ``shared``) between guard zones of random bytes."""
    caches = RankCaches()
    for layers, layer_pads in zip(logical, pads):
        pages = [rank_pages(kv, heads) for kv in layers]
        strides = [p.shape[1] + pad for p, pad in zip(pages, layer_pads)]
        sizes = [len(p) * s for p, s in zip(pages, strides)]
        spans = [sizes] if shared else [[size] for size in sizes]
        starts = []
        for span in spans:
            buffer = rng.integers(0, 256, guard + sum(span) + guard, dtype=np.uint8)
            starts += [guard + int(a) for a in np.cumsum([0, *span[:-1]])]
            caches.buffers.append(buffer)
        group_refs, group_places = [], []
        first_buffer = len(caches.buffers) - len(spans)
        for d, (page, stride, start) in enumerate(zip(pages, strides, starts)):
            b = first_buffer if shared else first_buffer + d
            blocks, width = page.shape
            group_places.append((b, start, stride, width))
            rows = caches.buffers[b][start : start + blocks * stride].reshape(
                blocks, stride
            )
            rows[:, :width] = page
            tensor = as_tensor(caches.buffers[b][start : start + blocks * stride])
            tensor = tensor.reshape(blocks, stride)[:, :width]
            group_refs.append(ptrres.CanonicalKVCacheRef(len(caches.tensors), width))
            caches.tensors.append(ptrres.CanonicalKVCacheTensor(tensor, stride))
        caches.refs.append(group_refs)
        caches.places.append(group_places)
    return caches


def execute_into(
    local: np.ndarray, remote: np.ndarray, sizes: np.ndarray, within: list[np.ndarray]
) -> None:
    """A READ: the remote side's bytes into the local side's, every copy
    inside one of the allocations."""
    reference.execute_descriptors(remote, local, sizes, within=within)


# Two groups of other block counts and layers (a hybrid model), the first's
# three layers views of one allocation on the decode side.
HYBRID = Shape(
    [
        GroupShape(
            4, 6, 1, [2, 2, 2], [0, 0, 0], [0, 0, 0], [0, 1, 2, 3], [5, 4, 3, 2]
        ),
        GroupShape(2, 3, 3, [1], [4], [0], [1, 0], [2, 2]),
    ],
    shared=(True, False),
)


@given(
    st.sampled_from(TP_SIZES),
    st.sampled_from(TP_SIZES),
    st.sampled_from(KV_HEADS),
    st.booleans(),
    shapes(),
)
@example(
    1,
    4,
    2,
    False,
    Shape([GroupShape(6, 6, 2, [4, 2], [0, 3], [5, 0], [0, 1, 2, 5], [5, 4, 3, 0])]),
)  # SGLang #31295
@example(
    2,
    1,
    8,
    False,
    Shape(
        [GroupShape(5, 7, 1, [2], [0], [0], [4, 3, 2], [0, 1, 2])], shared=(True, True)
    ),
)
@example(
    1,
    2,
    8,
    False,
    Shape([GroupShape(3, 3, 2, [1], [0], [0], [0, 1, 2], [0, 1, 2])], max_run_bytes=64),
)
@example(
    8, 2, 4, True, Shape([GroupShape(4, 4, 2, [3], [0], [7], [1, 1, 2], [3, 3, 0])])
)
@example(8, 1, 16, False, HYBRID)
def test_every_decode_rank_ends_with_its_shard_of_the_prefill_kv(
    prefill_tp: int, decode_tp: int, num_kv_heads: int, mla: bool, shape: Shape
) -> None:
    """THE head oracle: every rank of both engines in host memory, built from
    one logical KV per layer; every decode rank reads each of its slices
    from its source rank (plain plans, coalesced plans, and prepared lists
    with their indices), and then every decode rank's pages of the moved
    blocks are its shard of the prefill KV, every other byte as it was."""
    rng = np.random.default_rng(shape.seed)
    seeds = iter(range(shape.seed, shape.seed + 10_000))
    prefill_kv, decode_kv = (
        [
            [
                logical_kv(blocks, num_kv_heads, g.tokens, b, next(seeds))
                for b in g.head_bytes
            ]
            for g, blocks in zip(shape.groups, engine_blocks)
        ]
        for engine_blocks in (
            [g.remote_blocks for g in shape.groups],
            [g.local_blocks for g in shape.groups],
        )
    )
    prefill = [
        rank_caches(
            prefill_kv,
            shard(r, prefill_tp, num_kv_heads, mla),
            [g.remote_pads for g in shape.groups],
            shape.guard,
            shape.shared[1],
            rng,
        )
        for r in range(prefill_tp)
    ]
    decode = [
        rank_caches(
            decode_kv,
            shard(r, decode_tp, num_kv_heads, mla),
            [g.local_pads for g in shape.groups],
            shape.guard,
            shape.shared[0],
            rng,
        )
        for r in range(decode_tp)
    ]
    peers = [ptrres.PeerLayout.of(rank.table()) for rank in prefill]
    tables = [rank.table() for rank in decode]
    spec = ptrres.GPULoadStoreSpec(
        np.array([i for g in shape.groups for i in g.local_ids], np.int64),
        [len(g.local_ids) for g in shape.groups],
    )
    remote_ids = np.array([i for g in shape.groups for i in g.remote_ids], np.int64)
    everything = [b for rank in (*prefill, *decode) for b in rank.buffers]
    initial = [b.copy() for b in everything]
    # What the oracle says each decode rank's allocations hold afterwards.
    expected = []
    for r, rank in enumerate(decode):
        heads = shard(r, decode_tp, num_kv_heads, mla)
        after = [b.copy() for b in rank.buffers]
        for g, group in enumerate(shape.groups):
            for d in range(len(group.head_bytes)):
                before = rank_pages(decode_kv[g][d], heads)
                rows = rank.rows(after, g, d, group.local_blocks)
                assert (rows == before).all()  # as built
                rows[:] = expected_pages(
                    before, prefill_kv[g][d], heads, group.local_ids, group.remote_ids
                )
        expected.append(after)
    # Each decode rank's page bytes per block, over its refs: what its
    # slices must move per id, no head read twice.
    page_bytes = [
        sum(rank.places[g][d][3] for d in range(len(group.head_bytes)))
        for rank in decode[:1]
        for g, group in enumerate(shape.groups)
    ]
    moved = sum(n * b for n, b in zip(spec.group_sizes, page_bytes))
    for mode in ("plain", "coalesced", "prepped"):
        for buffer, copy in zip(everything, initial):
            buffer[:] = copy
        for r, table in enumerate(tables):
            mapping = ptrres.tp_mapping(r, decode_tp, prefill_tp, num_kv_heads, mla=mla)
            num_bytes = 0
            for s in mapping.slices:
                peer = peers[s.source_rank]
                if mode == "prepped":
                    local, remote, sizes = prepped_plan(
                        table, peer, s, spec, remote_ids
                    )
                else:
                    plan = table.plan_peer_transfer(
                        spec, peer, remote_ids, heads=s, coalesce=mode == "coalesced",
                        max_run_bytes=shape.max_run_bytes,
                    )  # fmt: skip
                    local, remote, sizes = plan.local, plan.remote, plan.sizes
                    assert plan.num_bytes == int(sizes.sum())
                execute_into(local, remote, sizes, everything)
                num_bytes += int(sizes.sum())
            assert num_bytes == moved, (mode, r)
        n_prefill = sum(len(rank.buffers) for rank in prefill)
        for buffer, copy in zip(everything[:n_prefill], initial[:n_prefill]):
            np.testing.assert_array_equal(buffer, copy, err_msg=f"{mode}: prefill side")
        for r, (rank, after) in enumerate(zip(decode, expected)):
            for b, (buffer, want) in enumerate(zip(rank.buffers, after)):
                np.testing.assert_array_equal(
                    buffer, want, err_msg=f"{mode}: decode rank {r}, allocation {b}"
                )


# Bad input -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "pattern"),
    [
        ((0, 3, 2, 4), {}, ptrres.LayoutError, "TP 3 here and TP 2 at the peer"),
        ((0, 4, 6, 12), {}, ptrres.LayoutError, "TP 4 here and TP 6"),
        ((0, 2, 2, 3), {}, ptrres.LayoutError, "3 KV heads do not split over TP 2"),
        ((0, 2, 4, 6), {}, ptrres.LayoutError, r"6 KV heads .* TP 4 \(the peer\)"),
        ((0, 6, 3, 4), {}, ptrres.LayoutError, r"4 KV heads .* TP 6 \(this engine\)"),
        ((2, 2, 2, 4), {}, ptrres.LayoutError, "tp_rank 2 is not a rank of TP 2"),
        ((-1, 2, 2, 4), {}, ptrres.LayoutError, "tp_rank -1 is not a rank of TP 2"),
        ((0, 0, 2, 4), {}, ptrres.LayoutError, "tp_size 0, .* from 1 to 65536"),
        ((0, 2, -2, 4), {}, ptrres.LayoutError, "peer_tp_size -2 .* from 1 to 65536"),
        ((0, 2, 2, 0), {}, ptrres.LayoutError, "num_kv_heads 0 must each"),
        ((0.0, 2, 2, 4), {}, ptrres.InputTypeError, "tp_rank must be an integer"),
        ((0, "2", 2, 4), {}, ptrres.InputTypeError, "tp_size must be an integer"),
        ((0, 2, True, 4), {}, ptrres.InputTypeError, "peer_tp_size must be an int"),
        ((0, 2, 2, None), {}, ptrres.InputTypeError, "num_kv_heads must be an int"),
        ((0, 2, 2, 4), {"mla": 1}, ptrres.InputTypeError, "mla must be True or"),
        ((0, 2, 2, 4), {"mla": "yes"}, ptrres.InputTypeError, "mla must be True or"),
        ((0, 2, 2, 4), {"kv_layout": "hnd"}, ptrres.InputTypeError, "kv_layout"),
        ((0, 2, 2, 4), {"kv_layout": None}, ptrres.InputTypeError, "kv_layout"),
        (
            (0, 2, 2, 4),
            {"kv_layout": np.array(["HND", "NHD"])},
            ptrres.InputTypeError,
            "kv_layout",
        ),
        ((0, 2, 1, 4), {"kv_layout": "NHD"}, ptrres.LayoutError, "NHD pages"),
        ((0, 2, 1, 4), {"kv_layout": "LBNHC"}, ptrres.LayoutError, "LBNHC pages"),
        (
            (1, 4, 2, 8),
            {"kv_layout": "LHBNC"},
            ptrres.LayoutError,
            r"LHBNC pages \(heads outside blocks.* reads 2 of the 4 heads.* LBHNC",
        ),
        ((0, 1, 2, 8), {"kv_layout": "BLNHC"}, ptrres.LayoutError, "BLNHC pages"),
        ((0, 2, 1, 2), {"kv_layout": "BHLNC"}, ptrres.LayoutError, "BHLNC pages"),
        ((0, 2, 2, 4), {"kv_layout": "lbhnc"}, ptrres.InputTypeError, "'LBHNC'"),
        ((0, 2, 2, 4), {"kv_layout": ""}, ptrres.InputTypeError, "kv_layout"),
    ],
)
def test_impossible_mappings_name_their_numbers(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type, pattern: str
) -> None:
    """Each impossible combination: ptrres's error naming the numbers, and
    the reference's error of the same class."""
    with pytest.raises(error, match=pattern):
        ptrres.tp_mapping(*args, **kwargs)
    with pytest.raises(error):
        reference.tp_mapping(*args, **kwargs)


@pytest.mark.parametrize(
    "args",
    [
        (0, 1, 2**62, 2**62),
        (0, 1, 2**17, 4),
        (0, 2**17, 2**17, 2**17),
        (0, 2, 2, 2**40),
    ],
)
@pytest.mark.parametrize("mla", [False, True])
def test_a_peers_huge_sizes_are_refused_not_walked(
    args: tuple[int, ...], mla: bool
) -> None:
    """A handshake can say TP 2**62: a mapping walks every rank and head, so
    tp_mapping, push_mapping and rank_heads refuse sizes past 2**16 at once
    (tp_mapping(0, 1, 2**62, 2**62) never returned; issue 40, item 4)."""
    for mapping in (ptrres.tp_mapping, ptrres.push_mapping):
        with pytest.raises(ptrres.LayoutError, match="from 1 to 65536"):
            mapping(*args, mla=mla)
    with pytest.raises(ptrres.LayoutError, match="from 1 to 65536"):
        ptrres.rank_heads(0, args[2], args[3])


def test_numpy_ints_and_mla_of_any_heads_are_mappings() -> None:
    """numpy ints are ints (the mapping holds Python ints); MLA's latent
    pages need no heads that split."""
    mapping = ptrres.tp_mapping(np.int64(1), np.int32(2), np.uint8(4), np.int16(8))
    assert mapping == ptrres.tp_mapping(1, 2, 4, 8)
    assert mapping == reference.tp_mapping(np.int64(1), 2, np.uint8(4), 8)
    assert all(type(v) is int for s in mapping.slices for v in s)
    mla = ptrres.tp_mapping(3, 4, 2, 3, mla=True)
    assert mla == reference.tp_mapping(3, 4, 2, 3, mla=True)
    assert [tuple(s) for s in mla.slices] == [(1, 0, 0, 1, 1, 1)]
    with pytest.raises(ptrres.LayoutError, match="peer rank 0 holds none"):
        mla.slice_of(0)


EXTREMES = [-1, 0, 2**31, 2**63 - 1, 2**63, 2**100, -(2**100)]
NOT_INTS = [None, True, 1.0, float("nan"), "3", b"3", [3], np.array([3]), object()]


def test_rank_heads_is_the_references_and_the_oracles() -> None:
    """Every rank of TP sizes up to 16 and heads up to 16 that split: the
    oracle's shard, the reference's (head by head), and plain ints."""
    checked = 0
    for tp in range(1, 17):
        for heads in range(1, 17):
            if tp % heads and heads % tp:
                continue
            for rank in range(tp):
                held = ptrres.rank_heads(rank, tp, heads)
                assert list(held) == shard(rank, tp, heads, False)
                assert held == reference_rank_heads(rank, tp, heads)
                assert type(held.start) is int
                checked += 1
    assert checked == 570  # the (rank, tp, heads) of the loops that split
    assert ptrres.rank_heads(np.int64(3), np.uint8(4), np.int32(8)) == range(6, 8)


@pytest.mark.parametrize(
    ("args", "error", "pattern"),
    [
        # Issue 40: each of these was an answer, or a ZeroDivisionError.
        ((5, 4, 8), ptrres.LayoutError, "tp_rank 5 is not a rank of TP 4"),
        ((-1, 2, 4), ptrres.LayoutError, "tp_rank -1 is not a rank of TP 2"),
        ((0, 0, 8), ptrres.LayoutError, "tp_size 0 and num_kv_heads 8 must each"),
        ((0, 2, 0), ptrres.LayoutError, "tp_size 2 and num_kv_heads 0 must each"),
        ((0, -4, 8), ptrres.LayoutError, "tp_size -4"),
        ((0, 3, 8), ptrres.LayoutError, "8 KV heads do not split over TP 3"),
        ((0, 4, 6), ptrres.LayoutError, "6 KV heads do not split over TP 4"),
        ((4, 4, 2), ptrres.LayoutError, "tp_rank 4 is not a rank of TP 4"),
        ((0.0, 2, 4), ptrres.InputTypeError, "tp_rank must be an integer"),
        ((0, True, 4), ptrres.InputTypeError, "tp_size must be an integer"),
        ((0, 2, "4"), ptrres.InputTypeError, "num_kv_heads must be an integer"),
        ((0, 2, np.float64(4)), ptrres.InputTypeError, "num_kv_heads must be"),
        ((None, 2, 4), ptrres.InputTypeError, "tp_rank must be an integer"),
    ],
)
def test_rank_heads_refuses_what_tp_mapping_refuses(
    args: tuple[Any, ...], error: type, pattern: str
) -> None:
    """The checks and errors of tp_mapping, naming the numbers; the
    reference raises the same class."""
    with pytest.raises(error, match=pattern):
        ptrres.rank_heads(*args)
    with pytest.raises(error):
        reference_rank_heads(*args)
    if error is ptrres.LayoutError:  # tp_mapping refuses the same numbers
        with pytest.raises(ptrres.LayoutError):
            ptrres.tp_mapping(args[0], args[1], 1, args[2])


@given(
    st.integers(0, 2),
    st.one_of(
        st.integers(-3, 20), st.sampled_from(EXTREMES), st.sampled_from(NOT_INTS)
    ),
    st.tuples(*[st.sampled_from([0, 1, 2, 3, 4, 8])] * 3),
)
@example(0, 2**62, (0, 2**62, 2**61))  # huge but possible: ranks of one head
@example(1, 2**63, (2**63 - 1, 0, 4))
def test_any_input_to_rank_heads_is_the_references_answer_or_its_error(
    position: int, hostile: Any, numbers: tuple[int, ...]
) -> None:
    """One argument of anything: heads of the rank, inside the model's, or
    a PtrresError; the reference's answer or error where it can walk the
    heads."""
    args = list(numbers)
    args[position] = hostile
    small = all(not isinstance(a, int) or abs(a) <= 2**12 for a in args)
    try:
        held = ptrres.rank_heads(*args)
    except ptrres.PtrresError as error:
        if small:
            with pytest.raises(type(error)):
                reference_rank_heads(*args)
        return
    rank, tp, heads = (int(a) for a in args)
    assert 0 <= held.start < held.stop <= heads
    assert len(held) == max(1, heads // tp)
    assert held.start == rank * heads // tp
    if small:
        assert held == reference_rank_heads(*args)


@given(
    st.integers(0, 3),
    st.one_of(
        st.integers(-3, 20), st.sampled_from(EXTREMES), st.sampled_from(NOT_INTS)
    ),
    st.tuples(*[st.sampled_from([0, 1, 2, 4, 8, 3, 6])] * 4),
    st.sampled_from([False, True, None, 0]),
    st.sampled_from(["HND", "NHD", "LBHNC", "LHBNC", "BHLNC", "nhd", None, 0]),
)
@example(2, 2**62, (0, 1, 4, 4), False, "HND")  # a peer TP of 2**62, 4 heads
@example(1, 2**63, (0, 4, 1, 4), True, "NHD")
def test_any_input_to_tp_mapping_is_the_references_answer_or_its_error(
    position: int, hostile: Any, numbers: tuple[int, ...], mla: Any, layout: Any
) -> None:
    """One argument of anything, the others small: the reference's mapping,
    or a PtrresError of the reference's class (it walks every head, so it
    is asked only where the heads are few)."""
    args = list(numbers)
    args[position] = hostile
    # The reference walks heads and ranks one by one: asked of small ones.
    small = not isinstance(hostile, int) or abs(hostile) <= 2**12
    try:
        mapping = ptrres.tp_mapping(*args, mla=mla, kv_layout=layout)
    except ptrres.PtrresError as error:
        if small:
            with pytest.raises(type(error)):
                reference.tp_mapping(*args, mla=mla, kv_layout=layout)
        return
    if small:
        assert mapping == reference.tp_mapping(*args, mla=mla, kv_layout=layout)
        assert_mapping_holds(
            mapping, mapping.tp_rank, mapping.tp_size, mapping.peer_tp_size,
            mapping.num_kv_heads, mapping.mla,
        )  # fmt: skip
    else:  # one slice per peer rank that gives heads, each within its pages
        assert 1 <= len(mapping.slices) <= max(numbers)
        for s in mapping.slices:
            assert s.local_head + s.num_heads <= s.local_heads
            assert s.remote_head + s.num_heads <= s.remote_heads


BAD_SLICES = [
    (ptrres.HeadSlice(0, 5, 0, 1, 2, 4), ptrres.LayoutError, "heads 5 to 5 are not"),
    (ptrres.HeadSlice(0, 0, 3, 2, 2, 4), ptrres.LayoutError, "heads 3 to 4 are not"),
    (ptrres.HeadSlice(0, -1, 0, 1, 2, 4), ptrres.LayoutError, "heads -1 to -1"),
    (ptrres.HeadSlice(0, 0, 0, 0, 2, 4), ptrres.LayoutError, "at least one head"),
    (ptrres.HeadSlice(-1, 0, 0, 1, 2, 4), ptrres.LayoutError, "at least one head"),
    (ptrres.HeadSlice(0, 0, 0, 1, 0, 4), ptrres.LayoutError, "page of 0 heads"),
    (ptrres.HeadSlice(0, 0, 0, 1.0, 2, 4), ptrres.InputTypeError, "num_heads must"),  # type: ignore[arg-type]
    (ptrres.HeadSlice(0, 0, 0, 1, 2, True), ptrres.InputTypeError, "remote_heads"),
    ((0, 0, 0, 1, 2, 4), ptrres.InputTypeError, "must be a HeadSlice"),
    (np.array([0, 0, 0, 1, 2, 4]), ptrres.InputTypeError, "must be a HeadSlice"),
    ("0", ptrres.InputTypeError, "must be a HeadSlice"),
    (ptrres.tp_mapping(0, 2, 1, 4), ptrres.InputTypeError, "got TPMapping"),
]


@pytest.mark.parametrize(("heads", "error", "pattern"), BAD_SLICES)
@pytest.mark.parametrize("primed", [None, "slice", "whole"])
def test_a_bad_slice_is_refused_before_anything(
    heads: Any, error: type, pattern: str, primed: str | None
) -> None:
    """A slice made by hand that would address past a page, or of no heads,
    or not a HeadSlice at all: refused by plans (after a plan of another
    slice, or of none, too), prepared lists and the reference; nothing
    written into out=, and the table keeps working."""
    local, table, peer = sliced_engines()
    good = ptrres.tp_mapping(1, 2, 1, 4).slices[0]
    spec = ptrres.GPULoadStoreSpec(np.array([1, 2, 3, 4]), [2, 2])
    if primed is not None:  # a pair cached for another slice
        whole = ptrres.HeadSlice(0, 0, 0, 2, 2, 2)
        other_peer = peer if primed == "slice" else sliced_engines(2, 2)[2]
        other = good if primed == "slice" else whole
        table.plan_peer_transfer(spec, other_peer, [1, 2, 3, 4], heads=other)
    out = tuple(np.full(8, 7, np.uint64) for _ in FIELDS)
    with pytest.raises(error, match=pattern):
        table.plan_peer_transfer(spec, peer, [5, 6, 7, 8], heads=heads, out=out)
    assert all((buffer == 7).all() for buffer in out)
    for call in (
        lambda: ptrres.nixl.prepped_pair(table, peer, heads),
        lambda: ptrres.nixl.prepped_rows(table, heads=heads),
        lambda: ptrres.nixl.prepped_rows(peer, heads=heads),
    ):
        with pytest.raises(error, match=pattern):
            call()
    with pytest.raises(error):
        reference.plan_peer_transfer(
            spec, local, peer.groups, [5, 6, 7, 8], heads=heads
        )
    plan = table.plan_peer_transfer(spec, peer, [5, 6, 7, 8], heads=good, out=out)
    assert plan.sizes.tolist() == [16] * 8


@pytest.mark.parametrize(
    ("local_heads", "remote_heads", "local_page", "remote_page", "pattern"),
    [
        # 16 B a head here, 12 B at the peer.
        (2, 4, 32, 48, r"a head is 16 B in this rank's page \(32 B, 2 heads\) but "
         r"12 B in peer rank 0's \(48 B, 4 heads\): its page must be 64 B"),
        (2, 4, 33, 64, "this rank's page of 33 B does not split into its 2 heads"),
        (2, 4, 32, 66, "peer rank 0's page of 66 B does not split into its 4 heads"),
        (1, 1, 32, 64, "a head is 32 B in this rank's page"),
    ],
)  # fmt: skip
def test_a_peer_page_of_other_bytes_per_head_is_refused(
    local_heads: int, remote_heads: int, local_page: int, remote_page: int, pattern: str
) -> None:
    """A peer rank whose page is not the right multiple of this rank's: a
    LayoutError naming the group, the ref and the bytes, nothing written,
    and the table still working."""
    heads = ptrres.HeadSlice(0, 0, 0, 1, local_heads, remote_heads)
    pages = [32 * local_heads, 32 * local_heads, local_page]
    tensors = byte_tensors(6, pages, False, 0)
    local = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(t, row_stride(t)) for t in tensors],
        [[ptrres.CanonicalKVCacheRef(0, pages[0])],
         [ptrres.CanonicalKVCacheRef(1, pages[1]),
          ptrres.CanonicalKVCacheRef(2, pages[2])]],
    )  # fmt: skip
    table = ptrres.PointerTable(local)

    def peer_of(last_page: int) -> ptrres.PeerLayout:
        """The peer's numbers (plans read no memory): pages of 32 B a head
        but the last ref's, 8 blocks each, 4 KiB apart."""
        page = 32 * remote_heads
        refs = [
            (2**20 + 2**12 * i, 2**9, p, 8)
            for i, p in enumerate((page, page, last_page))
        ]
        return ptrres.PeerLayout([refs[:1], refs[1:]])

    peer = peer_of(remote_page)
    spec = ptrres.GPULoadStoreSpec(np.array([1, 2]), [1, 1])
    out = tuple(np.full(3, 7, np.uint64) for _ in FIELDS)
    with pytest.raises(ptrres.LayoutError, match=f"group 1, ref 1: {pattern}"):
        table.plan_peer_transfer(spec, peer, [3, 4], heads=heads, out=out)
    assert all((buffer == 7).all() for buffer in out)
    with pytest.raises(ptrres.LayoutError, match=pattern):
        ptrres.nixl.prepped_pair(table, peer, heads)
    with pytest.raises(ptrres.LayoutError):
        reference.plan_peer_transfer(spec, local, peer.groups, [3, 4], heads=heads)
    if local_page % local_heads == 0:  # the page the peer should have had
        right = peer_of(local_page // local_heads * remote_heads)
        plan = table.plan_peer_transfer(spec, right, [3, 4], heads=heads, out=out)
        assert plan.sizes.tolist() == [32, 32, local_page // local_heads]
        assert plan.remote.tolist()[2] == 2**20 + 2 * 2**12 + 4 * 2**9


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_are_sliced_where_heads_are_a_byte_range(layout: str) -> None:
    """A peer's pages of each layout: a slice of some of its heads plans as
    on HND pages where they are one byte range of a page (HND, vLLM's LBHNC
    and BLHNC), and is refused elsewhere by plans and prepared lists, naming
    the layout and saying what works; a whole-page slice, or none, plans as
    on HND pages whatever the layout."""
    _, table, hnd_peer = sliced_engines(2, 4)
    peer = ptrres.PeerLayout(hnd_peer.groups, kv_layout=layout)
    assert (peer.kv_layout, hnd_peer.kv_layout) == (layout, None)
    part = ptrres.tp_mapping(1, 2, 1, 4).slices[0]
    spec = ptrres.GPULoadStoreSpec(np.array([1, 2, 3, 4]), [2, 2])
    calls = (
        lambda: table.plan_peer_transfer(spec, peer, [5, 6, 7, 8], heads=part),
        lambda: ptrres.nixl.prepped_pair(table, peer, part),
        lambda: ptrres.nixl.prepped_rows(peer, heads=part),
    )
    if layout in SLICEABLE_LAYOUTS:
        assert_same_plan(
            calls[0](),
            table.plan_peer_transfer(spec, hnd_peer, [5, 6, 7, 8], heads=part),
        )
        for rows, expected in zip(
            ptrres.nixl.prepped_pair(table, peer, part),
            ptrres.nixl.prepped_pair(table, hnd_peer, part),
        ):
            np.testing.assert_array_equal(rows.xfer_list, expected.xfer_list)
    else:
        for call in calls:
            with pytest.raises(
                ptrres.LayoutError,
                match=rf"are {layout} \(.*\): the 2 of 4 heads .* LBHNC or BLHNC",
            ):
                call()
    sliced = table.plan_peer_transfer(spec, hnd_peer, [5, 6, 7, 8], heads=part)
    assert sliced.sizes.tolist() == [16] * 8
    # Whole pages: the same plan with or without the slice, any layout.
    _, same_table, same_peer = sliced_engines(4, 4)
    whole_pages = ptrres.PeerLayout(same_peer.groups, kv_layout=layout)
    (whole,) = ptrres.tp_mapping(0, 2, 2, 8, kv_layout=layout).slices
    assert whole.whole_page
    plain = same_table.plan_peer_transfer(spec, same_peer, [5, 6, 7, 8])
    for peer, heads in ((whole_pages, whole), (whole_pages, None), (same_peer, whole)):
        assert_same_plan(
            same_table.plan_peer_transfer(spec, peer, [5, 6, 7, 8], heads=heads), plain
        )
    layouts: tuple[Any, Any] = (same_table, same_peer)
    for rows, side in zip(
        ptrres.nixl.prepped_pair(same_table, whole_pages, whole), layouts
    ):
        np.testing.assert_array_equal(
            rows.xfer_list, ptrres.nixl.prepped_rows(side).xfer_list
        )


@pytest.mark.parametrize(
    "bad", ["hnd", "lbhnc", "LBHNC ", "", "KVCacheLayout.LBHNC", 0, b"HND"]
)
def test_a_peer_layout_of_no_known_layout_is_refused(bad: Any) -> None:
    """Another case, another spelling, another type: refused, never read as
    unknown; the names ptrres reads are listed."""
    _, _, peer = sliced_engines()
    with pytest.raises(ptrres.InputTypeError, match=r"kv_layout .*must be one of"):
        ptrres.PeerLayout(peer.groups, kv_layout=bad)
    with pytest.raises(ptrres.InputTypeError, match="'LBHNC', 'LBNHC'"):
        ptrres.PeerLayout(peer.groups, kv_layout=np.array(["HND"]))  # type: ignore[arg-type]


# vLLM's NIXL handshake ------------------------------------------------------


def handshake(peer: ptrres.PeerLayout, **fields: Any) -> SimpleNamespace:
    """A NixlAgentMetadata of vLLM 0.33's fields (tests/vllm builds the real
    one) describing a peer layout's refs, one region per ref, group ids in
    region_group_ids; ``fields`` replace some."""
    refs = [ref for group in peer.groups for ref in group]
    values: dict[str, Any] = {
        "engine_id": "prefill",
        "agent_metadata": b"",
        "kv_caches_base_addr": [r.base_ptr for r in refs],
        "device_id": 3,
        "num_blocks": 99,
        "block_lens": [r.page_size_bytes for r in refs],
        "block_strides": [r.row_stride_bytes for r in refs],
        "kv_cache_layout": "HND",
        "block_size": 16,
        "ssm_sizes": (0, 0),
        "attn_backend_name": "FLASH_ATTN",
        "physical_blocks_per_logical_kv_block": 1,
        "region_num_blocks": [r.num_blocks for r in refs],
        "region_group_ids": [g for g, group in enumerate(peer.groups) for _ in group],
        "region_names": None,
        "region_mem_types": ["DRAM"] * len(refs),
        "dcp_size": 1,
        "pcp_size": 1,
        "ple_block_len": None,
        "region_members": [],
        "packed_member_layouts": {},
    }
    values.update(fields)
    return SimpleNamespace(**values)


def test_a_handshake_is_the_peer_layout_it_describes() -> None:
    """The regions of a handshake, group by group, plan as the layout they
    came from: sliced and whole, the same descriptors."""
    _, table, peer = sliced_engines(2, 4)
    from_handshake = ptrres.PeerLayout.from_nixl_metadata(handshake(peer))
    assert from_handshake.kv_layout == "HND"
    host = [[r._replace(allocation=None) for r in group] for group in peer.groups]
    assert [list(group) for group in from_handshake.groups] == host
    spec = ptrres.GPULoadStoreSpec(np.array([1, 2, 3, 4]), [2, 2])
    for heads in ptrres.tp_mapping(1, 2, 1, 4).slices:
        assert_same_plan(
            table.plan_peer_transfer(spec, from_handshake, [5, 6, 7, 8], heads=heads),
            table.plan_peer_transfer(spec, peer, [5, 6, 7, 8], heads=heads),
        )
    # VRAM regions are the peer's device; without region_mem_types, all are.
    vram = ptrres.PeerLayout.from_nixl_metadata(
        handshake(peer, region_mem_types=["VRAM", "DRAM", "VRAM", "DRAM"])
    )
    assert [r.device for g in vram.groups for r in g] == [3, -1, 3, -1]
    default = ptrres.PeerLayout.from_nixl_metadata(
        handshake(peer, region_mem_types=None, device_id=np.int64(5))
    )
    assert {r.device for g in default.groups for r in g} == {5}
    # No region_num_blocks: every region has num_blocks.
    counts = ptrres.PeerLayout.from_nixl_metadata(
        handshake(peer, region_num_blocks=None)
    )
    assert {r.num_blocks for g in counts.groups for r in g} == {99}
    nhd = ptrres.PeerLayout.from_nixl_metadata(handshake(peer, kv_cache_layout="NHD"))
    assert nhd.kv_layout == "NHD"
    with pytest.raises(ptrres.LayoutError, match="NHD"):
        table.plan_peer_transfer(
            spec, nhd, [5, 6, 7, 8], heads=ptrres.tp_mapping(1, 2, 1, 4).slices[0]
        )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_handshakes_layout_is_the_peer_layouts(layout: str) -> None:
    """Every layout vLLM sends (a KVCacheLayout name), and ptrres's own HND
    and NHD, read as given; a slice of some heads plans where they are one
    byte range of a page and is refused elsewhere (issue 40: LBNHC, vLLM's
    NHD, was read as unknown and its slice planned); whole pages plan on
    every layout."""
    _, table, peer = sliced_engines(2, 4)
    layout_peer = ptrres.PeerLayout.from_nixl_metadata(
        handshake(peer, kv_cache_layout=layout)
    )
    assert layout_peer.kv_layout == layout
    assert type(layout_peer.kv_layout) is str
    spec = ptrres.GPULoadStoreSpec(np.array([1, 2, 3, 4]), [2, 2])
    part = ptrres.tp_mapping(0, 2, 1, 4).slices[0]
    if layout in SLICEABLE_LAYOUTS:
        assert_same_plan(
            table.plan_peer_transfer(spec, layout_peer, [5, 6, 7, 8], heads=part),
            table.plan_peer_transfer(spec, peer, [5, 6, 7, 8], heads=part),
        )
    else:
        with pytest.raises(ptrres.LayoutError, match=f"are {layout} .* LBHNC"):
            table.plan_peer_transfer(spec, layout_peer, [5, 6, 7, 8], heads=part)
    _, same_table, same_peer = sliced_engines(4, 4)
    whole_pages = ptrres.PeerLayout.from_nixl_metadata(
        handshake(same_peer, kv_cache_layout=layout)
    )
    (whole,) = ptrres.tp_mapping(0, 2, 2, 8, kv_layout=layout).slices
    assert_same_plan(
        same_table.plan_peer_transfer(spec, whole_pages, [5, 6, 7, 8], heads=whole),
        same_table.plan_peer_transfer(spec, same_peer, [5, 6, 7, 8]),
    )


@pytest.mark.parametrize(
    ("layout", "error", "pattern"),
    [
        ("nhd", ptrres.LayoutError, "kv_cache_layout 'nhd': ptrres reads"),
        ("lbnhc", ptrres.LayoutError, "kv_cache_layout 'lbnhc'"),
        ("", ptrres.LayoutError, "kv_cache_layout '': .* LBHNC, LBNHC"),
        ("KVCacheLayout.LBHNC", ptrres.LayoutError, "'KVCacheLayout.LBHNC'"),
        ("LHNBC", ptrres.LayoutError, "'LHNBC'"),  # no member of vLLM's
        (None, ptrres.InputTypeError, "kv_cache_layout must be .* NoneType"),
        (0, ptrres.InputTypeError, "kv_cache_layout must be .* int 0"),
        (b"LBHNC", ptrres.InputTypeError, "kv_cache_layout must be"),
        (("LBHNC",), ptrres.InputTypeError, "kv_cache_layout must be"),
    ],
)
def test_a_handshake_of_no_known_layout_is_refused(
    layout: Any, error: type, pattern: str
) -> None:
    """An unknown or malformed kv_cache_layout is refused with the names
    ptrres reads, never read as unknown."""
    _, _, peer = sliced_engines()
    with pytest.raises(error, match=pattern):
        ptrres.PeerLayout.from_nixl_metadata(handshake(peer, kv_cache_layout=layout))


def test_a_handshake_without_a_layout_is_refused() -> None:
    """vLLM always sends kv_cache_layout (a field of NixlAgentMetadata
    without a default in 0.30 to 0.34): a handshake without it is malformed,
    refused as one without its regions is."""
    _, _, peer = sliced_engines()
    missing = handshake(peer)
    del missing.kv_cache_layout
    with pytest.raises(ptrres.InputTypeError, match="has no kv_cache_layout"):
        ptrres.PeerLayout.from_nixl_metadata(missing)


@pytest.mark.parametrize(
    ("group_ids", "groups"),
    [
        # Hybrid: each region its group's, region 2 shared by every group.
        ([0, 1, -1, 1], [[0, 2], [1, 2, 3]]),
        ([1, -1, 1, 0], [[1, 3], [0, 1, 2]]),
        # A group without regions of its own keeps the shared ones.
        ([0, 2, -1, 2], [[0, 2], [2], [1, 2, 3]]),
        # One group id (or none): one group of every region, as vLLM.
        ([0, 0, 0, 0], [[0, 1, 2, 3]]),
        ([1, 1, 1, 1], [[0, 1, 2, 3]]),
        ([0, -1, 0, -1], [[0, 1, 2, 3]]),
        ([-1, -1, -1, -1], [[0, 1, 2, 3]]),
        (None, [[0, 1, 2, 3]]),
    ],
)
def test_region_group_ids_make_the_groups(
    group_ids: list[int] | None, groups: list[list[int]]
) -> None:
    _, _, peer = sliced_engines()
    regions = [ref for group in peer.groups for ref in group]
    layout = ptrres.PeerLayout.from_nixl_metadata(
        handshake(peer, region_group_ids=group_ids, region_num_blocks=[4, 5, 6, 7])
    )
    assert [[r.num_blocks - 4 for r in group] for group in layout.groups] == groups
    assert [[r.base_ptr for r in g] for g in layout.groups] == [
        [regions[i].base_ptr for i in group] for group in groups
    ]


@pytest.mark.parametrize(
    ("fields", "error", "pattern"),
    [
        ({"ssm_sizes": (4096, 128)}, ptrres.LayoutError, r"ssm_sizes \(Mamba"),
        ({"dcp_size": 2}, ptrres.LayoutError, "dcp_size 2"),
        ({"pcp_size": 4}, ptrres.LayoutError, "pcp_size 4"),
        ({"ple_block_len": 32}, ptrres.LayoutError, r"ple_block_len \(PLE"),
        (
            {"packed_member_layouts": {"layer.0": (0, 64)}},
            ptrres.LayoutError,
            "packed_member_layouts",
        ),
        ({"dcp_size": 2, "pcp_size": 2}, ptrres.LayoutError, "dcp_size 2, pcp_size 2"),
        (
            {"block_lens": [32, 32, 32]},
            ptrres.LayoutError,
            "4 regions .* but 3 block_lens",
        ),
        ({"block_strides": [36] * 5}, ptrres.LayoutError, "but 5 block_strides"),
        ({"region_num_blocks": [3]}, ptrres.LayoutError, "but 1 region_num_blocks"),
        ({"region_group_ids": [0, 1]}, ptrres.LayoutError, "but 2 region_group_ids"),
        ({"region_mem_types": ["DRAM"] * 3}, ptrres.LayoutError, "3 region_mem_types"),
        ({"region_mem_types": ["DRAM", "FILE"] * 2}, ptrres.LayoutError, "'FILE'"),
        (
            {"region_group_ids": [0, -2, 1, 1]},
            ptrres.LayoutError,
            "every group \\(-1\\)",
        ),
        (
            {"region_group_ids": [0, 1.5, 1, 1]},
            ptrres.InputTypeError,
            "region_group_ids",
        ),
        ({"region_num_blocks": 7}, ptrres.InputTypeError, "region_num_blocks"),
        ({"device_id": "cuda:0"}, ptrres.InputTypeError, "device_id"),
        ({"block_lens": [64, 32, 32, 32]}, ptrres.LayoutError, "larger than the row"),
        ({"kv_caches_base_addr": [-8] * 4}, ptrres.LayoutError, "none may be negative"),
        # What issue 40's fuzz (test_peer_hostile) found: each raised
        # another exception, was read as something else, or hung.
        ({"ssm_sizes": float("nan")}, ptrres.InputTypeError, "ssm_sizes must be"),
        ({"ssm_sizes": 5}, ptrres.InputTypeError, "ssm_sizes must be a sequence"),
        ({"ssm_sizes": np.array([8, 0])}, ptrres.LayoutError, r"ssm_sizes \(Mamba"),
        ({"ssm_sizes": (0, 1.5)}, ptrres.InputTypeError, "ssm_sizes must be an int"),
        ({"packed_member_layouts": 5}, ptrres.InputTypeError, "packed_member"),
        ({"region_group_ids": 0}, ptrres.InputTypeError, "region_group_ids must"),
        ({"region_num_blocks": []}, ptrres.LayoutError, "but 0 region_num_blocks"),
        ({"region_mem_types": 0}, ptrres.InputTypeError, "region_mem_types must"),
        ({"dcp_size": 1.0}, ptrres.InputTypeError, "dcp_size must be an integer"),
        ({"pcp_size": True}, ptrres.InputTypeError, "pcp_size must be an integer"),
        ({"num_blocks": float("nan")}, ptrres.InputTypeError, "num_blocks must be"),
        ({"device_id": -1}, ptrres.LayoutError, "device_id -1: a CUDA device"),
        ({"device_id": 2**64}, ptrres.LayoutError, "device_id 18446744073709551616"),
        (
            {"region_group_ids": [0, 10**12, 1, 1]},
            ptrres.LayoutError,
            "numbered below its 4 regions",
        ),
        ({"region_group_ids": [0, 1, 4, 1]}, ptrres.LayoutError, "below its 4"),
    ],
)
def test_a_handshake_of_what_ptrres_cannot_read_is_refused(
    fields: dict[str, Any], error: type, pattern: str
) -> None:
    """Mamba state, context parallelism, packed regions, fields of other
    lengths, unknown memory or group ids: a clear error; then a good
    handshake still reads."""
    _, table, peer = sliced_engines()
    with pytest.raises(error, match=pattern):
        ptrres.PeerLayout.from_nixl_metadata(handshake(peer, **fields))
    missing = handshake(peer)
    del missing.kv_caches_base_addr
    with pytest.raises(ptrres.InputTypeError, match="kv_caches_base_addr"):
        ptrres.PeerLayout.from_nixl_metadata(missing)
    layout = ptrres.PeerLayout.from_nixl_metadata(handshake(peer))
    spec = ptrres.GPULoadStoreSpec(np.array([1, 2]), [1, 1])
    heads = ptrres.tp_mapping(0, 2, 1, 4).slices[0]
    assert table.plan_peer_transfer(spec, layout, [3, 4], heads=heads).num_bytes == 64
