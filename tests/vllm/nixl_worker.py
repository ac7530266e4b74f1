"""vLLM's NIXL connector workers (0.30 to 0.34) moving real bytes: a pull
worker on the decode engine and a push worker on the prefill engine, each
never initialised (``object.__new__``) and holding only what vLLM's own
``_read_blocks`` / ``_xfer_blocks`` read (and what they call:
``_compute_desc_ids``, ``_apply_prefix_caching``, ``_log_failure``,
``_handle_failed_transfer``, ``_try_release_xfer_handle``), with a real NIXL
agent (vLLM's ``NixlWrapper``) on host memory as its ``nixl_wrapper``.

Both engines live in this process, each with its own agent (no progress
thread: the passive agent is driven with ``get_new_notifs()``). Each has a
hybrid model of two KV-cache groups with per-group regions (region-group
mapping): region 0 holds group 0's layer, region 1 group 1's, each region
NUM_BLOCKS blocks of BLOCK_LEN bytes in a numpy buffer of its own, registered
with NIXL as vLLM registers each layer's cache. The prepared descriptor
lists are built as the release builds them: one descriptor per block per
region, region after region, as strided Nx5 rows in 0.33 and 0.34
(``_block_strided_descs``), as Nx3 rows before (``_stack_descs``); both
number the descriptors alike. On 0.34, which pairs the two engines' regions
by layer name, the pull and push workers' pairs (``_dst_pairs``) are made by
vLLM's own ``_pair_regions`` from the peer's ``NixlAgentMetadata``: region r
holds layer LAYERS[r] on both engines.

A request is read or written as vLLM's ``_read_blocks_for_req`` /
``_xfer_blocks_for_req`` do it for one remote rank, and waited for with
vLLM's own ``_pop_done_transfers``.
"""

from __future__ import annotations

import os

# Before vLLM imports NIXL (and NIXL its UCX): UCX's TCP transport would also
# use the machine's network interfaces.
os.environ["UCX_NET_DEVICES"] = "lo"

import importlib
import itertools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import pytest

# Where vLLM is missing, "vllm" would be found as tests/vllm (a namespace
# package): skip there; where it is installed, its NIXL modules must import.
pytest.importorskip("vllm.v1")
import vllm
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

# vLLM's NIXL connector modules, untyped: what they hold differs between the
# releases (mypy sees one).
NIXL_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
base_worker = importlib.import_module(f"{NIXL_PACKAGE}.base_worker")
# vLLM's worker class, for a class to derive from (untyped here).
WorkerBase: Any = base_worker.NixlBaseConnectorWorker
metadata = importlib.import_module(f"{NIXL_PACKAGE}.metadata")
pull_worker = importlib.import_module(f"{NIXL_PACKAGE}.pull_worker")
push_worker = importlib.import_module(f"{NIXL_PACKAGE}.push_worker")
tp_mapping = importlib.import_module(f"{NIXL_PACKAGE}.tp_mapping")
connector_utils = importlib.import_module(
    "vllm.distributed.kv_transfer.kv_connector.utils"
)

# The tested release series of the installed vLLM ("0.33" for 0.33.0).
RELEASE = ".".join(vllm.__version__.split(".")[:2])
# Whether the release pairs regions by layer name (0.34: _RegionPairs, and
# _compute_desc_ids(..., pairs=(regions, keys), ...)).
PAIRS = hasattr(base_worker, "_RegionPairs")

DECODE, PREFILL = "decode-engine", "prefill-engine"
BLOCK_SIZE = 16  # tokens per block, on both engines (block_size_ratio 1)
BLOCK_LEN = 32  # bytes per block, per region
NUM_BLOCKS = 4  # blocks per region, on both engines
# Region r holds a layer of group REGION_GROUPS[r] (a hybrid model), named
# LAYERS[r].
REGION_GROUPS = (0, 1)
GROUP_SPECS = (FullAttentionSpec, SlidingWindowSpec)
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
# Seconds a transfer may take before a test fails instead of hanging.
TIMEOUT = 30.0

_names = itertools.count()


