"""vLLM's transfer_async, patched by ptrres or not (issues 12, 21 and 39).

End-to-end CPU time of ``SingleDirectionOffloadingHandler.transfer_async``,
vLLM's own against ptrres.vllm's, on the same handler, in one process, in
interleaved rounds. On vLLM 0.34, whose offloading connector resolves each
job (``pointer_utils.resolve_device_pointers``) before the handler fills its
buffers from the DevicePointers, a job is both: vLLM's resolve and
transfer_async against the patched connector's resolve and the patched
transfer_async; a second table times the resolve alone, vLLM's
``pointer_utils.resolve_device_pointers`` against the one patched in. The
handler is vLLM's, built through its real __init__ on CPU tensors (the
device side a tensor subclass that reports is_cuda); streams
and events are stubs and the copy is skipped (``_swap_blocks_batch`` does
nothing), so what is timed is vLLM's Python and the descriptor fill: what a
vLLM worker spends on the CPU per store or load.

Tensors are real but their rows are small (each page divided by ROW_SCALE):
vLLM and ptrres only do pointer arithmetic here, whose cost does not depend on
the page size, and 2048-block transfers of 160 layers then fit in 30 MiB.

Canonical layouts (vLLM's ``canonical_layout=True``, SPEC 10) run the same
way on ptrres.bench's CANONICAL_PRESETS, Llama-3.1-70B at TP=4 in packed NHD
(16 fragments per block per layer) and DeepSeek-V3's MLA under TP=8 (writer
rotation: rank 3 of 8 stores every 8th page), their byte fields scaled down
alike so that the smallest is 8 B (the fragment count is the model's).

``--first-transfer`` times instead what a fresh process pays (issue 21):
each round is a new interpreter that loads the plugin through vLLM's own
``load_general_plugins()``, builds a llama-3.1-8b store handler through the
patched ``__init__`` (which makes the kernels ready and builds the plan), and
times its first ``transfer_async`` of 16 blocks x 32 layers, the calls after
it, vLLM's own unpatched ``transfer_async`` on the same handler, and vLLM's
own constructor; on an empty Numba cache (a new folder per round) and on the
warm cache the previous round left.

Any installed vLLM that ptrres.vllm supports (0.30 to 0.34) works; the table
says which ran.

Run: python benchmarks/vllm_transfer.py [--quick] [--canonical-only]
     python benchmarks/vllm_transfer.py --first-transfer [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import vllm
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalPageMapping,
    CopyRun,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu import gpu_worker as worker
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

import ptrres
import ptrres.vllm as plugin
from ptrres.bench import (
    CANONICAL_PRESETS,
    PRESETS,
    geometric_mean,
    make_offloaded_ids,
    make_spec,
)
from ptrres.vllm import _handler

# vLLM 0.34: the connector resolves each job, and the handler takes
# DevicePointers: transfer_async(job_id, device_ptrs, cpu_spec).
DEVICE_POINTERS = hasattr(worker, "iter_pointer_groups")
CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker"

LAYOUTS = ["llama-3.1-8b", "llama-3.1-70b-tp4", "hybrid-4x12"]
CANONICAL_LAYOUTS = list(CANONICAL_PRESETS)
# Canonical CPU tensors hold this many chunks (2048 blocks take 513).
NUM_CANONICAL_CHUNKS = 640
BLOCKS = [1, 16, 256, 2048]
BLOCKS_PER_CHUNK = 4
NUM_GPU_BLOCKS = 4096
NUM_CPU_CHUNKS = 4096
# Pages are this many times smaller than the model's (64 KiB -> 64 B).
ROW_SCALE = 1024


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that reports is_cuda, with plain (untraced) tensor methods."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


class FakeStream:
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

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class FakePlatform:
    Stream = FakeStream

    def current_stream(self) -> FakeStream:
        return FakeStream()

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        yield

    def is_xpu(self) -> bool:
        return False

    def is_rocm(self) -> bool:
        return False

    def is_cuda_alike(self) -> bool:
        return False


def skip_copy(*args: Any, **kwargs: Any) -> None:
    """The copy engine, skipped: only the CPU work is timed."""


def stub_vllm() -> None:
    worker.current_platform = FakePlatform()
    worker.PIN_MEMORY = False
    torch.Event = FakeEvent  # type: ignore[misc]


def handler_for(name: str, gpu_to_cpu: bool) -> Any:
    """vLLM's handler for a preset's layout, on small real tensors."""
    kv = PRESETS[name].kv_caches(num_blocks=1)
    gpu, cpu = [], []
    for entry in kv.tensors:
        row = max(8, entry.tensor.shape[1] // ROW_SCALE)
        gpu.append(
            torch.zeros((NUM_GPU_BLOCKS, row), dtype=torch.int8).as_subclass(
                FakeCudaTensor
            )
        )
        cpu.append(
            torch.zeros((NUM_CPU_CHUNKS, row * BLOCKS_PER_CHUNK), dtype=torch.int8)
        )
    refs = [
        [
            CanonicalKVCacheRef(r.tensor_idx, max(8, r.page_size_bytes // ROW_SCALE))
            for r in group
        ]
        for group in kv.group_data_refs
    ]
    return new_handler(gpu, cpu, refs, gpu_to_cpu)


def new_handler(
    gpu: list[Any], cpu: list[Any], refs: list[Any], gpu_to_cpu: bool, **options: Any
) -> Any:
    """vLLM's handler through its real __init__, the copy skipped; on 0.34
    without GPU tensors, which its ``kv_caches`` attribute (set here) holds
    for the resolve."""
    handler = worker.SingleDirectionOffloadingHandler(
        **({} if DEVICE_POINTERS else {"gpu_tensors": gpu}),
        cpu_tensors=cpu,
        blocks_per_chunk=BLOCKS_PER_CHUNK,
        layer_refs_per_group=refs,
        gpu_to_cpu=gpu_to_cpu,
        **options,
    )
    if DEVICE_POINTERS:
        from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor

        handler.kv_caches = CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, int(t.shape[1])) for t in gpu], refs
        )
    handler._swap_blocks_batch = skip_copy
    return handler


def canonical_handler_for(name: str, gpu_to_cpu: bool) -> Any:
    """vLLM's canonical handler for a preset: one tensor and ref per layer."""
    preset = CANONICAL_PRESETS[name]
    offset, canonical_offset, size, count, stride, canonical_stride = preset.run
    byte_fields = (preset.local_page, preset.canonical_page, size, stride)
    scale = math.gcd(*byte_fields, canonical_offset, offset, canonical_stride) // 8
    local, canonical = preset.local_page // scale, preset.canonical_page // scale
    run = CopyRun(
        offset // scale,
        canonical_offset // scale,
        size // scale,
        count,  # the model's fragments per block
        stride // scale,
        canonical_stride // scale,
    )
    mapping = CanonicalPageMapping(
        canonical, local, (run,), preset.num_writers, preset.writer_index, True
    )
    gpu = [
        torch.zeros((NUM_GPU_BLOCKS, local), dtype=torch.int8).as_subclass(
            FakeCudaTensor
        )
        for _ in range(preset.num_layers)
    ]
    cpu = [
        torch.zeros(
            (NUM_CANONICAL_CHUNKS, canonical * BLOCKS_PER_CHUNK), dtype=torch.int8
        )
        for _ in range(preset.num_layers)
    ]
    refs = [[CanonicalKVCacheRef(t, local, mapping) for t in range(len(gpu))]]
    return new_handler(gpu, cpu, refs, gpu_to_cpu, canonical_layout=True)


