"""Peer plans moved by real NIXL agents in two processes, over UCX (SPEC 14).

Transfer descriptors (peer_xfer_descs of plan_peer_transfer's plans, plain
and coalesced) and prepared lists (prepped_rows and prepped_indices) move
blocks between this process's KV caches and a peer process's, READ and
WRITE, several transfers in a row, on numpy arrays and torch CPU tensors,
one KV-cache group and hybrid layouts. After each transfer every byte of
both sides' buffers, guard zones included, must be what the reference's own
plan, executed on copies of the same buffers, leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from nixl_harness import DESIGNS, OPS, PeerProcess, Transfer, peer_process, race_free

import ptrres
from ptrres import reference

# ids of group g, k-th, on a side with n blocks: runs up and down, scattered
# ids, and ids repeated on the source side (NIXL's order is not the plan's:
# a destination block is written once, see race_free).
Pattern = Callable[[int, int, int], int]
PATTERNS: list[tuple[str, str, Pattern, Pattern, int]] = [
    # (name, op, local id, remote id, ids per group), each f(g, k, n)
    ("ascending", "WRITE", lambda g, k, n: 2 * g + k, lambda g, k, n: 4 * g + k + 1, 4),
    (
        "descending",
        "READ",
        lambda g, k, n: n - 1 - 4 * g - k,
        lambda g, k, n: 5 + g - k,
        4,
    ),
    (
        "scattered",
        "WRITE",
        lambda g, k, n: (7 * k + 3 * g) % n,
        lambda g, k, n: (5 * k + 2 + g) % n,
        5,
    ),
    ("repeated source", "WRITE", lambda g, k, n: g + 1, lambda g, k, n: 3 * k + g, 4),
    ("repeated source", "READ", lambda g, k, n: 3 * k + g, lambda g, k, n: 7 - g, 4),
    # The first and the last block of each ref: a merged copy runs from tensor
    # 0's last row into tensor 1's first (one allocation on both sides).
    (
        "first and last",
        "READ",
        lambda g, k, n: (0, 1, n - 1)[k],
        lambda g, k, n: (0, 1, n - 1)[k],
        3,
    ),
    (
        "first and last",
        "WRITE",
        lambda g, k, n: (0, 1, n - 1)[k],
        lambda g, k, n: (0, 1, n - 1)[k],
        3,
    ),
]


@pytest.fixture(scope="module")
def peer() -> Iterator[PeerProcess]:
    """One peer process for every test of this module, stopped at its end."""
    with peer_process(DESIGNS) as process:
        yield process


def patterned(key: str, op: str, local: Pattern, remote: Pattern, n: int) -> Transfer:
    """A transfer of a pattern, its ids modulo each group's block limit on
    their side, less the racing pairs."""
    local_design, peer_design = DESIGNS[key]
    local_ids, remote_ids = [], []
    for g, (n_local, n_remote) in enumerate(
        zip(local_design.group_limits(), peer_design.group_limits())
    ):
        local_ids.append([local(g, k, n_local) % n_local for k in range(n)])
        remote_ids.append([remote(g, k, n_remote) % n_remote for k in range(n)])
    return race_free(op, local_design.group_tensors(), local_ids, remote_ids)


LAYOUTS = ["numpy one group", "numpy hybrid", "torch one group", "torch hybrid"]


@pytest.mark.parametrize("coalesce", [False, True], ids=["plain", "coalesced"])
@pytest.mark.parametrize("key", LAYOUTS)
def test_descriptors_move_the_reference_bytes(
    peer: PeerProcess, key: str, coalesce: bool
) -> None:
    """peer_xfer_descs of plan_peer_transfer's plans, every pattern in a row."""
    peer.reset(key)
    for _, op, local, remote, n in PATTERNS:
        peer.transfer(key, patterned(key, op, local, remote, n), coalesce=coalesce)


@pytest.mark.parametrize("key", LAYOUTS)
def test_prepared_lists_move_the_reference_bytes(peer: PeerProcess, key: str) -> None:
    """make_prepped_xfer with prepped_indices into prepped_rows' lists."""
    peer.reset(key)
    for _, op, local, remote, n in PATTERNS:
        peer.transfer(key, patterned(key, op, local, remote, n), prepared=True)


