"""Peer transfers (SPEC 14) and what ptrres.nixl builds of them, without NIXL.

Peer plans, plain and coalesced, against ptrres.reference's; indices into
prepared lists against the reference's; every id checked at every ref
boundary; the descriptor rows NIXL takes, the prepared rows, memory types and
registration (with a stand-in agent). tests/nixl moves the same plans with
real NIXL agents.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import (
    allocation,
    clone,
    copy_into,
    data_ptr,
    dtype_of,
    equal,
    itemsize,
    layouts,
    random_tensor,
    row_stride,
)
from hypothesis import example, given
from hypothesis import strategies as st

import ptrres
import ptrres.nixl
from ptrres import reference
from ptrres.nixl import DRAM, Memory

FIELDS = ("local", "remote", "sizes")


def assert_same_plan(actual: Any, expected: Any) -> None:
    for name in FIELDS:
        np.testing.assert_array_equal(
            getattr(actual, name), getattr(expected, name), err_msg=name
        )
        assert getattr(actual, name).dtype == np.uint64
    assert actual.num_bytes == expected.num_bytes


def peer_of(kv_caches: ptrres.CanonicalKVCaches, blocks: list[int]) -> Any:
    """A peer's KV caches of the same refs: tensor t has blocks[t] rows of
    the same width and padding as the local tensor t (new memory)."""
    tensors = []
    for t, entry in enumerate(kv_caches.tensors):
        local = entry.tensor
        padded = row_stride(local) // itemsize(local)
        tensor = random_tensor(blocks[t], padded, 0, local.dtype, 100 + t)
        tensors.append(ptrres.CanonicalKVCacheTensor(tensor[:, : local.shape[1]], 0))
    return ptrres.CanonicalKVCaches(tensors, kv_caches.group_data_refs)


@st.composite
def runs_of_ids(draw: Any, n: int, limit: int, other_limit: int) -> Any:
    """n local ids below limit and n remote ids below other_limit, made of
    runs up and down, repeats and gaps, so that plans have runs to merge."""
    local: list[int] = []
    remote: list[int] = []
    while len(local) < n:
        kind = draw(st.sampled_from(["up", "down", "repeat", "scatter"]))
        start, other = draw(st.integers(0, limit - 1)), draw(st.integers(0, 50))
        for k in range(min(draw(st.integers(1, 5)), n - len(local))):
            step = {"up": k, "down": -k, "repeat": 0}.get(kind, 3 * k)
            local.append((start + step) % limit)
            remote.append((other + step) % other_limit)
    return local, remote


@dataclass
class PeerCase:
    kv_caches: ptrres.CanonicalKVCaches
    peer_caches: ptrres.CanonicalKVCaches
    spec: ptrres.GPULoadStoreSpec
    remote_ids: np.ndarray


@st.composite
def peer_cases(draw: Any) -> PeerCase:
    kv = draw(layouts())
    blocks = [draw(st.integers(1, 14)) for _ in kv.tensors]
    peer_kv = peer_of(kv, blocks)
    local_ids: list[int] = []
    remote_ids: list[int] = []
    sizes = []
    for refs in kv.group_data_refs:
        limit = min((kv.tensors[r.tensor_idx].tensor.shape[0] for r in refs), default=9)
        other = min((blocks[r.tensor_idx] for r in refs), default=9)
        n = draw(st.integers(0, 8))
        ids, peer_ids = draw(runs_of_ids(n, limit, other))
        local_ids += ids
        remote_ids += peer_ids
        sizes.append(n)
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    spec = ptrres.GPULoadStoreSpec(np.array(local_ids, dtype), sizes)
    return PeerCase(kv, peer_kv, spec, np.array(remote_ids, dtype))


def ref_allocations(kv: ptrres.CanonicalKVCaches) -> list[int]:
    """The allocation of each ref's tensor, group by group (torch storage,
    or the numpy array that owns the memory)."""
    return [
        allocation(kv.tensors[r.tensor_idx].tensor)
        for refs in kv.group_data_refs
        for r in refs
    ]


@given(peer_cases(), st.sampled_from([None, 8, 40]))
def test_peer_plans_are_the_references(case: PeerCase, cap: int | None) -> None:
    """Plain plans equal the reference's; coalesced ones equal the
    reference's coalescing of the plain plan, never across allocations."""
    table = ptrres.PointerTable(case.kv_caches)
    peer = ptrres.PeerLayout.of(ptrres.PointerTable(case.peer_caches))
    expected = reference.plan_peer_transfer(
        case.spec, case.kv_caches, peer.groups, case.remote_ids
    )
    assert_same_plan(
        table.plan_peer_transfer(case.spec, peer, case.remote_ids), expected
    )
    # One allocation pair per ref: runs never pass between pairs that differ.
    pairs = list(
        zip(ref_allocations(case.kv_caches), ref_allocations(case.peer_caches))
    )
    keys = {pair: i for i, pair in enumerate(dict.fromkeys(pairs))}
    per_ref = [keys[pair] for pair in pairs]
    sizes = case.spec.group_sizes
    counts = [len(refs) for refs in case.kv_caches.group_data_refs]
    allocations = np.repeat(
        per_ref, [n for n, c in zip(sizes, counts) for _ in range(c)]
    )
    merged = reference.coalesce(
        expected.local, expected.remote, expected.sizes, max_run_bytes=cap,
        allocations=allocations,
    )  # fmt: skip
    plan = table.plan_peer_transfer(
        case.spec, peer, case.remote_ids, coalesce=True, max_run_bytes=cap
    )
    for name, expected_name in zip(FIELDS, ("src", "dst", "sizes")):
        np.testing.assert_array_equal(
            getattr(plan, name), getattr(merged, expected_name), err_msg=name
        )
    assert plan.num_bytes == expected.num_bytes


