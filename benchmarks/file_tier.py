"""The file tier, side by side (issue 13).

1. plan_file_ops against vLLM PR #56076's Python op building
   (`ptrres bench --operation files`), geometric mean over llama-3.1-8b,
   llama-3.1-70b-tp4 and hybrid-4x12 at 16 and 256 blocks.
2. write_files/read_files throughput against a plain loop of one os.pwrite
   (os.preadv of one buffer on load) per op, into the page cache: a 128 MiB
   transfer of real CPU tensors (32 refs of 16 KiB pages, 256 blocks, 16
   blocks per file) to files in a temporary directory, deleted after.

    PYTHONPATH=. python benchmarks/file_tier.py

``--vllm-worker`` times instead vLLM 0.34's file worker (``vllm_worker()``):
``FSOffloadingWorker._submit_io``, vLLM's own against ptrres.vllm's, on the
same worker, in one process, interleaved, on every model preset at 1 to 2048
blocks and on the shipped traces (``--quick``: three presets, up to 256).

    PYTHONPATH=. python benchmarks/file_tier.py --vllm-worker [--quick]
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import ptrres
from ptrres._posix import _host_bytes
from ptrres.bench import PRESETS, bench_cell, geometric_mean

PAGE = 16 * 1024
REFS = 32
BLOCKS = 256
BPC = 16
ROUNDS = 5


def planning() -> None:
    speedups = []
    for name in ("llama-3.1-8b", "llama-3.1-70b-tp4", "hybrid-4x12"):
        for blocks in (16, 256):
            row = bench_cell(
                PRESETS[name], "files", blocks, seconds=0.6, with_fill=False
            )
            speedups.append(row.speedup)
            print(
                f"{name:<18} {blocks:>4} blocks {row.ops:>6} ops: PR worker "
                f"{row.reference_seconds * 1e6:9.1f} us, ptrres "
                f"{row.ptrres_seconds * 1e6:7.1f} us, {row.speedup:6.1f}x"
            )
    print(f"plan_file_ops: geometric mean {geometric_mean(speedups):.1f}x\n")


def pwrite_loop(plan: ptrres.FilePlan, paths: list[Path], write: bool) -> None:
    """One os.pwrite (or a one-buffer os.preadv) per op, file by file."""
    for f, path in enumerate(paths):
        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        fd = os.open(path, flags, 0o644)
        try:
            for i in range(plan.file_starts[f], plan.file_starts[f + 1]):
                buffer = _host_bytes(int(plan.dev_ptrs[i]), int(plan.sizes[i]))
                offset = int(plan.file_offsets[i])
                if write:
                    os.pwrite(fd, buffer, offset)
                else:
                    os.preadv(fd, [buffer], offset)
        finally:
            os.close(fd)


def executor() -> None:
    import torch

    tensors = [torch.randint(0, 256, (BLOCKS * 2, PAGE), dtype=torch.uint8)]
    tensors += [torch.empty_like(tensors[0]) for _ in range(REFS - 1)]
    for t in tensors[1:]:
        t.copy_(tensors[0])
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(t, PAGE) for t in tensors],
        [[ptrres.CanonicalKVCacheRef(d, PAGE) for d in range(REFS)]],
    )
    ids = np.random.default_rng(0).permutation(BLOCKS * 2)[:BLOCKS]
    spec = ptrres.GPULoadStoreSpec(ids, [BLOCKS], [0])
    plan = ptrres.PointerTable(kv).plan_file_ops(spec, BPC)
    mib = plan.num_bytes / 2**20
    print(
        f"executor: {plan.num_files} files, {len(plan.sizes)} ops of {PAGE} B, "
        f"{mib:.0f} MiB, page cache (files rewritten in place)"
    )
    contenders: dict[str, Any] = {
        "pwrite loop (1 call per op)": lambda p: pwrite_loop(plan, p, True),
        "write_files max_workers=1": lambda p: ptrres.write_files(
            plan, p, max_workers=1
        ),
        "write_files max_workers=None": lambda p: ptrres.write_files(plan, p),
        "preadv loop (1 call per op)": lambda p: pwrite_loop(plan, p, False),
        "read_files max_workers=1": lambda p: ptrres.read_files(plan, p, max_workers=1),
        "read_files max_workers=None": lambda p: ptrres.read_files(plan, p),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        paths = [Path(tmp) / f"chunk{f}" for f in range(plan.num_files)]
        ptrres.write_files(plan, paths)  # create the files, warm the cache
        for _ in range(ROUNDS):
            for name, run in contenders.items():
                start = time.perf_counter()
                run(paths)
                times[name].append(time.perf_counter() - start)
    for name, samples in times.items():
        seconds = float(np.median(samples))
        print(
            f"  {name:<30} {seconds * 1e3:7.1f} ms  {mib / 1024 / seconds:5.2f} GiB/s"
        )


# --- vLLM 0.34's file worker --------------------------------------------------

WORKER_BSF = 4
WORKER_BLOCKS = (1, 16, 256, 2048)
QUICK_PRESETS = ("llama-3.1-8b", "llama-3.1-70b-tp4", "hybrid-4x12")
# The cells whose patched call is taken apart (where the time goes).
BREAKDOWN = (("llama-3.1-8b", 16), ("llama-3.1-8b", 256), ("llama-3.1-70b-tp4", 256))
# Transfers of each shipped trace timed (evenly spaced over the trace).
TRACE_SAMPLE = 64


class _NoEvent:
    """torch.Event on a CPU build, which has none (both sides make one)."""

    def record(self, stream: Any = None) -> None:
        pass


class WorkerBench:
    """vLLM 0.34's file worker module, its own ``_submit_io`` and ptrres's,
    and a subclass of vLLM's worker whose ``submit_io`` does nothing."""

    def __init__(self) -> None:
        import torch
        from vllm.v1.kv_offload.fs import worker as fs_worker

        from ptrres.vllm import _file_worker
        from ptrres.vllm._warmup import warm_up_kernels

        torch.Event = _NoEvent  # type: ignore[misc,assignment]
        self.fs_worker = fs_worker
        self.vllm_submit_io = vars(fs_worker.FSOffloadingWorker)["_submit_io"]
        replacements = _file_worker.file_worker_replacements(
            lambda: True, warm_up_kernels
        )
        self.patched = next(
            r.replacement for r in replacements if r.name == "_submit_io"
        )
        self.rng = np.random.default_rng(0)

        class Worker(fs_worker.FSOffloadingWorker):
            captured: list[Any] | None = None

            def submit_io(self, file_ops: Any, is_store: bool, event: Any) -> Any:
                if self.captured is not None:
                    self.captured.append(file_ops)
                return []

        self.worker_class = Worker

    def job(self, kv: Any, spec: Any, bsf: int) -> WorkerJob:
        """A job as the patched connector hands it, and a worker for it; both
        sides' op lists checked equal."""
        from vllm.v1.kv_offload.base import DevicePointers, make_offload_key
        from vllm.v1.kv_offload.file_mapper import FileMapper

        from ptrres.vllm import _pointers

        ours = _pointers.resolve_device_pointers(spec, kv)
        plain = DevicePointers(
            ours.ptrs,
            ours.sizes,
            ours.group_block_counts,
            ours.group_data_ref_counts,
            ours.block_indices,
        )
        plan = ptrres.plan_file_ops(plain, bsf)
        rng = self.rng
        keys = [make_offload_key(rng.bytes(32), int(g)) for g in plan.file_groups]
        mapper = FileMapper("/kv", "meta-llama/Llama", 16, bsf, 1, 1, 1, 1, 0, "bf16")
        job = WorkerJob(self, ours, plain, keys, self.worker_class(mapper, bsf), plan)
        job.check()
        return job