def canonical_specs(blocks: int, gpu_to_cpu: bool) -> tuple[Any, Any]:
    """One group of `blocks` random blocks, starting mid-chunk (index 6)."""
    rng = torch.Generator().manual_seed(blocks)
    block_ids = torch.randint(0, NUM_GPU_BLOCKS, (blocks,), generator=rng).tolist()
    spec = ptrres.GPULoadStoreSpec(block_ids, [blocks], [6])
    chunk_ids = make_offloaded_ids(
        spec, BLOCKS_PER_CHUNK, num_chunks=NUM_CANONICAL_CHUNKS
    )
    gpu_spec = GPULoadStoreSpec(block_ids, [blocks], [6])
    cpu_spec = CPULoadStoreSpec(chunk_ids.tolist())
    return (gpu_spec, cpu_spec) if gpu_to_cpu else (cpu_spec, gpu_spec)


def vllm_specs(name: str, blocks: int, gpu_to_cpu: bool) -> tuple[Any, Any]:
    """(src_spec, dst_spec) of vLLM's own classes (int32 ids, as vLLM makes)."""
    spec = make_spec(PRESETS[name], blocks, num_blocks=NUM_GPU_BLOCKS)
    chunk_ids = make_offloaded_ids(spec, BLOCKS_PER_CHUNK, num_chunks=NUM_CPU_CHUNKS)
    gpu_spec = GPULoadStoreSpec(
        spec.block_ids.tolist(), list(spec.group_sizes), list(spec.block_indices)
    )
    cpu_spec = CPULoadStoreSpec(chunk_ids.tolist())
    return (gpu_spec, cpu_spec) if gpu_to_cpu else (cpu_spec, gpu_spec)


