"""warmup() makes every kernel ready; afterwards no call compiles anything."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import warnings
from collections import Counter
from types import SimpleNamespace
from typing import Any

import numba
import numpy as np
import pytest
from conftest import JIT_DISABLED

import ptrres
import ptrres.nixl
from ptrres import _config, _warmup
from ptrres._config import KERNELS, argument_types


def exercise_every_kernel(id_dtype: type, tensor: Any = None) -> None:
    """Resolve, plan (both directions, merged or not), coalesce, from pointers.

    ``tensor`` holds the device blocks: 8 rows of 4 elements, of any dtype, a
    numpy array or a torch tensor (default: int8 numpy rows, padded by one).
    """
    if tensor is None:
        tensor = np.arange(8 * 5, dtype=np.int8).reshape(8, 5)[:, :4]
    page = 4 * tensor.itemsize
    kv = ptrres.CanonicalKVCaches(
        [ptrres.CanonicalKVCacheTensor(tensor, 0)],
        [[ptrres.CanonicalKVCacheRef(0, page)], []],
    )
    offloaded = ptrres.OffloadedLayout([np.zeros((4, 2 * page), np.uint8)], 2)
    spec = ptrres.GPULoadStoreSpec(np.array([1, 7], id_dtype), [2, 0], [0, 0])
    table = ptrres.PointerTable(kv)
    for out_dtype in (np.int64, np.uint64):
        out = tuple(np.zeros(2, out_dtype) for _ in range(3))
        table.resolve(spec, out=out[:2])
        for store in (True, False):
            for merge in (True, False):
                table.plan_transfer(
                    spec, offloaded, np.array([2], id_dtype), store=store,
                    coalesce=merge, out=out,
                )  # fmt: skip
        ptrres.coalesce(*out, max_run_bytes=64)
    device_ptrs = ptrres.resolve_device_pointers(spec, kv)
    table.plan_from_device_pointers(device_ptrs, offloaded, [2], store=True)
    ptrres.plan_file_ops(device_ptrs, 2, coalesce=True)
    file_plan = table.plan_file_ops(spec, 2, layout="block-major")
    # Peer plans and what NIXL takes of them (SPEC 14).
    peer = ptrres.PeerLayout.of(table)
    peer_plan = table.plan_peer_transfer(spec, peer, np.array([3, 4], id_dtype))
    ptrres.nixl.peer_xfer_descs(peer_plan, local=table, remote=peer)
    ptrres.nixl.file_xfer_descs(file_plan, [5], memory=table)
    ptrres.nixl.prepped_indices(table, spec.block_ids, spec.group_sizes)
    # vLLM's NixlConnector's descriptor ids (ptrres.vllm._nixl).
    from ptrres import _kernels

    ids = np.array([1, 7], np.int64)
    _kernels.desc_ids_kernel(
        ids, np.array([0, 2], np.int64), np.array([[-1, 0, 8]], np.int64), ids * 0
    )
    # Canonical and strided plans (SPEC 10).
    mapping = ptrres.CanonicalPageMapping(
        page, page, (ptrres.CopyRun(0, 0, 1, page, 1, 1),), 2, 1, False
    )
    kv.group_data_refs[0][0].mapping = mapping
    canonical = ptrres.OffloadedLayout(
        [np.zeros((4, 2 * page), np.uint8)], 2, canonical=True
    )
    table = ptrres.PointerTable(kv)
    for layout in (offloaded, canonical):
        table.plan_strided_transfer(spec, layout, np.array([2], id_dtype), store=True)
    table.plan_transfer(spec, canonical, [2], store=False, coalesce=True)
    # vLLM's simple offload path: copy_blocks' descriptors, merged or not.
    from ptrres.vllm._simple import CopyPlan, block_ids_array

    base = tensor.ctypes.data if isinstance(tensor, np.ndarray) else tensor.data_ptr()
    params = SimpleNamespace(
        src_bases=np.array([base], np.uint64),
        dst_bases=np.array([base], np.uint64),
        bpb=np.array([page], np.uint64),
        attrs=ctypes.c_uint(0),
        attrs_idx=ctypes.c_size_t(0),
        fail_idx=ctypes.c_size_t(0),
    )
    for merge in (False, True):
        plan = CopyPlan(params, {"0": tensor}, {"0": tensor}, coalesce=merge)
        ids = block_ids_array(np.array([1, 7], id_dtype), "src", plan.src_limit)
        plan.fill(ids, ids[::-1].copy())


def test_warmup_reports_every_kernel_signature() -> None:
    report = ptrres.warmup()
    expected = sum(len(signatures) for _, signatures in KERNELS)
    assert len(report.kernels) == expected
    assert {k.kernel for k in report.kernels} == {
        "resolve_kernel",
        "plan_kernel",
        "coalesce_kernel",
        "block_ids_from_pointers",
        "plan_file_ops_kernel",
        "canonical_plan_kernel",
        "copy_blocks_kernel",
        "copy_block_runs_kernel",
        "descriptor_rows_kernel",
        "prepped_indices_kernel",
        "desc_ids_kernel",
    }
    hows = {k.how for k in report.kernels}
    if JIT_DISABLED:
        assert hows == {"interpreted"}
    else:
        assert hows <= {"loaded", "compiled", "ready"}
    again = ptrres.warmup()
    assert {k.how for k in again.kernels} == (
        {"interpreted"} if JIT_DISABLED else {"ready"}
    )
    assert "kernel signatures" in str(again)


@pytest.mark.skipif(JIT_DISABLED, reason="nothing is compiled without the JIT")
def test_no_compilation_after_warmup_whatever_the_dtypes() -> None:
    ptrres.warmup()
    before = {id(d): len(d.overloads) for d, _ in KERNELS}
    for dtype in (np.int8, np.float16, np.float32, np.uint64):
        for id_dtype in (np.int32, np.int64, np.uint8, np.int16, np.uint64):
            tensor = np.zeros((8, 5), dtype)[:, :4]
            exercise_every_kernel(id_dtype, tensor)
    assert {id(d): len(d.overloads) for d, _ in KERNELS} == before
    # The kernels are closed: a dtype nobody converted fails loudly.
    from ptrres import _kernels

    with pytest.raises(TypeError):
        _kernels.resolve_kernel(
            np.zeros((1, 5), np.int64), np.zeros(2, np.int64), np.zeros(1, np.int16),
            np.ones(1, np.int64), np.zeros(1, np.uint64), np.zeros(1, np.uint64),
        )  # fmt: skip


@pytest.mark.needs_torch
@pytest.mark.skipif(JIT_DISABLED, reason="nothing is compiled without the JIT")
def test_no_compilation_after_warmup_with_torch_tensors() -> None:
    """Torch tensors of every dtype, bfloat16 included, read as numpy's do."""
    import torch
    from conftest import random_tensor

    ptrres.warmup()
    before = {id(d): len(d.overloads) for d, _ in KERNELS}
    for dtype in (torch.int8, torch.bfloat16, torch.float16, torch.float32):
        for id_dtype in (np.int32, np.int64, np.uint64):
            exercise_every_kernel(id_dtype, random_tensor(8, 4, 1, dtype, 0))
    assert {id(d): len(d.overloads) for d, _ in KERNELS} == before