def two_engines(
    blocks: tuple[int, int] = (10, 12), page: int = 64, groups: int = 2
) -> tuple[Any, Any, ptrres.PointerTable, ptrres.PeerLayout]:
    """Two engines of `groups` groups, two refs each on tensors of their own
    (hybrid: every group has its own layers), pages filling their rows."""

    def caches(n: int, seed: int) -> ptrres.CanonicalKVCaches:
        tensors = [
            ptrres.CanonicalKVCacheTensor(
                random_tensor(n, page, 0, dtype_of("int8"), seed + t), 0
            )
            for t in range(2 * groups)
        ]
        refs = [
            [ptrres.CanonicalKVCacheRef(2 * g + d, page) for d in range(2)]
            for g in range(groups)
        ]
        return ptrres.CanonicalKVCaches(tensors, refs)

    local, remote = caches(blocks[0], 0), caches(blocks[1], 50)
    table = ptrres.PointerTable(local)
    return local, remote, table, ptrres.PeerLayout.of(ptrres.PointerTable(remote))


def test_a_peer_plan_moves_the_blocks_it_names() -> None:
    """Executed on host memory, a READ plan leaves the peer's blocks in this
    engine's, and coalesced plans leave the same bytes."""
    local, remote, table, peer = two_engines()
    spec = ptrres.GPULoadStoreSpec(np.array([1, 2, 3, 9, 8], np.int32), [3, 2])
    remote_ids = [4, 5, 6, 11, 10]
    before = [clone(e.tensor) for e in local.tensors]
    results = []
    for coalesce in (False, True):
        for t, entry in zip(before, local.tensors):
            copy_into(entry.tensor, t)
        plan = table.plan_peer_transfer(spec, peer, remote_ids, coalesce=coalesce)
        reference.execute_descriptors(plan.remote, plan.local, plan.sizes)
        results.append([clone(e.tensor) for e in local.tensors])
    assert (
        len(table.plan_peer_transfer(spec, peer, remote_ids, coalesce=True).sizes) == 4
    )
    for a, b in zip(*results):
        assert equal(a, b)
    for g, ids, peer_ids in ((0, [1, 2, 3], [4, 5, 6]), (1, [9, 8], [11, 10])):
        for d in range(2):
            t = 2 * g + d
            assert equal(results[0][t][ids], remote.tensors[t].tensor[peer_ids])
            untouched = [k for k in range(10) if k not in ids]
            assert equal(results[0][t][untouched], before[t][untouched])