@pytest.mark.parametrize("key", ["numpy hybrid", "torch one group"])
def test_merged_copies_cross_tensors_of_one_allocation(
    peer: PeerProcess, key: str
) -> None:
    """The coalesced plan of the first and last blocks merges a copy from
    tensor 0's last row into tensor 1's first on both sides, and NIXL takes
    it (one registration spans both tensors)."""
    transfer = patterned(key, *PATTERNS[-1][1:])
    pair = peer.reset(key)
    plain, merged = (
        pair.local.table.plan_peer_transfer(
            transfer.spec, pair.peer, transfer.flat_remote_ids, coalesce=coalesce
        )
        for coalesce in (False, True)
    )
    page = DESIGNS[key][0].tensors[0].row_bytes
    # Blocks 0, 1 and the last: rows 0 and 1 of tensor 0 merge, and its last
    # row with rows 0 and 1 of tensor 1 (3 pages, across the two tensors).
    assert sorted(merged.sizes.tolist())[-2:] == [2 * page, 3 * page]
    assert len(merged.sizes) < len(plain.sizes)
    assert merged.num_bytes == plain.num_bytes
    peer.transfer(key, transfer, coalesce=True)


@st.composite
def group_ids(draw: Any, n_local: int, n_remote: int) -> tuple[list[int], list[int]]:
    """Pairs of ids of one group: runs up or down on both sides, an id
    repeated on one side, scattered ids."""
    local: list[int] = []
    remote: list[int] = []
    n = draw(st.integers(0, 6))
    while len(local) < n:
        local_step, remote_step = draw(
            st.sampled_from([(1, 1), (-1, -1), (0, 1), (1, 0), (3, 5), (-2, 3)])
        )
        start, other = (
            draw(st.integers(0, n_local - 1)),
            draw(st.integers(0, n_remote - 1)),
        )
        for k in range(min(draw(st.integers(1, 4)), n - len(local))):
            local.append((start + k * local_step) % n_local)
            remote.append((other + k * remote_step) % n_remote)
    return local, remote


@st.composite
def transfers(draw: Any, key: str) -> tuple[Transfer, str]:
    """A transfer of any ids (less the racing pairs), and how to move it:
    "plain" or "coalesced" descriptors, or "prepared" lists."""
    local_design, peer_design = DESIGNS[key]
    pairs = [
        draw(group_ids(n_local, n_remote))
        for n_local, n_remote in zip(
            local_design.group_limits(), peer_design.group_limits()
        )
    ]
    op = draw(st.sampled_from(OPS))
    transfer = race_free(
        op,
        local_design.group_tensors(),
        [local for local, _ in pairs],
        [remote for _, remote in pairs],
    )
    return transfer, draw(st.sampled_from(["plain", "coalesced", "prepared"]))


@settings(max_examples=20)
@given(data=st.data())
def test_any_transfers_move_the_reference_bytes(peer: PeerProcess, data: Any) -> None:
    """Transfers of drawn ids, one to three in a row, each checked."""
    key = data.draw(st.sampled_from(LAYOUTS), label="key")
    peer.reset(key)
    for _ in range(data.draw(st.integers(1, 3), label="transfers")):
        transfer, mode = data.draw(transfers(key), label="transfer")
        if not sum(transfer.group_sizes):
            # NIXL takes no empty list: ptrres says so before NIXL sees it.
            plan = peer.pairs[key].local.table.plan_peer_transfer(
                transfer.spec, peer.pairs[key].peer, transfer.flat_remote_ids
            )
            with pytest.raises(ptrres.SpecError, match="no descriptor"):
                ptrres.nixl.peer_xfer_descs(
                    plan, local=ptrres.nixl.DRAM, remote=ptrres.nixl.DRAM
                ).dlists(peer.agent)
            continue
        peer.transfer(
            key, transfer, coalesce=mode == "coalesced", prepared=mode == "prepared"
        )


def test_plans_are_the_references(peer: PeerProcess) -> None:
    """The plan NIXL moves is the reference's plan of the peer's numbers (the
    bytes checks compare against the reference's plan on the copies)."""
    key = "torch hybrid"
    pair = peer.reset(key)
    transfer = patterned(key, *PATTERNS[2][1:])
    plan = pair.local.table.plan_peer_transfer(
        transfer.spec, pair.peer, transfer.flat_remote_ids
    )
    expected = reference.plan_peer_transfer(
        transfer.spec, pair.local.kv_caches, pair.peer.groups, transfer.flat_remote_ids
    )
    for name in ("local", "remote", "sizes"):
        assert getattr(plan, name).tolist() == getattr(expected, name).tolist(), name