# In a fresh interpreter: the steps of argv[1] in turn ("use": every kernel
# called, compiling on first use what is not in memory; "warmup"), then
# what was compiled, loaded, and made ready.
STEPS = """
import json, sys
import numpy as np
sys.path.insert(0, "tests")
import ptrres
from ptrres._config import KERNELS
from test_warmup import exercise_every_kernel
reports = []
for step in sys.argv[1].split(","):
    if step == "warmup":
        report = ptrres.warmup()
        hows = ("loaded", "compiled", "ready")
        reports.append({how: report.count(how) for how in hows})
    else:
        for id_dtype in (np.int32, np.int64):
            exercise_every_kernel(id_dtype)
print(json.dumps({
    "warmups": reports,
    "misses": sum(sum(d.stats.cache_misses.values()) for d, _ in KERNELS),
    "hits": sum(sum(d.stats.cache_hits.values()) for d, _ in KERNELS),
    "overloads": sum(len(d.overloads) for d, _ in KERNELS),
    "return_types": sorted({
        str(cres.signature.return_type)
        for d, _ in KERNELS for cres in d.overloads.values()
    }),
}))
"""
SIGNATURES = sum(len(signatures) for _, signatures in KERNELS)


def run_steps(steps: str, cache: str) -> dict[str, Any]:
    """STEPS in a fresh interpreter caching into ``cache``: what it printed."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    result = subprocess.run(
        [sys.executable, "-c", STEPS, steps],
        env=env,
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def cache_entries(cache: str) -> Counter[str]:
    """Numba's cached code per kernel: ``<module>.<kernel>-<line>.pyXY.<n>.nbc``
    files, under the cache's one directory per source directory."""
    return Counter(
        name.split(".")[1].rpartition("-")[0]
        for _, _, files in os.walk(cache)
        for name in files
        if name.endswith(".nbc")
    )