class WorkerJob:
    """One job: ptrres's DevicePointers (carrying their table), a plain vLLM
    DevicePointers of the same pointers, the keys and a worker."""

    def __init__(
        self,
        bench: WorkerBench,
        ours: Any,
        plain: Any,
        keys: list[Any],
        worker: Any,
        plan: ptrres.FilePlan,
    ) -> None:
        self.bench, self.ours, self.plain = bench, ours, plain
        self.keys, self.worker, self.plan = keys, worker, plan
        self.ints = (
            plan.dev_ptrs.tolist(),
            plan.sizes.tolist(),
            plan.file_offsets.tolist(),
        )

    def vllm(self) -> Any:
        return self.bench.vllm_submit_io(self.worker, self.ours, self.keys, True)

    def ptrres(self) -> Any:
        return self.bench.patched(self.worker, self.ours, self.keys, True)

    def from_pointers(self) -> Any:
        return self.bench.patched(self.worker, self.plain, self.keys, True)

    def file_ops_alone(self) -> Any:
        return list(map(self.bench.fs_worker.FileOp, *self.ints))

    def check(self) -> None:
        """Every side hands submit_io the same op lists."""
        self.worker.captured = []
        self.vllm()
        self.ptrres()
        self.from_pointers()
        first, *others = self.worker.captured
        assert all(other == first for other in others)
        self.worker.captured = None