@dataclass
class Engine:
    """One engine's KV caches in host memory and its NIXL agent."""

    engine_id: str
    agent: Any  # vLLM's NixlWrapper (nixl_agent)
    # One (NUM_BLOCKS, BLOCK_LEN) uint8 buffer per region.
    regions: list[npt.NDArray[np.uint8]]
    registered: list[Any] = field(default_factory=list)

    def rows(self) -> npt.NDArray[np.uint64]:
        """This engine's descriptors as the release prepares them: one per
        block per region, region after region."""
        worker_class = base_worker.NixlBaseConnectorWorker
        if hasattr(worker_class, "_block_strided_descs"):  # 0.33: Nx5 strided
            return np.concatenate(
                [
                    worker_class._block_strided_descs(
                        region.ctypes.data, BLOCK_LEN, BLOCK_LEN, NUM_BLOCKS, 1, 0
                    )
                    for region in self.regions
                ]
            )
        addrs = np.concatenate(
            [
                region.ctypes.data + np.arange(NUM_BLOCKS, dtype=np.uint64) * BLOCK_LEN
                for region in self.regions
            ]
        )
        rows: npt.NDArray[np.uint64] = worker_class._stack_descs(addrs, BLOCK_LEN, 0)
        return rows

    def prep(self, agent: Any, agent_name: str) -> Any:
        """This engine's descriptors prepared by ``agent`` (this engine's own
        for "NIXL_INIT_AGENT", its peer's for this engine's name)."""
        rows = self.rows()
        if rows.shape[1] == 5:
            return agent.prep_xfer_dlist(agent_name, rows, mem_type="DRAM")
        return agent.prep_xfer_dlist(agent_name, agent.get_xfer_descs(rows, "DRAM"))

    def block(self, region: int, block: int) -> bytes:
        return bytes(self.regions[region][block])

    def snapshot(self) -> list[bytes]:
        return [region.tobytes() for region in self.regions]


def new_engine(engine_id: str, seed: int) -> Engine:
    """An engine of random bytes, its agent on UCX, every region registered."""
    config = base_worker.nixl_agent_config(
        enable_prog_thread=False, backends=["UCX"], capture_telemetry=True
    )
    agent = base_worker.NixlWrapper(f"{engine_id}-{next(_names)}", config)
    generator = np.random.default_rng(seed)
    regions = [
        generator.integers(0, 256, (NUM_BLOCKS, BLOCK_LEN), dtype=np.uint8)
        for _ in REGION_GROUPS
    ]
    engine = Engine(engine_id, agent, regions)
    for region in regions:
        descs = agent.get_reg_descs(
            np.array([[region.ctypes.data, region.nbytes, 0]], np.uint64), "DRAM"
        )
        agent.register_memory(descs)
        engine.registered.append(descs)
    return engine


@contextmanager
def engines() -> Iterator[tuple[Engine, Engine]]:
    """The decode and the prefill engine, each knowing the other's agent;
    their memory deregistered at the end."""
    if base_worker.NixlWrapper is None:
        pytest.fail("vLLM found no NIXL (nixl, nixl-cu12 1.5.1 are in the test extra)")
    decode, prefill = new_engine(DECODE, 1), new_engine(PREFILL, 2)
    decode.agent.add_remote_agent(prefill.agent.get_agent_metadata())
    prefill.agent.add_remote_agent(decode.agent.get_agent_metadata())
    try:
        yield decode, prefill
    finally:
        for engine, peer in ((decode, prefill), (prefill, decode)):
            engine.agent.remove_remote_agent(peer.agent.name)
            for descs in engine.registered:
                engine.agent.deregister_memory(descs)


class _KVCacheConfig:
    """What _read_blocks reads of vLLM's KVCacheConfig: one transfer group
    per group of the model; and what 0.34's _pair_regions reads: each
    layer's group."""

    transfer_groups = GROUP_SPECS
    transfer_group_index_by_layer: ClassVar[dict[str, int]] = dict(
        zip(LAYERS, REGION_GROUPS)
    )


def agent_metadata(engine: Engine) -> Any:
    """What ``engine``'s handshake says of its KV caches (0.34's
    NixlAgentMetadata): one region a layer, host memory, every field a
    region has."""
    regions = len(engine.regions)
    return metadata.NixlAgentMetadata(
        engine_id=engine.engine_id,
        agent_metadata=b"",
        kv_caches_base_addr=[region.ctypes.data for region in engine.regions],
        device_id=0,
        num_blocks=NUM_BLOCKS,
        block_lens=[BLOCK_LEN] * regions,
        block_strides=[BLOCK_LEN] * regions,
        kv_cache_layout="LBHNC",
        block_size=BLOCK_SIZE,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=[NUM_BLOCKS] * regions,
        region_group_ids=list(REGION_GROUPS),
        region_names=list(LAYERS),
        region_mem_types=["DRAM"] * regions,
        region_members=[[layer] for layer in LAYERS],
        layer_group_ids=dict(zip(LAYERS, REGION_GROUPS)),
    )


def _bare(worker_class: type) -> Any:
    """A worker never initialised (vLLM's __del__ would shut down a NIXL
    connector this worker never started)."""
    bare = type(worker_class.__name__, (worker_class,), {"__del__": _no_shutdown})
    return object.__new__(bare)