def boundary_ids(num_blocks: int) -> list[int]:
    """Ids just outside a ref of num_blocks blocks, and ids that pass int32."""
    return [-1, num_blocks, num_blocks + 1, 2**31, 2**31 + 5, 2**63 - 1]


@pytest.mark.parametrize("side", ["local", "remote"])
@pytest.mark.parametrize("group", [0, 1])
@pytest.mark.parametrize("where", ["plan", "indices"])
def test_bad_ids_at_every_boundary_raise_before_anything(
    side: str, group: int, where: str
) -> None:
    """-1, num_blocks (in a prepared list, the next ref's first block),
    and ids past int32 and int64's last: the first bad id is named, with
    the reference's error, and the next call works."""
    local, _, table, peer = two_engines()
    num_blocks = (10, 12)[side == "remote"]
    for bad in boundary_ids(num_blocks):
        local_ids = np.array([1, 2, 3, 4], np.int64)
        remote_ids = np.array([5, 6, 7, 8], np.int64)
        ids = local_ids if side == "local" else remote_ids
        ids[2 * group + 1] = bad
        spec = ptrres.GPULoadStoreSpec(local_ids, [2, 2])
        expected_type = (
            ptrres.BlockIdError if side == "local" else ptrres.RemoteBlockIdError
        )
        if where == "plan":
            out = tuple(np.full(8, 7, np.uint64) for _ in range(3))
            with pytest.raises(expected_type) as error:
                table.plan_peer_transfer(spec, peer, remote_ids, out=out)
            with pytest.raises(expected_type) as expected:
                reference.plan_peer_transfer(spec, local, peer.groups, remote_ids)
            assert all((buffer[:8] == 0).all() for buffer in out)  # nothing kept
        else:
            layout, ref_layout = (
                (table, local) if side == "local" else (peer, peer.groups)
            )
            with pytest.raises(expected_type) as error:
                ptrres.nixl.prepped_indices(layout, ids, [2, 2])
            with pytest.raises(expected_type) as expected:
                reference.prepped_indices(ref_layout, ids, [2, 2])
        assert type(error.value) is expected_type
        assert str(error.value) == str(expected.value)
        assert (error.value.group, error.value.position, error.value.value) == (
            group,
            1,
            bad,
        )
        assert f"block id {bad} is out of range for ref 0" in str(error.value)
    # The table and the peer keep working.
    spec = ptrres.GPULoadStoreSpec(np.array([1, 2, 3, 4]), [2, 2])
    assert len(table.plan_peer_transfer(spec, peer, [5, 6, 7, 8]).sizes) == 8


def test_the_issues_hybrid_case_never_reaches_the_next_region() -> None:
    """Two groups, each with its own region of 4 blocks per side: vLLM's
    ``region_offset + id`` turns a group-0 remote id of 4 into region 1's
    block 0, and a group-1 id of -1 into region 0's last block. ptrres's
    indices refuse both."""
    _, _, _, peer = two_engines(blocks=(4, 4), groups=2)
    rows = ptrres.nixl.prepped_rows(peer).xfer_list
    # One ref per group here would be one region; with two refs a group, the
    # group's first ref is region 2 * g.
    first_index = np.cumsum(rows[:, 4]) - rows[:, 4]
    assert first_index[0] + 4 == first_index[1]  # what vLLM would have read
    for ids, group in (([4, 0], 0), ([0, -1], 1)):
        with pytest.raises(ptrres.RemoteBlockIdError) as error:
            ptrres.nixl.prepped_indices(peer, np.array(ids), [1, 1])
        assert error.value.group == group
    assert ptrres.nixl.prepped_indices(peer, [3, 0], [1, 1]).tolist() == [3, 7, 8, 12]
    # A spec says its ids and group sizes itself.
    spec = ptrres.GPULoadStoreSpec(np.array([3, 0]), [1, 1])
    assert ptrres.nixl.prepped_indices(peer, spec).tolist() == [3, 7, 8, 12]


