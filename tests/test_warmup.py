"""warmup() makes every kernel ready; afterwards no call compiles anything."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import warnings
from collections import Counter
from types import SimpleNamespace
from typing import Any, cast

import numba
import numpy as np
import pytest
import torch
from conftest import JIT_DISABLED, random_tensor

import ptrres
from ptrres import _compilers, _config, _warmup
from ptrres._config import KERNELS


def exercise_every_kernel(id_dtype: type, dtype: torch.dtype = torch.int8) -> None:
    """Resolve, plan (both directions, merged or not), coalesce, from pointers."""
    tensor = random_tensor(8, 4, 1, dtype, 0)
    page = 4 * dtype.itemsize
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
    table.plan_file_ops(spec, 2, layout="block-major")
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
    for dtype in (torch.int8, torch.bfloat16, torch.float16, torch.float32):
        for id_dtype in (np.int32, np.int64, np.uint8, np.int16, np.uint64):
            exercise_every_kernel(id_dtype, dtype)
    assert {id(d): len(d.overloads) for d, _ in KERNELS} == before
    # The kernels are closed: a dtype nobody converted fails loudly.
    from ptrres import _kernels

    with pytest.raises(TypeError):
        _kernels.resolve_kernel(
            np.zeros((1, 5), np.int64), np.zeros(2, np.int64), np.zeros(1, np.int16),
            np.ones(1, np.int64), np.zeros(1, np.uint64), np.zeros(1, np.uint64),
        )  # fmt: skip


LAZY = """
import json, sys
import numpy as np
sys.path.insert(0, "tests")
from test_warmup import exercise_every_kernel
from numba.core import sigutils
from ptrres._config import KERNELS
for id_dtype in (np.int32, np.int64):
    exercise_every_kernel(id_dtype)
mismatches = []
for dispatcher, signatures in KERNELS:
    declared = {sigutils.normalize_signature(s) for s in signatures}
    declared = {(tuple(args), ret) for args, ret in declared}
    for args, cres in dispatcher.overloads.items():
        if (tuple(args), cres.signature.return_type) not in declared:
            mismatches.append(f"{dispatcher.__name__}{cres.signature}")
print(json.dumps(mismatches))
"""


@pytest.mark.skipif(JIT_DISABLED, reason="nothing is compiled without the JIT")
def test_compiling_lazily_gives_the_declared_signatures(tmp_path) -> None:
    """Without warmup(), each call compiles exactly a declared signature.

    Run in a fresh process with an empty Numba cache, so that nothing is
    loaded that an explicit signature compiled.
    """
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-c", LAZY],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


class FakeDispatcher:
    """Stands for a Numba dispatcher whose on-disk cache holds some signatures."""

    __name__ = "fake_kernel"

    def __init__(self, cached: set[str]) -> None:
        self.cached = cached
        self.overloads: dict[str, object] = {}
        self.stats = SimpleNamespace(cache_hits=Counter())
        self.closed = False
        self.calls: list[str] = []  # what was asked of it, in order
        self.typingctx = SimpleNamespace(refresh=lambda: self.calls.append("typing"))
        self.targetctx = SimpleNamespace(refresh=lambda: self.calls.append("target"))
        self._cache: FakeCache | None = None  # Numba's on-disk cache, if any

    def compile(self, signature: str) -> None:
        self.calls.append(signature)
        if self._cache is not None:
            self._cache.load_overload(signature, self.targetctx)
        if signature not in self.overloads:
            self.overloads[signature] = object()
            if signature in self.cached:
                self.stats.cache_hits[signature] += 1

    def disable_compile(self) -> None:
        self.closed = True


class FakeCache:
    """Numba's on-disk cache's load: a refresh of Numba's registries, then
    the load itself."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def load_overload(self, signature: str, target_context: object) -> None:
        self.calls.append("refresh")
        self._load_overload(signature, target_context)

    def _load_overload(self, signature: str, target_context: object) -> None:
        self.calls.append("load")

    def _guard_against_spurious_io_errors(self) -> Any:
        return contextlib.nullcontext()


