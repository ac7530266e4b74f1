"""Plans executed on real host memory (``reference.execute``, SPEC 6).

A plan means the bytes it leaves. The plain plan, the coalesced plan (merged
while filling, or by coalesce()), the strided plan and the reference's plans,
each executed in order on the same host buffers (numpy int8 arrays, filled
with random bytes), must leave every byte the same, and nothing outside the
tensors may change: each allocation has guard zones at both ends, and the
source side is read only. Runs go up, down, both ways, repeat and skip; the
tensors are separate allocations, or views laid back to back in one buffer
where a run can continue from one tensor into the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import hypothesis.strategies as st
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from test_canonical import mappings, nhd_mapping
from test_plans import chunks_of

import ptrres
from ptrres import CanonicalPageMapping, CopyRun, reference

Bytes = npt.NDArray[np.int8]
# (rows, bytes of a row's elements, row stride in bytes) of one tensor.
Shape = tuple[int, int, int]
# A ref as drawn: its tensor, and its page (direct) or mapping (canonical).
RefSpec = tuple[int, int | CanonicalPageMapping]

GUARD = 64  # bytes of the guard zone at each end of an allocation
GUARD_PATTERN = ((np.arange(GUARD) * 37 + 11) % 256).astype(np.uint8).view(np.int8)
FAMILIES = ["separate", "one buffer"]
CAPS = [None, None, 1, 8, 24, 64]
FIELDS = ("src", "dst", "sizes")


# --- host memory with guard zones --------------------------------------------


@dataclass
class Memory:
    """Every allocation of a world, guard zones included, and its tensors."""

    allocations: list[Bytes]  # 1-D, GUARD_PATTERN in the first and last GUARD
    device: list[Bytes]  # (rows, row bytes) views, rows a stride apart
    offloaded: list[Bytes]

    def snapshot(self) -> list[bytes]:
        return [a.tobytes() for a in self.allocations]

    def restore(self, snapshot: list[bytes]) -> None:
        for allocation, saved in zip(self.allocations, snapshot):
            allocation[:] = np.frombuffer(saved, np.int8)

    def guards_intact(self) -> bool:
        return all(
            (a[:GUARD] == GUARD_PATTERN).all() and (a[-GUARD:] == GUARD_PATTERN).all()
            for a in self.allocations
        )


def allocate(
    device_shapes: list[Shape], offloaded_shapes: list[Shape], family: str, seed: int
) -> Memory:
    """Tensors of these shapes, random bytes everywhere but the guard zones.

    ``separate``: each tensor its own allocation; ``one buffer``: all of them
    (device ones first) back to back in one allocation, each tensor's rows
    right after the last row of the one before.
    """
    shapes = device_shapes + offloaded_shapes
    spans = [rows * stride for rows, _, stride in shapes]
    if family == "separate":
        allocations = [np.empty(GUARD + span + GUARD, np.int8) for span in spans]
        starts = [(k, GUARD) for k in range(len(spans))]
    else:
        allocations = [np.empty(GUARD + sum(spans) + GUARD, np.int8)]
        starts = [(0, GUARD + sum(spans[:k])) for k in range(len(spans))]
    rng = np.random.default_rng(seed)
    for allocation in allocations:
        allocation[:] = rng.integers(-128, 128, len(allocation), dtype=np.int8)
        allocation[:GUARD] = GUARD_PATTERN
        allocation[-GUARD:] = GUARD_PATTERN
    tensors = [
        allocations[k][start : start + span].reshape(rows, stride)[:, :row_bytes]
        for (rows, row_bytes, stride), (k, start), span in zip(shapes, starts, spans)
    ]
    n = len(device_shapes)
    return Memory(allocations, tensors[:n], tensors[n:])


@dataclass
class World:
    """A layout on real host memory and one transfer of it."""

    memory: Memory
    kv_caches: ptrres.CanonicalKVCaches
    blocks_per_chunk: int
    spec: ptrres.GPULoadStoreSpec
    chunk_ids: npt.NDArray[np.int64]
    canonical: bool


def build_world(
    device_shapes: list[Shape],
    offloaded_shapes: list[Shape],
    groups: list[list[RefSpec]],
    bpc: int,
    ids: list[list[int]],
    block_indices: list[int],
    chunk_ids: list[int],
    family: str,
    seed: int = 0,
) -> World:
    """A World of these tensors, refs and ids; canonical if a ref has a mapping."""
    memory = allocate(device_shapes, offloaded_shapes, family, seed)
    canonical = any(isinstance(p, CanonicalPageMapping) for g in groups for _, p in g)
    refs = [
        [
            ptrres.CanonicalKVCacheRef(t, p.local_page_size_bytes, p)
            if isinstance(p, CanonicalPageMapping)
            else ptrres.CanonicalKVCacheRef(t, p)
            for t, p in group
        ]
        for group in groups
    ]
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(t, t.strides[0]) for t in memory.device], refs
    )
    spec = ptrres.GPULoadStoreSpec(
        np.array([b for group in ids for b in group], np.int64),
        [len(group) for group in ids],
        block_indices,
    )
    return World(memory, kv, bpc, spec, np.array(chunk_ids, np.int64), canonical)


# --- executing plans ---------------------------------------------------------


def plans_of(
    world: World, store: bool, max_run_bytes: int | None
) -> dict[str, ptrres.TransferPlan | ptrres.StridedTransferPlan]:
    """Every plan of the transfer, by name: ptrres's and the reference's."""
    table = ptrres.PointerTable(world.kv_caches)
    layout = ptrres.OffloadedLayout(
        world.memory.offloaded, world.blocks_per_chunk, canonical=world.canonical
    )
    args = (world.spec, layout, world.chunk_ids)
    plain = table.plan_transfer(*args, store=store)
    reference_args = (
        world.spec,
        world.kv_caches,
        world.memory.offloaded,
        world.blocks_per_chunk,
        world.chunk_ids,
    )
    reference_plan = (
        reference.plan_canonical_transfer(*reference_args, store=store)
        if world.canonical
        else reference.plan_transfer(*reference_args, store=store)
    )
    return {
        "plain": plain,
        "coalesced": table.plan_transfer(
            *args, store=store, coalesce=True, max_run_bytes=max_run_bytes
        ),
        "coalesce()": ptrres.coalesce(
            plain.src, plain.dst, plain.sizes, max_run_bytes=max_run_bytes
        ),
        "strided": table.plan_strided_transfer(*args, store=store),
        "reference": reference_plan,
        "reference coalesced": reference.coalesce(
            reference_plan.src,
            reference_plan.dst,
            reference_plan.sizes,
            max_run_bytes=max_run_bytes,
        ),
        "reference strided": reference.plan_strided_transfer(
            *reference_args, store=store, canonical=world.canonical
        ),
    }


def assert_same_bytes(world: World, store: bool, max_run_bytes: int | None) -> None:
    """Each plan, executed on a fresh copy of the world's memory, leaves the
    plain plan's bytes; no guard zone and no source byte changes."""
    memory = world.memory
    plans = plans_of(world, store, max_run_bytes)
    sources = memory.device if store else memory.offloaded
    sources_before = [t.copy() for t in sources]
    initial = memory.snapshot()
    results = {}
    for name, plan in plans.items():
        memory.restore(initial)
        copied = reference.execute(plan, within=memory.allocations)
        assert copied == plan.num_bytes == plans["plain"].num_bytes, name
        assert memory.guards_intact(), f"{name} wrote into a guard zone"
        results[name] = memory.snapshot()
    # The byte mapping: every plan leaves the plain plan's bytes.
    for name, result in results.items():
        for k, (actual, expected) in enumerate(zip(result, results["plain"])):
            if actual != expected:
                a, e = np.frombuffer(actual, np.int8), np.frombuffer(expected, np.int8)
                first = int(np.flatnonzero(a != e)[0])
                pytest.fail(
                    f"{name} and the plain plan differ in allocation {k} from "
                    f"byte {first} ({int((a != e).sum())} bytes)"
                )
    assert all(
        (before == after).all() for before, after in zip(sources_before, sources)
    ), "a source byte changed"
    assert len(plans["coalesced"].src) <= len(plans["plain"].src)