@given(peer_cases())
def test_prepped_indices_are_the_references(case: PeerCase) -> None:
    table = ptrres.PointerTable(case.kv_caches)
    peer = ptrres.PeerLayout.of(ptrres.PointerTable(case.peer_caches))
    sizes = case.spec.group_sizes
    for layout, ref_layout, ids in (
        (table, case.kv_caches, case.spec.block_ids),
        (peer, peer.groups, case.remote_ids),
    ):
        indices = ptrres.nixl.prepped_indices(layout, ids, sizes)
        assert indices.dtype == np.int32
        np.testing.assert_array_equal(
            indices, reference.prepped_indices(ref_layout, ids, sizes)
        )
    # Indices into the prepared rows name the plan's descriptors, side by side.
    plan = table.plan_peer_transfer(case.spec, peer, case.remote_ids)
    for layout, ids, addresses in (
        (table, case.spec.block_ids, plan.local),
        (peer, case.remote_ids, plan.remote),
    ):
        rows = ptrres.nixl.prepped_rows(layout).xfer_list
        expanded = np.concatenate(
            [np.arange(count, dtype=np.uint64) * stride + base
             for base, _, _, stride, count in rows.tolist()] or [np.zeros(0, np.uint64)]
        )  # fmt: skip
        indices = ptrres.nixl.prepped_indices(layout, ids, sizes)
        np.testing.assert_array_equal(expanded[indices], addresses)


def test_prepped_rows_are_one_strided_row_per_ref() -> None:
    local, _, table, peer = two_engines()
    rows = ptrres.nixl.prepped_rows(table)
    assert rows.mem_type == "DRAM"
    assert rows.xfer_list.dtype == np.uint64
    assert rows.xfer_list.flags.c_contiguous
    expected = [
        (data_ptr(local.tensors[2 * g + d].tensor), 64, 0, 64, 10)
        for g in range(2)
        for d in range(2)
    ]
    assert [tuple(r) for r in rows.xfer_list.tolist()] == expected
    assert ptrres.nixl.prepped_rows(peer).xfer_list[:, 4].tolist() == [12] * 4
    huge = ptrres.PeerLayout([[(0, 1, 1, 2**30), (2**31, 1, 1, 2**30)]])
    with pytest.raises(ptrres.LayoutError, match=r"NIXL's 2147483647 indices"):
        ptrres.nixl.prepped_rows(huge)
    with pytest.raises(ptrres.LayoutError, match=r"NIXL's 2147483647 indices"):
        ptrres.nixl.prepped_indices(huge, [0], [1])
    # Counts that sum past 2**64 (a peer's word: refs of one address, each
    # 2**62 or 2**63 - 1 blocks) are summed exactly: numpy's sum wrapped to
    # 0 or -2, which passed, and the indices of a good id came out negative
    # (issue 40's fuzz).
    for count, refs in ((2**62, 4), (2**63 - 1, 2)):
        wraps = ptrres.PeerLayout([[(0, 0, 0, count)] * refs])
        message = f"hold {count * refs} blocks"
        with pytest.raises(ptrres.LayoutError, match=message):
            ptrres.nixl.prepped_rows(wraps)
        with pytest.raises(ptrres.LayoutError, match=message):
            ptrres.nixl.prepped_indices(wraps, [count - 1], [1])
    on_gpu = ptrres.nixl.prepped_rows(peer, memory=ptrres.nixl.vram(1))
    assert on_gpu.mem_type == "VRAM"
    assert on_gpu.xfer_list[:, 2].tolist() == [1] * 4


