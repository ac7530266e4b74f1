"""Bad block ids never reach NIXL (SPEC 7, 14).

At every ref boundary of both sides (-1, the ref's block count, the id that
would address the next ref's first block, ids past int32 and int64's last),
plan_peer_transfer and prepped_indices raise ptrres's error (BlockIdError
for a local id, RemoteBlockIdError for a peer's) before NIXL sees anything,
and a transfer right after moves the right bytes. NIXL itself checks a
prepared index only against the whole list: the issue's case shows what an
unchecked index (vLLM's ``region_offset + id``) would move.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from nixl_harness import (
    DESIGNS,
    OPS,
    CachePair,
    PeerProcess,
    Transfer,
    assert_same_bytes,
    peer_process,
    race_free,
    wait_for,
)

import ptrres
import ptrres.nixl

# Ids no block count reaches: past int32 (NIXL's indices are C ints) and the
# last int64.
OVERFLOWING = (2**31, 2**31 + 5, 2**63 - 1)
KEYS = ["numpy hybrid", "torch one group", "regions"]


@pytest.fixture(scope="module")
def peer() -> Iterator[PeerProcess]:
    """One peer process for every test of this module, stopped at its end."""
    designs = {key: DESIGNS[key] for key in KEYS}
    with peer_process(designs) as process:
        yield process


def boundary_ids(layout: ptrres.PeerLayout) -> list[tuple[int, int]]:
    """(group, id) of the bad ids at every ref's boundaries: -1, its block
    count (in a prepared list, the next ref's first index), the id whose
    address is the next ref's first block (where it has one), and ids past
    int32 and int64."""
    refs = [(g, ref) for g, group in enumerate(layout.groups) for ref in group]
    cases = []
    for i, (g, ref) in enumerate(refs):
        values = [-1, ref.num_blocks]
        following = refs[i + 1][1] if i + 1 < len(refs) else None
        if following is not None and following.allocation == ref.allocation:
            gap = following.base_ptr - ref.base_ptr
            if gap > 0 and gap % ref.row_stride_bytes == 0:
                values.append(gap // ref.row_stride_bytes)
        cases += [(g, value) for value in dict.fromkeys((*values, *OVERFLOWING))]
    return cases


def good_transfer(key: str, op: str) -> Transfer:
    """Three valid pairs per group."""
    local_design, peer_design = DESIGNS[key]
    local_ids, remote_ids = [], []
    for n_local, n_remote in zip(
        local_design.group_limits(), peer_design.group_limits()
    ):
        local_ids.append([0, n_local - 1, n_local // 2])
        remote_ids.append([n_remote // 2, 0, n_remote - 1])
    return race_free(op, local_design.group_tensors(), local_ids, remote_ids)


def with_id(ids: tuple[tuple[int, ...], ...], g: int, position: int, value: int) -> Any:
    """ids with group g's id at ``position`` replaced by ``value``."""
    group = list(ids[g])
    group[position] = value
    return (*ids[:g], tuple(group), *ids[g + 1 :])


def planners(pair: CachePair, side: str, transfer: Transfer) -> list[Callable[[], Any]]:
    """What turns a transfer's ids into NIXL's input: its plan, plain and
    coalesced, and one side's indices into the prepared list."""
    table, spec, remote_ids = pair.local.table, transfer.spec, transfer.flat_remote_ids
    layout: ptrres.PointerTable | ptrres.PeerLayout = table
    ids: Any = spec.block_ids
    if side == "remote":
        layout, ids = pair.peer, remote_ids
    return [
        lambda: table.plan_peer_transfer(spec, pair.peer, remote_ids),
        lambda: table.plan_peer_transfer(spec, pair.peer, remote_ids, coalesce=True),
        lambda: ptrres.nixl.prepped_indices(layout, ids, transfer.group_sizes),
    ]


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("side", ["local", "remote"])
def test_bad_ids_raise_before_nixl_and_the_agent_keeps_working(
    peer: PeerProcess, side: str, key: str
) -> None:
    pair = peer.reset(key)
    good = good_transfer(key, "WRITE")
    if side == "local":
        layout, error = ptrres.PeerLayout.of(pair.local.table), ptrres.BlockIdError
    else:
        layout, error = pair.peer, ptrres.RemoteBlockIdError
    cases = boundary_ids(layout)
    # Each ref's count, an id into the next ref, and the overflowing ones.
    assert len(cases) >= 4 * len(layout.ref_table)
    for case, (g, value) in enumerate(cases):
        position = case % len(good.local_ids[g])
        if side == "local":
            bad = Transfer(
                "WRITE", with_id(good.local_ids, g, position, value), good.remote_ids
            )
        else:
            bad = Transfer(
                "WRITE", good.local_ids, with_id(good.remote_ids, g, position, value)
            )
        for call in planners(pair, side, bad):
            with pytest.raises(error) as raised:
                call()
            assert type(raised.value) is error  # a local id is never "remote"
            found = (raised.value.group, raised.value.position, raised.value.value)
            assert found == (g, position, value)
    # NIXL saw none of them: the same agents move the right bytes right after.
    for op in OPS:
        transfer = good_transfer(key, op)
        peer.transfer(key, transfer)
        peer.transfer(key, transfer, coalesce=True)
        peer.transfer(key, transfer, prepared=True)


def test_region_offset_plus_id_would_read_another_region(peer: PeerProcess) -> None:
    """The issue's case: two groups, each with one region of 4 blocks per
    side, prepared lists. vLLM's index ``region_offset[r] + id`` of remote id
    4 in group 0 is region 1's block 0, of remote id -1 in group 1 region
    0's last block; NIXL checks only the whole list's length, so such a
    transfer completes. prepped_indices refuses both."""
    pair = peer.reset("regions")
    counts = ptrres.nixl.prepped_rows(pair.peer).xfer_list[:, 4].astype(np.int64)
    assert counts.tolist() == [4, 4]
    region_offset = np.cumsum(counts) - counts  # vLLM's: [0, 4]
    rows_of = [range(start, start + n) for start, n in zip(region_offset, counts)]
    # Group 0's remote id 4: index 0 + 4, region 1's block 0.
    assert region_offset[0] + 4 in rows_of[1]
    assert region_offset[0] + 4 == rows_of[1][0]
    # Group 1's remote id -1: index 4 - 1, region 0's last block.
    assert region_offset[1] - 1 == rows_of[0][-1]
    for remote_ids, group in (([4, 0], 0), ([0, -1], 1)):
        with pytest.raises(ptrres.RemoteBlockIdError) as raised:
            ptrres.nixl.prepped_indices(pair.peer, remote_ids, [1, 1])
        assert (raised.value.group, raised.value.value) == (group, remote_ids[group])
        with pytest.raises(ptrres.RemoteBlockIdError):
            pair.local.table.plan_peer_transfer(
                ptrres.GPULoadStoreSpec(np.array([0, 0]), [1, 1]), pair.peer, remote_ids
            )

    # What ptrres keeps from NIXL: the unchecked index 4 of group 0 READs
    # region 1's block 0 into local region 0's block 0, without an error.
    handle = peer.agent.make_prepped_xfer(
        "READ", pair.local_list, [0], pair.remote_list, [int(region_offset[0]) + 4]
    )
    try:
        wait_for(peer.agent, handle)
    finally:
        handle.release()
    region_1 = pair.mirror.tensors[1]
    assert pair.local.tensors[0][0].tobytes() == region_1[0].tobytes()

    # And the agent moves the right bytes right after.
    pair = peer.reset("regions")
    for op in OPS:
        peer.transfer(
            key="regions", transfer=good_transfer("regions", op), prepared=True
        )
    assert_same_bytes(pair.local.snapshot(), pair.local_copy.snapshot(), "local")