def _no_shutdown(self: Any) -> None:
    pass


def _transfer_worker(worker_class: type, local: Engine, remote: Engine) -> Any:
    """What a pull or push worker reads to set up a transfer with ``remote``:
    its regions, both engines' block counts and region groups, the topology,
    and its agent."""
    topology = connector_utils.TransferTopology(
        tp_rank=0,
        tp_size=1,
        block_size=BLOCK_SIZE,
        engine_id=local.engine_id,
        is_mla=False,
        is_mamba=False,
        total_num_kv_heads=1,
        attn_backends=[],
    )
    topology.register_remote_engine(
        remote.engine_id,
        connector_utils.EngineTransferInfo(
            remote_tp_size=1,
            remote_block_len=BLOCK_LEN,
            remote_block_size=BLOCK_SIZE,
            remote_physical_blocks_per_logical=1,
        ),
    )
    engines = (local.engine_id, remote.engine_id)
    worker = _bare(worker_class)
    attributes: dict[str, Any] = {
        "engine_id": local.engine_id,
        "nixl_wrapper": local.agent,
        "transfer_topo": topology,
        "kv_cache_config": _KVCacheConfig(),
        # _compute_desc_ids' (test_vllm_nixl.DESC_IDS_ATTRIBUTES)
        "_has_mamba": False,
        "_conv_decomp": None,
        "_ssm_region_indices": [],
        "block_len_per_layer": [BLOCK_LEN] * len(REGION_GROUPS),
        "num_regions": len(REGION_GROUPS),
        "region_group_ids": list(REGION_GROUPS),
        "_uses_region_group_mapping": True,
        "_group_spec_types": list(GROUP_SPECS),
        "_scratch_region_indices": [],
        "_ple_group_index": None,
        # Both engines alike: the handshake's numbers.
        "dst_num_blocks": dict.fromkeys(engines, NUM_BLOCKS),
        "dst_region_num_blocks": {
            e: [NUM_BLOCKS] * len(REGION_GROUPS) for e in engines
        },
        "dst_region_group_ids": {e: list(REGION_GROUPS) for e in engines},
        "dst_uses_region_group_mapping": dict.fromkeys(engines, True),
        "_physical_blocks_per_logical_kv_block": 1,
        "xfer_stats": base_worker.NixlKVConnectorStats(),
        "_recving_metadata": {},
    }
    if RELEASE != "0.30":
        attributes["_transfer_layer_group_ids"] = []
    if PAIRS:  # what _pair_regions reads, then its pairs with the remote
        attributes |= {
            "pp_size": 1,
            "_packed_member_layouts": {},
            "_region_is_mla": [False] * len(REGION_GROUPS),
        }
    for name, value in attributes.items():
        setattr(worker, name, value)
    if PAIRS:
        worker._set_region_layers([[layer] for layer in LAYERS])
        worker._dst_pairs = {
            remote.engine_id: worker._pair_regions(agent_metadata(remote))
        }
    return worker


@dataclass
class Transfer:
    """A worker, and the prepared lists of its two sides."""

    worker: Any
    local: Engine
    remote: Engine
    local_handle: Any
    remote_handle: Any


def pull(decode: Engine, prefill: Engine) -> Transfer:
    """The decode engine's pull worker (READ), reading from prefill."""
    worker = _transfer_worker(pull_worker.NixlPullConnectorWorker, decode, prefill)
    worker.dcp_size = 1
    worker._mixed_mem_types = False
    worker._recving_transfers = defaultdict(list)
    worker._recv_failures = set()
    if RELEASE not in ("0.30", "0.31"):
        worker._failed_remote_engines = set()
    return Transfer(
        worker,
        decode,
        prefill,
        decode.prep(decode.agent, "NIXL_INIT_AGENT"),
        prefill.prep(decode.agent, prefill.agent.name),
    )


def push(prefill: Engine, decode: Engine) -> Transfer:
    """The prefill engine's push worker (WRITE), writing into decode."""
    worker = _transfer_worker(push_worker.NixlPushConnectorWorker, prefill, decode)
    worker.world_size = 1
    worker._sending_transfers_lock = threading.Lock()
    if RELEASE != "0.30":
        worker._send_failures = set()
    return Transfer(
        worker,
        prefill,
        decode,
        prefill.prep(prefill.agent, "NIXL_INIT_AGENT"),
        decode.prep(prefill.agent, decode.agent.name),
    )