def test_descriptor_rows_are_the_plans_in_order() -> None:
    _, _, table, peer = two_engines()
    spec = ptrres.GPULoadStoreSpec(np.array([1, 2, 3, 9, 8], np.int32), [3, 2])
    plan = table.plan_peer_transfer(spec, peer, [4, 5, 6, 11, 10])
    descs = ptrres.nixl.peer_xfer_descs(plan, local=table, remote=peer)
    assert (descs.local_mem_type, descs.remote_mem_type) == ("DRAM", "DRAM")
    for rows, addresses in ((descs.local, plan.local), (descs.remote, plan.remote)):
        assert rows.dtype == np.uint64
        assert rows.flags.c_contiguous
        assert rows.shape == (len(plan.sizes), 3)
        np.testing.assert_array_equal(rows[:, 0], addresses)
        np.testing.assert_array_equal(rows[:, 1], plan.sizes)
        assert (rows[:, 2] == 0).all()
    assert descs.num_bytes == plan.num_bytes == len(descs) * 64
    # Into the caller's buffers, on GPU devices named explicitly.
    out = (np.zeros((30, 3), np.int64), np.zeros((30, 3), np.uint64))
    on_gpus = ptrres.nixl.peer_xfer_descs(
        plan, local=ptrres.nixl.vram(3), remote=ptrres.nixl.vram(1), out=out
    )
    assert on_gpus.local.base is out[0] or np.shares_memory(on_gpus.local, out[0])
    assert (on_gpus.local_mem_type, on_gpus.remote_mem_type) == ("VRAM", "VRAM")
    assert (out[0][:10, 2] == 3).all()
    assert (out[1][:10, 2] == 1).all()
    assert (out[0][10:] == 0).all()


def test_a_transfer_plans_local_side_is_the_ops() -> None:
    """WRITE holds the source as local, READ the destination: either way the
    bytes go from src to dst."""
    _, _, table, _ = two_engines()
    cpu = [np.zeros((8, 2 * 64), np.int8) for _ in range(4)]
    offloaded = ptrres.OffloadedLayout(cpu, 2)
    spec = ptrres.GPULoadStoreSpec(np.array([1, 2, 3, 9], np.int32), [2, 2])
    plan = table.plan_transfer(spec, offloaded, [3, 4], store=True)
    write = ptrres.nixl.xfer_descs(plan, "WRITE", src=table, dst=offloaded)
    read = ptrres.nixl.xfer_descs(plan, "READ", src=table, dst=offloaded)
    np.testing.assert_array_equal(write.local[:, 0], plan.src)
    np.testing.assert_array_equal(write.remote[:, 0], plan.dst)
    np.testing.assert_array_equal(read.local[:, 0], plan.dst)
    np.testing.assert_array_equal(read.remote[:, 0], plan.src)
    with pytest.raises(ptrres.InputTypeError, match="op must be one of"):
        ptrres.nixl.xfer_descs(plan, "COPY", src=table, dst=offloaded)


def test_file_descriptors_name_each_ops_file() -> None:
    _, _, table, _ = two_engines()
    spec = ptrres.GPULoadStoreSpec(np.arange(6, dtype=np.int32), [4, 2], [1, 0])
    plan = table.plan_file_ops(spec, 2)
    fds = list(range(40, 40 + plan.num_files))
    descs = ptrres.nixl.file_xfer_descs(plan, fds, memory=table)
    assert (descs.local_mem_type, descs.remote_mem_type) == ("DRAM", "FILE")
    np.testing.assert_array_equal(descs.local[:, 0], plan.dev_ptrs)
    np.testing.assert_array_equal(descs.remote[:, 0], plan.file_offsets)
    expected_fds = np.repeat(fds, np.diff(plan.file_starts))
    np.testing.assert_array_equal(descs.remote[:, 2], expected_fds)
    with pytest.raises(ptrres.SpecError, match="files but 1 fds"):
        ptrres.nixl.file_xfer_descs(plan, [3], memory=table)
    # file_starts that do not rise from 0 to the number of ops are refused.
    backwards = SimpleNamespace(
        dev_ptrs=plan.dev_ptrs, file_offsets=plan.file_offsets, sizes=plan.sizes,
        file_starts=plan.file_starts[::-1].copy(),
    )  # fmt: skip
    with pytest.raises(ptrres.SpecError, match="must rise from 0"):
        ptrres.nixl.file_xfer_descs(backwards, fds, memory=table)  # type: ignore[arg-type]


