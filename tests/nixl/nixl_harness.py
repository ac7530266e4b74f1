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

For engines of different TP (SPEC 15), serve_ranks() holds one agent per
engine rank in a process, each rank's caches built from the head oracle
(tests/head_oracle.py): RankDesign and RankCaches. Child and serve_commands
are the Pipe machinery both kinds of process share.
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

import head_oracle
import numpy as np
import numpy.typing as npt

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
# The element types of the caches' tensors. torch is imported where a design
# asks for it: a peer process of numpy caches starts without it (NIXL does
# not import it either), seconds sooner.
NUMPY_DTYPES = {"uint8": np.uint8, "float16": np.float16, "float32": np.float32}
TORCH_DTYPES = ("uint8", "bfloat16", "float16", "float32")
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
                torch = importlib.import_module("torch")
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
                    assert shape.dtype in TORCH_DTYPES, shape.dtype
                    self.tensors[t] = rows.view(getattr(torch, shape.dtype))
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

    def rows(self, t: int) -> npt.NDArray[np.uint8]:
        """Tensor ``t``'s rows as bytes, ``[num_blocks, row_bytes]``: a view
        of its buffer (the padding after each row left out)."""
        for b, tensor_indices in enumerate(self.design.buffers):
            if t in tensor_indices:
                shapes = [self.design.tensors[i] for i in tensor_indices]
                position = tensor_indices.index(t)
                start = GUARD + sum(
                    shape.num_blocks * shape.row_stride for shape in shapes[:position]
                )
                shape = shapes[position]
                span = shape.num_blocks * shape.row_stride
                rows = self.buffers[b][start : start + span]
                return rows.reshape(shape.num_blocks, shape.row_stride)[
                    :, : shape.row_bytes
                ]
        raise ValueError(f"tensor {t} is in no buffer")


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
    wait_for_all([(agent, handle)])


def wait_for_all(transfers: Sequence[tuple[Any, Any]]) -> None:
    """Post transfers, each (agent, handle), all before waiting on any, and
    wait until NIXL says DONE of each: fail on ERR, or after TIMEOUT
    seconds."""
    states = [agent.transfer(handle) for agent, handle in transfers]
    deadline = time.monotonic() + TIMEOUT
    while any(state != "DONE" for state in states):
        for k, ((agent, handle), state) in enumerate(zip(transfers, states)):
            assert state in ("PROC", "DONE"), f"NIXL transfer {k} failed: {state}"
            if state == "PROC":
                states[k] = agent.check_xfer_state(handle)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the NIXL transfers are not done after {TIMEOUT} s")
        time.sleep(0.0002)  # the peer (or the backend's threads) need the core


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
        peer_designs = {key: peer for key, (_, peer) in designs.items()}
        self._child = Child(serve, peer_designs)
        self.agent: Any = None
        try:
            self.agent = new_agent("local", "UCX")
            metadata, numbers = self._child.reply(START_TIMEOUT)
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

    def peer_bytes(self, key: str) -> list[bytes]:
        """The peer's buffers' bytes, guard zones included."""
        answer: list[bytes] = self._child.ask("bytes", key)
        return answer

    def reset(self, key: str) -> CachePair:
        """Both sides' caches, and the reference's copies, back to their seeded
        bytes (checked: the mirror is the peer's caches)."""
        self._child.ask("fill", key)
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
        self._child.close()
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
    serve_commands(
        conn,
        [agent],
        {
            "bytes": lambda key: caches[key].snapshot(),
            "fill": lambda key: caches[key].fill(),
        },
        registrations,
    )


class Child:
    """A process started with multiprocessing's "spawn", running
    ``target(conn, *args)``, which answers commands over a Pipe
    (serve_commands): this side sends a command and waits for its answer."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=run_child, args=(target, child_conn, *args), daemon=True
        )
        self._process.start()
        child_conn.close()

    def reply(self, timeout: float = TIMEOUT) -> Any:
        """The child's answer to the last command, within ``timeout`` seconds."""
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

    def ask(self, *command: Any) -> Any:
        """Send a command, and return the child's answer."""
        self._conn.send(command)
        return self.reply()

    def close(self) -> None:
        """Stop the child (killed if it does not stop in time)."""
        try:
            if self._process.is_alive():
                self._conn.send(("stop",))
                if self._conn.poll(TIMEOUT):
                    self._conn.recv()
        except (OSError, EOFError):
            pass  # the child is gone already
        finally:
            self._process.join(TIMEOUT)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(TIMEOUT)
            self._conn.close()