def jobs(
    resolve: Callable[[Any, Any], Any], transfer: Callable[..., bool]
) -> Callable[..., bool]:
    """vLLM 0.34's job: the connector's resolve, then the handler's
    transfer_async, as ``transfer(handler, job_id, src_spec, dst_spec)``."""

    def job(handler: Any, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        gpu_spec, cpu_spec = (
            (src_spec, dst_spec) if handler.gpu_to_cpu else (dst_spec, src_spec)
        )
        device_ptrs = resolve(gpu_spec, handler.kv_caches)
        return transfer(handler, job_id, device_ptrs, cpu_spec)

    return job


def time_transfers(
    transfer: Callable[..., bool], handler: Any, specs: tuple[Any, Any], calls: int
) -> float:
    """Seconds per transfer_async call, the pool refilled between calls."""
    total = 0.0
    for job_id in range(calls):
        start = time.perf_counter()
        transfer(handler, job_id, *specs)
        total += time.perf_counter() - start
        handler.get_finished()
    return total / calls


def compare(
    contenders: dict[str, Callable[..., bool]],
    handler: Any,
    specs: tuple[Any, Any],
    *,
    seconds: float,
    rounds: int = 7,
) -> dict[str, float]:
    """Median seconds per call of each contender, in interleaved rounds."""
    batch = seconds / (rounds * len(contenders))
    calls = {}
    for name, transfer in contenders.items():
        per_call = time_transfers(transfer, handler, specs, 3)  # warm up
        calls[name] = max(3, int(batch / max(per_call, 1e-7)))
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, transfer in contenders.items():
            times[name].append(time_transfers(transfer, handler, specs, calls[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def check_same_descriptors(
    contenders: dict[str, Callable[..., bool]], handler: Any, specs: tuple[Any, Any]
) -> int:
    """Both paths submit the same descriptors (checked before timing them)."""
    submitted: list[tuple[bytes, ...]] = []

    def record(src: Any, dst: Any, sizes: Any, **kwargs: Any) -> None:
        submitted.append(tuple(t.numpy().tobytes() for t in (src, dst, sizes)))

    handler._swap_blocks_batch = record
    contenders["vllm"](handler, 0, *specs)
    contenders["ptrres"](handler, 1, *specs)
    handler.get_finished()
    handler._swap_blocks_batch = skip_copy
    # A store whose blocks all go to other writers submits nothing, either way.
    assert len(submitted) in (0, 2), "only one of vLLM and ptrres submitted"
    if not submitted:
        return 0
    assert submitted[0] == submitted[1], "ptrres's descriptors differ from vLLM's"
    return len(submitted[0][0]) // 8


def first_transfer_child() -> dict[str, float]:
    """In a fresh interpreter: what building a patched handler and its first
    transfer cost, against later calls and vLLM's own (seconds). On vLLM
    0.34 the handler is CPUOffloadingWorker's (built through its patched
    __init__) and a transfer is a whole job, resolve included."""
    import vllm.plugins

    vllm.plugins.load_general_plugins()  # type: ignore[no-untyped-call]
    assert plugin.is_patched(), "vLLM's loader did not patch (is ptrres installed?)"
    stub_vllm()
    start = time.perf_counter()
    handler = store_handler("llama-3.1-8b")
    constructor = time.perf_counter() - start
    transfer, vllm_transfer = type(handler).transfer_async, _handler.vllm_transfer_async
    if DEVICE_POINTERS:
        import importlib

        from ptrres.vllm import _state

        resolve = importlib.import_module(CONNECTOR_MODULE).resolve_device_pointers
        transfer = jobs(resolve, transfer)
        vllm_transfer = jobs(_state.vllm_own(resolve), vllm_transfer)
    specs = vllm_specs("llama-3.1-8b", 16, True)
    start = time.perf_counter()
    transfer(handler, 0, *specs)
    first = time.perf_counter() - start
    handler.get_finished()
    later = statistics.median(
        time_transfers(transfer, handler, specs, 1) for _ in range(51)
    )
    vllms = statistics.median(
        time_transfers(vllm_transfer, handler, specs, 1) for _ in range(51)
    )
    plugin.unpatch()
    start = time.perf_counter()
    store_handler("llama-3.1-8b")
    vllm_constructor = time.perf_counter() - start
    return {
        "constructor": constructor,
        "vllm_constructor": vllm_constructor,
        "first": first,
        "later": later,
        "vllm": vllms,
    }


def store_handler(name: str) -> Any:
    """A preset's store handler as vLLM builds it: through the handler's own
    __init__, or on 0.34 through CPUOffloadingWorker's (three handlers)."""
    handler = handler_for(name, True)
    if not DEVICE_POINTERS:
        return handler
    offloading = worker.CPUOffloadingWorker(
        kv_caches=handler.kv_caches,
        blocks_per_chunk=BLOCKS_PER_CHUNK,
        num_cpu_chunks=NUM_CPU_CHUNKS,
    )
    store = offloading._store_handler
    store.kv_caches = handler.kv_caches
    store._swap_blocks_batch = skip_copy
    return store


def first_transfer_table(rounds: int) -> None:
    """Fresh processes on an empty Numba cache, then on the warm one."""
    print(
        f"vLLM {vllm.__version__}, ptrres {ptrres.__version__}: llama-3.1-8b store, "
        "16 blocks x 32 layers, in fresh processes\n"
    )
    print(
        "| Numba cache | patched constructor "
        "| vLLM's constructor | first transfer_async | later calls "
        "| vLLM's own, unpatched |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PTRRES_VLLM")}
    with tempfile.TemporaryDirectory() as scratch:
        warm_cache = os.path.join(scratch, "warm")
        for state in ("empty", "warm"):
            for round_ in range(rounds):
                cache = (
                    os.path.join(scratch, f"empty-{round_}")
                    if state == "empty"
                    else warm_cache
                )
                result = subprocess.run(
                    [sys.executable, __file__, "--child"],
                    env={**env, "NUMBA_CACHE_DIR": cache},
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if result.returncode != 0:
                    raise SystemExit(result.stderr)
                t = json.loads(result.stdout.splitlines()[-1])
                print(
                    f"| {state} | {t['constructor']:.3f} s "
                    f"| {t['vllm_constructor'] * 1e3:.1f} ms "
                    f"| {t['first'] * 1e3:.2f} ms | {t['later'] * 1e3:.3f} ms "
                    f"| {t['vllm'] * 1e3:.3f} ms |",
                    flush=True,
                )
            if state == "empty":  # the warm rounds start from a filled cache
                subprocess.run(
                    [sys.executable, "-m", "ptrres", "warmup"],
                    env={**env, "NUMBA_CACHE_DIR": warm_cache},
                    capture_output=True,
                    check=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter timings")
    parser.add_argument(
        "--canonical-only", action="store_true", help="only the canonical layouts"
    )
    parser.add_argument(
        "--first-transfer",
        action="store_true",
        help="time a fresh process's first transfer, on an empty and a warm cache",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="fresh processes per cache state"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(first_transfer_child()))
        return
    if args.first_transfer:
        first_transfer_table(args.rounds)
        return
    seconds = 0.15 if args.quick else 0.6
    print(f"vLLM {vllm.__version__}, ptrres {ptrres.__version__}\n")

    stub_vllm()
    contenders = patched_contenders()

    print(
        "| layout | blocks/group | direction | descriptors | vLLM us | ptrres us "
        "| speedup |"
    )
    print("|---|---:|---|---:|---:|---:|---:|")
    cases: list[tuple[str, Callable[[bool], Any], Callable[..., Any]]] = [
        (f"{name} (canonical)", lambda store, n=name: canonical_handler_for(n, store),
         lambda blocks, store: canonical_specs(blocks, store))
        for name in CANONICAL_LAYOUTS
    ]  # fmt: skip
    if not args.canonical_only:
        cases = [
            (name, lambda store, n=name: handler_for(n, store),
             lambda blocks, store, n=name: vllm_specs(n, blocks, store))
            for name in LAYOUTS
        ] + cases  # fmt: skip
    speedups = []
    for name, make_handler, make_specs in cases:
        for gpu_to_cpu in (True, False):
            handler = make_handler(gpu_to_cpu)
            for blocks in BLOCKS:
                specs = make_specs(blocks, gpu_to_cpu)
                descriptors = check_same_descriptors(contenders, handler, specs)
                timing = compare(contenders, handler, specs, seconds=seconds)
                speedup = timing["vllm"] / timing["ptrres"]
                speedups.append(speedup)
                print(
                    f"| {name} | {blocks} | {'store' if gpu_to_cpu else 'load'} "
                    f"| {descriptors} | {timing['vllm'] * 1e6:.1f} "
                    f"| {timing['ptrres'] * 1e6:.1f} | {speedup:.1f}x |",
                    flush=True,
                )
            del handler
    print(
        f"\ngeometric mean {geometric_mean(speedups):.1f}x (target >= "
        f"{20 if DEVICE_POINTERS else 10}x), lowest {min(speedups):.1f}x "
        "(target >= 3x)"
    )
    if DEVICE_POINTERS and not args.canonical_only:
        resolve_table(seconds)
    plugin.unpatch()


def patched_contenders() -> dict[str, Callable[..., bool]]:
    """vLLM's own transfer and the patched one (on 0.34: each a whole job,
    resolve included), vLLM patched from here on."""
    import importlib

    vllm_transfer = worker.SingleDirectionOffloadingHandler.transfer_async
    connector = importlib.import_module(CONNECTOR_MODULE) if DEVICE_POINTERS else None
    vllm_resolve = None if connector is None else connector.resolve_device_pointers
    patched = plugin.patch()
    assert patched, "ptrres.vllm did not patch vLLM"
    ptrres_transfer = worker.SingleDirectionOffloadingHandler.transfer_async
    if connector is None:
        return {"vllm": vllm_transfer, "ptrres": ptrres_transfer}
    assert connector.resolve_device_pointers is not vllm_resolve
    return {
        "vllm": jobs(vllm_resolve, vllm_transfer),
        "ptrres": jobs(connector.resolve_device_pointers, ptrres_transfer),
    }


def resolve_table(seconds: float) -> None:
    """vLLM 0.34's pointer_utils.resolve_device_pointers, its own against the
    one patched in (vLLM's DevicePointers either way), at 1 and 16 blocks."""
    from vllm.v1.kv_offload import pointer_utils

    vllm_resolve = _state_original(pointer_utils, "resolve_device_pointers")
    contenders = {"vllm": vllm_resolve, "ptrres": pointer_utils.resolve_device_pointers}
    print(
        "\n| layout | blocks | descriptors | vLLM's resolve us | patched us | speedup |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    speedups = []
    for name in LAYOUTS:
        handler = handler_for(name, True)
        for blocks in (1, 16):
            spec, _ = vllm_specs(name, blocks, True)
            ours = contenders["ptrres"](spec, handler.kv_caches)
            theirs = contenders["vllm"](spec, handler.kv_caches)
            assert ours.ptrs.tobytes() == theirs.ptrs.tobytes()
            timing = compare_calls(contenders, (spec, handler.kv_caches), seconds)
            speedup = timing["vllm"] / timing["ptrres"]
            speedups.append(speedup)
            print(
                f"| {name} | {blocks} | {len(ours.ptrs)} "
                f"| {timing['vllm'] * 1e6:.2f} | {timing['ptrres'] * 1e6:.2f} "
                f"| {speedup:.1f}x |",
                flush=True,
            )
    print(
        f"\nresolve alone, 1 and 16 blocks: geometric mean "
        f"{geometric_mean(speedups):.1f}x (target >= 30x), lowest "
        f"{min(speedups):.1f}x"
    )


def _state_original(owner: Any, name: str) -> Any:
    """vLLM's own attribute behind a patched one."""
    from ptrres.vllm import _state

    return _state.vllm_own(getattr(owner, name))


def compare_calls(
    contenders: dict[str, Callable[..., Any]],
    arguments: tuple[Any, ...],
    seconds: float,
    rounds: int = 7,
) -> dict[str, float]:
    """Median seconds per call of each contender on ``arguments``, in
    interleaved rounds of as many calls as fill its share of ``seconds``."""

    def per_call(call: Callable[..., Any], n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            call(*arguments)
        return (time.perf_counter() - start) / n

    batch = seconds / (rounds * len(contenders))
    calls = {
        name: max(3, int(batch / max(per_call(call, 3), 1e-7)))
        for name, call in contenders.items()
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, call in contenders.items():
            times[name].append(per_call(call, calls[name]))
    return {name: statistics.median(t) for name, t in times.items()}


if __name__ == "__main__":
    main()
