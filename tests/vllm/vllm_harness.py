"""vLLM's own offloading code (0.30 to 0.34), on CPU tensors with stubbed streams.

The handler is built through its real ``__init__``: its GPU tensors are CPU
tensors of a subclass that reports ``is_cuda``, streams and events are stubs,
and what it submits to ``swap_blocks_batch`` is captured (or executed as
memmoves over the descriptors). vLLM 0.34's handler holds no GPU tensors and
takes DevicePointers (``DEVICE_POINTERS``): ``Layout.handler`` then gives a
PointerHandler, which resolves each transfer's GPU spec as vLLM's
offloading connector does (its module's ``resolve_device_pointers``, the
plugin's where patched) and hands the handler the pointers, so that a test
drives either release with 0.33's ``transfer_async(job_id, src, dst)``.

The simple offload path (``vllm/v1/simple_kv_offload``) runs its own
``build_params``, ``copy_blocks`` and backends: the driver function
(``cuda_mem_ops._batch_memcpy``, SPEC 12) is a BatchDriver, which reads back
the three arrays it is handed (and may execute them as memmoves).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

# Not `import vllm`: without vLLM that finds tests/vllm as a namespace package.
worker = pytest.importorskip("vllm.v1.kv_offload.cpu.gpu_worker")
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402

# vLLM 0.34: the connector resolves each job, and the handler takes
# DevicePointers (its transfer_async(job_id, device_ptrs, cpu_spec)).
DEVICE_POINTERS = hasattr(worker, "iter_pointer_groups")
CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker"

# The simple offload path (modules, untyped: their tests hand them stand-ins).
cuda_mem_ops = pytest.importorskip("vllm.v1.simple_kv_offload.cuda_mem_ops")
copy_backend = pytest.importorskip("vllm.v1.simple_kv_offload.copy_backend")
disk_backend = pytest.importorskip("vllm.v1.simple_kv_offload.disk_backend")


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it is on CUDA (sharing the CPU tensor's storage)."""

    # Plain tensor methods, without __torch_function__'s per-call cost.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def fake_cuda(tensor: Any) -> Any:
    return tensor.as_subclass(FakeCudaTensor)


class FakeStream:
    cuda_stream = 0x5EED  # what build_params keeps as the stream handle

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class FakePlatform:
    """The few calls the handler and the backends make on current_platform."""

    Stream = FakeStream

    def __init__(self, xpu: bool = False) -> None:
        self.xpu = xpu

    def set_device(self, device: Any) -> None:
        pass

    def current_stream(self) -> FakeStream:
        return FakeStream()

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        yield

    def is_xpu(self) -> bool:
        return self.xpu

    def is_rocm(self) -> bool:
        return False

    def is_cuda_alike(self) -> bool:
        return False


@dataclass
class Submitted:
    """What one swap_blocks_batch call received (copied: buffers are pooled)."""

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray


@dataclass
class CopyEngine:
    """Stands in for ops.swap_blocks_batch: records, and optionally copies."""

    memmove: bool = False
    calls: list[Submitted] = field(default_factory=list)

    def __call__(
        self,
        src: Any,
        dst: Any,
        sizes: Any,
        is_src_access_order_any: bool = False,
    ) -> None:
        assert src.dtype == dst.dtype == sizes.dtype
        assert src.dtype in (torch.int64, torch.uint64)
        call = Submitted(src.numpy().copy(), dst.numpy().copy(), sizes.numpy().copy())
        self.calls.append(call)
        if self.memmove:
            for s, d, n in zip(call.src, call.dst, call.sizes):
                ctypes.memmove(int(d), int(s), int(n))


