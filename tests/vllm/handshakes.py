"""vLLM's NIXL handshakes as each release (0.30 to 0.34) writes them, one per
KV-cache layout, with the caches they describe.

An engine here is built by the release's own code from end to end: the
layout is asked for as an operator asks for it (``VLLM_KV_CACHE_LAYOUT``)
and resolved by the engine core's ``resolve_kv_cache_layout``, which records
it on the ``CacheConfig``; the KV cache is planned
(``get_kv_cache_config_from_groups``) and allocated (``allocate_kv_cache``)
in host memory for that layout, one ``[B, H, N, C]`` view per layer; a NIXL
worker that was never initialised (``object.__new__``, as tests/vllm's
other workers) registers the views with ``register_kv_caches``, on a real
NIXL agent (UCX on loopback), and the ``NixlAgentMetadata`` it builds there
is decoded from its handshake payload as the peer decodes it. The worker
holds what ``register_kv_caches`` reads, as its ``__init__`` sets it:
``kv_cache_layout`` is ``get_resolved_kv_cache_layout().name``, as
``__init__`` reads it in every release (checked against its source).
"""

from __future__ import annotations

import os

# Before vLLM imports NIXL (and NIXL its UCX): UCX's TCP transport would also
# use the machine's network interfaces.
os.environ["UCX_NET_DEVICES"] = "lo"

import importlib
import inspect
import itertools
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch

# Where vLLM is missing, "vllm" would be found as tests/vllm (a namespace
# package): skip there; where it is installed, its modules must import.
pytest.importorskip("vllm.v1")

import ptrres

# vLLM's modules, untyped: what they hold differs between the releases.
NIXL_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
base_worker: Any = importlib.import_module(f"{NIXL_PACKAGE}.base_worker")
metadata: Any = importlib.import_module(f"{NIXL_PACKAGE}.metadata")
pull_worker: Any = importlib.import_module(f"{NIXL_PACKAGE}.pull_worker")
config: Any = importlib.import_module("vllm.config")
backend_utils: Any = importlib.import_module("vllm.v1.attention.backends.utils")
cpu_attn: Any = importlib.import_module("vllm.v1.attention.backends.cpu_attn")
kv_cache_interface: Any = importlib.import_module("vllm.v1.kv_cache_interface")
kv_cache_layout: Any = importlib.import_module("vllm.v1.kv_cache_layout")
worker_utils: Any = importlib.import_module("vllm.v1.worker.utils")
try:  # 0.33 moved the planning out of kv_cache_utils
    planning: Any = importlib.import_module("vllm.v1.core.kv_cache_planning")
except ImportError:
    planning = importlib.import_module("vllm.v1.core.kv_cache_utils")

# vLLM's KVCacheLayout member names, as its enum lists them.
LAYOUTS: tuple[str, ...] = tuple(m.name for m in kv_cache_layout.KVCacheLayout)
# The engines' model: layers of one attention group, head_size 8 in float16,
# K and V packed in a head's content (32 B a token), blocks of 16 tokens.
NUM_LAYERS = 2
NUM_BLOCKS = 4
BLOCK_SIZE = 16
HEAD_SIZE = 8
DTYPE = torch.float16

_names = itertools.count()


@dataclass
class Engine:
    """One rank's KV caches as vLLM allocated them, and the handshake its
    NIXL worker sends."""

    # The layout vLLM resolved (a KVCacheLayout name).
    layout: str
    # This rank's KV heads.
    num_heads: int
    # vLLM's view of each layer, logical [B, H, N, C], layers in order.
    caches: list[torch.Tensor]
    # The backing allocation, as bytes.
    storage: torch.Tensor
    # The NixlAgentMetadata the worker built, decoded as the peer decodes it.
    handshake: Any

    def table(self) -> ptrres.PointerTable:
        """This rank's KV caches as ptrres's table of the regions it
        registers with NIXL (and sends): one ref per region, its blocks
        ``block_strides`` apart, its page ``block_lens``."""
        start = self.storage.data_ptr()
        tensors = [
            ptrres.CanonicalKVCacheTensor(
                torch.as_strided(
                    self.storage, (blocks, page), (stride, 1), base - start
                ),
                page,
            )
            for base, page, stride, blocks in zip(
                self.handshake.kv_caches_base_addr,
                self.handshake.block_lens,
                self.handshake.block_strides,
                self.handshake.region_num_blocks,
            )
        ]
        refs = [
            ptrres.CanonicalKVCacheRef(i, t.page_size_bytes)
            for i, t in enumerate(tensors)
        ]
        return ptrres.PointerTable(ptrres.CanonicalKVCaches(tensors, [refs]))

    def allocation(self) -> tuple[int, int]:
        """``(address, nbytes)`` of the backing allocation."""
        return self.storage.data_ptr(), self.storage.numel()


