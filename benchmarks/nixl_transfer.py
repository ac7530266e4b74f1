"""NIXL transfers four ways: vLLM 0.33's prepared indices against ptrres's
(issue 30, item 7).

Two engines' KV caches in one process, each with its own NIXL agent over UCX
(progress thread off; the remote agent is driven with get_new_notifs() while
the local one waits, as a peer's own loop would), loopback only
(UCX_NET_DEVICES=lo). The local engine READs the remote engine's blocks into
its own, as vLLM's NIXL connector does on the decode side, with a
notification. One transfer is built and posted four ways:

- (a) vLLM 0.33's formula (``_compute_desc_ids``, its all-attention fast
  path: ``(region_offsets[:, None] + block_arr[None, :]).ravel()`` with
  ``region_offsets = np.cumsum([0, *region_num_blocks[:-1]])``, transcribed
  here in numpy) for both sides' indices, then ``make_prepped_xfer``;
- (b) ``ptrres.nixl.prepped_indices`` (every id checked against its own
  ref) for both sides, then ``make_prepped_xfer``;
- (c) ``plan_peer_transfer`` and ``peer_xfer_descs`` (two Nx3 arrays), then
  ``initialize_xfer``;
- (d) the same, ``coalesce=True``.

(a) and (b) share the prepared lists: one strided row per ref
(``ptrres.nixl.prepped_rows``, what vLLM 0.33 prepares per region). Every
way starts from the same int32 numpy arrays of ids; ptrres writes into
buffers allocated once (``out=``), as a server does; ways (c) and (d) name
each side's memory with a Memory computed once.

What is timed, per transfer: ``build`` (ids to what NIXL takes), ``make``
(``make_prepped_xfer``, or ``initialize_xfer``, which includes NIXL's
``get_xfer_descs`` of the two arrays), ``transfer()`` (make + transfer() is
the post) and ``completion`` (from transfer() returning until the local
agent reports DONE). UCX here moves the bytes mostly inside transfer(): RMA
is emulated over active messages on tcp/lo, with cma for bulk data, so
transfer() is what each posted descriptor costs, and completion is short.
The four ways take turns on each transfer (the first way rotating from round
to round), and each cell is the median over the rounds; a table row gives
the mean over its transfers of those medians, and the ratios are sums over
the same transfers against (a). ``descr`` is what the way hands NIXL;
``posted`` what NIXL posts, read from its telemetry (the local agent
captures telemetry, which costs every way alike): ``make_prepped_xfer``
merges runs of consecutive indices itself (dense strided rows),
``initialize_xfer`` does not.

Ids: each shipped trace (``ptrres.bench.traces``) gives a transfer's GPU
block ids as the local ids and its CPU ids as the remote ones, a CPU chunk
of ``blocks_per_chunk`` > 1 expanded to its blocks (``paired_positions``);
transfers are bucketed by blocks and a few of each bucket are taken, spread
over the trace. The synthetic rows then take id patterns the traces lack:
one consecutive run on both sides, runs of 1-8 local ids against
consecutive remote ones, and scattered local ids against consecutive remote
ones.

Memory: the presets' refs and pages, but every page divided by
``--page-divisor`` (64: llama-3.1-8b's 64 KiB pages become 1 KiB,
llama-3.1-70b-tp4's 8 KiB become 128 B), the ids as recorded, over pools as
large as the ids reach (NUM_LOCAL_BLOCKS local blocks, the traces' CPU
blocks remote). At full size the traces' two pools of llama-3.1-8b alone
(3072 and 12288 blocks) would take 30 GiB, and one of its large transfers
would move 1.5 GiB. The descriptors, their count, their merging, build and
make do not depend on the page bytes; transfer() and completion do (UCX
moves the bytes), so they are measured on scaled pages: what each posted
descriptor costs UCX here, plus 1/64 of the bytes, not the bandwidth of
real pages. Each way is first checked to move the right bytes.

Last, NIXL's POSIX backend (Linux AIO, its default in NIXL 1.5) against
``ptrres.write_files`` on the same FilePlans (``plan_file_ops`` of a trace's
stores, one file per chunk, on the same scaled pages, in a temporary
directory, rewritten in place: the page cache): NIXL with the files opened
and registered beforehand (what that costs is its own column), write_files
opening each file itself. NIXL is checked to write what write_files writes.

Run: python benchmarks/nixl_transfer.py [--quick] [--page-divisor N]
     [--only traces|patterns|posix]...
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Loopback only, before NIXL (and its UCX) is loaded.
os.environ["UCX_NET_DEVICES"] = "lo"

import numpy as np
import numpy.typing as npt

import ptrres
import ptrres.nixl as pn
from ptrres.bench import PRESETS, TRACES, Preset, load_trace
from ptrres.bench.traces import Trace, paired_positions, spread

PRESET_NAMES = ("llama-3.1-8b", "llama-3.1-70b-tp4")
PAGE_DIVISOR = 64
# The local pool: every trace's GPU ids (3072 blocks) and the synthetic ones.
NUM_LOCAL_BLOCKS = 8192
# Blocks per transfer: [low, high) of each bucket; the traces reach 757.
BUCKETS = ((1, 16), (16, 256), (256, 1 << 30))
PATTERN_SIZES = (16, 256, 2048)
QUICK_PATTERN_SIZES = (16, 256)
WAYS = ("a", "b", "c", "d")
WAY_NAMES = {
    "a": "(a) vLLM 0.33 indices + make_prepped_xfer",
    "b": "(b) ptrres prepped_indices + make_prepped_xfer",
    "c": "(c) ptrres Nx3 rows + initialize_xfer",
    "d": "(d) ptrres Nx3 rows, coalesced + initialize_xfer",
}
NOTIF = b"kv-ready"
# Seconds to wait for a transfer or a notification before calling it stuck.
STUCK_SECONDS = 60.0

IdArray = npt.NDArray[np.int32]


def nixl_classes() -> tuple[Any, Any]:
    """NIXL's agent and its config, from whichever package is installed."""
    try:
        from nixl_cu12 import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl._api import nixl_agent, nixl_agent_config  # type: ignore
    # NIXL logs to stdout, where the tables go: warnings only, to stderr.
    nixl_logger = logging.getLogger("nixl")
    nixl_logger.setLevel(logging.WARNING)
    for handler in nixl_logger.handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)
    return nixl_agent, nixl_agent_config


