"""The patched constructor of what vLLM builds at engine start-up: kernels
made ready, the plans built, so that no transfer compiles or loads anything
(issue 21), in this process and in fresh ones, with the plugin loaded by
vLLM's own load_general_plugins(). On vLLM 0.30-0.33 that is the handler's
constructor; on 0.34 CPUOffloadingWorker's, which builds its three handlers
(they hold no GPU tensors) and one table of its KV caches.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_vllm_handler import assert_same, transfer, two_group_layout
from vllm_harness import (
    DEVICE_POINTERS,
    CopyEngine,
    Layout,
    PointerHandler,
    connector_resolve,
    specs,
    stubbed_vllm,
    worker,
)

import ptrres
import ptrres.vllm as plugin
from ptrres._config import KERNELS
from ptrres.vllm import _handler, _warmup

ROOT = Path(__file__).resolve().parents[2]
# What vLLM builds at engine start-up, whose constructor the plugin patches.
BUILT_AT_START = (
    worker.CPUOffloadingWorker
    if DEVICE_POINTERS
    else (worker.SingleDirectionOffloadingHandler)
)
JIT_DISABLED = os.environ.get("NUMBA_DISABLE_JIT", "0") not in ("", "0")
IDS = ([3, 4, 5, 9, 1, 2], [4, 2], [6, 1])  # as test_vllm_handler's
CPU_IDS = [5, 2, 7]


@pytest.fixture(autouse=True)
def _unpatched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    plugin.unpatch()
    monkeypatch.setattr(_warmup, "_warmup_logged", False)
    yield
    plugin.unpatch()


def start_up(layout: Layout, gpu_to_cpu: bool) -> Any:
    """The handler for this direction, built as at engine start-up: by its
    own constructor (0.30-0.33), or by CPUOffloadingWorker's (0.34), which
    is then behind a PointerHandler that resolves each transfer as the
    connector does (its module imported first, as vLLM's connector has)."""
    if not DEVICE_POINTERS:
        return layout.handler(gpu_to_cpu)
    connector_resolve()
    kv_caches = layout.kv_caches()
    offloading = worker.CPUOffloadingWorker(
        kv_caches=kv_caches,
        blocks_per_chunk=layout.blocks_per_chunk,
        num_cpu_chunks=layout.num_cpu_chunks,
    )
    handler = offloading._store_handler if gpu_to_cpu else offloading._load_handler
    return PointerHandler(handler, kv_caches)


def kernel_state() -> list[Any]:
    """What compiling or loading a kernel would change: each dispatcher's
    overloads and its cache hits and misses (public Numba attributes)."""
    return [
        (
            len(dispatcher.overloads),
            dict(dispatcher.stats.cache_hits),
            dict(dispatcher.stats.cache_misses),
        )
        if hasattr(dispatcher, "overloads")
        else dispatcher  # NUMBA_DISABLE_JIT=1: a plain function
        for dispatcher, _ in KERNELS
    ]


def test_the_constructor_warms_up_then_builds_the_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Kernels first, then each handler's plan: one handler per constructor
    on 0.30-0.33, the worker's three handlers on 0.34."""
    events: list[str] = []
    real_warmup = ptrres.warmup

    def recorded_warmup(**kwargs: Any) -> ptrres.WarmupReport:
        events.append("warmup")
        return real_warmup(**kwargs)

    class RecordedPlan(_handler.HandlerPlan):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            events.append("plan")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(_warmup, "warmup", recorded_warmup)
    monkeypatch.setattr(_handler, "HandlerPlan", RecordedPlan)
    built = ["warmup", *["plan"] * (3 if DEVICE_POINTERS else 1)]
    with stubbed_vllm():
        plugin.patch()
        handler = start_up(two_group_layout(), True)
        assert events == built
        plan = handler._ptrres_plan
        assert isinstance(plan, RecordedPlan)
        assert isinstance(plan.table, ptrres.PointerTable)
        assert isinstance(plan.offloaded, ptrres.OffloadedLayout)
        assert plan.offloaded.blocks_per_chunk == 4
        start_up(two_group_layout(), False)
    assert events == built * 2


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_after_the_constructor_the_first_transfer_compiles_nothing(
    gpu_to_cpu: bool,
) -> None:
    engine = CopyEngine()
    with stubbed_vllm(engine):
        plugin.patch()
        handler = start_up(two_group_layout(), gpu_to_cpu)
        src, dst = specs(*IDS, CPU_IDS, gpu_to_cpu=gpu_to_cpu)
        before, modules = kernel_state(), set(sys.modules)
        got = transfer(handler, engine, 1, src, dst)
        assert kernel_state() == before
        assert set(sys.modules) == modules
        # vLLM's own fill, on the same handler, gives the same descriptors.
        plugin.unpatch()
        assert_same(transfer(handler, engine, 2, src, dst), got)
    if not JIT_DISABLED:  # every signature of every kernel is in memory
        assert [s[0] for s in before] == [len(sigs) for _, sigs in KERNELS]


def test_warmup_is_logged_once_per_process(caplog: pytest.LogCaptureFixture) -> None:
    with stubbed_vllm(), caplog.at_level(logging.DEBUG, logger="ptrres.vllm"):
        plugin.patch()
        start_up(two_group_layout(), True)
        start_up(two_group_layout(), False)
    lines = [r for r in caplog.records if "ptrres warmup:" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.INFO, logging.DEBUG]
    how = "interpreted" if JIT_DISABLED else "(loaded|compiled|ready)"
    assert re.fullmatch(
        rf"ptrres warmup: {sum(len(s) for _, s in KERNELS)} kernel signatures "
        rf"\(\d+ {how}.*\) in \d+\.\d\d s.*, before vLLM's first KV offload",
        lines[0].getMessage(),
    )


def test_register_alone_compiles_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The API server registers the plugin and builds no handler: it pays
    nothing for the kernels."""

    def no_warmup(**kwargs: Any) -> Any:
        raise AssertionError("register() must not warm up")

    monkeypatch.setattr(_warmup, "warmup", no_warmup)
    monkeypatch.delenv("PTRRES_VLLM", raising=False)
    plugin.register()
    assert plugin.is_patched()


def test_ptrres_vllm_0_builds_vllms_handler_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_warmup(**kwargs: Any) -> Any:
        raise AssertionError("PTRRES_VLLM=0 must not warm up")

    monkeypatch.setattr(_warmup, "warmup", no_warmup)
    monkeypatch.setenv("PTRRES_VLLM", "0")
    plugin.register()
    with stubbed_vllm():
        handler = start_up(two_group_layout(), True)
    assert not hasattr(handler, "_ptrres_plan")


def test_a_handler_built_after_unpatch_is_vllms_alone() -> None:
    vllm_init = vars(BUILT_AT_START)["__init__"]
    with stubbed_vllm():
        plugin.patch()
        plugin.unpatch()
        handler = start_up(two_group_layout(), True)
    assert not hasattr(handler, "_ptrres_plan")
    assert vars(BUILT_AT_START)["__init__"] is vllm_init


@pytest.mark.parametrize("failure", ["warmup", "attribute"])
def test_a_handler_ptrres_cannot_plan_for_keeps_vllms_transfers(
    failure: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A kernel that does not compile, or a handler without an attribute the
    patched transfer reads: vLLM builds, and its transfers stay vLLM's."""
    if failure == "warmup":

        def broken_warmup(**kwargs: Any) -> Any:
            raise RuntimeError("no compiler here")

        monkeypatch.setattr(_warmup, "warmup", broken_warmup)
        # 0.34: the worker makes the kernels ready for its handlers.
        owner = BUILT_AT_START.__name__
        reason = "no compiler here"
    else:
        # What the handler's form requires of it (0.34's is a module's own).
        form, name = (
            (
                importlib.import_module("ptrres.vllm._handler_pointers"),
                "_HANDLER_034_ATTRIBUTES",
            )
            if DEVICE_POINTERS
            else (_handler, "_HANDLER_ATTRIBUTES")
        )
        monkeypatch.setattr(form, name, (*getattr(form, name), "_no_such_pool"))
        owner = "SingleDirectionOffloadingHandler"
        reason = "the handler has no _no_such_pool"
    engine = CopyEngine()
    fills: list[int] = []
    with stubbed_vllm(engine), caplog.at_level(logging.WARNING, logger="ptrres"):
        src, dst = specs(*IDS, CPU_IDS, gpu_to_cpu=True)
        plugin.patch()
        handler = start_up(two_group_layout(), True)
        assert handler._ptrres_plan == _handler.DECLINED
        original_fill = handler._fill_group_ops

        def counted_fill(*args: Any, **kwargs: Any) -> Any:
            fills.append(1)
            return original_fill(*args, **kwargs)

        monkeypatch.setattr(handler, "_fill_group_ops", counted_fill)
        transfer(handler, engine, 1, src, dst)
    assert fills == [1, 1]  # vLLM filled both groups
    assert f"this {owner} keeps vLLM's own transfers: {reason}" in caplog.text


# --- a fresh process, the plugin loaded by vLLM ---------------------------------

# Loads the plugin as vLLM does, builds vLLM's handler, and reports what the
# first transfer changed in the kernels, which modules it imported (under
# numpy 2, Numba's first look at an array imports numpy.ma), and whether its
# descriptors are vLLM's.
FRESH_PROCESS = """
import json, logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
import vllm.plugins
vllm.plugins.load_general_plugins()
import ptrres.vllm as plugin
from test_vllm_startup import kernel_state, start_up, IDS, CPU_IDS
from test_vllm_handler import transfer, two_group_layout
from vllm_harness import CopyEngine, specs, stubbed_vllm
engine = CopyEngine()
with stubbed_vllm(engine):
    start = time.perf_counter()
    handler = start_up(two_group_layout(), True)
    built = time.perf_counter() - start
    src, dst = specs(*IDS, CPU_IDS, gpu_to_cpu=True)
    before, modules = kernel_state(), set(sys.modules)
    start = time.perf_counter()
    ours = transfer(handler, engine, 1, src, dst)
    first = time.perf_counter() - start
    after, imported = kernel_state(), sorted(set(sys.modules) - modules)
    patched = plugin.is_patched()
    plugin.unpatch()
    vllms = transfer(handler, engine, 2, src, dst)
print(json.dumps({
    "patched": patched,
    "unchanged": before == after,
    "imported": imported,
    "same": [a.tobytes() for a in ours[0]] == [a.tobytes() for a in vllms[0]]
    and ours[1] == vllms[1],
    "seconds": {"constructor": built, "first_transfer": first},
}))
"""


def vllm_sees_the_entry_point() -> bool:
    return any(
        ep.name == "ptrres" and ep.value == "ptrres.vllm:register"
        for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
    )


def run_fresh(cache: Path) -> tuple[dict[str, Any], str]:
    env = {
        **os.environ,
        "NUMBA_CACHE_DIR": str(cache),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "vllm")]),
    }
    for name in ("PTRRES_VLLM", "PTRRES_VLLM_COALESCE", "VLLM_PLUGINS"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1]), result.stderr