@contextlib.contextmanager
def stubbed_vllm(
    copy: Callable[..., None] | None = None, *, xpu: bool = False
) -> Iterator[Any]:
    """Streams, events and pinned memory stubbed; ops.swap_blocks_batch = copy.

    With ``xpu``, the platform says XPU, so vLLM's buffers are uint64.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker, "current_platform", FakePlatform(xpu))
        mp.setattr(worker, "PIN_MEMORY", False)
        mp.setattr(torch, "Event", FakeEvent)
        mp.setattr(worker.ops, "swap_blocks_batch", copy or CopyEngine())
        yield mp


@dataclass(frozen=True)
class Layout:
    """A direct KV layout: GPU and CPU tensors, refs per group, bpc."""

    gpu_tensors: list[Any]
    cpu_tensors: list[Any]
    refs: list[list[Any]]
    blocks_per_chunk: int

    @property
    def num_gpu_blocks(self) -> int:
        return int(min(t.shape[0] for t in self.gpu_tensors))

    @property
    def num_cpu_chunks(self) -> int:
        return int(min(t.shape[0] for t in self.cpu_tensors))

    def handler(self, gpu_to_cpu: bool, **options: Any) -> Any:
        """vLLM's own handler, through its real __init__ (stubs in place), with
        the release's ``options`` (host_memory_is_pinned, canonical_layout);
        on 0.34, behind a PointerHandler."""
        handler = worker.SingleDirectionOffloadingHandler(
            **({} if DEVICE_POINTERS else {"gpu_tensors": list(self.gpu_tensors)}),
            cpu_tensors=list(self.cpu_tensors),
            blocks_per_chunk=self.blocks_per_chunk,
            layer_refs_per_group=self.refs,
            gpu_to_cpu=gpu_to_cpu,
            **options,
        )
        return PointerHandler(handler, self.kv_caches()) if DEVICE_POINTERS else handler

    def kv_caches(self) -> Any:
        """vLLM's CanonicalKVCaches of the GPU tensors (0.34's resolve and
        CPUOffloadingWorker take it): one per call, as vLLM's connector makes
        one per engine."""
        from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor

        return CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, int(t.shape[1])) for t in self.gpu_tensors],
            self.refs,
        )


def connector_resolve() -> Callable[[Any, Any], Any]:
    """vLLM 0.34's offloading connector's resolve, as bound in its module now
    (vLLM's own, or the plugin's, which refuses a bad job)."""
    import importlib

    return importlib.import_module(CONNECTOR_MODULE).resolve_device_pointers  # type: ignore[no-any-return]


class PointerHandler:
    """vLLM 0.34's handler driven as 0.33's was: ``transfer_async(job_id,
    src_spec, dst_spec)`` resolves the GPU spec as the connector does, then
    calls the handler's own ``transfer_async(job_id, device_ptrs, cpu_spec)``.
    Every other attribute is the handler's."""

    def __init__(self, handler: Any, kv_caches: Any) -> None:
        self.__dict__["handler"] = handler
        self.__dict__["kv_caches"] = kv_caches

    def transfer_async(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        handler = self.__dict__["handler"]
        gpu_spec, cpu_spec = (
            (src_spec, dst_spec) if handler.gpu_to_cpu else (dst_spec, src_spec)
        )
        device_ptrs = connector_resolve()(gpu_spec, self.__dict__["kv_caches"])
        return bool(handler.transfer_async(job_id, device_ptrs, cpu_spec))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["handler"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.__dict__["handler"], name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self.__dict__["handler"], name)


def refused(
    handler: Any,
    engine: CopyEngine,
    job_id: int,
    src: Any,
    dst: Any,
    error: type[BaseException],
    caplog: pytest.LogCaptureFixture,
) -> BaseException:
    """A transfer ptrres refuses, nothing submitted: on vLLM 0.30-0.33 it
    raises ``error``; on 0.34 the job fails as a failed copy fails it (a
    failed Transfer, reported unsuccessful) and the error is logged. Returns
    the error."""
    before = len(engine.calls)
    if not DEVICE_POINTERS:
        with pytest.raises(error) as raised:
            handler.transfer_async(job_id, src, dst)
        assert job_id not in handler._transfer_events
        assert engine.calls[before:] == []
        return raised.value
    caplog.clear()
    with caplog.at_level("ERROR", logger="ptrres.vllm"):
        assert handler.transfer_async(job_id, src, dst) is True
    transfer = handler._transfers[-1]
    assert (transfer.job_id, transfer.failed, transfer.num_bytes) == (job_id, True, 0)
    result = handler.get_finished()[-1]
    assert (result.job_id, result.success) == (job_id, False)
    assert engine.calls[before:] == []
    (record,) = [r for r in caplog.records if r.name == "ptrres.vllm"]
    assert f"job {job_id} failed, nothing copied" in record.getMessage()
    logged = record.args[-1]  # type: ignore[index]
    assert isinstance(logged, error)
    return logged


def padded_rows(num_rows: int, row_bytes: int, pad: int) -> Any:
    """An int8 (num_rows, row_bytes) view with row stride row_bytes + pad."""
    base = torch.zeros((num_rows, row_bytes + pad), dtype=torch.int8)
    return base[:, :row_bytes]


def make_layout(
    gpu_rows: Sequence[tuple[int, int, int]],
    refs: Sequence[Sequence[tuple[int, int]]],
    blocks_per_chunk: int,
    num_cpu_chunks: int,
    cpu_pad: int = 0,
) -> Layout:
    """gpu_rows: (num_blocks, row_bytes, pad) per tensor; refs: (tensor, page)."""
    gpu = [fake_cuda(padded_rows(n, row, pad)) for n, row, pad in gpu_rows]
    cpu = [
        padded_rows(num_cpu_chunks, row * blocks_per_chunk, cpu_pad)
        for _, row, _ in gpu_rows
    ]
    return Layout(
        gpu,
        cpu,
        [[CanonicalKVCacheRef(t, page) for t, page in group] for group in refs],
        blocks_per_chunk,
    )


def chunks_of(
    group_sizes: Sequence[int], block_indices: Sequence[int], bpc: int
) -> int:
    """How many CPU chunk ids a transfer of these groups takes."""
    return sum(
        -(-(n + index % bpc) // bpc)
        for n, index in zip(group_sizes, block_indices)
        if n
    )


def draw_ids(
    draw: Any, num_groups: int, num_blocks: int, num_cpu_chunks: int, bpc: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """A transfer's ids, drawn: (block ids, group sizes, block indices, CPU
    chunk ids), as many chunk ids as the groups take."""
    group_sizes = [draw(st.integers(0, 6)) for _ in range(num_groups)]
    block_indices = [draw(st.integers(0, 20)) for _ in range(num_groups)]
    n_ids = sum(group_sizes)
    block_ids = draw(
        st.lists(st.integers(0, num_blocks - 1), min_size=n_ids, max_size=n_ids)
    )
    n_chunks = chunks_of(group_sizes, block_indices, bpc)
    cpu_ids = draw(
        st.lists(
            st.integers(0, num_cpu_chunks - 1), min_size=n_chunks, max_size=n_chunks
        )
    )
    return block_ids, group_sizes, block_indices, cpu_ids


def specs(
    block_ids: Sequence[int],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    cpu_ids: Sequence[int],
    *,
    gpu_to_cpu: bool,
    dtype: Any = np.int32,
) -> tuple[Any, Any]:
    """(src_spec, dst_spec) as vLLM's offloading connector passes them."""
    gpu = GPULoadStoreSpec(list(block_ids), list(group_sizes), list(block_indices))
    cpu = CPULoadStoreSpec(list(cpu_ids))
    gpu.block_ids = gpu.block_ids.astype(dtype)
    cpu.block_ids = cpu.block_ids.astype(dtype)
    return (gpu, cpu) if gpu_to_cpu else (cpu, gpu)


# --- the simple offload path (SimpleCPUOffloadConnector) ----------------------


@dataclass(frozen=True)
class DriverCall:
    """One call of the batch-memcpy driver: the three arrays, read back from
    the addresses it was handed, and its other arguments."""

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray
    # (attrs address, numAttrs, stream handle): what else identifies a call.
    others: tuple[int, int, int]


@dataclass
class BatchDriver:
    """Stands in for cuMemcpyBatchAsync, as ``cuda_mem_ops._batch_memcpy =
    (driver, 1)``: records what each call describes, executes it as memmoves
    with ``memmove``, and returns ``status`` (0: success)."""

    memmove: bool = False
    status: int = 0
    calls: list[DriverCall] = field(default_factory=list)

    def __call__(
        self,
        dsts: int,
        srcs: int,
        sizes: int,
        count: int,
        attrs: int,
        attr_idxs: Any,
        num_attrs: int,
        fail_idx: Any,
        stream: int,
    ) -> int:
        def read(address: int) -> np.ndarray:
            entries = (ctypes.c_uint64 * count).from_address(address)
            return np.frombuffer(bytes(entries), np.uint64)

        call = DriverCall(
            read(srcs), read(dsts), read(sizes), (attrs, num_attrs, stream)
        )
        self.calls.append(call)
        if self.memmove:
            for s, d, n in zip(call.src, call.dst, call.sizes):
                ctypes.memmove(int(d), int(s), int(n))
        return self.status


@contextlib.contextmanager
def stubbed_simple(
    driver: Callable[..., int] | None = None, *, max_batch: int = 0
) -> Iterator[Any]:
    """The driver function stood in for by ``driver`` (a new BatchDriver by
    default), ``max_batch`` descriptors per call (0: one call), platform,
    events and pinning stubbed; yields the driver."""
    driver = BatchDriver() if driver is None else driver
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cuda_mem_ops, "_batch_memcpy", (driver, 1))
        mp.setattr(cuda_mem_ops, "_max_batch_descriptors", max_batch)
        for backend in (copy_backend, disk_backend):
            mp.setattr(backend, "current_platform", FakePlatform())
        mp.setattr(disk_backend, "pin_tensor", lambda tensor: None)
        mp.setattr(torch, "Event", FakeEvent)
        yield driver


def simple_caches(
    num_blocks: int, block_bytes: Sequence[int], seed: int = 0
) -> dict[str, Any]:
    """One int8 (num_blocks, bpb) tensor per layer, named as vLLM's worker
    names its regions (the same names on both sides of a copy), filled with
    bytes that differ from block to block (and with ``seed``)."""
    caches = {}
    for layer, bpb in enumerate(block_bytes):
        values = torch.arange(num_blocks * bpb, dtype=torch.int64) * 7 + layer * 131
        caches[f"layer.{layer}"] = (
            ((values + seed * 37) % 251 - 125).to(torch.int8).view(num_blocks, bpb)
        )
    return caches