def bucket_name(low: int, high: int) -> str:
    return f">= {low}" if high >= 1 << 30 else f"{low}-{high - 1}"


# --- Memory ---------------------------------------------------------------


@dataclass
class HostCaches:
    """One engine's KV caches in host memory: a preset's refs, pages scaled."""

    tensors: list[npt.NDArray[np.uint8]]
    table: ptrres.PointerTable

    @property
    def num_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def host_caches(preset: Preset, num_blocks: int, divisor: int) -> HostCaches:
    """The preset's layout over real host tensors, one allocation per ref
    (vLLM allocates each layer's cache apart), each page ``1 / divisor`` of
    the preset's. np.zeros: pages no transfer touches stay unmapped."""
    if preset.shared_tensors:
        raise ValueError(f"{preset.name}: layouts of shared tensors are not built here")
    tensors: list[npt.NDArray[np.uint8]] = []
    groups: list[list[ptrres.CanonicalKVCacheRef]] = []
    for page in preset.group_page_sizes:
        scaled = max(page // divisor, 1)
        refs = []
        for _ in range(preset.refs_per_group):
            refs.append(ptrres.CanonicalKVCacheRef(len(tensors), scaled))
            tensors.append(np.zeros((num_blocks, scaled), np.uint8))
        groups.append(refs)
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(t, t.shape[1]) for t in tensors], groups
    )
    return HostCaches(tensors, ptrres.PointerTable(kv))


# --- The four ways --------------------------------------------------------


def vllm_desc_ids(block_ids: Sequence[Any], region_num_blocks: list[int]) -> Any:
    """vLLM 0.33's descriptor ids (``_compute_desc_ids``, all-attention fast
    path, no region-group mapping), as it writes them."""
    region_offsets = np.cumsum([0, *region_num_blocks[:-1]])
    block_arr = np.concatenate(
        [np.asarray(group, dtype=np.int32) for group in block_ids]
    )[None, :]
    return (region_offsets[:, None] + block_arr).ravel()


