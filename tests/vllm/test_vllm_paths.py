"""Each of vLLM's paths patched on its own (issue 35, item 3): when vLLM
imports that path's modules, importing no other path's; left alone on its
own where its guard trips, the others patched; every combination of the
PTRRES_VLLM* switches; what ``ptrres check`` says of each path, including in
a trimmed vLLM where the NIXL connector cannot be imported.
"""

from __future__ import annotations

import importlib
import io
import itertools
import json
import logging
import os
import re
import subprocess
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nixl_worker import base_worker
from vllm_harness import copy_backend, cuda_mem_ops, disk_backend, worker

import ptrres.vllm as plugin
from ptrres.vllm import _check, _hook, _patching, _state
from ptrres.vllm._release import PATH_MODULES, PATH_TRIGGERS, release_series
from ptrres.vllm._state import HANDLER, NIXL, PATHS, SIMPLE

ROOT = Path(__file__).resolve().parents[2]
Handler = worker.SingleDirectionOffloadingHandler
Base = base_worker.NixlBaseConnectorWorker
NIXL_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
SWITCHES = ("PTRRES_VLLM", "PTRRES_VLLM_NIXL", "PTRRES_VLLM_COALESCE")


@pytest.fixture(autouse=True)
def _unpatched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts and ends unpatched, the switches unset."""
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    plugin.unpatch()
    _patching._warned.clear()
    yield
    plugin.unpatch()


def _replaced() -> dict[tuple[int, str], tuple[Any, str, str, str]]:
    """Every attribute a path replaces, by owner and name: its owner, its
    name, its path and its qualified name (each path's plan, made without
    applying it)."""
    series, refusal = release_series()
    assert series is not None, refusal
    found = {}
    for path in PATHS:
        replacements, refusal = _patching.plan_path(path, series)
        assert refusal is None, refusal
        for r in replacements:
            found[id(r.owner), r.name] = (r.owner, r.name, path, r.qualified_name)
    return found


# Collected once, unpatched (tests change the plans and the attributes).
REPLACED = _replaced()


def attributes() -> dict[tuple[int, str], Any]:
    """Every attribute any path replaces, as it is now."""
    return {key: _current(owner, name) for key, (owner, name, *_) in REPLACED.items()}


def _current(owner: Any, name: str) -> Any:
    return vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)


def states() -> dict[str, str]:
    return {s.path: s.status for s in _patching.path_states()}


# --- each path imported alone, in a fresh process -----------------------------------

# register() as vLLM's loader calls it, before any vLLM module; then vLLM,
# then one module of one path, as vLLM imports it. What the process imported
# of each path, and where each path stands.
ALONE = """
import importlib, json, sys
import ptrres.vllm
ptrres.vllm.register()
registered = sorted(m for m in ("vllm", "numba", "ptrres._kernels") if m in sys.modules)
import vllm
from ptrres.vllm import _patching
from ptrres.vllm._release import PATH_MODULES
importlib.import_module(sys.argv[1])
print(json.dumps({
    "registered": registered,
    "states": {s.path: s.status for s in _patching.path_states()},
    "imported": {
        path: [m for m in modules if m in sys.modules]
        for path, modules in PATH_MODULES.items()
    },
    "numba": "numba" in sys.modules,
    "hook": [type(f).__name__ for f in sys.meta_path].count("PatchOnImport"),
}))
"""


def python_env(**switches: str) -> dict[str, str]:
    """This environment, the switches unset but for ``switches``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PTRRES_VLLM")}
    environ.pop("VLLM_PLUGINS", None)
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "vllm")])
    environ.update(switches)
    return environ


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter, the switches unset."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=python_env(),
        cwd=ROOT,
        timeout=300,
    )


def run_both(code: str, *args: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``code``'s last line of JSON, with the plugin on and off (PTRRES_VLLM=0),
    in two fresh interpreters at once."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=python_env(PTRRES_VLLM=switch),
            cwd=ROOT,
        )
        for switch in ("1", "0")
    ]
    reports = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
        reports.append(json.loads(out.splitlines()[-1]))
    return reports[0], reports[1]