@pytest.mark.skipif(JIT_DISABLED, reason="nothing is compiled without the JIT")
@pytest.mark.parametrize(
    ("steps", "first_warmups"),
    [
        ("use,warmup", [{"loaded": 0, "compiled": 0, "ready": SIGNATURES}]),
        ("warmup,use", [{"loaded": 0, "compiled": SIGNATURES, "ready": 0}]),
        ("use", []),
    ],
)
def test_whatever_compiled_first_a_fresh_process_loads(
    tmp_path, steps: str, first_warmups: list[dict[str, int]]
) -> None:
    """Kernels compiled on first use, or by warmup(), before or after each
    other, are one cache entry per signature, which the next process loads
    whether it calls warmup() first or uses the kernels straight away: it
    compiles nothing. So each call compiles exactly a declared signature,
    and returns int64 as declared. (A call compiles for its arguments'
    types; warmup() once compiled the declared strings, which Numba cached
    apart.) Each process starts fresh, on the cache the first one filled."""
    cache = str(tmp_path)
    first = run_steps(steps, cache)
    assert first["warmups"] == first_warmups
    assert first["overloads"] == SIGNATURES
    assert first["return_types"] == ["int64"]
    # On an empty cache warmup() may fill it in workers, then load their work.
    assert first["misses"] + first["hits"] == SIGNATURES
    expected = {d.__name__: len(signatures) for d, signatures in KERNELS}
    assert cache_entries(cache) == expected
    warm = {"loaded": SIGNATURES, "compiled": 0, "ready": 0}
    assert run_steps("warmup,use", cache) == {
        "warmups": [warm], "misses": 0, "hits": SIGNATURES,
        "overloads": SIGNATURES, "return_types": ["int64"],
    }  # fmt: skip
    assert run_steps("use", cache) == {
        "warmups": [], "misses": 0, "hits": SIGNATURES,
        "overloads": SIGNATURES, "return_types": ["int64"],
    }  # fmt: skip
    assert cache_entries(cache) == expected


class FakeDispatcher:
    """Stands for a Numba dispatcher whose on-disk cache holds some signatures."""

    __name__ = "fake_kernel"

    def __init__(self, cached: set[str], cache_path: str | None = None) -> None:
        # Numba keys its cache by argument types: warmup() compiles those.
        self.cached = {argument_types(signature) for signature in cached}
        self.overloads: dict[tuple[Any, ...], object] = {}
        self.stats = SimpleNamespace(
            cache_path=cache_path, cache_hits=Counter(), cache_misses=Counter()
        )
        self.py_func = exercise_every_kernel  # any function of a real module
        self.closed = False

    def compile(self, signature: tuple[Any, ...]) -> None:
        if signature not in self.overloads:
            self.overloads[signature] = object()
            if signature in self.cached:
                self.stats.cache_hits[signature] += 1
            else:
                self.stats.cache_misses[signature] += 1

    def disable_compile(self) -> None:
        self.closed = True


def test_warmup_says_what_it_loaded_compiled_or_found_ready(monkeypatch) -> None:
    """The report's logic, on a stand-in dispatcher (also without the JIT)."""
    dispatcher = FakeDispatcher(cached={"int64(int64)"})
    signatures = ("int64(int64)", "int32(int32)", "int64(int64)")
    monkeypatch.setattr(_warmup, "KERNELS", [(dispatcher, signatures)])
    monkeypatch.setattr(_warmup, "_closed", set())
    report = ptrres.warmup()
    assert [k.how for k in report.kernels] == ["loaded", "compiled", "ready"]
    assert dispatcher.closed
    assert report.cache_dir is None  # the stand-in has no cache directory
    assert "3 kernel signatures (1 loaded, 1 compiled, 1 ready)" in str(report)
    again = ptrres.warmup()
    assert [k.how for k in again.kernels] == ["ready"] * 3
    assert again.count("ready") == 3