def test_warmup_loads_without_numbas_refresh(monkeypatch) -> None:
    """warmup() loads from the cache without Numba's refresh of its
    registries (_warmup._loads_without_refresh), and leaves the cache's own
    load as it was."""
    dispatcher = FakeDispatcher(cached={"int64(int64)"})
    dispatcher._cache = FakeCache(dispatcher.calls)
    monkeypatch.setattr(_warmup, "KERNELS", [(dispatcher, ("int64(int64)",))])
    monkeypatch.setattr(_warmup, "_cached", lambda d, s: s in d.cached)
    ptrres.warmup(processes=1)
    assert dispatcher.calls == ["int64(int64)", "load"]
    dispatcher._cache.load_overload("int64(int64)", None)  # as it was
    assert dispatcher.calls[2:] == ["refresh", "load"]


def test_warmup_says_what_it_loaded_compiled_or_found_ready(monkeypatch) -> None:
    """The report's logic, on a stand-in dispatcher (also without the JIT)."""
    dispatcher = FakeDispatcher(cached={"int64(int64)"})
    signatures = ("int64(int64)", "int32(int32)", "int64(int64)")
    monkeypatch.setattr(_warmup, "KERNELS", [(dispatcher, signatures)])
    report = ptrres.warmup()
    assert [k.how for k in report.kernels] == ["loaded", "compiled", "ready"]
    assert dispatcher.closed
    assert "3 kernel signatures (1 loaded, 1 compiled, 1 ready)" in str(report)
    again = ptrres.warmup()
    assert [k.how for k in again.kernels] == ["ready"] * 3
    assert again.count("ready") == 3