# --- strategies --------------------------------------------------------------

# An id stream is a few segments, each going up, going down, repeating one id
# or anywhere, wrapping at the tensor's rows; between segments, gaps. "up" and
# "down" streams hold segments of one kind; "whole" is every row, in order.
KINDS = {"up": ["up"], "down": ["down"], "mixed": ["up", "down", "same", "any"]}
STEPS = {"up": 1, "down": -1, "same": 0}
Segment = tuple[str, int]  # (kind, length)


@st.composite
def segments(draw: Any, n: int, mode: str) -> list[Segment]:
    """Kinds and lengths of segments that add up to n ids."""
    result: list[Segment] = []
    while n > 0:
        length = draw(st.integers(1, n))
        result.append((draw(st.sampled_from(KINDS[mode])), length))
        n -= length
    return result


@st.composite
def ids_of(draw: Any, parts: list[Segment], limit: int) -> list[int]:
    """Ids in [0, limit) that follow these segments, each from a drawn start."""
    ids: list[int] = []
    for kind, length in parts:
        start = draw(st.integers(0, limit - 1))
        if kind == "any":
            ids += draw(
                st.lists(st.integers(0, limit - 1), min_size=length, max_size=length)
            )
        else:
            ids += [(start + STEPS[kind] * i) % limit for i in range(length)]
    return ids