def vllm_worker(quick: bool = False) -> None:
    """vLLM 0.34's ``FSOffloadingWorker._submit_io``, its own against
    ptrres.vllm's, on the same worker, interleaved (ptrres.bench.compare).

    The worker is a subclass of vLLM's whose ``submit_io`` does nothing, so
    what is timed is what the engine step's thread spends per store or load:
    the op lists, vLLM's FileMapper naming each file, the event. The jobs
    are make_spec's (runs of up to 16 consecutive ids at random places, int32
    as vLLM's GPULoadStoreSpec holds them, block index 1: a partial first
    chunk), on every preset, tensors never allocated. Both sides
    get the DevicePointers the patched connector gives (ptrres's, carrying
    their table: ptrres plans from the checked ids); "from pointers" gives
    ptrres a plain vLLM DevicePointers instead. "FileOps alone" makes the
    same FileOp objects from ready Python ints, nothing else: the floor of
    any _submit_io that hands vLLM's subclasses FileOps. Before timing, the
    heap is frozen with vLLM's own freeze_gc_heap(), as vLLM's GPU worker
    does once warmed up, so that the collector scans what a serving process
    allocates, not the interpreter's start-up.
    """
    import vllm
    from vllm.utils.gc_utils import freeze_gc_heap

    from ptrres.bench import compare, make_spec

    bench = WorkerBench()
    names = QUICK_PRESETS if quick else tuple(PRESETS)
    cells = []
    for name in names:
        preset = PRESETS[name]
        kv = preset.kv_caches()
        for blocks in WORKER_BLOCKS[:3] if quick else WORKER_BLOCKS:
            spec = make_spec(preset, blocks, block_index=1, id_dtype=np.int32)
            cells.append((name, blocks, bench.job(kv, spec, WORKER_BSF)))
    traces = [] if quick else _trace_jobs(bench)
    freeze_gc_heap()
    print(
        f"vLLM {vllm.__version__}, block_size_factor {WORKER_BSF}, a no-op "
        "submit_io, vLLM's FileMapper; the heap frozen (vLLM's freeze_gc_heap)\n"
    )
    print(
        "| layout | blocks | files | FileOps | vLLM us | ptrres us | from pointers "
        "us | FileOps alone us | speedup | ceiling |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    speedups, ceilings = [], []
    for name, blocks, job in cells:
        t = compare(
            {
                "vllm": job.vllm,
                "ptrres": job.ptrres,
                "pointers": job.from_pointers,
                "floor": job.file_ops_alone,
            },
            seconds=0.4 if quick else 2.0,
            rounds=5 if quick else 9,
        )
        us = {k: v.seconds * 1e6 for k, v in t.items()}
        speedups.append(us["vllm"] / us["ptrres"])
        ceilings.append(us["vllm"] / us["floor"])
        print(
            f"| {name} | {blocks} | {job.plan.num_files} | {len(job.plan.sizes)} | "
            f"{us['vllm']:.1f} | {us['ptrres']:.1f} | {us['pointers']:.1f} | "
            f"{us['floor']:.1f} | {speedups[-1]:.1f}x | {ceilings[-1]:.1f}x |"
        )
    print(
        f"\nGeometric mean {geometric_mean(speedups):.1f}x (lowest "
        f"{min(speedups):.1f}x); the FileOps alone allow "
        f"{geometric_mean(ceilings):.1f}x (geometric mean of the ceilings)\n"
    )
    _breakdown([(n, b, j) for n, b, j in cells if (n, b) in BREAKDOWN], quick)
    if traces:
        _trace_table(traces)


def _breakdown(cells: list[tuple[str, int, WorkerJob]], quick: bool) -> None:
    """Where the patched call's time goes, part by part."""
    from ptrres.bench import compare
    from ptrres.vllm import _file_pages, _file_worker, _pointers

    print(
        "| layout | blocks | patched us | plan (ids) | FileOps | "
        "ints and per-file lists | file names | the rest |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, blocks, job in cells:
        table = _pointers.resolved_table(job.ours)
        assert table is not None
        spec = _pointers.resolved_by(job.ours, table)
        name_of = job.worker._file_mapper.get_file_name
        paths = list(map(name_of, job.keys))
        file_op = job.bench.fs_worker.FileOp
        page = _file_pages.table_pages(table, WORKER_BSF).page
        t = compare(
            {
                "total": job.ptrres,
                "plan": functools.partial(table.plan_file_ops, spec, WORKER_BSF),
                "lists": functools.partial(
                    _file_worker.file_op_lists, job.plan, paths, file_op, page
                ),
                "floor": job.file_ops_alone,
                "names": lambda: list(map(name_of, job.keys)),  # noqa: B023
            },
            seconds=0.4 if quick else 2.0,
            rounds=5 if quick else 9,
        )
        us = {k: v.seconds * 1e6 for k, v in t.items()}
        parts = {
            "plan": us["plan"],
            "floor": us["floor"],
            "lists": us["lists"] - us["floor"],
            "names": us["names"],
        }
        parts["rest"] = us["total"] - sum(parts.values())
        shares = " | ".join(
            f"{v:.1f} ({100 * v / us['total']:.0f}%)" for v in parts.values()
        )
        print(f"| {name} | {blocks} | {us['total']:.1f} | {shares} |")
    print()


def _trace_jobs(bench: WorkerBench) -> list[tuple[str, int, list[WorkerJob]]]:
    """The shipped traces' transfers (vLLM 0.33's own block ids), on
    llama-3.1-8b, block_size_factor the trace's blocks_per_chunk:
    TRACE_SAMPLE of each, evenly spaced."""
    from ptrres import GPULoadStoreSpec
    from ptrres.bench import TRACES, load_trace

    preset = PRESETS["llama-3.1-8b"]
    traces = []
    for trace_name in TRACES:
        trace = load_trace(trace_name)
        bsf = trace.blocks_per_chunk
        kv = preset.kv_caches(num_blocks=trace.num_gpu_blocks)
        picked = np.linspace(0, len(trace) - 1, TRACE_SAMPLE).round().astype(int)
        jobs = []
        for i in picked.tolist():
            transfer = trace.transfer(i)
            spec = GPULoadStoreSpec(
                transfer.gpu_ids, [len(transfer.gpu_ids)], [transfer.block_index]
            )
            jobs.append(bench.job(kv, spec, bsf))
        traces.append((trace_name, bsf, jobs))
    return traces


def _run_all(jobs: list[WorkerJob], patched: bool) -> None:
    for job in jobs:
        if patched:
            job.ptrres()
        else:
            job.vllm()


def _trace_table(traces: list[tuple[str, int, list[WorkerJob]]]) -> None:
    """The time of each trace's sampled transfers, one after the other."""
    from ptrres.bench import compare

    print(
        "| trace | block_size_factor | transfers | blocks | files | FileOps | "
        "vLLM ms | ptrres ms | speedup |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for trace_name, bsf, jobs in traces:
        t = compare(
            {
                "vllm": functools.partial(_run_all, jobs, False),
                "ptrres": functools.partial(_run_all, jobs, True),
            },
            seconds=2.0,
            rounds=9,
        )
        blocks = sum(int(job.ours.group_block_counts[0]) for job in jobs)
        files = sum(len(job.keys) for job in jobs)
        ops = sum(len(job.plan.sizes) for job in jobs)
        ms = {k: v.seconds * 1e3 for k, v in t.items()}
        print(
            f"| {trace_name} | {bsf} | {len(jobs)} | {blocks} | {files} | {ops} | "
            f"{ms['vllm']:.2f} | {ms['ptrres']:.2f} | "
            f"{ms['vllm'] / ms['ptrres']:.1f}x |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-worker", action="store_true")
    parser.add_argument("--quick", action="store_true")
    options = parser.parse_args()
    ptrres.warmup()
    if options.vllm_worker:
        vllm_worker(quick=options.quick)
    else:
        planning()
        executor()