@contextmanager
def layout_env(name: str) -> Iterator[None]:
    """``VLLM_KV_CACHE_LAYOUT=name`` while the engine core resolves it."""
    before = os.environ.get("VLLM_KV_CACHE_LAYOUT")
    os.environ["VLLM_KV_CACHE_LAYOUT"] = name
    try:
        yield
    finally:
        if before is None:
            del os.environ["VLLM_KV_CACHE_LAYOUT"]
        else:
            os.environ["VLLM_KV_CACHE_LAYOUT"] = before


def resolved_config(requested: str) -> Any:
    """A VllmConfig whose layout the engine core resolved from
    ``VLLM_KV_CACHE_LAYOUT=requested``, for workers whose backends declare
    no layouts (they report vLLM's default preference, every layout)."""
    vllm_config = config.VllmConfig(device_config=config.DeviceConfig(device="cpu"))
    supported = [
        [layout.name for layout in backend_utils.get_supported_kv_cache_layouts([])]
    ]
    with layout_env(requested):
        backend_utils.resolve_kv_cache_layout(vllm_config, supported)
    return vllm_config


def worker_reads_the_resolved_layout() -> bool:
    """Whether the release's worker __init__ takes its kv_cache_layout from
    the resolved layout's name (what the bare worker here is given)."""
    source = inspect.getsource(base_worker.NixlBaseConnectorWorker.__init__)
    return "cache_config.get_resolved_kv_cache_layout().name" in "".join(source.split())


@contextmanager
def engine(requested: str, num_heads: int, tp_size: int = 1) -> Iterator[Engine]:
    """A rank holding ``num_heads`` KV heads of a model at TP ``tp_size``,
    its cache allocated for the layout ``VLLM_KV_CACHE_LAYOUT=requested``
    resolves to, registered by the release's NIXL worker; deregistered
    after."""
    vllm_config = resolved_config(requested)
    cache_config = vllm_config.cache_config
    layout = cache_config.get_resolved_kv_cache_layout()
    spec = kv_cache_interface.FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=num_heads, head_size=HEAD_SIZE, dtype=DTYPE
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    groups = [kv_cache_interface.KVCacheGroupSpec(names, spec)]
    kv_cache_config = planning.get_kv_cache_config_from_groups(
        vllm_config, groups, spec.page_size_bytes * NUM_LAYERS * NUM_BLOCKS
    )
    assert kv_cache_config.num_blocks == NUM_BLOCKS
    caches = worker_utils.allocate_kv_cache(
        kv_cache_config, torch.device("cpu"), layout
    )
    storage = next(iter(caches.values())).untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    agent = base_worker.NixlWrapper(
        f"handshake-{layout.name}-{next(_names)}",
        base_worker.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]),
    )
    worker = _bare_worker(vllm_config, kv_cache_config, spec, names, agent, tp_size)
    worker.register_kv_caches(caches)
    try:
        payload = worker.xfer_handshake_metadata
        handshake = msgspec.msgpack.Decoder(metadata.NixlAgentMetadata).decode(
            payload.agent_metadata_bytes
        )
        yield Engine(layout.name, num_heads, [caches[n] for n in names], raw, handshake)
    finally:
        for handle in worker.src_xfer_handles_by_block_size.values():
            agent.release_dlist_handle(handle)
        for descs in worker._registered_descs:
            agent.deregister_memory(descs)