def read(
    transfer: Transfer,
    request_id: str,
    local_ids: Sequence[list[int]],
    remote_ids: Sequence[list[int]],
) -> bool:
    """One request read as vLLM reads it from one remote rank: its metadata
    kept (start_load_kv) and its transfer list seeded (_read_blocks_for_req),
    then vLLM's own _read_blocks, called as _read_blocks_for_req calls it."""
    worker = transfer.worker
    remote = metadata.RemoteMeta(
        block_ids=list(remote_ids),
        host="127.0.0.1",
        port=0,
        engine_id=transfer.remote.engine_id,
        request_id=f"{transfer.remote.engine_id}-{request_id}",
    )
    worker._recving_metadata[request_id] = metadata.ReqMeta(
        local_block_ids=list(local_ids),
        local_physical_block_ids=list(local_ids),
        tp_size=1,
        remote=remote,
    )
    worker._recving_transfers.setdefault(request_id, [])
    spec = tp_mapping.ReadSpec(
        remote_rank=0,
        local_block_ids=list(local_ids),
        remote_block_ids=list(remote_ids),
    )
    posted: bool = worker._read_blocks(
        read_spec=spec,
        request_id=request_id,
        dst_engine_id=transfer.remote.engine_id,
        remote_request_id=remote.request_id,
        local_xfer_side_handle=transfer.local_handle,
        local_dram_handle=None,
        remote_xfer_side_handle=transfer.remote_handle,
        expected_consumers=1,
        awaiting_kvs=True,
    )
    return posted


def write(
    transfer: Transfer,
    request_id: str,
    local_ids: Sequence[list[int]],
    remote_ids: Sequence[list[int]],
) -> Any:
    """One request written as vLLM's _xfer_blocks_for_req writes it to one
    remote rank: vLLM's own _xfer_blocks; its handle, or None."""
    spec = tp_mapping.ReadSpec(
        remote_rank=0,
        local_block_ids=list(local_ids),
        remote_block_ids=list(remote_ids),
    )
    return transfer.worker._xfer_blocks(
        read_spec=spec,
        dst_engine_id=transfer.remote.engine_id,
        request_id=request_id,
        remote_request_id=f"{transfer.remote.engine_id}-{request_id}",
        local_xfer_side_handle=transfer.local_handle,
        remote_xfer_side_handle=transfer.remote_handle,
    )


def wait_done(
    transfer: Transfer, transfers: dict[str, list[Any]], request_id: str
) -> None:
    """vLLM's own polling (_pop_done_transfers) until every handle of the
    request is DONE, the passive agent driven meanwhile."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        done, failed = transfer.worker._pop_done_transfers(transfers)
        assert not failed, f"vLLM saw {failed} fail"
        if request_id in done:
            return
        transfer.remote.agent.get_new_notifs()
        assert time.monotonic() < deadline, f"{request_id} did not complete"


# --- what the tests of _compute_desc_ids share ----------------------------------


class Records(logging.Handler):
    """Every record of the loggers it is added to."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


@contextmanager
def captured(*names: str) -> Iterator[Records]:
    """What the named loggers log meanwhile (vLLM's "vllm" logger does not
    propagate to the root, where caplog listens)."""
    handler = Records()
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


class StrictWorker(WorkerBase):  # type: ignore[misc]
    """A worker never initialised, holding only the attributes it is given,
    that lets nothing else be read: a read of any other name (dunders and
    ``__dict__`` apart) is recorded in ``misses`` and raises AttributeError.
    Every read is recorded in ``reads``."""

    allowed: frozenset[str] = frozenset()

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            return super().__getattribute__(name)
        own = super().__getattribute__("__dict__")
        if name not in type(self).allowed:
            own["__misses__"].append(name)
            raise AttributeError(name)
        own["__reads__"].add(name)
        return own[name]

    def __del__(self) -> None:
        """vLLM's shuts down a NIXL connector this worker never started."""


# What the patched _compute_desc_ids reads of a worker besides vLLM's: its
# engine, for its log line.
PATCH_ATTRIBUTES = ("engine_id",)


def strict_worker(attributes: dict[str, Any]) -> Any:
    """A StrictWorker holding ``attributes`` (and an engine_id), which may
    read them and PATCH_ATTRIBUTES."""
    cls = type(
        "Worker",
        (StrictWorker,),
        {"allowed": frozenset(attributes) | frozenset(PATCH_ATTRIBUTES)},
    )
    worker: Any = object.__new__(cls)
    worker.__dict__.update(attributes, engine_id="engine-under-test")
    worker.__dict__.update(__misses__=[], __reads__=set())
    return worker


def misses(worker: Any) -> list[str]:
    found: list[str] = worker.__dict__["__misses__"]
    return found


def outcome(function: Callable[..., Any], *arguments: Any, **kwargs: Any) -> Any:
    """What a call returns, or the exception it raises."""
    try:
        return function(*arguments, **kwargs)
    except Exception as error:  # compared by type
        return error
