"""The patched handler's constructor: kernels made ready, the plan built, so
that no transfer compiles or loads anything (issue 21), in this process and
in fresh ones, with the plugin loaded by vLLM's own load_general_plugins().
"""

from __future__ import annotations

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
from vllm_harness import CopyEngine, specs, stubbed_vllm, worker

import ptrres
import ptrres.vllm as plugin
from ptrres._config import KERNELS
from ptrres.vllm import _handler, _warmup

ROOT = Path(__file__).resolve().parents[2]
JIT_DISABLED = os.environ.get("NUMBA_DISABLE_JIT", "0") not in ("", "0")
IDS = ([3, 4, 5, 9, 1, 2], [4, 2], [6, 1])  # as test_vllm_handler's
CPU_IDS = [5, 2, 7]


@pytest.fixture(autouse=True)
def _unpatched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    plugin.unpatch()
    monkeypatch.setattr(_warmup, "_warmup_logged", False)
    yield
    plugin.unpatch()


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
    events: list[str] = []
    real_warmup, real_plan = ptrres.warmup, _handler._handler_plan

    def recorded_warmup(**kwargs: Any) -> ptrres.WarmupReport:
        events.append("warmup")
        return real_warmup(**kwargs)

    def recorded_plan(handler: Any) -> Any:
        events.append("plan")
        return real_plan(handler)

    monkeypatch.setattr(_warmup, "warmup", recorded_warmup)
    monkeypatch.setattr(_handler, "_handler_plan", recorded_plan)
    with stubbed_vllm():
        plugin.patch()
        handler = two_group_layout().handler(True)
        assert events == ["warmup", "plan"]
        plan = handler._ptrres_plan
        assert isinstance(plan.table, ptrres.PointerTable)
        assert isinstance(plan.offloaded, ptrres.OffloadedLayout)
        assert plan.offloaded.blocks_per_chunk == 4
        two_group_layout().handler(False)
    assert events == ["warmup", "plan", "warmup", "plan"]


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_after_the_constructor_the_first_transfer_compiles_nothing(
    gpu_to_cpu: bool,
) -> None:
    engine = CopyEngine()
    with stubbed_vllm(engine):
        plugin.patch()
        handler = two_group_layout().handler(gpu_to_cpu)
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
        two_group_layout().handler(True)
        two_group_layout().handler(False)
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
        handler = two_group_layout().handler(True)
    assert not hasattr(handler, "_ptrres_plan")


def test_a_handler_built_after_unpatch_is_vllms_alone() -> None:
    with stubbed_vllm():
        plugin.patch()
        plugin.unpatch()
        handler = two_group_layout().handler(True)
    assert not hasattr(handler, "_ptrres_plan")
    assert (
        type(handler).__init__
        is vars(worker.SingleDirectionOffloadingHandler)["__init__"]
    )


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
        reason = "no compiler here"
    else:
        attributes = (*_handler._HANDLER_ATTRIBUTES, "_no_such_pool")
        monkeypatch.setattr(_handler, "_HANDLER_ATTRIBUTES", attributes)
        reason = "the handler has no _no_such_pool"
    engine = CopyEngine()
    fills: list[int] = []
    with stubbed_vllm(engine), caplog.at_level(logging.WARNING, logger="ptrres"):
        src, dst = specs(*IDS, CPU_IDS, gpu_to_cpu=True)
        plugin.patch()
        handler = two_group_layout().handler(True)
        assert handler._ptrres_plan == _handler._DECLINED
        original_fill = handler._fill_group_ops

        def counted_fill(*args: Any, **kwargs: Any) -> Any:
            fills.append(1)
            return original_fill(*args, **kwargs)

        monkeypatch.setattr(handler, "_fill_group_ops", counted_fill)
        transfer(handler, engine, 1, src, dst)
    assert fills == [1, 1]  # vLLM filled both groups
    assert f"keeps vLLM's own transfers: {reason}" in caplog.text


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
from ptrres.vllm import _handler
from test_vllm_startup import kernel_state, IDS, CPU_IDS
from test_vllm_handler import transfer, two_group_layout
from vllm_harness import CopyEngine, specs, stubbed_vllm
engine = CopyEngine()
with stubbed_vllm(engine):
    start = time.perf_counter()
    handler = two_group_layout().handler(True)
    built = time.perf_counter() - start
    src, dst = specs(*IDS, CPU_IDS, gpu_to_cpu=True)
    before, modules = kernel_state(), set(sys.modules)
    start = time.perf_counter()
    ours = transfer(handler, engine, 1, src, dst)
    first = time.perf_counter() - start
    after, imported = kernel_state(), sorted(set(sys.modules) - modules)
    vllms = _handler.vllm_transfer_async(handler, 2, src, dst)
    handler.get_finished()
print(json.dumps({
    "patched": plugin.is_patched(),
    "unchanged": before == after,
    "imported": imported,
    "same": [a.tobytes() for a in ours[0]]
    == [engine.calls[-1].src.tobytes(), engine.calls[-1].dst.tobytes(),
        engine.calls[-1].sizes.tobytes()],
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