class _NoShutdown:
    """vLLM's __del__ would shut down a NIXL connector never started."""

    def __del__(self) -> None:
        pass


def _bare_worker(
    vllm_config: Any,
    kv_cache_config: Any,
    spec: Any,
    names: list[str],
    agent: Any,
    tp_size: int,
) -> Any:
    """A pull worker never initialised, holding what register_kv_caches
    reads in every release, as __init__ sets it."""
    worker_class = type(
        "BareNixlWorker", (_NoShutdown, pull_worker.NixlPullConnectorWorker), {}
    )
    worker: Any = object.__new__(worker_class)
    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    heads = spec.num_kv_heads * tp_size
    model_config = SimpleNamespace(
        model="ptrres-handshakes",
        dtype=DTYPE,
        use_mla=False,
        get_total_num_kv_heads=lambda: heads,
        get_head_size=lambda: HEAD_SIZE,
        get_total_num_hidden_layers=lambda: NUM_LAYERS,
    )
    backend = cpu_attn.CPUAttentionBackend
    worker.__dict__.update(
        vllm_config=SimpleNamespace(
            model_config=model_config,
            cache_config=vllm_config.cache_config,
            scheduler_config=vllm_config.scheduler_config,
            parallel_config=vllm_config.parallel_config,
            speculative_config=None,
        ),
        model_config=model_config,
        kv_cache_config=kv_cache_config,
        # As __init__: the resolved layout's name.
        kv_cache_layout=layout.name,
        host_buffer_kv_cache_layout=layout.name,
        _has_packed_cache=layout.is_block_outermost,
        engine_id=f"engine-{next(_names)}",
        tp_rank=0,
        tp_size=tp_size,
        transfer_tp_rank=0,
        transfer_tp_size=tp_size,
        world_size=tp_size,
        pp_size=1,
        dcp_size=1,
        pcp_size=1,
        block_size=BLOCK_SIZE,
        num_blocks=kv_cache_config.num_blocks,
        _logical_num_blocks=kv_cache_config.num_blocks,
        _physical_blocks_per_logical_kv_block=1,
        use_mla=False,
        use_host_buffer=False,
        kv_buffer_device="cpu",
        nixl_memory_type="DRAM",
        nixl_backends=["UCX"],
        nixl_wrapper=agent,
        attn_backends=[backend],
        backend_name=backend.get_name(),
        kv_transfer_config=config.KVTransferConfig(
            kv_connector="NixlConnector", kv_role="kv_both"
        ),
        _layer_specs=dict.fromkeys(names, spec),
        _has_mamba=False,
        _is_hma_required=False,
        _is_csa_linear=False,
        _conv_decomp=None,
        _mamba_ssm_size=(0, 0),
        _head_sharded_draft_kv_heads=None,
        device_id=0,
        host_xfer_buffers={},
        _region_is_mla=[],
        _registered_descs=[],
        block_len_per_layer=[],
        block_stride_per_layer=[],
        region_group_ids=[],
        region_names=[],
        region_num_blocks=[],
        region_mem_types=[],
        region_members=[],
        kv_caches_base_addr=defaultdict(dict),
        dst_num_blocks={},
        dst_region_num_blocks={},
        dst_region_group_ids={},
        dst_region_mem_types={},
        dst_uses_region_group_mapping={},
        src_xfer_handles_by_block_size={},
        src_blocks_data_by_block_size={},
        _desc_is_dram_by_block_size={},
        _desc_pos_by_block_size={},
        _dram_src_handles_by_block_size={},
        _ssm_region_indices=[],
        _group_region_indices=[],
        _head_sharded_draft_regions=set(),
        _transfer_layer_region_indices=[],
        _ple_block_len=None,
        _ple_region_index=None,
        _packed_member_layouts={},
        _regions_by_layer={},
        _uses_region_group_mapping=False,
        _mixed_mem_types=False,
        _skip_dram_xfer=False,
        compat_hash=None,
        transfer_topo=None,
        tp_mappings={},
        draft_tp_mappings={},
    )
    return worker