@pytest.mark.parametrize(
    ("path", "module"),
    [
        (HANDLER, "vllm.v1.kv_offload.cpu.gpu_worker"),
        (SIMPLE, "vllm.v1.simple_kv_offload.copy_backend"),
        (NIXL, f"{NIXL_PACKAGE}.push_worker"),
        (NIXL, f"{NIXL_PACKAGE}.connector"),  # what vLLM imports: both workers
    ],
)
def test_each_path_imported_alone_is_patched_alone(path: str, module: str) -> None:
    """Only that path is patched, and the plugin imports no other path's
    module (vLLM's NIXL workers import cuda_mem_ops themselves, for
    pin_tensor: as many with the plugin off); the hook waits for the other
    paths. Nothing of numba."""
    report, without = run_both(ALONE, module)
    assert report["registered"] == []  # register() imports neither vLLM nor numba
    assert report["states"] == {
        other: "patched" if other == path else "waiting" for other in PATHS
    }
    assert without["states"] == dict.fromkeys(PATHS, "off")
    own = [m for m in PATH_MODULES[path] if m != "vllm.v1.kv_offload.pointer_utils"]
    assert report["imported"][path] == own
    for other in PATHS:
        if other != path:
            assert report["imported"][other] == without["imported"][other]
            assert not set(report["imported"][other]) & set(PATH_TRIGGERS[other])
    assert report["numba"] is False
    assert report["hook"] == 1  # still waiting for the other paths


# vLLM imports each path in turn: each is patched then, and the hook leaves
# once none waits.
IN_TURN = """
import importlib, json, sys
import vllm, ptrres.vllm
from ptrres.vllm import _patching
from ptrres.vllm._release import PATH_TRIGGERS
ptrres.vllm.register()
seen = []
for path, triggers in PATH_TRIGGERS.items():
    importlib.import_module(triggers[0])
    seen.append({
        "states": [s.status for s in _patching.path_states()],
        "hook": [type(f).__name__ for f in sys.meta_path].count("PatchOnImport"),
    })
print(json.dumps(seen))
"""


def test_paths_imported_in_turn_are_patched_in_turn() -> None:
    result = run_python(IN_TURN)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == [
        {"states": ["patched", "waiting", "waiting"], "hook": 1},
        {"states": ["patched", "patched", "waiting"], "hook": 1},
        {"states": ["patched", "patched", "patched"], "hook": 0},
    ]


# --- each path's guard, tripped in turn -----------------------------------------------


def changed(*args: Any, out: Any = None) -> Any:
    """A stand-in for a vLLM method or function with another signature."""
    raise AssertionError("never called")


# Per path: an attribute its guard checks, and the reason it then gives.
GUARDS = {
    HANDLER: (Handler, "transfer_async", "transfer_async has the signature"),
    SIMPLE: (cuda_mem_ops, "copy_blocks", "copy_blocks has the signature"),
    NIXL: (Base, "_compute_desc_ids", "_compute_desc_ids has the signature"),
}


