"""Real NIXL agents for tests/nixl: KV caches in host memory, a peer process,
and the reference's bytes to compare with (SPEC 14).

NIXL is imported plainly: where it is missing, every test of tests/nixl fails
at collection (it is in the test extra), never skips.

This process holds one UCX agent; a peer process, started with multiprocessing's
"spawn", holds another. Both build their KV caches from the same designs and
seeds, so that this process can rebuild byte-identical copies of the peer's
caches (the mirror). Nothing listens on a socket: the agents' metadata, the
peer's layout numbers and its caches' bytes pass through a Pipe, and UCX keeps
to the loopback device. The peer serves commands over the Pipe and, between
them, drives its agent (``get_new_notifs``), since no progress thread runs.

A transfer is checked against ``ptrres.reference``: the reference's own plan
of the same ids, executed on copies of both sides, must leave every byte of
every buffer (guard zones included) as NIXL left the real ones.
"""

from __future__ import annotations

import os

# Before NIXL loads UCX: UCX's TCP transport would also use the machine's
# network interfaces.
os.environ["UCX_NET_DEVICES"] = "lo"

import importlib
import itertools
import multiprocessing
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

import ptrres
import ptrres.nixl
from ptrres import reference

# The Python API of NIXL 1.5: the meta package, else one CUDA major's wheel.
NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


def _import_nixl_api() -> ModuleType:
    """NIXL's ``_api`` module, from the first package that has it."""
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            # Without the meta package, "nixl" may have been found as this
            # directory (a namespace package: tests/ is on sys.path); do not
            # leave it for the next importer.
            found = sys.modules.get("nixl")
            if found is not None and getattr(found, "__file__", None) is None:
                del sys.modules["nixl"]
    raise ImportError(
        "tests/nixl needs NIXL: install nixl-cu12==1.5.1 or nixl-cu13 (the test "
        f"extra has it); none of {', '.join(NIXL_MODULES)} imports"
    )


NIXL_API = _import_nixl_api()