def warmup_counts(log: str) -> dict[str, int]:
    """How many kernel signatures the warmup log line says went which way."""
    (line,) = [line for line in log.splitlines() if "ptrres warmup:" in line]
    counts = re.search(r"kernel signatures \(([^)]*)\)", line)
    assert counts is not None, line
    return {how: int(n) for n, how in re.findall(r"(\d+) ([a-z]+)", counts[1])}


def test_in_a_fresh_process_the_first_transfer_compiles_nothing(
    tmp_path: Path,
) -> None:
    """On an empty Numba cache, then on the cache that run filled: vLLM's
    loader patches, the constructor makes every kernel ready, and the first
    transfer compiles and loads nothing and gives vLLM's descriptors."""
    if not vllm_sees_the_entry_point():
        pytest.skip("ptrres is not installed here, so vLLM cannot find it")
    cache = tmp_path / "numba-cache"
    cold, cold_log = run_fresh(cache)
    # Without the JIT there is no cache to warm: one run says it all.
    warm, warm_log = (cold, cold_log) if JIT_DISABLED else run_fresh(cache)
    for report, log in ((cold, cold_log), (warm, warm_log)):
        assert report["patched"], log
        assert report["unchanged"], log
        assert report["imported"] == [], log
        assert report["same"], log
        # register()'s line for the handler's path, through vLLM's loader.
        assert "'s offloading handler: patched " in log
    import ptrres._kernels  # noqa: F401  (KERNELS fills as the kernels are defined)

    signatures = sum(len(s) for _, s in KERNELS)
    if JIT_DISABLED:
        assert warmup_counts(cold_log) == {"interpreted": signatures}
        return
    assert warmup_counts(cold_log) == {"compiled": signatures}
    assert warmup_counts(warm_log) == {"loaded": signatures}