def test_nowhere_to_cache_compiles_uncached_with_one_warning(monkeypatch) -> None:
    """_config._jit() in process, with Numba refusing to cache (see
    test_install.py for the real thing, in a read-only install)."""
    options_seen = []

    def njit(**options: object):
        options_seen.append(options["cache"])
        if options["cache"]:
            raise RuntimeError("cannot cache function 'f': no locator available")
        return lambda function: function

    monkeypatch.setattr(numba, "njit", njit)  # as _config calls it
    monkeypatch.setattr(_config, "cache_refused", None)

    def kernel_function() -> int:
        return 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = [
            _config._jit(kernel_function, _config.JIT_OPTIONS) for _ in range(2)
        ]
    assert compiled == [kernel_function] * 2
    assert [w.category for w in caught] == [UserWarning]
    assert "cannot cache compiled kernels" in str(caught[0].message)
    assert "NUMBA_CACHE_DIR" in str(caught[0].message)
    assert _config.cache_refused is not None
    assert options_seen == [True, False, False]  # the second never tries to cache
    assert _warmup.cache_dir() is None
    assert _warmup._lock_path(FakeDispatcher(set(), "/tmp")) is None  # no lock either


def test_a_kernel_locked_by_another_process_is_left_to_it(tmp_path, monkeypatch):
    """The lock file of a kernel's cache entry: held, another holder is
    refused or waits; a holder that never lets go is waited for only
    WORKER_TIMEOUT; a cache without a directory locks nothing."""
    dispatcher = FakeDispatcher(set(), str(tmp_path))
    with _warmup._kernel_lock(dispatcher, wait=False) as held:
        assert held
        assert os.listdir(tmp_path) == ["test_warmup.fake_kernel.ptrres-lock"]
        with _warmup._kernel_lock(dispatcher, wait=False) as second:
            assert not second
        monkeypatch.setattr(_warmup, "WORKER_TIMEOUT", 0.05)
        with _warmup._kernel_lock(dispatcher, wait=True) as waited:
            assert waited  # gave up waiting: compiled as without a lock
    with _warmup._kernel_lock(dispatcher, wait=False) as again:
        assert again  # released when its holder was done
    no_cache = FakeDispatcher(set(), None)
    with _warmup._kernel_lock(no_cache, wait=False) as unlocked:
        assert unlocked
    read_only = FakeDispatcher(set(), str(tmp_path / "missing"))
    with _warmup._kernel_lock(read_only, wait=False) as unlocked:
        assert unlocked


def test_a_kernel_being_compiled_elsewhere_is_not_compiled_here(tmp_path, monkeypatch):
    """_compile_if_free() skips a kernel whose lock another process holds,
    and says whether it compiled (not loaded) what it took."""
    cached = FakeDispatcher({"int64(int64)"}, str(tmp_path))
    fresh = FakeDispatcher(set(), str(tmp_path))
    fresh.__name__ = "fresh_kernel"
    kernels = [(cached, ("int64(int64)",)), (fresh, ("int64(int64)",))]
    monkeypatch.setattr(_warmup, "KERNELS", kernels)
    assert not _warmup._compile_if_free(0)  # loaded: nothing compiled
    with _warmup._kernel_lock(fresh, wait=False):
        assert not _warmup._compile_if_free(1)
    assert fresh.overloads == {}
    assert _warmup._compile_if_free(1)
    assert list(fresh.overloads) == [argument_types("int64(int64)")]


def test_a_kernel_seems_cached_when_its_index_is_newer_than_its_source(tmp_path):
    """Whether to start workers: the kernel's Numba index file is there, and
    newer than its source (an edited kernel recompiles)."""
    dispatcher = FakeDispatcher(set(), str(tmp_path))
    assert not _warmup._probably_cached(dispatcher)
    version = f"py{sys.version_info[0]}{sys.version_info[1]}"
    index = tmp_path / f"test_warmup.exercise_every_kernel-27.{version}.nbi"
    index.write_bytes(b"")
    assert _warmup._probably_cached(dispatcher)
    source = os.stat(__file__).st_mtime
    os.utime(index, (source - 10, source - 10))
    assert not _warmup._probably_cached(dispatcher)
    assert not _warmup._probably_cached(FakeDispatcher(set(), None))