# Seconds any one wait may take: a peer's start-up (imports), a reply, a
# transfer. A test that passes one fails instead of hanging.
START_TIMEOUT = 120.0
TIMEOUT = 30.0
# Seconds the peer waits on its Pipe before driving its agent again.
IDLE_POLL = 0.001
# Bytes before and after the tensors of each buffer: a copy outside a tensor
# changes them, and no reference copy does.
GUARD = 64
# The element types of the caches' tensors.
NUMPY_DTYPES = {"uint8": np.uint8, "float16": np.float16, "float32": np.float32}
TORCH_DTYPES = {
    "uint8": torch.uint8,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
# NIXL's transfer operations: READ moves the peer's blocks into this
# process's, WRITE this process's into the peer's.
OPS = ("READ", "WRITE")

_agent_numbers = itertools.count()


def new_agent(role: str, backend: str) -> Any:
    """A NIXL agent of one backend, without a progress thread (it would spin a
    core) and without a listener (nothing binds a socket)."""
    config = NIXL_API.nixl_agent_config(
        enable_prog_thread=False, enable_listen_thread=False, backends=[backend]
    )
    name = f"{role}-{os.getpid()}-{next(_agent_numbers)}"
    return NIXL_API.nixl_agent(name, config)


# --- KV caches in host memory, with guard zones --------------------------------


@dataclass(frozen=True)
class TensorDesign:
    """One tensor of KV caches: rows of ``row_bytes`` bytes, ``row_stride``
    bytes apart (the rest of a row is padding)."""

    num_blocks: int
    row_bytes: int
    row_stride: int
    # A key of NUMPY_DTYPES or TORCH_DTYPES (bfloat16 is torch's only).
    dtype: str


@dataclass(frozen=True)
class CacheDesign:
    """KV caches to build the same way in either process: plain data, sent to
    the peer through the Pipe."""

    # "numpy" or "torch": what allocates the buffers and makes the tensors.
    library: str
    tensors: tuple[TensorDesign, ...]
    # Per buffer (one allocation), its tensors (indices), back to back, between
    # two guard zones.
    buffers: tuple[tuple[int, ...], ...]
    # Per KV-cache group, its refs: (tensor index, page bytes).
    groups: tuple[tuple[tuple[int, int], ...], ...]
    # Seeds the bytes of every buffer, guard zones and padding included.
    seed: int

    def group_tensors(self) -> list[list[int]]:
        """The tensor of each ref, group by group."""
        return [[tensor for tensor, _ in refs] for refs in self.groups]

    def group_limits(self) -> list[int]:
        """The blocks every ref of each group has: a valid id is below it."""
        return [
            min(self.tensors[tensor].num_blocks for tensor in tensors)
            for tensors in self.group_tensors()
        ]


def hybrid(
    library: str, num_blocks: int, pad: int, seed: int, *, one_group: bool = False
) -> CacheDesign:
    """Four tensors, padded rows (``pad`` bytes) in two of them, refs of three
    groups: group 0 over tensors 0 and 1 (back to back in one buffer, rows
    unpadded, so that merged copies run from one into the other), group 1
    over tensor 2 and tensor 1 again (another page), group 2 over tensor 3.
    Tensors 2 and 3 have more blocks: group 1's refs have different counts.
    ``one_group``: the same refs, all in one group."""
    first = "bfloat16" if library == "torch" else "float16"
    tensors = (
        TensorDesign(num_blocks, 256, 256, first),
        TensorDesign(num_blocks, 256, 256, "uint8"),
        TensorDesign(num_blocks + 1, 192, 192 + pad, "float32"),
        TensorDesign(num_blocks + 2, 128, 128 + pad, "float16"),
    )
    groups: tuple[tuple[tuple[int, int], ...], ...] = (
        ((0, 256), (1, 256)),
        ((2, 192), (1, 128)),
        ((3, 96),),
    )
    if one_group:
        groups = (tuple(ref for refs in groups for ref in refs),)
    return CacheDesign(library, tensors, ((0, 1), (2,), (3,)), groups, seed)


def regions(library: str, seed: int) -> CacheDesign:
    """Two groups, each with one region (ref) of 4 blocks, the regions back to
    back in one buffer: vLLM's per-group regions (SPEC 14)."""
    tensors = (TensorDesign(4, 128, 128, "uint8"), TensorDesign(4, 128, 128, "uint8"))
    return CacheDesign(library, tensors, ((0, 1),), (((0, 128),), ((1, 128),)), seed)


# Per key, (this process's design, the peer's): the peer has more blocks and
# other padding, so that ids, strides and addresses differ on the two sides.
DESIGNS = {
    **{
        f"{library} {layout}": (
            hybrid(library, 10, 16, 10 + k, one_group=layout == "one group"),
            hybrid(library, 13, 48, 20 + k, one_group=layout == "one group"),
        )
        for k, (library, layout) in enumerate(
            itertools.product(("numpy", "torch"), ("one group", "hybrid"))
        )
    },
    "regions": (regions("numpy", 30), regions("numpy", 31)),
}


class Caches:
    """KV caches built from a design: buffers with guard zones, tensors (numpy
    arrays or torch CPU tensors) inside them, and their PointerTable."""

    def __init__(self, design: CacheDesign) -> None:
        self.design = design
        # What owns each buffer (a numpy array or a torch tensor), and its
        # bytes as a numpy uint8 array (a view of the same memory).
        self._owners: list[Any] = []
        self.buffers: list[npt.NDArray[np.uint8]] = []
        self.tensors: list[Any] = [None] * len(design.tensors)
        for tensor_indices in design.buffers:
            shapes = [design.tensors[t] for t in tensor_indices]
            spans = [shape.num_blocks * shape.row_stride for shape in shapes]
            nbytes = GUARD + sum(spans) + GUARD
            if design.library == "torch":
                owner: Any = torch.empty(nbytes, dtype=torch.uint8)
                buffer = owner.numpy()
            else:
                owner = buffer = np.empty(nbytes, np.uint8)
            self._owners.append(owner)
            self.buffers.append(buffer)
            start = GUARD
            for t, shape, span in zip(tensor_indices, shapes, spans):
                rows = owner[start : start + span]
                rows = rows.reshape(shape.num_blocks, shape.row_stride)
                rows = rows[:, : shape.row_bytes]
                if design.library == "torch":
                    self.tensors[t] = rows.view(TORCH_DTYPES[shape.dtype])
                else:
                    self.tensors[t] = rows.view(NUMPY_DTYPES[shape.dtype])
                start += span
        self.fill()
        # The numbers a handshake carries of each ref, group by group: its
        # tensor's address, row stride, page and blocks (from the design).
        self.ref_numbers = [
            [
                (
                    int(self.tensors[t].data_ptr())
                    if design.library == "torch"
                    else int(self.tensors[t].ctypes.data),
                    design.tensors[t].row_stride,
                    page,
                    design.tensors[t].num_blocks,
                )
                for t, page in refs
            ]
            for refs in design.groups
        ]
        self.kv_caches = ptrres.CanonicalKVCaches(
            [ptrres.CanonicalKVCacheTensor(tensor, 0) for tensor in self.tensors],
            [
                [ptrres.CanonicalKVCacheRef(tensor, page) for tensor, page in refs]
                for refs in design.groups
            ],
        )
        self.table = ptrres.PointerTable(self.kv_caches)

    def fill(self) -> None:
        """Every byte of every buffer from the design's seed."""
        for b, buffer in enumerate(self.buffers):
            rng = np.random.default_rng((self.design.seed, b))
            buffer[:] = rng.integers(0, 256, len(buffer), dtype=np.uint8)

    def zero(self) -> None:
        """Every byte of every buffer, guard zones included, zero."""
        for buffer in self.buffers:
            buffer[:] = 0

    def snapshot(self) -> list[bytes]:
        """Every buffer's bytes, guard zones included."""
        return [buffer.tobytes() for buffer in self.buffers]

    def restore(self, snapshot: Sequence[bytes]) -> None:
        """Set every buffer's bytes."""
        for buffer, saved in zip(self.buffers, snapshot):
            buffer[:] = np.frombuffer(saved, np.uint8)

    def copy(self) -> Caches:
        """New caches of the same design, with these bytes."""
        twin = Caches(self.design)
        twin.restore(self.snapshot())
        return twin


def peer_numbers(table: ptrres.PointerTable) -> tuple[tuple[tuple[Any, ...], ...], ...]:
    """What a handshake carries of a table: PeerLayout.of()'s refs, as plain
    tuples of their fields, group by group."""
    return tuple(
        tuple(tuple(ref) for ref in refs) for refs in ptrres.PeerLayout.of(table).groups
    )


def assert_same_bytes(
    actual: Sequence[bytes], expected: Sequence[bytes], what: str
) -> None:
    """Buffers byte for byte equal; else say which buffer and byte differ, and
    whether that byte is in a guard zone."""
    assert len(actual) == len(expected), what
    for b, (got, want) in enumerate(zip(actual, expected)):
        if got == want:
            continue
        assert len(got) == len(want), f"{what}: buffer {b} has another length"
        first = next(i for i, (x, y) in enumerate(zip(got, want)) if x != y)
        where = (
            "guard zone" if first < GUARD or first >= len(got) - GUARD else "tensors"
        )
        count = sum(x != y for x, y in zip(got, want))
        raise AssertionError(
            f"{what}: buffer {b} differs from the reference's in {count} bytes, "
            f"the first at offset {first} ({where}): {got[first]} != {want[first]}"
        )


# --- transfers through NIXL ----------------------------------------------------


def wait_for(agent: Any, handle: Any) -> None:
    """Post a transfer and wait until NIXL says DONE: fail on ERR, or after
    TIMEOUT seconds."""
    state = agent.transfer(handle)
    deadline = time.monotonic() + TIMEOUT
    while state != "DONE":
        assert state == "PROC", f"the NIXL transfer failed: {state}"
        if time.monotonic() > deadline:
            raise TimeoutError(f"the NIXL transfer is not done after {TIMEOUT} s")
        time.sleep(0.0002)  # the peer (or the backend's threads) need the core
        state = agent.check_xfer_state(handle)


@dataclass(frozen=True)
class Transfer:
    """One transfer of a test: the op, and per group the local block ids and
    the peer's, pairwise."""

    op: str
    local_ids: tuple[tuple[int, ...], ...]
    remote_ids: tuple[tuple[int, ...], ...]

    @property
    def spec(self) -> ptrres.GPULoadStoreSpec:
        """The local side as a spec (int64 ids: bad ids may pass int32)."""
        ids = [block for group in self.local_ids for block in group]
        return ptrres.GPULoadStoreSpec(
            np.array(ids, np.int64), [len(group) for group in self.local_ids]
        )

    @property
    def flat_remote_ids(self) -> npt.NDArray[np.int64]:
        return np.array(
            [block for group in self.remote_ids for block in group], np.int64
        )

    @property
    def group_sizes(self) -> list[int]:
        return [len(group) for group in self.local_ids]


def race_free(
    op: str,
    group_tensors: Sequence[Sequence[int]],
    local_ids: Sequence[Sequence[int]],
    remote_ids: Sequence[Sequence[int]],
) -> Transfer:
    """The transfer of these pairs less each pair that would write a
    destination row another pair writes from another source row.

    NIXL runs descriptors in no set order, the reference in order: where two
    write one row with different bytes, both may be right. Both sides have
    the same tensor under each ref, so a destination row (tensor, id) written
    twice from one source id gets the same bytes either way (a repeated pair,
    or refs of two groups sharing a tensor).
    """
    source_of: dict[tuple[int, int], int] = {}
    kept_local: list[tuple[int, ...]] = []
    kept_remote: list[tuple[int, ...]] = []
    for tensors, group_local, group_remote in zip(group_tensors, local_ids, remote_ids):
        pairs = []
        for local, remote in zip(group_local, group_remote):
            source, destination = (local, remote) if op == "WRITE" else (remote, local)
            rows = [(tensor, destination) for tensor in tensors]
            if any(source_of.get(row, source) != source for row in rows):
                continue
            source_of.update(dict.fromkeys(rows, source))
            pairs.append((local, remote))
        kept_local.append(tuple(local for local, _ in pairs))
        kept_remote.append(tuple(remote for _, remote in pairs))
    return Transfer(op, tuple(kept_local), tuple(kept_remote))


@dataclass
class CachePair:
    """One design's caches on both sides, and the reference's copies of them."""

    # This process's caches, registered with its agent: NIXL moves them.
    local: Caches
    # The reference's copies: of ``local``, and of the peer's caches (built
    # from the peer's design and seed: byte-identical when both are reset).
    local_copy: Caches
    mirror: Caches
    # The peer's caches, by the numbers its handshake sent.
    peer: ptrres.PeerLayout
    # Prepared lists of both sides (prep_xfer_dlist of prepped_rows).
    local_list: Any
    remote_list: Any


class PeerProcess:
    """This process's UCX agent and caches, and a peer process's (SPEC 14).

    Args:
        designs: per key, (this process's design, the peer's design): the
            refs per group and the page of each ref must match.
    """

    def __init__(self, designs: dict[str, tuple[CacheDesign, CacheDesign]]) -> None:
        self.pairs: dict[str, CachePair] = {}
        self._registrations: list[ptrres.nixl.Registration] = []
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        peer_designs = {key: peer for key, (_, peer) in designs.items()}
        self._process = context.Process(
            target=serve, args=(child_conn, peer_designs), daemon=True
        )
        self._process.start()
        child_conn.close()
        self.agent: Any = None
        try:
            self.agent = new_agent("local", "UCX")
            metadata, numbers = self._reply(START_TIMEOUT)
            self.peer_name: str = self.agent.add_remote_agent(metadata)
            for key, (local_design, peer_design) in designs.items():
                self.pairs[key] = self._pair(local_design, peer_design, numbers[key])
        except BaseException:
            self.close()
            raise

    def _pair(
        self, local_design: CacheDesign, peer_design: CacheDesign, numbers: Any
    ) -> CachePair:
        local = Caches(local_design)
        self._registrations.append(ptrres.nixl.register(self.agent, local.table))
        mirror = Caches(peer_design)
        peer = ptrres.PeerLayout(numbers)
        # The peer sent its design's numbers: the mirror's, but its addresses.
        sent = [[ref[1:4] for ref in refs] for refs in peer.groups]
        assert sent == [[ref[1:] for ref in refs] for refs in mirror.ref_numbers]
        local_rows = ptrres.nixl.prepped_rows(local.table)
        remote_rows = ptrres.nixl.prepped_rows(peer)
        return CachePair(
            local,
            local.copy(),
            mirror,
            peer,
            self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", *local_rows),
            self.agent.prep_xfer_dlist(self.peer_name, *remote_rows),
        )

    def _reply(self, timeout: float = TIMEOUT) -> Any:
        """The peer's answer to the last command, within ``timeout`` seconds."""
        if not self._conn.poll(timeout):
            raise TimeoutError(f"the peer process did not answer in {timeout} s")
        try:
            status, answer = self._conn.recv()
        except EOFError:
            self._process.join(TIMEOUT)
            raise RuntimeError(
                f"the peer process ended (exit code {self._process.exitcode})"
            ) from None
        if status != "ok":
            raise RuntimeError(f"the peer process failed:\n{answer}")
        return answer

    def _ask(self, *command: Any) -> Any:
        self._conn.send(command)
        return self._reply()

    def peer_bytes(self, key: str) -> list[bytes]:
        """The peer's buffers' bytes, guard zones included."""
        answer: list[bytes] = self._ask("bytes", key)
        return answer

    def reset(self, key: str) -> CachePair:
        """Both sides' caches, and the reference's copies, back to their seeded
        bytes (checked: the mirror is the peer's caches)."""
        self._ask("fill", key)
        pair = self.pairs[key]
        for caches in (pair.local, pair.local_copy, pair.mirror):
            caches.fill()
        assert_same_bytes(self.peer_bytes(key), pair.mirror.snapshot(), "the mirror")
        return pair

    def transfer(
        self,
        key: str,
        transfer: Transfer,
        *,
        coalesce: bool = False,
        prepared: bool = False,
    ) -> None:
        """Move a transfer through NIXL, the plan's descriptors or indices into
        the prepared lists, then check both sides' bytes against the
        reference's plan executed on the copies."""
        pair = self.pairs[key]
        if prepared:
            local_indices = ptrres.nixl.prepped_indices(
                pair.local.table, transfer.spec.block_ids, transfer.group_sizes
            )
            remote_indices = ptrres.nixl.prepped_indices(
                pair.peer, transfer.flat_remote_ids, transfer.group_sizes
            )
            handle = self.agent.make_prepped_xfer(
                transfer.op,
                pair.local_list,
                local_indices,
                pair.remote_list,
                remote_indices,
            )
        else:
            plan = pair.local.table.plan_peer_transfer(
                transfer.spec, pair.peer, transfer.flat_remote_ids, coalesce=coalesce
            )
            descs = ptrres.nixl.peer_xfer_descs(
                plan, local=pair.local.table, remote=pair.peer
            )
            handle = descs.initialize_xfer(self.agent, transfer.op, self.peer_name)
        try:
            wait_for(self.agent, handle)
        finally:
            handle.release()
        self.expect(key, transfer)

    def expect(self, key: str, transfer: Transfer) -> None:
        """Execute the reference's plan of a transfer on the copies, and check
        that both sides' buffers hold the same bytes as theirs."""
        pair = self.pairs[key]
        expected = reference.plan_peer_transfer(
            transfer.spec,
            pair.local_copy.kv_caches,
            pair.mirror.ref_numbers,
            transfer.flat_remote_ids,
        )
        if transfer.op == "WRITE":
            reference.execute_descriptors(
                expected.local, expected.remote, expected.sizes
            )
        else:
            reference.execute_descriptors(
                expected.remote, expected.local, expected.sizes
            )
        local_role, peer_role = ("source", "destination")
        if transfer.op == "READ":
            local_role, peer_role = peer_role, local_role
        assert_same_bytes(
            pair.local.snapshot(),
            pair.local_copy.snapshot(),
            f"{transfer.op}: the {local_role} (local)",
        )
        assert_same_bytes(
            self.peer_bytes(key),
            pair.mirror.snapshot(),
            f"{transfer.op}: the {peer_role} (peer)",
        )

    def close(self) -> None:
        """Stop the peer (killed if it does not stop in time), release the
        prepared lists, deregister this process's caches."""
        try:
            if self._process.is_alive():
                self._conn.send(("stop",))
                if self._conn.poll(TIMEOUT):
                    self._conn.recv()
        except (OSError, EOFError):
            pass  # the peer is gone already
        finally:
            self._process.join(TIMEOUT)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(TIMEOUT)
            self._conn.close()
        for pair in self.pairs.values():
            pair.local_list.release()
            pair.remote_list.release()
        for registration in self._registrations:
            registration.deregister()
        if self.agent is not None and hasattr(self, "peer_name"):
            self.agent.remove_remote_agent(self.peer_name)


@contextmanager
def peer_process(
    designs: dict[str, tuple[CacheDesign, CacheDesign]],
) -> Iterator[PeerProcess]:
    """A PeerProcess, closed (the peer stopped) on the way out."""
    process = PeerProcess(designs)
    try:
        yield process
    finally:
        process.close()


def serve(conn: Connection, designs: dict[str, CacheDesign]) -> None:
    """The peer process: its agent and caches, registered; then commands from
    the Pipe, and between them its agent driven.

    Commands: ("bytes", key) its caches' bytes; ("fill", key) back to the
    seeded bytes; ("stop",). Each is answered ("ok", answer), or ("error",
    traceback).
    """
    try:
        agent = new_agent("peer", "UCX")
        caches = {key: Caches(design) for key, design in designs.items()}
        registrations = [ptrres.nixl.register(agent, c.table) for c in caches.values()]
        numbers = {key: peer_numbers(c.table) for key, c in caches.items()}
        for key, c in caches.items():  # PeerLayout.of() tells the truth
            sent = [[ref[:4] for ref in refs] for refs in numbers[key]]
            assert sent == [[tuple(ref) for ref in refs] for refs in c.ref_numbers]
        conn.send(("ok", (agent.get_agent_metadata(), numbers)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        if not conn.poll(IDLE_POLL):
            agent.get_new_notifs()
            continue
        try:
            command, *args = conn.recv()
        except EOFError:
            break  # the test process is gone
        try:
            if command == "stop":
                for registration in registrations:
                    registration.deregister()
                conn.send(("ok", None))
                break
            if command == "bytes":
                conn.send(("ok", caches[args[0]].snapshot()))
            elif command == "fill":
                caches[args[0]].fill()
                conn.send(("ok", None))
            else:
                raise ValueError(f"unknown command {command!r}")
        except Exception:
            conn.send(("error", traceback.format_exc()))