@pytest.mark.parametrize("cached", [False, True])
def test_typing_registries_load_before_the_targets(monkeypatch, cached) -> None:
    """As Numba's compiler does, not as its cache lookup does: kernels type
    faster with the templates in that order (_warmup._load_registries). When
    every kernel is in the cache, nothing is compiled and neither loads."""
    dispatcher = FakeDispatcher(cached={"int64(int64)"} if cached else set())
    monkeypatch.setattr(_warmup, "KERNELS", [(dispatcher, ("int64(int64)",))])
    monkeypatch.setattr(_warmup, "_cached", lambda d, s: s in d.cached)
    ptrres.warmup(processes=1)
    registries = [] if cached else ["typing", "target"]
    assert dispatcher.calls == [*registries, "int64(int64)"]


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
# One of the modules Numba's target refresh imports: what compiling needs.
registries = "numba.np.linalg" in sys.modules
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
    "registries": registries,
    "processes": report.processes,
    "hows": sorted({k.how for k in report.kernels}),
    "compiled_after": grown,
    "same": ours.ptrs.tolist() == theirs.ptrs.tolist(),
}))
"""


def warm_up_in_a_fresh_process(cache: str, processes: int, how: str = "") -> Any:
    """warmup(processes=...) in a fresh interpreter caching into ``cache``."""
    result = subprocess.run(
        [sys.executable, "-c", PARALLEL, str(processes), how],
        env=dict(os.environ, NUMBA_CACHE_DIR=cache),
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(JIT_DISABLED, reason="nothing is compiled without the JIT")
@pytest.mark.parametrize("how", ["", "threaded"])
def test_an_empty_cache_is_filled_by_several_processes(tmp_path, how: str) -> None:
    """Cold: two processes compile (a fork taking from the same queue, or a
    fresh interpreter when other threads run), and what the worker compiled
    is what this process runs. Warm: everything loads, nothing is spawned,
    and Numba's compiling registries are never loaded (the kernels still run
    right: exercise_every_kernel and the resolve against the reference)."""
    forks = how != "threaded"
    cold = warm_up_in_a_fresh_process(str(tmp_path), 2, how)
    assert cold == {
        "forks": forks, "registries": True, "processes": 2, "hows": ["compiled"],
        "compiled_after": [], "same": True,
    }  # fmt: skip
    warm = warm_up_in_a_fresh_process(str(tmp_path), 2, how)
    assert warm == {
        "forks": forks, "registries": False, "processes": 1, "hows": ["loaded"],
        "compiled_after": [], "same": True,
    }  # fmt: skip


@pytest.mark.skipif(JIT_DISABLED, reason="nothing is compiled without the JIT")
def test_without_a_worker_everything_compiles_here(tmp_path) -> None:
    """A worker that cannot start (no interpreter to run, in a process whose
    other threads rule out a fork) costs only time: its share compiles here."""
    report = warm_up_in_a_fresh_process(str(tmp_path), 2, "no-interpreter")
    assert report == {
        "forks": False, "registries": True, "processes": 1, "hows": ["compiled"],
        "compiled_after": [], "same": True,
    }  # fmt: skip


def test_shares_split_every_signature_once() -> None:
    """Largest first, each to the cheapest share; never more shares than work."""
    if JIT_DISABLED:
        pytest.skip("kernels are plain functions without the JIT")
    missing = [(d, s) for d, signatures in KERNELS for s in signatures]
    for processes in (2, 3, len(missing) + 5):
        shares = _warmup._shares(missing, processes)
        assert len(shares) == min(processes, len(missing))
        assert all(shares)
        assert sorted((id(d), s) for share in shares for d, s in share) == sorted(
            (id(d), s) for d, s in missing
        )


def test_unreadable_cache_counts_as_cached() -> None:
    """An object whose cache cannot be read is left to the serial path."""
    assert _warmup._cached(FakeDispatcher(cached=set()), "int64(int64)")


def test_kernel_loops_unroll_only_where_asked(monkeypatch) -> None:
    """Kernels' LLVM options: Numba's level and loop vectoriser, loops
    unrolled and interleaved only for kernels that ask (the resolver)."""
    import llvmlite.binding as llvm

    tuning = _compilers._tuning_options(llvm)
    assert tuning is not None
    plain, unrolled = tuning(False), tuning(True)
    assert (plain.loop_unrolling, plain.loop_interleaving) == (False, False)
    assert (unrolled.loop_unrolling, unrolled.loop_interleaving) == (True, True)
    assert plain.loop_vectorization
    assert unrolled.loop_vectorization
    assert plain.speed_level == unrolled.speed_level == 3
    monkeypatch.setattr(numba.config, "OPT", 0)  # NUMBA_OPT=0 still applies
    assert tuning(False).speed_level == 0


@pytest.mark.skipif(JIT_DISABLED, reason="nothing is compiled without the JIT")
@pytest.mark.parametrize("refcounts", [False, True])
def test_kernels_skip_the_passes_they_do_not_need(refcounts: bool) -> None:
    """Numba's pipeline runs less the passes for features ptrres never uses,
    and less the marking of variables' deaths only without reference counts;
    what remains still types and lowers a function that runs."""
    from numba.core import compiler

    kernel_compiler, _, _ = _compilers.pipelines(refcounts=refcounts)
    options = {"pipeline_class": kernel_compiler, "_nrt": refcounts}
    add_one = numba.njit(**options)(lambda x: x + 1)
    assert add_one(41) == 42
    [overload] = add_one.overloads.values()
    [times] = overload.metadata["pipeline_times"].values()
    ran = {key.split("_", 1)[1] for key in times}

    def names(passes: frozenset[str]) -> set[str]:
        return {getattr(compiler, name)._name for name in passes}

    assert {"nopython_type_inference", "native_lowering"} <= ran
    assert not ran & names(_compilers.UNUSED_PASSES)
    assert (names(_compilers.REFCOUNTING_PASSES) <= ran) == refcounts


@pytest.mark.skipif(JIT_DISABLED, reason="nothing is compiled without the JIT")
def test_inline_helpers_are_compiled_into_callers_only() -> None:
    """A helper, and a helper's helper, run inside their caller; the JIT
    engine never generates code for them on their own, and the caller's
    library is a kernel's, optimised once (see ptrres._compilers). A Numba
    whose internals changed would make the pipelines None and every function
    a plain njit one: this says so."""
    assert _config.HELPER_PIPELINE is not None
    assert _config.KERNEL_PIPELINE is not None
    assert _config.JIT_OPTIONS["pipeline_class"] is _config.KERNEL_PIPELINE

    @_config.inline_helper
    def triple(value: int) -> int:
        return value * 3

    @_config.inline_helper
    def triple_plus_one(value: int) -> int:
        return triple(value) + 1

    def twice_that(value: int) -> int:
        return triple_plus_one(value) * 2

    caller = numba.njit(**dict(_config.JIT_OPTIONS, cache=False))(twice_that)
    assert caller(5) == 32
    for helper in (triple, triple_plus_one):
        (compiled,) = cast(Any, helper).overloads.values()
        engine = compiled.library.codegen._engine
        assert not engine.is_symbol_defined(compiled.fndesc.llvm_func_name)
    (compiled,) = caller.overloads.values()
    engine = compiled.library.codegen._engine
    assert engine.is_symbol_defined(compiled.fndesc.llvm_func_name)
    assert type(compiled.library).__name__ == "KernelLibrary"