def run_child(target: Callable[..., None], conn: Connection, *args: Any) -> None:
    """A Child's process: ``target(conn, *args)``, then the process ends at
    once (exit code 0, or 1 where the target raised), its output flushed.
    The interpreter's own finalization would take 3 s or more here (after
    torch, numba and NIXL), and does nothing a test needs: the target has
    deregistered its memory and answered its last command."""
    code = 1
    try:
        target(conn, *args)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve_commands(
    conn: Connection,
    agents: Sequence[Any],
    commands: dict[str, Callable[..., Any]],
    registrations: Sequence[ptrres.nixl.Registration],
) -> None:
    """A child's loop: commands from the Pipe, each answered ("ok", what
    ``commands[name](*args)`` returns) or ("error", traceback); between them,
    every agent driven (``get_new_notifs``: no progress thread runs).
    ("stop",) deregisters the registrations, answers and returns."""
    while True:
        if not conn.poll(IDLE_POLL):
            for agent in agents:
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
            if command not in commands:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", commands[command](*args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


# --- ranks of engines at different TP (SPEC 15) ----------------------------------
#
# Each rank of an engine holds its shard of every layer's KV heads, as the head
# oracle (tests/head_oracle.py) models them: a prefill rank's pages are its
# shard of its engine's logical KV, a decode rank's pages start as other random
# bytes. One ref per layer, one tensor per ref.


@dataclass(frozen=True)
class HeadModel:
    """A model's KV, as the head oracle sees it: every layer has
    ``num_kv_heads`` heads of ``tokens`` tokens; ``head_bytes[g][d]`` is the
    bytes of one head's token in layer d of group g. MLA: the latent page,
    whole on every rank (the oracle's one "head")."""

    num_kv_heads: int
    tokens: int
    head_bytes: tuple[tuple[int, ...], ...]
    mla: bool
    seed: int

    def heads(self, rank: int, tp_size: int) -> list[int]:
        """The heads a rank's pages hold (the oracle's shard)."""
        return head_oracle.shard(rank, tp_size, self.num_kv_heads, self.mla)

    def logical(self, group: int, layer: int, num_blocks: int) -> npt.NDArray[np.uint8]:
        """Layer ``layer`` of group ``group`` of an engine of ``num_blocks``
        blocks in that group: ``[blocks, heads, tokens, head_bytes]``."""
        seed = self.seed * 10_000 + group * 100 + layer
        head_bytes = self.head_bytes[group][layer]
        return head_oracle.logical_kv(
            num_blocks, self.num_kv_heads, self.tokens, head_bytes, seed
        )