@st.composite
def transfers(
    draw: Any, limit: int, chunk_limit: int, bpc: int, block_index: int
) -> tuple[list[int], list[int]]:
    """A group's block ids and chunk ids. With one block per chunk the chunks
    mostly follow the blocks' segments, so that runs pair up on both sides
    (GPU 40, 39, 38 to CPU 12, 11, 10); otherwise they are a stream of the
    same mode."""
    mode = draw(st.sampled_from(["down", "down", "mixed", "up", "whole"]))
    if mode == "whole":
        ids = list(range(limit))
        n_chunks = chunks_of(limit, block_index, bpc)
        first = max(0, chunk_limit - n_chunks)  # ending at the last row
        return ids, [(first + i) % chunk_limit for i in range(n_chunks)]
    parts = draw(segments(draw(st.sampled_from([0, 2, 3, 4, 5, 6, 8])), mode))
    ids = draw(ids_of(parts, limit))
    n_chunks = chunks_of(len(ids), block_index, bpc)
    if bpc == 1 and draw(st.integers(0, 3)):
        return ids, draw(ids_of(parts, chunk_limit))
    return ids, draw(ids_of(draw(segments(n_chunks, mode)), chunk_limit))


@st.composite
def canonical_mappings(draw: Any, row_bytes: int, dense: bool) -> CanonicalPageMapping:
    """Mappings whose fragments tile the page (and so merge), vLLM's NHD and
    MLA shapes, and test_canonical's random ones; dense: whole rows, tiled."""
    kinds = ["whole", "tiled"] if dense else ["whole", "tiled", "nhd", "random"]
    kind = draw(st.sampled_from(kinds))
    if kind == "random":
        mapping: CanonicalPageMapping = draw(mappings(row_bytes))
        return mapping
    page = row_bytes if dense else draw(st.sampled_from([row_bytes, row_bytes // 2]))
    pieces = draw(st.sampled_from([k for k in (1, 2, 4) if page % k == 0]))
    if kind == "nhd":  # TP=2, two heads: rank r's head of each token
        mapping = nhd_mapping(draw(st.integers(0, 1)), 2, 2, page // pieces, pieces)
        return mapping
    num_writers = draw(st.sampled_from([1, 1, 2, 3]))
    runs: tuple[CopyRun, ...]
    if kind == "whole":  # MLA: one whole-page run, a writer per page
        runs = (CopyRun(0, 0, page, 1, page, page),)
    else:  # the page in pieces, as one run or one run per piece
        f = page // pieces
        runs = (
            (CopyRun(0, 0, f, pieces, f, f),)
            if draw(st.booleans())
            else tuple(CopyRun(i * f, i * f, f, 1, f, f) for i in range(pieces))
        )
    return CanonicalPageMapping(
        page, page, runs, num_writers, draw(st.integers(0, num_writers - 1)), False
    )


@st.composite
def worlds(draw: Any, family: str, canonical: bool) -> World:
    """1-3 tensors shared by the refs of 1-3 groups, bpc 1-4, and id streams
    that run up, down or both. Half the worlds are dense (whole pages, rows
    and sub-blocks without padding: where runs merge), half are not (padded
    rows, short pages, larger sub-blocks, random canonical mappings)."""
    dense = draw(st.booleans())
    pads = [0] if dense else [0, 0, 4]
    bpc = draw(st.sampled_from([1, 1, 1, 2, 3, 4]))
    device_shapes: list[Shape] = []
    for _ in range(draw(st.integers(1, 3))):
        row_bytes = draw(st.sampled_from([4, 8, 16]))
        pad = draw(st.sampled_from(pads))
        device_shapes.append((draw(st.integers(2, 10)), row_bytes, row_bytes + pad))
    groups: list[list[RefSpec]] = []
    for g in range(draw(st.integers(1, 3))):
        group: list[RefSpec] = []
        for _ in range(draw(st.integers(0 if g else 1, 3))):  # group 0 has refs
            t = draw(st.integers(0, len(device_shapes) - 1))
            row_bytes = device_shapes[t][1]
            if canonical:
                group.append((t, draw(canonical_mappings(row_bytes, dense))))
            else:
                short = [row_bytes, row_bytes // 2, 0]
                page = row_bytes if dense else draw(st.sampled_from(short))
                group.append((t, page))
        groups.append(group)
    offloaded_shapes: list[Shape] = []
    for t in range(len(device_shapes)):
        pages = [
            p.canonical_page_size_bytes if isinstance(p, CanonicalPageMapping) else p
            for group in groups
            for u, p in group
            if u == t
        ]
        sub = max(1, max(pages, default=1) + draw(st.sampled_from(pads)))
        pad = draw(st.sampled_from(pads))
        rows = draw(st.integers(2, 8))
        offloaded_shapes.append((rows, bpc * sub, bpc * sub + pad))
    ids, block_indices, chunk_ids = [], [], []
    for group in groups:
        tensors = {t for t, _ in group}
        limit = min((device_shapes[t][0] for t in tensors), default=8)
        chunk_limit = min((offloaded_shapes[t][0] for t in tensors), default=8)
        block_index = draw(st.integers(0, 7))
        group_ids, group_chunks = draw(transfers(limit, chunk_limit, bpc, block_index))
        chunk_ids += group_chunks
        ids.append(group_ids)
        block_indices.append(block_index)
    seed = draw(st.integers(0, 2**32 - 1))
    return build_world(
        device_shapes, offloaded_shapes, groups, bpc, ids, block_indices,
        chunk_ids, family, seed,
    )  # fmt: skip


# --- the property tests ------------------------------------------------------


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
@given(data=st.data())
def test_direct_plans_leave_the_same_bytes(
    family: str, store: bool, data: st.DataObject
) -> None:
    world = data.draw(worlds(family, canonical=False))
    assert_same_bytes(world, store, data.draw(st.sampled_from(CAPS)))


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
@given(data=st.data())
def test_canonical_plans_leave_the_same_bytes(
    family: str, store: bool, data: st.DataObject
) -> None:
    world = data.draw(worlds(family, canonical=True))
    assert_same_bytes(world, store, data.draw(st.sampled_from(CAPS)))


# --- hand-picked transfers ---------------------------------------------------

# (block ids, chunk ids, blocks per chunk, block index) of one group.
STREAMS = {
    "ascending": ([8, 9, 10, 11, 12, 13], [2, 3, 4], 2, 0),
    "descending pairs": ([40, 39, 38], [12, 11, 10], 1, 0),  # vLLM PR #56110
    "descending in chunks": ([41, 40, 39, 38], [5, 4], 2, 0),
    "mixed with a gap": ([5, 6, 7, 3, 2, 1, 20, 21], [1, 2, 3, 9, 8, 7, 4, 5], 1, 0),
    "repeats": ([4, 4, 4, 5, 5, 9], [3, 3, 6, 6, 6, 6], 1, 0),
    "skip": ([10, 11, 12, 13, 14], [6, 7, 8], 2, 1),
    "every row": (list(range(48)), list(range(12)), 4, 0),
}


@pytest.mark.parametrize("max_run_bytes", [None, 48])
@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("stream", sorted(STREAMS))
def test_hand_picked_streams(
    stream: str, family: str, store: bool, max_run_bytes: int | None
) -> None:
    """Three refs over two tensors (one padded), full and short pages. In one
    buffer, "every row" of ref 0 runs on into ref 1's first block, in the
    next tensor, on both sides."""
    ids, chunks, bpc, block_index = STREAMS[stream]
    row, chunk_rows = 16, max(chunks) + 1  # the chunks end at the last row
    world = build_world(
        [(48, row, row), (48, row, row + 8)],
        [(chunk_rows, bpc * row, bpc * row)] * 2,
        [[(0, row), (1, row), (1, 8)]],
        bpc,
        [ids],
        [block_index],
        chunks,
        family,
    )
    assert_same_bytes(world, store, max_run_bytes)


@pytest.mark.parametrize("store", [True, False])
def test_repeated_ids_are_copied_in_order(store: bool) -> None:
    """Order is the meaning: a block loaded twice holds the later chunk's page,
    a block stored twice is in both chunks, merged or not."""
    world = build_world(
        [(4, 8, 8)], [(4, 8, 8)], [[(0, 8)]], 1, [[2, 3, 2]], [0], [0, 1, 3],
        "separate",
    )  # fmt: skip
    device, offloaded = world.memory.device[0], world.memory.offloaded[0]
    initial = world.memory.snapshot()
    before_device, before_offloaded = device.copy(), offloaded.copy()
    assert_same_bytes(world, store, None)
    world.memory.restore(initial)
    reference.execute(plans_of(world, store, None)["coalesced"])
    if store:
        for block, chunk in ((2, 0), (3, 1), (2, 3)):
            assert (offloaded[chunk] == before_device[block]).all()
    else:
        assert (device[2] == before_offloaded[3]).all()
        assert (device[3] == before_offloaded[1]).all()


# --- the executor itself -----------------------------------------------------


def addresses(buffer: Bytes) -> int:
    return int(buffer.ctypes.data)


def test_execute_copies_in_order_and_counts_bytes() -> None:
    memory = np.arange(32, dtype=np.int8)
    base = addresses(memory)
    src = np.array([base, base + 4, base + 100], np.uint64)
    dst = np.array([base + 16, base + 16, base + 30], np.uint64)
    sizes = np.array([4, 4, 0], np.uint64)
    assert reference.execute_descriptors(src, dst, sizes, within=[memory]) == 8
    assert memory[16:20].tolist() == [4, 5, 6, 7]  # the later copy wins
    plan = ptrres.TransferPlan(dst[:1], src[:1].astype(np.int64), sizes[:1], 4)
    assert reference.execute(plan) == 4  # int64 or uint64, any plan-like object
    assert memory[:4].tolist() == [4, 5, 6, 7]


def test_execute_runs_a_strided_plan_row_by_row() -> None:
    memory = np.zeros(64, np.int8)
    memory[:16] = np.arange(1, 17)
    base = addresses(memory)
    plan = SimpleNamespace(
        src=np.array([base], np.uint64),
        dst=np.array([base + 32], np.uint64),
        width=np.array([2], np.uint64),
        height=np.array([3], np.uint64),
        src_pitch=np.array([4], np.uint64),
        dst_pitch=np.array([8], np.uint64),
    )
    assert reference.execute(plan, within=[(base, 64)]) == 6
    expected = np.zeros(32, np.int8)
    expected[[0, 1, 8, 9, 16, 17]] = [1, 2, 5, 6, 9, 10]
    assert (memory[32:] == expected).all()
    assert (memory[:16] == np.arange(1, 17)).all()


def test_execute_refuses_a_copy_outside_the_allocations_and_copies_nothing() -> None:
    one, two = np.zeros(16, np.int8), np.ones(16, np.int8)
    src = np.array([addresses(two), addresses(two) + 8], np.uint64)
    dst = np.array([addresses(one), addresses(one) + 12], np.uint64)
    with pytest.raises(ptrres.SpecError, match="copy 1: its destination bytes"):
        reference.execute_descriptors(
            src, dst, np.array([8, 8], np.uint64), within=[one, two]
        )
    assert not one.any()
    # Zero bytes touch nothing, wherever they point.
    nowhere = np.zeros(1, np.uint64)
    assert reference.execute_descriptors(nowhere, nowhere, nowhere, within=[]) == 0


@pytest.mark.parametrize(
    ("plan", "error", "pattern"),
    [
        (SimpleNamespace(src=np.zeros(1, np.uint64)), ptrres.InputTypeError, "dst"),
        (
            SimpleNamespace(src=np.zeros(2, np.uint64), dst=np.zeros(2), sizes=None),
            ptrres.InputTypeError,
            "dst must be int64 or uint64",
        ),
        (
            SimpleNamespace(
                **{k: np.zeros(n, np.uint64) for k, n in zip(FIELDS, (2, 1, 2))}
            ),
            ptrres.SpecError,
            "src 2, dst 1, sizes 2",
        ),
    ],
)
def test_execute_refuses_malformed_plans(plan: Any, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        reference.execute(plan)