class FakeDevice:
    def __init__(self, kind: str, index: int | None) -> None:
        self.type, self.index = kind, index


class OnDevice:
    """A torch-like tensor of host memory that says it lives on a device."""

    def __init__(self, array: np.ndarray, device: Any) -> None:
        self.array, self.device, self.shape = array, device, array.shape

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def stride(self, dim: int) -> int:
        return int(self.array.strides[dim])

    def element_size(self) -> int:
        return 1


def test_memory_of_reads_each_tensors_device() -> None:
    def table_on(*devices: Any) -> ptrres.PointerTable:
        tensors = [OnDevice(np.zeros((4, 8), np.int8), d) for d in devices]
        return ptrres.PointerTable(
            ptrres.CanonicalKVCaches(
                [ptrres.CanonicalKVCacheTensor(t, 8) for t in tensors],
                [[ptrres.CanonicalKVCacheRef(i, 8) for i in range(len(tensors))]],
            )
        )

    assert ptrres.nixl.memory_of(table_on(FakeDevice("cuda", 3))) == Memory("VRAM", 3)
    assert ptrres.nixl.memory_of(table_on(FakeDevice("cpu", None))) == DRAM
    table = table_on(FakeDevice("cuda", 3))
    assert ptrres.nixl.memory_of(ptrres.PeerLayout.of(table)) == Memory("VRAM", 3)
    for devices in ((FakeDevice("cuda", 0), FakeDevice("cuda", 1)), (None,)):
        with pytest.raises(ptrres.LayoutError, match=r"pass a ptrres\.nixl\.Memory"):
            ptrres.nixl.memory_of(table_on(*devices))
    with pytest.raises(ptrres.LayoutError, match="cannot register"):
        ptrres.nixl.register(FakeAgent(), table_on(FakeDevice("xpu", 0)))