PARALLEL = """
import json, sys
import numpy as np
sys.path.insert(0, "tests")
import ptrres
from ptrres import reference
from ptrres._config import KERNELS
from test_warmup import exercise_every_kernel
if sys.argv[2] in ("threaded", "no-interpreter"):
    # Another thread: workers are fresh interpreters, not forks.
    import threading
    threading.Thread(target=threading.Event().wait, daemon=True).start()
if sys.argv[2] == "no-interpreter":
    sys.executable = "/nonexistent/python"
forks = ptrres._warmup.can_fork()
report = ptrres.warmup(processes=int(sys.argv[1]))
counts = {id(d): len(d.overloads) for d, _ in KERNELS}
for id_dtype in (np.int32, np.int64):
    exercise_every_kernel(id_dtype)
tensor = np.arange(64, dtype=np.int8).reshape(8, 8)
kv = ptrres.CanonicalKVCaches(
    [ptrres.CanonicalKVCacheTensor(tensor, 8)], [[ptrres.CanonicalKVCacheRef(0, 6)]]
)
spec = ptrres.GPULoadStoreSpec(np.array([5, 2, 7]))
ours = ptrres.PointerTable(kv).resolve(spec)
theirs = reference.resolve_device_pointers(spec, kv)
grown = [d.__name__ for d, _ in KERNELS if len(d.overloads) != counts[id(d)]]
print(json.dumps({
    "forks": forks,
    "processes": report.processes,
    "hows": sorted({k.how for k in report.kernels}),
    "compiled": sorted({k.kernel for k in report.kernels if k.how == "compiled"}),
    "compiled_after": grown,
    "same": ours.ptrs.tolist() == theirs.ptrs.tolist(),
}))
"""
KERNEL_NAMES = sorted(
    {getattr(dispatcher, "__name__", "") for dispatcher, _ in KERNELS}
)


def warm_up_in_fresh_processes(
    cache: str, processes: int, how: str = "", ranks: int = 1
) -> list[Any]:
    """warmup(processes=...) in ``ranks`` fresh interpreters started at once,
    caching into ``cache``; what each printed."""
    started = [
        subprocess.Popen(
            [sys.executable, "-c", PARALLEL, str(processes), how],
            env=dict(os.environ, NUMBA_CACHE_DIR=cache),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=os.path.dirname(os.path.dirname(__file__)),
        )
        for _ in range(ranks)
    ]
    results = []
    for process in started:
        out, err = process.communicate()
        assert process.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.skipif(JIT_DISABLED, reason="nothing is compiled without the JIT")
@pytest.mark.parametrize("how", ["", "threaded"])
def test_an_empty_cache_is_filled_by_several_processes(tmp_path, how: str) -> None:
    """Cold: two processes compile (a fork taking from the same queue, or a
    fresh interpreter when other threads run), and what the worker compiled
    is what this process runs. Warm: everything loads, nothing is spawned
    (the kernels still run right: exercise_every_kernel and the resolve
    against the reference)."""
    forks = how != "threaded"
    [cold] = warm_up_in_fresh_processes(str(tmp_path), 2, how)
    assert cold == {
        "forks": forks, "processes": 2, "hows": ["compiled"],
        "compiled": KERNEL_NAMES, "compiled_after": [], "same": True,
    }  # fmt: skip
    [warm] = warm_up_in_fresh_processes(str(tmp_path), 2, how)
    assert warm == {
        "forks": forks, "processes": 1, "hows": ["loaded"],
        "compiled": [], "compiled_after": [], "same": True,
    }  # fmt: skip


@pytest.mark.skipif(JIT_DISABLED, reason="nothing is compiled without the JIT")
def test_without_a_worker_everything_compiles_here(tmp_path) -> None:
    """A worker that cannot start (no interpreter to run, in a process whose
    other threads rule out a fork) costs only time: its share compiles here."""
    [report] = warm_up_in_fresh_processes(str(tmp_path), 2, "no-interpreter")
    assert report == {
        "forks": False, "processes": 1, "hows": ["compiled"],
        "compiled": KERNEL_NAMES, "compiled_after": [], "same": True,
    }  # fmt: skip


@pytest.mark.skipif(JIT_DISABLED, reason="nothing is compiled without the JIT")
def test_ranks_starting_together_compile_each_kernel_once(tmp_path) -> None:
    """Four processes on one empty cache (tensor-parallel ranks starting at
    once) all end ready and right, and between them compile every kernel
    exactly once: the others wait for its lock, then load it. A fifth then
    loads everything and compiles nothing."""
    ranks = warm_up_in_fresh_processes(str(tmp_path), 2, ranks=4)
    assert all(r["same"] and r["compiled_after"] == [] for r in ranks)
    compiled = sorted(name for r in ranks for name in r["compiled"])
    assert compiled == KERNEL_NAMES
    assert all(set(r["hows"]) <= {"compiled", "loaded"} for r in ranks)
    [fifth] = warm_up_in_fresh_processes(str(tmp_path), 2)
    assert (fifth["hows"], fifth["compiled"], fifth["same"]) == (["loaded"], [], True)