@dataclass
class Sample:
    """One transfer moved one way: counts and nanoseconds."""

    descriptors: int  # handed to NIXL
    posted: int  # NIXL's own count after its merge (telemetry)
    build: int
    make: int  # make_prepped_xfer or initialize_xfer
    transfer: int  # transfer(): make + transfer is the post
    completion: int


@dataclass
class PeerPair:
    """A local engine and a remote one, each with its agent, registered, the
    remote's metadata loaded, both prepared lists made; and the buffers ptrres
    writes into."""

    local_agent: Any
    remote_agent: Any
    local: HostCaches
    remote: HostCaches
    peer: ptrres.PeerLayout
    local_region_blocks: list[int]
    remote_region_blocks: list[int]
    registrations: list[pn.Registration]
    local_prepped: Any
    remote_prepped: Any
    local_memory: pn.Memory
    remote_memory: pn.Memory
    index_out: tuple[IdArray, IdArray]
    plan_out: tuple[npt.NDArray[np.uint64], ...]
    rows_out: tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]
    notifs_seen: int = 0
    released: bool = field(default=False)

    def close(self) -> None:
        """Release the prepared lists, deregister, forget the remote agent."""
        if self.released:
            return
        self.released = True
        self.local_prepped.release()
        self.remote_prepped.release()
        self.local_agent.remove_remote_agent(self.remote_agent.name)
        for registration in self.registrations:
            registration.deregister()


def peer_pair(
    preset: Preset, remote_blocks: int, max_ids: int, divisor: int
) -> PeerPair:
    """Two engines of the preset's geometry, ready to move ``max_ids`` ids."""
    nixl_agent, nixl_agent_config = nixl_classes()
    local_agent = nixl_agent(
        f"local-{preset.name}",
        nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"], capture_telemetry=True
        ),
    )
    remote_agent = nixl_agent(
        f"remote-{preset.name}",
        nixl_agent_config(enable_prog_thread=False, backends=["UCX"]),
    )
    local = host_caches(preset, NUM_LOCAL_BLOCKS, divisor)
    remote = host_caches(preset, remote_blocks, divisor)
    registrations = [
        pn.register(local_agent, local.table),
        pn.register(remote_agent, remote.table),
    ]
    local_agent.add_remote_agent(remote_agent.get_agent_metadata())
    peer = ptrres.PeerLayout.of(remote.table)
    local_prepped = local_agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", *pn.prepped_rows(local.table)
    )
    remote_prepped = local_agent.prep_xfer_dlist(
        remote_agent.name, *pn.prepped_rows(peer)
    )
    n_ops = max_ids * preset.num_refs
    return PeerPair(
        local_agent,
        remote_agent,
        local,
        remote,
        peer,
        [NUM_LOCAL_BLOCKS] * preset.num_refs,
        [remote_blocks] * preset.num_refs,
        registrations,
        local_prepped,
        remote_prepped,
        pn.memory_of(local.table),
        pn.memory_of(peer),
        # np.zeros then written: mapped before any timing, as a server's
        # pinned buffers are.
        (touched(np.zeros(n_ops, np.int32)), touched(np.zeros(n_ops, np.int32))),
        tuple(touched(np.zeros(n_ops, np.uint64)) for _ in range(3)),
        (
            touched(np.zeros((n_ops, 3), np.uint64)),
            touched(np.zeros((n_ops, 3), np.uint64)),
        ),
    )