@pytest.mark.parametrize("how", ["patch", "register"])
@pytest.mark.parametrize("path", PATHS)
def test_a_paths_guard_leaves_it_alone_and_patches_the_others(
    path: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One warning naming the path and why; none of its attributes replaced
    (all or nothing within it); every other path patched; unpatch() then
    restores every attribute to the very object it was."""
    owner, name, reason = GUARDS[path]
    vllms = attributes()
    monkeypatch.setattr(owner, name, changed)
    before = attributes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "patch":
            plugin.patch()
        else:
            plugin.register()
    messages = [str(w.message) for w in caught if w.category is plugin.VllmPatchWarning]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"ptrres.vllm left vLLM's {path} unpatched: ")
    assert reason in messages[0]
    assert states() == {
        other: "left alone" if other == path else "patched" for other in PATHS
    }
    (refusal,) = next(s for s in _patching.path_states() if s.path == path).detail
    assert reason in refusal
    after = attributes()
    replaced = {key for key in before if after[key] is not before[key]}
    theirs = {key for key, (_, _, other, _) in REPLACED.items() if other != path}
    assert replaced == theirs  # the other paths' attributes, and only those
    assert _current(owner, name) is changed
    plugin.unpatch()
    restored = attributes()
    assert all(restored[key] is before[key] for key in before)
    monkeypatch.undo()
    assert all(attributes()[key] is vllms[key] for key in vllms)


class ReadOnly(types.ModuleType):
    """A module whose attribute ``frozen`` cannot be set."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "frozen":
            raise AttributeError("frozen is read-only")
        super().__setattr__(name, value)


@pytest.mark.parametrize("path", PATHS)
def test_a_path_whose_last_attribute_cannot_be_set_is_left_whole(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never half-patched: every attribute the path had replaced before the
    failing one is restored; the other paths are patched."""
    real_plan = _patching.plan_path
    frozen = ReadOnly("frozen_owner")

    def plan_with_a_frozen_attribute(which: str, series: str) -> Any:
        replacements, refusal = real_plan(which, series)
        if which == path:
            replacements = [
                *replacements,
                _state.Replacement(frozen, "frozen", None, object()),
            ]
        return replacements, refusal

    monkeypatch.setattr(_patching, "plan_path", plan_with_a_frozen_attribute)
    before = attributes()
    with pytest.warns(plugin.VllmPatchWarning, match=f"vLLM's {path} unpatched: "):
        patched = plugin.patch()
    assert states() == {
        other: "left alone" if other == path else "patched" for other in PATHS
    }
    after = attributes()
    for key, (_, _, which, qualified) in REPLACED.items():
        assert (after[key] is before[key]) == (which == path), qualified
        assert (qualified in patched) == (which != path)
    plugin.unpatch()
    assert all(attributes()[key] is before[key] for key in before)


def test_an_untested_release_leaves_every_path_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import vllm

    before = attributes()
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with pytest.warns(plugin.VllmPatchWarning) as caught:
        assert plugin.patch() == []
    assert [str(w.message) for w in caught] == [
        "ptrres.vllm left vLLM unpatched: vLLM 0.34.0 is not a tested version "
        "(0.30.x, 0.31.x, 0.32.x, 0.33.x)"
    ]
    assert states() == dict.fromkeys(PATHS, "left alone")
    monkeypatch.undo()
    assert all(attributes()[key] is before[key] for key in before)


# --- the switches, every combination -------------------------------------------------


@pytest.mark.parametrize(
    ("vllm", "nixl", "coalesce"), list(itertools.product(("1", "0"), repeat=3))
)
def test_every_combination_of_the_switches(
    vllm: str,
    nixl: str,
    coalesce: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """register() (vLLM's modules imported already: at once) and `ptrres
    check`'s lines agree with what each switch says, path by path."""
    monkeypatch.setenv("PTRRES_VLLM", vllm)
    monkeypatch.setenv("PTRRES_VLLM_NIXL", nixl)
    monkeypatch.setenv("PTRRES_VLLM_COALESCE", coalesce)
    expected = {
        HANDLER: "patched" if vllm == "1" else "off",
        SIMPLE: "patched" if vllm == "1" else "off",
        NIXL: "patched" if vllm == "1" and nixl == "1" else "off",
    }
    before = attributes()
    with caplog.at_level(logging.INFO, logger="ptrres.vllm"):
        plugin.register()
    assert states() == expected
    lines = {
        path: r.getMessage()
        for r in caplog.records
        for path in PATHS
        if f"'s {path}: patched " in r.getMessage()
    }
    assert set(lines) == {p for p, s in expected.items() if s == "patched"}
    for path, line in lines.items():
        assert line.endswith(
            "(coalescing on); kernels are made ready at engine start-up"
            if coalesce == "1" and path != NIXL
            else "_blocks; kernels are made ready at engine start-up"
            if path != HANDLER
            else "transfer_async; kernels are made ready at engine start-up"
        ), line
    assert _state.coalesce_requested() == (coalesce == "1")
    assert _hook.PatchOnImport.installed is None  # nothing left to wait for
    after = attributes()
    for key, (_, _, path, _) in REPLACED.items():
        assert (after[key] is not before[key]) == (expected[path] == "patched")

    plugin.unpatch()
    findings = {f.topic: f.status for f in _check.path_findings()}
    assert findings == {
        path: "ok" if status == "patched" else "off"
        for path, status in expected.items()
    }
    assert not plugin.is_patched()  # check restores what it patched
    assert all(attributes()[key] is before[key] for key in before)


# --- ptrres check, path by path ----------------------------------------------------


def test_check_shows_a_waiting_path_as_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a process where the plugin waits for vLLM (register() done, the
    path's modules not imported), check shows where each path stands, and
    changes nothing."""
    monkeypatch.setattr(
        _patching,
        "PATH_TRIGGERS",
        {**PATH_TRIGGERS, NIXL: ("ptrres_never_imported_pull_worker",)},
    )
    monkeypatch.setenv("PTRRES_VLLM_NIXL", "1")
    plugin.register()
    findings = {f.topic: (f.status, f.detail) for f in _check.path_findings()}
    assert findings[NIXL] == (
        "wait",
        "waiting for vLLM to import it (ptrres_never_imported_pull_worker); "
        "patched then",
    )
    assert findings[HANDLER][0] == findings[SIMPLE][0] == "ok"
    assert states()[NIXL] == "waiting"  # check left the process as it was
    status, line = _check.summary(list(_check.path_findings()))
    assert (status, line) == (
        0,
        "The plugin will patch vLLM in every process vLLM starts.",
    )


def check_lines(text: str) -> dict[str, tuple[str, str]]:
    """`ptrres check`'s findings by topic: (status, detail)."""
    findings = {}
    for line in text.splitlines()[1:-1]:
        status, rest = line.split(maxsplit=1)
        topic, detail = re.split(r"\s{2,}", rest, maxsplit=1)
        findings[topic] = (status, detail)
    return findings


def test_check_shows_one_line_per_path() -> None:
    from ptrres._operator import check_command

    out = io.StringIO()
    check_command(out, kernels=False)
    topics = list(check_lines(out.getvalue()))
    assert [t for t in topics if t in PATHS] == list(PATHS)
    assert topics.index(NIXL) + 1 == topics.index("PTRRES_VLLM")


# In a trimmed vLLM: transformers cannot be imported (as where vLLM is
# installed --no-deps with only what its offloading workers import), and so
# neither can the NIXL connector. "check": `ptrres check`, ptrres's entry
# point visible to vLLM; "vllm": the plugin registered, then vLLM's imports
# of each path.
TRIMMED = """
import importlib.abc, importlib.metadata, io, json, sys, warnings

class NoTransformers(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" or name.startswith("transformers."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoTransformers())
if sys.argv[1] == "check":
    real = importlib.metadata.entry_points
    group = "vllm.general_plugins"
    if not any(ep.value == "ptrres.vllm:register" for ep in real(group=group)):
        ours = importlib.metadata.EntryPoint("ptrres", "ptrres.vllm:register", group)
        importlib.metadata.entry_points = (
            lambda **selection: [ours] if selection.get("group") == group
            else real(**selection)
        )
    from ptrres._operator import check_command
    out = io.StringIO()
    status = check_command(out, kernels=False)
    # vLLM's own log lines may go to stdout too: the report is the last line.
    print(json.dumps({"status": status, "text": out.getvalue()}))
    sys.exit()
import ptrres.vllm
from ptrres.vllm import _patching
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ptrres.vllm.register()
    import vllm.v1.kv_offload.cpu.gpu_worker
    import vllm.v1.simple_kv_offload.copy_backend
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector
        nixl = "imported"
    except ImportError as error:
        nixl = repr(error)
print(json.dumps({
    "states": {s.path: s.status for s in _patching.path_states()},
    "nixl": nixl,
    "warnings": [str(w.message) for w in caught],
}))
"""


def test_in_a_trimmed_vllm_check_shows_the_nixl_connector_left_alone() -> None:
    """Without transformers the NIXL connector cannot be imported: check
    says it is left alone, and why, and the offloading paths patched."""
    result = run_python(TRIMMED, "check")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    text = report["text"].splitlines()
    findings = check_lines(report["text"])
    assert findings[HANDLER][0] == "ok"
    assert findings[SIMPLE][0] == "ok"
    assert findings[NIXL] == (
        "no",
        f"left as vLLM has it: {NIXL_PACKAGE}.pull_worker cannot be imported "
        "(ModuleNotFoundError(\"No module named 'transformers'\"))",
    )
    assert text[-1] == (
        "The plugin will patch vLLM's offloading handler and simple offload "
        "path, and leave its NIXL connector as vLLM has it (why: above)."
    )
    assert report["status"] == 1


def test_in_a_trimmed_vllm_the_offloading_paths_are_patched() -> None:
    """In vLLM's process the offloading paths are patched as vLLM imports
    them, without a warning; the NIXL connector waits for an import that
    vLLM cannot make either."""
    result = run_python(TRIMMED, "vllm")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["states"] == {HANDLER: "patched", SIMPLE: "patched", NIXL: "waiting"}
    assert "transformers" in report["nixl"]
    assert report["warnings"] == []


def test_the_paths_modules_are_their_own() -> None:
    """No module belongs to two paths, and each path's triggers are its own."""
    modules = [m for ms in PATH_MODULES.values() for m in ms]
    assert len(modules) == len(set(modules))
    for path, triggers in PATH_TRIGGERS.items():
        assert set(triggers) <= set(PATH_MODULES[path])
    assert copy_backend.__name__ in PATH_TRIGGERS[SIMPLE]
    assert disk_backend.__name__ in PATH_TRIGGERS[SIMPLE]
    importlib.import_module(PATH_TRIGGERS[NIXL][0])