class FakeAgent:
    """Records what register() asks of a nixl_agent; fails where told."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail_on = fail_on

    def register_memory(self, rows: Any, mem_type: str, backends: Any) -> Any:
        if self.fail_on == len(self.calls):
            raise RuntimeError("NIXL_ERR_BACKEND")
        token = SimpleNamespace(rows=rows, mem_type=mem_type)
        self.calls.append(("register", token))
        return token

    def deregister_memory(self, token: Any, backends: Any) -> None:
        self.calls.append(("deregister", token))


def test_register_takes_each_allocation_once_and_undoes_it() -> None:
    buffer = np.zeros(4096, np.int8)
    views = [buffer[:1024].reshape(16, 64), buffer[1024:2048].reshape(16, 64)]
    own = np.zeros((8, 64), np.int8)
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(t, 64) for t in (*views, own)],
        [[ptrres.CanonicalKVCacheRef(i, 64) for i in range(3)]],
    )
    table = ptrres.PointerTable(kv)
    offloaded = ptrres.OffloadedLayout([buffer[2048:].reshape(16, 128)], 2)
    agent = FakeAgent()
    with ptrres.nixl.register(agent, table, offloaded, table) as registration:
        ((_, token),) = agent.calls
        assert token.mem_type == "DRAM"
        # The table's views of one buffer are one region; the offloaded rows
        # in the rest of it another (the table, given twice, counts once).
        start = buffer.ctypes.data
        assert sorted(token.rows) == sorted(
            [(start, 2048, 0, ""), (start + 2048, 2048, 0, ""),
             (own.ctypes.data, 512, 0, "")]
        )  # fmt: skip
        assert len(registration.regions) == 3
    assert agent.calls[-1] == ("deregister", token)
    registration.deregister()  # once only
    assert len(agent.calls) == 2
    # A failure part way undoes what was registered.
    files = FakeAgent(fail_on=1)
    with pytest.raises(RuntimeError):
        ptrres.nixl._memory._register(
            files, [(0, 8, DRAM), (0, 0, Memory("FILE", 5))], ()
        )
    assert [kind for kind, _ in files.calls] == ["register", "deregister"]
    assert ptrres.nixl.register_files(FakeAgent(), [5, 6]).regions[1][2] == Memory(
        "FILE", 6
    )
    with pytest.raises(ptrres.InputTypeError, match="PeerLayout"):
        ptrres.nixl.register(FakeAgent(), ptrres.PeerLayout.of(table))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("group_refs", "error", "pattern"),
    [
        ([[(0, 8, 16, 4)]], ptrres.LayoutError, "larger than the row stride"),
        ([[(0, -8, 0, 4)]], ptrres.LayoutError, "none may be negative"),
        ([[(2**62, 2**62, 8, 4)]], ptrres.LayoutError, "below 2\\*\\*63"),
        # No blocks, but fields past int64: the kernels' columns overflowed
        # (issue 40's fuzz).
        ([[(2**63, 0, 0, 0)]], ptrres.LayoutError, "below 2\\*\\*63"),
        ([[(0, 2**64, 0, 0)]], ptrres.LayoutError, "below 2\\*\\*63"),
        ([[(0, 8, 8)]], ptrres.InputTypeError, "4 to 6 fields"),
        ([[(0, 8, 8, 4.5)]], ptrres.InputTypeError, "must be an integer"),
        ([[(0, 8, 8, 4, -2)]], ptrres.LayoutError, "neither HOST"),
        # A device past a C int: NIXL's devId column overflowed (issue 40).
        ([[(0, 8, 8, 4, 2**31)]], ptrres.LayoutError, r"0 to 2147483647\)"),
        ([[(0, 8, 8, 4, 2**70)]], ptrres.LayoutError, "neither HOST"),
        ([[SimpleNamespace(base_ptr=0)]], ptrres.InputTypeError, "has no"),
        ("refs", ptrres.InputTypeError, "must be a sequence"),
    ],
)
def test_bad_peer_layouts(group_refs: Any, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        ptrres.PeerLayout(group_refs)


def test_a_peer_of_other_refs_or_pages_is_refused() -> None:
    _, _, table, peer = two_engines()
    spec = ptrres.GPULoadStoreSpec(np.array([1, 2]), [1, 1])
    one_group = ptrres.PeerLayout([peer.groups[0]])
    with pytest.raises(ptrres.LayoutError, match="refs per group"):
        table.plan_peer_transfer(spec, one_group, [1, 2])
    other_page = ptrres.PeerLayout(
        [
            peer.groups[0],
            [peer.groups[1][0]._replace(page_size_bytes=32), peer.groups[1][1]],
        ]
    )
    with pytest.raises(ptrres.LayoutError, match="group 1, ref 0: the local page"):
        table.plan_peer_transfer(spec, other_page, [1, 2])
    with pytest.raises(ptrres.InputTypeError, match="must be a PeerLayout"):
        table.plan_peer_transfer(spec, peer.groups, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ptrres.SpecError, match="3 remote ids but 2 local"):
        table.plan_peer_transfer(spec, peer, [1, 2, 3])
    assert len(table.plan_peer_transfer(spec, peer, [1, 2]).sizes) == 4


@given(
    st.one_of(
        st.none(),
        st.integers(-5, 5),
        st.text(max_size=3),
        st.lists(
            st.one_of(st.integers(-3, 20), st.floats(), st.text(max_size=1)), max_size=5
        ),
    ),
    st.sampled_from([None, "short", "overlap", "f32", "ro"]),
)
@example(remote_ids=[0, 1, 2, 3], out="overlap")
def test_hostile_input_raises_ptrres_errors(remote_ids: Any, out: str | None) -> None:
    """Anything as remote ids, odd out= buffers: a PtrresError or a plan,
    and nothing written outside the buffers given."""
    _, _, table, peer = two_engines()
    spec = ptrres.GPULoadStoreSpec(np.array([1, 2, 3, 4]), [2, 2])
    guard = np.full(40, 9, np.uint64)
    buffers: Any = None
    if out == "short":
        buffers = (guard[:3], guard[10:13], guard[20:23])
    elif out == "overlap":
        buffers = (guard[:8], guard[4:12], guard[20:28])
    elif out == "f32":
        buffers = (np.zeros(8, np.float32), guard[10:18], guard[20:28])
    elif out == "ro":
        frozen = guard[:8].copy()
        frozen.setflags(write=False)
        buffers = (frozen, guard[10:18], guard[20:28])
    try:
        plan = table.plan_peer_transfer(spec, peer, remote_ids, out=buffers)
    except ptrres.PtrresError:
        pass
    else:
        assert len(plan.sizes) == 8
    assert (guard[28:] == 9).all()
    assert (guard[18:20] == 9).all()


def test_what_nixl_takes_refuses_malformed_input_and_keeps_working() -> None:
    """Plans without their fields or of several lengths, odd out= buffers,
    bad fds, memory of no kind: each a PtrresError naming what is wrong,
    nothing written outside the buffers given, and the next call works."""
    _, _, table, peer = two_engines()
    spec = ptrres.GPULoadStoreSpec(np.array([1, 2, 3, 9], np.int32), [2, 2])
    plan = table.plan_peer_transfer(spec, peer, [4, 5, 6, 11])
    n = len(plan.sizes)
    nixl: Any = ptrres.nixl  # handed what its types refuse, on purpose

    def descs(plan: Any = plan, local: Any = table, out: Any = None) -> Any:
        return nixl.peer_xfer_descs(plan, local=local, remote=peer, out=out)

    short = SimpleNamespace(local=plan.local, remote=plan.remote[:-1], sizes=plan.sizes)
    rows = np.zeros((n, 3), np.int64)
    cases: list[tuple[Any, type, str]] = [
        (lambda: descs(object()), ptrres.InputTypeError, "local, remote and sizes"),
        (lambda: descs(short), ptrres.SpecError, "have 8, 7 and 8 entries"),
        (lambda: descs(out=(rows,)), ptrres.InputTypeError, "pair of"),
        (lambda: descs(out=(np.zeros((n, 3)), rows)), ptrres.InputTypeError, "int64"),
        (lambda: descs(out=(rows[::2], rows)), ptrres.OutBufferError, "C-contiguous"),
        (lambda: descs(out=(rows[1:], rows)), ptrres.OutBufferError, "7 rows; 8 are"),
        (lambda: descs(local="DRAM"), ptrres.InputTypeError, "must be a Memory"),
        (
            lambda: nixl.file_xfer_descs(object(), [3], memory=table),
            ptrres.InputTypeError,
            "plan must be a FilePlan",
        ),
        (lambda: nixl.vram(-1), ptrres.LayoutError, "device index is >= 0"),
        (
            lambda: nixl.prepped_indices(table, spec, out=np.zeros(8, np.int64)),
            ptrres.InputTypeError,
            "1-D int32",
        ),
        (
            lambda: nixl.prepped_indices(table, spec, out=np.zeros(16, np.int32)[::2]),
            ptrres.OutBufferError,
            "C-contiguous",
        ),
        (
            lambda: nixl.prepped_indices(table, spec, out=np.zeros(7, np.int32)),
            ptrres.OutBufferError,
            "7 entries; 8 indices",
        ),
        (
            lambda: nixl.prepped_indices(spec, spec),
            ptrres.InputTypeError,
            "PointerTable or a PeerLayout",
        ),
    ]
    for call, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            call()
    # A shared out= buffer is refused before anything is written.
    shared = np.full((n, 3), 9, np.int64)
    with pytest.raises(ptrres.OutBufferError, match="share memory"):
        descs(out=(shared, shared))
    assert (shared == 9).all()
    file_plan = table.plan_file_ops(spec, 2)
    with pytest.raises(ptrres.SpecError, match="open file descriptors"):
        nixl.file_xfer_descs(file_plan, [-1] * file_plan.num_files, memory=table)
    # Indices into the caller's buffer, then everything works as before.
    out = np.full(10, -5, np.int32)
    indices = ptrres.nixl.prepped_indices(table, spec, out=out)
    assert np.shares_memory(indices, out)
    assert (out[8:] == -5).all()
    np.testing.assert_array_equal(descs().local[:, 0], plan.local)