def touched(buffer: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """The buffer, every page of it written (mapped)."""
    buffer.fill(1)
    return buffer


def build(pair: PeerPair, way: str, local_ids: IdArray, remote_ids: IdArray) -> Any:
    """What way ``way`` hands NIXL for one transfer."""
    if way == "a":
        return (
            vllm_desc_ids([local_ids], pair.local_region_blocks),
            vllm_desc_ids([remote_ids], pair.remote_region_blocks),
        )
    if way == "b":
        return (
            pn.prepped_indices(pair.local.table, local_ids, out=pair.index_out[0]),
            pn.prepped_indices(pair.peer, remote_ids, out=pair.index_out[1]),
        )
    spec = ptrres.GPULoadStoreSpec(local_ids)
    plan = pair.local.table.plan_peer_transfer(
        spec, pair.peer, remote_ids, coalesce=way == "d", out=pair.plan_out
    )
    return pn.peer_xfer_descs(
        plan, local=pair.local_memory, remote=pair.remote_memory, out=pair.rows_out
    )


def make(pair: PeerPair, way: str, built: Any) -> Any:
    """The transfer's handle."""
    if way in ("a", "b"):
        local_indices, remote_indices = built
        return pair.local_agent.make_prepped_xfer(
            "READ",
            pair.local_prepped,
            local_indices,
            pair.remote_prepped,
            remote_indices,
            notif_msg=NOTIF,
        )
    return built.initialize_xfer(
        pair.local_agent, "READ", pair.remote_agent.name, NOTIF
    )


def complete(pair: PeerPair, handle: Any) -> None:
    """Wait for DONE, driving the remote agent meanwhile."""
    deadline = time.monotonic() + STUCK_SECONDS
    while (state := pair.local_agent.check_xfer_state(handle)) == "PROC":
        pair.notifs_seen += count_notifs(pair.remote_agent.get_new_notifs())
        if time.monotonic() > deadline:
            raise RuntimeError("a transfer did not complete")
    if state != "DONE":
        raise RuntimeError(f"a transfer ended {state}")


def count_notifs(notifs: dict[str, list[bytes]]) -> int:
    return sum(len(messages) for messages in notifs.values())


def drain_notif(pair: PeerPair) -> None:
    """Take the transfer's notification on the remote side (untimed)."""
    deadline = time.monotonic() + STUCK_SECONDS
    while pair.notifs_seen < 1:
        pair.notifs_seen += count_notifs(pair.remote_agent.get_new_notifs())
        if time.monotonic() > deadline:
            raise RuntimeError("a notification never came")
    pair.notifs_seen -= 1


def move(pair: PeerPair, way: str, local_ids: IdArray, remote_ids: IdArray) -> Sample:
    """Build, post and complete one transfer one way, timed."""
    clock = time.perf_counter_ns
    t0 = clock()
    built = build(pair, way, local_ids, remote_ids)
    t1 = clock()
    handle = make(pair, way, built)
    t2 = clock()
    state = pair.local_agent.transfer(handle)
    t3 = clock()
    if state == "ERR":
        raise RuntimeError(f"way {way}: transfer() failed")
    complete(pair, handle)
    t4 = clock()
    posted = int(pair.local_agent.get_xfer_telemetry(handle).descCount)
    handle.release()
    drain_notif(pair)
    descriptors = len(built[0]) if way in ("a", "b") else len(built)
    return Sample(descriptors, posted, t1 - t0, t2 - t1, t3 - t2, t4 - t3)


def check_ways(pair: PeerPair, local_ids: IdArray, remote_ids: IdArray) -> None:
    """Every way moves the remote blocks' bytes into the local blocks."""
    rng = np.random.default_rng(7)
    for remote_tensor in pair.remote.tensors:
        remote_tensor[remote_ids] = rng.integers(
            1, 256, (len(remote_ids), remote_tensor.shape[1]), dtype=np.uint8
        )
    for way in WAYS:
        for local_tensor in pair.local.tensors:
            local_tensor[local_ids] = 0
        move(pair, way, local_ids, remote_ids)
        for local_tensor, remote_tensor in zip(pair.local.tensors, pair.remote.tensors):
            if not np.array_equal(local_tensor[local_ids], remote_tensor[remote_ids]):
                raise AssertionError(f"way {way} moved the wrong bytes")


def time_transfer(
    pair: PeerPair, local_ids: IdArray, remote_ids: IdArray, rounds: int
) -> dict[str, Sample]:
    """The four ways in turn, ``rounds`` times; each field's median."""
    samples: dict[str, list[Sample]] = {way: [] for way in WAYS}
    for r in range(rounds):
        for k in range(len(WAYS)):
            way = WAYS[(r + k) % len(WAYS)]
            samples[way].append(move(pair, way, local_ids, remote_ids))
    return {way: median_sample(s) for way, s in samples.items()}


def median_sample(samples: list[Sample]) -> Sample:
    def med(name: str) -> int:
        return int(statistics.median(getattr(s, name) for s in samples))

    return Sample(*(med(n) for n in Sample.__dataclass_fields__))


# --- Transfers ------------------------------------------------------------


@dataclass
class Transfer:
    """One transfer's ids: local (GPU) and remote, block for block."""

    key: tuple[str, ...]  # the table row it counts in
    local_ids: IdArray
    remote_ids: IdArray


def trace_ids(trace: Trace, i: int) -> tuple[IdArray, IdArray]:
    """Transfer i's GPU ids and its CPU positions in blocks (a chunk of
    several blocks expanded to them)."""
    t = trace.transfer(i)
    gpu, cpu = paired_positions(
        t.gpu_ids, t.cpu_ids, trace.blocks_per_chunk, t.block_index
    )
    return gpu.astype(np.int32), cpu.astype(np.int32)


def trace_transfers(
    trace: Trace, per_bucket: int, stores_only: bool = False
) -> Iterator[tuple[str, int]]:
    """(bucket, transfer index): up to ``per_bucket`` transfers of each
    bucket, spread over the trace."""
    sizes = np.diff(trace.gpu_offsets)
    for low, high in BUCKETS:
        mask = (sizes >= low) & (sizes < high)
        if stores_only:
            mask &= trace.store
        members = np.flatnonzero(mask)
        for j in spread(len(members), per_bucket):
            yield bucket_name(low, high), int(members[j])


def pattern_ids(pattern: str, n: int, rng: np.random.Generator) -> IdArray:
    """Local ids of a synthetic pattern, distinct, inside the local pool."""
    if pattern == "consecutive":
        start = int(rng.integers(0, NUM_LOCAL_BLOCKS - n))
        return np.arange(start, start + n, dtype=np.int32)
    if pattern == "scattered":
        return rng.choice(NUM_LOCAL_BLOCKS, n, replace=False).astype(np.int32)
    # Runs of 1-8 from random 8-block slots: each slot gives one run.
    slots = rng.permutation(NUM_LOCAL_BLOCKS // 8)
    ids: list[int] = []
    for slot in slots:
        run = min(int(rng.integers(1, 9)), n - len(ids))
        ids.extend(range(slot * 8, slot * 8 + run))
        if len(ids) == n:
            break
    return np.array(ids, np.int32)


PATTERNS = ("consecutive", "runs of 1-8", "scattered")


def pattern_transfers(sizes: Sequence[int], remote_blocks: int) -> list[Transfer]:
    """Each pattern at each size; remote ids one consecutive run, as a
    peer's (or a CPU pool's) freshly allocated blocks are."""
    rng = np.random.default_rng(0)
    transfers = []
    for pattern in PATTERNS:
        for n in sizes:
            start = int(rng.integers(0, remote_blocks - n))
            remote = np.arange(start, start + n, dtype=np.int32)
            transfers.append(
                Transfer((pattern, str(n)), pattern_ids(pattern, n, rng), remote)
            )
    return transfers


# --- Tables ---------------------------------------------------------------


@dataclass
class Row:
    """A table row: the samples of one way over the transfers of a label."""

    samples: list[Sample] = field(default_factory=list)
    blocks: int = 0

    def mean(self, name: str) -> float:
        return statistics.fmean(getattr(s, name) for s in self.samples)

    def total(self, *names: str) -> int:
        """The fields named, summed over every sample."""
        return sum(getattr(s, n) for s in self.samples for n in names)


def us(ns: float) -> str:
    value = ns / 1e3
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def ratio(a: int, b: int) -> str:
    return f"{b / a:.2f}" if a else "-"


POST = ("make", "transfer")
ALL = ("build", "make", "transfer", "completion")


def way_table(
    first_column: str, rows: dict[tuple[str, ...], dict[str, Row]]
) -> list[str]:
    """One Markdown row per (label, way): means per transfer, ratios to (a)."""
    lines = [
        f"| {first_column} | transfers | blocks | way | descr | posted | build us "
        "| make/init us | transfer() us | completion us | build+post x(a) "
        "| all x(a) |",
        "|---" * (first_column.count("|") + 1) + "|---:|---:|---" + "|---:" * 8 + "|",
    ]
    for key, ways in rows.items():
        base = ways["a"]
        for way, row in ways.items():
            n = len(row.samples)
            lines.append(
                f"| {' | '.join(key)} | {n} | {row.blocks / n:.0f} | {way} "
                f"| {row.mean('descriptors'):.0f} | {row.mean('posted'):.0f} "
                f"| {us(row.mean('build'))} | {us(row.mean('make'))} "
                f"| {us(row.mean('transfer'))} | {us(row.mean('completion'))} "
                f"| {ratio(base.total('build', *POST), row.total('build', *POST))} "
                f"| {ratio(base.total(*ALL), row.total(*ALL))} |"
            )
    return lines


def summary_table(
    first_columns: str, rows: dict[tuple[str, ...], dict[str, Row]]
) -> list[str]:
    """Per label: (b), (c) and (d) against (a), sums over the label's
    transfers: what the CPU spends before transfer() (build + make), the
    post (build + make + transfer) and all of it; the fastest way."""
    lines = [
        f"| {first_columns} | transfers | build+make b, c, d x(a) "
        "| build+post b, c, d x(a) | all b, c, d x(a) | fastest build+make "
        "| fastest build+post | fastest all |",
        "|---" * (first_columns.count("|") + 1) + "|---:|---:|---:|---:|---|---|---|",
    ]
    for key, ways in rows.items():
        sums = [
            {w: r.total(*fields) for w, r in ways.items()}
            for fields in (("build", "make"), ("build", *POST), ALL)
        ]
        ratios = [", ".join(ratio(t["a"], t[w]) for w in "bcd") for t in sums]
        fastest = [min(t, key=t.__getitem__) for t in sums]
        lines.append(
            f"| {' | '.join(key)} | {len(ways['a'].samples)} "
            f"| {' | '.join(ratios)} | {' | '.join(fastest)} |"
        )
    return lines


def pooled(
    rows: dict[tuple[str, ...], dict[str, Row]], keep: int
) -> dict[tuple[str, ...], dict[str, Row]]:
    """The rows merged on the key's field ``keep`` (a trace's bucket)."""
    merged: dict[tuple[str, ...], dict[str, Row]] = {}
    for key, ways in rows.items():
        into = merged.setdefault((key[keep],), {way: Row() for way in WAYS})
        for way, row in ways.items():
            into[way].samples += row.samples
            into[way].blocks += row.blocks
    return merged


def add(
    rows: dict[tuple[str, ...], dict[str, Row]],
    key: tuple[str, ...],
    blocks: int,
    medians: dict[str, Sample],
) -> None:
    ways = rows.setdefault(key, {way: Row() for way in WAYS})
    for way, sample in medians.items():
        ways[way].samples.append(sample)
        ways[way].blocks += blocks


# --- Sections -------------------------------------------------------------


def run_peers(args: argparse.Namespace, sections: set[str]) -> None:
    traces = ["vllm033-lru"] if args.quick else list(TRACES)
    per_bucket = 1 if args.quick else args.per_bucket
    rounds = 1 if args.quick else args.rounds
    sizes = QUICK_PATTERN_SIZES if args.quick else PATTERN_SIZES
    loaded = {name: load_trace(name) for name in traces}
    remote_blocks = max(t.num_cpu_blocks * t.blocks_per_chunk for t in loaded.values())
    longest = max(
        [*(int(np.diff(t.gpu_offsets).max()) for t in loaded.values()), *sizes]
    )
    for name in PRESET_NAMES:
        preset = PRESETS[name]
        pair = peer_pair(preset, remote_blocks, longest, args.page_divisor)
        try:
            pages = ", ".join(
                f"{p // args.page_divisor} B" for p in preset.group_page_sizes
            )
            print(
                f"\n**{name}**: {preset.num_refs} refs, pages {pages} (1/"
                f"{args.page_divisor} of the preset's), {NUM_LOCAL_BLOCKS} local "
                f"and {remote_blocks} remote blocks: "
                f"{(pair.local.num_bytes + pair.remote.num_bytes) / 2**20:.0f} MiB "
                "allocated and registered.\n"
            )
            first_local, first_remote = trace_ids(next(iter(loaded.values())), 0)
            check_ways(pair, first_local, first_remote)
            if "traces" in sections:
                rows: dict[tuple[str, ...], dict[str, Row]] = {}
                for trace_name, trace in loaded.items():
                    for bucket, i in trace_transfers(trace, per_bucket):
                        local_ids, remote_ids = trace_ids(trace, i)
                        medians = time_transfer(pair, local_ids, remote_ids, rounds)
                        add(rows, (trace_name, bucket), len(local_ids), medians)
                print("\n".join(way_table("trace | blocks/transfer", rows)))
                print(f"\n{name}, every trace together:\n")
                print("\n".join(summary_table("blocks/transfer", pooled(rows, 1))))
                print()
            if "patterns" in sections:
                rows = {}
                for transfer in pattern_transfers(sizes, remote_blocks):
                    medians = time_transfer(
                        pair, transfer.local_ids, transfer.remote_ids, rounds
                    )
                    add(rows, transfer.key, len(transfer.local_ids), medians)
                print("\n".join(way_table("local ids | size", rows)))
                print(f"\n{name}, synthetic ids:\n")
                print("\n".join(summary_table("local ids | size", rows)))
                print()
        finally:
            pair.close()


def run_posix(args: argparse.Namespace) -> None:
    """NIXL's POSIX backend against write_files, on the same FilePlans."""
    nixl_agent, nixl_agent_config = nixl_classes()
    traces = ["vllm033-lru-bpc4"] if args.quick else list(TRACES)
    per_bucket = 1 if args.quick else args.per_bucket
    rounds = 1 if args.quick else args.rounds
    print(
        "\nPOSIX: stores of the traces, `plan_file_ops(spec, blocks_per_chunk)`, "
        "one file per chunk. `nixl` = `file_xfer_descs` + `initialize_xfer` + "
        "`transfer` + wait, files open and registered; `open+reg` = opening "
        "the files and `register_files` (and undoing both), which `nixl` "
        "leaves out; write_files opens and closes each file itself. Means per "
        "transfer of medians, in us.\n"
    )
    print(
        "| preset | trace | blocks/transfer | transfers | blocks | files | ops "
        "| nixl | open+reg | write_files(max_workers=1) | write_files() "
        "| nixl / write_files(1) | nixl+open+reg / write_files(1) |"
    )
    print("|---|---|---|" + "---:|" * 10)
    for name in PRESET_NAMES:
        preset = PRESETS[name]
        agent = nixl_agent(
            f"files-{name}",
            nixl_agent_config(enable_prog_thread=False, backends=["POSIX"]),
        )
        local = host_caches(preset, NUM_LOCAL_BLOCKS, args.page_divisor)
        for k, tensor in enumerate(local.tensors):
            tensor[:] = k % 255 + 1  # something to write, other in each ref
        memory = pn.memory_of(local.table)
        with pn.register(agent, local.table), tempfile.TemporaryDirectory() as tmp:
            for trace_name in traces:
                trace = load_trace(trace_name)
                cells: dict[str, list[tuple[int, ...]]] = {}
                for bucket, i in trace_transfers(trace, per_bucket, stores_only=True):
                    t = trace.transfer(i)
                    spec = ptrres.GPULoadStoreSpec(t.gpu_ids, None, [t.block_index])
                    plan = local.table.plan_file_ops(spec, trace.blocks_per_chunk)
                    paths = [
                        str(Path(tmp) / f"chunk{int(c)}")
                        for c in t.cpu_ids[: plan.num_files]
                    ]
                    ptrres.write_files(plan, paths)  # create them, warm the cache
                    check_posix(agent, plan, paths, local, memory)
                    times = time_posix(agent, plan, paths, memory, rounds)
                    cells.setdefault(bucket, []).append(
                        (len(t.gpu_ids), plan.num_files, len(plan.sizes), *times)
                    )
                for bucket, values in cells.items():
                    m = [statistics.fmean(v[k] for v in values) for k in range(7)]
                    print(
                        f"| {name} | {trace_name} | {bucket} | {len(values)} "
                        f"| {m[0]:.0f} | {m[1]:.0f} | {m[2]:.0f} | {us(m[3])} "
                        f"| {us(m[4])} | {us(m[5])} | {us(m[6])} "
                        f"| {m[3] / m[5]:.2f} | {(m[3] + m[4]) / m[5]:.2f} |"
                    )


def open_files(agent: Any, paths: Sequence[str]) -> tuple[list[int], pn.Registration]:
    fds = [os.open(p, os.O_RDWR | os.O_CREAT, 0o644) for p in paths]
    return fds, pn.register_files(agent, fds)


def close_files(fds: list[int], registration: pn.Registration) -> None:
    registration.deregister()
    for fd in fds:
        os.close(fd)


def nixl_write(agent: Any, plan: Any, fds: list[int], memory: pn.Memory) -> None:
    handle = pn.file_xfer_descs(plan, fds, memory=memory).initialize_xfer(
        agent, "WRITE", agent.name
    )
    state = agent.transfer(handle)
    deadline = time.monotonic() + STUCK_SECONDS
    while state == "PROC":
        state = agent.check_xfer_state(handle)
        if time.monotonic() > deadline:
            raise RuntimeError("a POSIX transfer did not complete")
    if state != "DONE":
        raise RuntimeError(f"a POSIX transfer ended {state}")
    handle.release()


def check_posix(
    agent: Any, plan: Any, paths: list[str], local: HostCaches, memory: pn.Memory
) -> None:
    """NIXL writes what write_files writes."""
    expected = [Path(p).read_bytes() for p in paths]
    for p in paths:
        Path(p).write_bytes(b"\0" * len(Path(p).read_bytes()))
    fds, registration = open_files(agent, paths)
    try:
        nixl_write(agent, plan, fds, memory)
    finally:
        close_files(fds, registration)
    if [Path(p).read_bytes() for p in paths] != expected:
        raise AssertionError("NIXL's POSIX backend wrote other bytes than write_files")


def time_posix(
    agent: Any, plan: Any, paths: list[str], memory: pn.Memory, rounds: int
) -> tuple[int, int, int, int]:
    """Medians (ns): NIXL's write, opening and registering the files,
    write_files in one thread, write_files with its pool; interleaved."""
    clock = time.perf_counter_ns
    samples: list[tuple[int, int, int, int]] = []
    for _ in range(rounds):
        t0 = clock()
        fds, registration = open_files(agent, paths)
        close_files(fds, registration)
        t1 = clock()
        fds, registration = open_files(agent, paths)
        t2 = clock()
        nixl_write(agent, plan, fds, memory)
        t3 = clock()
        close_files(fds, registration)
        t4 = clock()
        ptrres.write_files(plan, paths, max_workers=1)
        t5 = clock()
        ptrres.write_files(plan, paths)
        t6 = clock()
        samples.append((t3 - t2, t1 - t0, t5 - t4, t6 - t5))
    nixl, register, one_thread, pool = (
        int(statistics.median(s[k] for s in samples)) for k in range(4)
    )
    return nixl, register, one_thread, pool


def load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="seconds: one trace, one transfer per bucket, one round",
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-bucket", type=int, default=6)
    parser.add_argument("--page-divisor", type=int, default=PAGE_DIVISOR)
    parser.add_argument(
        "--only", action="append", choices=("traces", "patterns", "posix")
    )
    args = parser.parse_args(argv)
    sections = set(args.only or ("traces", "patterns", "posix"))
    ptrres.warmup()
    started = time.monotonic()
    rounds = 1 if args.quick else args.rounds
    print(
        f"Load average {load_average()} ({os.cpu_count()} CPUs), "
        f"Python {platform.python_version()}; READ of the remote blocks with a "
        f"notification; {rounds} round{'s' if rounds != 1 else ''} per transfer"
        + (", quick run (one trace, one transfer per bucket)" if args.quick else "")
        + ". UCX here: RMA emulated over active messages on tcp/lo (cma for "
        "bulk data), loopback only. descr: descriptors handed to NIXL; posted: "
        "NIXL's count after its own merge; times in us, means per transfer of "
        "medians; x(a): summed over the same transfers, against (a).\n"
    )
    print("\n".join(f"- {WAY_NAMES[w]}" for w in WAYS))
    if sections & {"traces", "patterns"}:
        run_peers(args, sections)
    if "posix" in sections:
        run_posix(args)
    print(
        f"\nLoad average at the end {load_average()}; "
        f"{time.monotonic() - started:.0f} s."
    )


if __name__ == "__main__":
    main()