@dataclass(frozen=True)
class RankDesign:
    """One rank of an engine: its model, TP and rank, its blocks per group,
    and whether its pages hold the logical KV (a prefill rank) or other
    random bytes (a decode rank, until it receives blocks).

    Group 0's tensors are back to back in one buffer, rows unpadded (merged
    copies may run from one layer into the next); every other group's
    tensors are each in a buffer of its own, rows padded by ``pad`` bytes.
    """

    model: HeadModel
    tp_size: int
    tp_rank: int
    group_blocks: tuple[int, ...]
    pad: int
    seed: int
    library: str
    prefill: bool

    @property
    def heads(self) -> list[int]:
        return self.model.heads(self.tp_rank, self.tp_size)

    def page(self, group: int, layer: int) -> int:
        """The bytes of one page of a layer: this rank's heads of a block."""
        head_bytes = self.model.head_bytes[group][layer]
        return len(self.heads) * self.model.tokens * head_bytes

    def refs(self) -> list[tuple[int, int, int]]:
        """(tensor index, group, layer) of every ref, group by group."""
        pairs = [
            (g, d)
            for g, layers in enumerate(self.model.head_bytes)
            for d in range(len(layers))
        ]
        return [(t, g, d) for t, (g, d) in enumerate(pairs)]

    def cache_design(self) -> CacheDesign:
        tensors: list[TensorDesign] = []
        buffers: list[tuple[int, ...]] = []
        groups: list[list[tuple[int, int]]] = [[] for _ in self.model.head_bytes]
        for t, g, d in self.refs():
            page = self.page(g, d)
            pad = self.pad if g else 0
            dtype = ("uint8", "float16")[t % 2]
            tensors.append(TensorDesign(self.group_blocks[g], page, page + pad, dtype))
            groups[g].append((t, page))
            if g == 0 and buffers:
                buffers[0] += (t,)
            else:
                buffers.append((t,))
        return CacheDesign(
            self.library,
            tuple(tensors),
            tuple(buffers),
            tuple(tuple(refs) for refs in groups),
            self.seed,
        )


class RankCaches(Caches):
    """A rank's KV caches: random bytes everywhere, and in a prefill rank's
    pages its shard of its engine's logical KV (the head oracle's
    rank_pages)."""

    def __init__(self, rank: RankDesign) -> None:
        self.rank = rank
        super().__init__(rank.cache_design())

    def fill(self) -> None:
        super().fill()
        if self.rank.prefill:
            for t, g, d in self.rank.refs():
                logical = self.rank.model.logical(g, d, self.rank.group_blocks[g])
                self.rows(t)[:] = head_oracle.rank_pages(logical, self.rank.heads)

    def nixl_metadata(self) -> dict[str, Any]:
        """The fields of vLLM's NixlAgentMetadata (0.33) a handshake would
        carry of these caches, but the agent's: one region per ref (layer),
        host memory, HND pages."""
        refs = [(ref, g) for g, group in enumerate(self.ref_numbers) for ref in group]
        return {
            "kv_caches_base_addr": [ref[0] for ref, _ in refs],
            "device_id": 0,
            "num_blocks": self.rank.group_blocks[0],
            "block_lens": [ref[2] for ref, _ in refs],
            "block_strides": [ref[1] for ref, _ in refs],
            "kv_cache_layout": "HND",
            "block_size": self.rank.model.tokens,
            "ssm_sizes": (0, 0),
            "attn_backend_name": "FLASH_ATTN",
            "physical_blocks_per_logical_kv_block": 1,
            "region_num_blocks": [ref[3] for ref, _ in refs],
            "region_group_ids": [g for _, g in refs],
            "region_mem_types": ["DRAM"] * len(refs),
        }


def serve_ranks(conn: Connection, ranks: dict[str, dict[str, RankDesign]]) -> None:
    """A process of engine ranks: per agent key, one UCX agent holding the
    caches of its ranks (per case key), registered. It first sends, per agent
    key, the agent's metadata and, per case key, what a handshake carries
    (peer_numbers, and RankCaches.nixl_metadata); then serves ("bytes",
    agent, case) and ("fill", agent, case), driving its agents between
    commands (serve_commands)."""
    try:
        agents = {key: new_agent("prefill", "UCX") for key in ranks}
        caches = {
            (key, case): RankCaches(design)
            for key, designs in ranks.items()
            for case, design in designs.items()
        }
        registrations = [
            ptrres.nixl.register(agents[key], c.table) for (key, _), c in caches.items()
        ]
        handshakes = {
            key: (
                agent.get_agent_metadata(),
                {
                    case: (peer_numbers(c.table), c.nixl_metadata())
                    for (owner, case), c in caches.items()
                    if owner == key
                },
            )
            for key, agent in agents.items()
        }
        conn.send(("ok", handshakes))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    serve_commands(
        conn,
        list(agents.values()),
        {
            "bytes": lambda key, case: caches[key, case].snapshot(),
            "fill": lambda key, case: caches[key, case].fill(),
        },
        registrations,
    )
