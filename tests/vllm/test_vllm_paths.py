"""Each of vLLM's paths patched on its own (issue 35, item 3; issue 39,
item 5): when vLLM imports that path's modules, importing no other path's;
left alone on its own where its code is no tested release's, the others
patched; every combination of the PTRRES_VLLM* switches; what ``ptrres
check`` says of each path, including in a trimmed vLLM where the NIXL
connector cannot be imported. On every release 0.30-0.34: what each has is
test_vllm_patch's RELEASE_PATHS.
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
from test_vllm_patch import (
    ABSENT,
    FS_WORKER_MODULE,
    INSTALLED,
    NAMES,
    POINTER_UTILS_MODULE,
    PRESENT,
    matching_release,
    refusal,
)
from vllm_harness import (
    CONNECTOR_MODULE,
    DEVICE_POINTERS,
    copy_backend,
    cuda_mem_ops,
    worker,
)

import ptrres
import ptrres.vllm as plugin
from ptrres.vllm import _check, _hook, _patching, _state
from ptrres.vllm._release import PATH_MODULES, PATH_TRIGGERS, match_path
from ptrres.vllm._state import (
    CONNECTOR,
    FILE_WORKER,
    HANDLER,
    NIXL,
    PATHS,
    POINTER_UTILS,
    SIMPLE,
    Match,
)

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
    name, its path and its qualified name (each present path's plan, made
    without applying it)."""
    found = {}
    for path in PRESENT:
        match = match_path(path)
        assert isinstance(match, Match), match
        for r in _patching.plan_path(path, match.variant):
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


def idle(path: str, how: str) -> str:
    """Where a path this vLLM lacks stands once patch() or register() ran:
    patch() finds it absent; register() (every trigger of this vLLM imported)
    finds it absent where its trigger is there (0.30-0.33's connector worker,
    without a resolve), and else waits for a module this vLLM never imports."""
    if how == "patch" or path == CONNECTOR:
        return "absent"
    return "waiting"


def test_the_replaced_attributes_are_the_names_patch_gives() -> None:
    assert sorted(q for *_, q in REPLACED.values()) == sorted(
        n for p in PRESENT for n in NAMES[p]
    )


# --- each path imported alone, in a fresh process -----------------------------------

# register() as vLLM's loader calls it, before any vLLM module; then vLLM,
# then one module of one path, as vLLM imports it. What the process imported
# of the paths' modules, and where each path stands.
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
    "imported": sorted(
        {m for modules in PATH_MODULES.values() for m in modules if m in sys.modules}
    ),
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


SIMPLE_BACKEND = copy_backend.__name__
DISK_BACKEND = "vllm.v1.simple_kv_offload.disk_backend"
# Each module vLLM may import first, alone, and the paths patched then. On
# 0.34 gpu_worker, fs.worker and the connector's worker import pointer_utils
# themselves, so its trigger has run too: it is patched with them, and first
# (once the outermost module has run; a module importing its functions later
# takes ptrres's, while these three bound vLLM's as they ran, and their own
# path's patch rebinds them). 0.30-0.33 have the connector's worker without
# its resolve: that path is found absent then. The simple path's patch
# imports its other backend.
ALONE_CASES = [
    (POINTER_UTILS_MODULE, {POINTER_UTILS}, set()),
    (CONNECTOR_MODULE, {POINTER_UTILS, CONNECTOR} if DEVICE_POINTERS else set(), set()),
    (
        worker.__name__,
        {POINTER_UTILS, HANDLER} if DEVICE_POINTERS else {HANDLER},
        set(),
    ),
    (FS_WORKER_MODULE, {POINTER_UTILS, FILE_WORKER}, set()),
    (SIMPLE_BACKEND, {SIMPLE}, {DISK_BACKEND}),
    (f"{NIXL_PACKAGE}.push_worker", {NIXL}, set()),
]


PATCHED_BY = {module: patched for module, patched, _ in ALONE_CASES}
NIXL_ALONE = {NIXL}


@pytest.mark.parametrize(
    ("module", "patched", "extra"),
    [
        pytest.param(*case, id=".".join(case[0].split(".")[-2:]))
        for case in ALONE_CASES
        if DEVICE_POINTERS or case[0] not in (POINTER_UTILS_MODULE, FS_WORKER_MODULE)
    ],
)
def test_each_path_imported_alone_is_patched_alone(
    module: str, patched: set[str], extra: set[str]
) -> None:
    """The paths of that module alone are patched (and, on 0.30-0.33, the
    connector's found absent), the plugin importing no module of vLLM's
    paths beyond the patched paths' own (the same as with the plugin off,
    but for ``extra``); the hook waits for the other paths. Nothing of
    numba."""
    report, without = run_both(ALONE, module)
    assert report["registered"] == []  # register() imports neither vLLM nor numba
    found_absent = (
        {CONNECTOR} if module == CONNECTOR_MODULE and not DEVICE_POINTERS else set()
    )
    assert report["states"] == {
        path: "patched"
        if path in patched
        else "absent"
        if path in found_absent
        else "waiting"
        for path in PATHS
    }
    assert without["states"] == dict.fromkeys(PATHS, "off")
    assert set(report["imported"]) - set(without["imported"]) == extra
    assert set(without["imported"]) <= set(report["imported"])
    for path in PATHS:
        triggered = set(report["imported"]) & set(PATH_TRIGGERS[path])
        assert bool(triggered) == (path in patched | found_absent), path
    assert report["numba"] is False
    assert report["hook"] == 1  # still waiting for the other paths


# vLLM imports each path in turn (each trigger this vLLM has, and 0.30-0.33's
# connector worker): each is patched then, and the hook leaves once none
# waits. On 0.34, the modules that bind pointer_utils' functions, imported
# after it was patched, take ptrres's at import; unpatch() gives each back
# vLLM's own (their paths' patches kept it).
IN_TURN = """
import importlib, json, sys
import vllm, ptrres.vllm
from ptrres.vllm import _patching
ptrres.vllm.register()
seen = []
for module in sys.argv[1:]:
    importlib.import_module(module)
    seen.append({
        "states": [s.status for s in _patching.path_states()],
        "hook": [type(f).__name__ for f in sys.meta_path].count("PatchOnImport"),
    })
bindings = [
    (module, name)
    for module in sys.argv[1:]
    for name in ("resolve_device_pointers", "iter_pointer_groups")
    if hasattr(sys.modules[module], name)
]
def owners():
    return [getattr(sys.modules[m], n).__module__ for m, n in bindings]
patched = owners()
ptrres.vllm.unpatch()
print(json.dumps({
    "seen": seen,
    "bindings": [f"{m.rpartition('.')[2]}.{n}" for m, n in bindings],
    "patched": patched,
    "unpatched": owners(),
}))
"""


def test_paths_imported_in_turn_are_patched_in_turn() -> None:
    modules = [
        module
        for module in (
            POINTER_UTILS_MODULE,
            CONNECTOR_MODULE,
            worker.__name__,
            FS_WORKER_MODULE,
            SIMPLE_BACKEND,
            f"{NIXL_PACKAGE}.pull_worker",
        )
        if DEVICE_POINTERS or module not in (POINTER_UTILS_MODULE, FS_WORKER_MODULE)
    ]
    result = run_python(IN_TURN, *modules)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    done: dict[str, str] = {}
    expected = []
    for module in modules:
        patched = NIXL_ALONE if module.startswith(NIXL_PACKAGE) else PATCHED_BY[module]
        done.update(dict.fromkeys(patched, "patched"))
        if module == CONNECTOR_MODULE and not DEVICE_POINTERS:
            done[CONNECTOR] = "absent"
        expected.append(
            {
                "states": [done.get(path, "waiting") for path in PATHS],
                # 0.30-0.33: pointer_utils and the file worker wait for good.
                "hook": int(len(done) < len(PATHS)),
            }
        )
    assert report["seen"] == expected
    assert expected[-1]["hook"] == int(not DEVICE_POINTERS)
    if not DEVICE_POINTERS:
        assert report["bindings"] == []
        return
    assert report["bindings"] == [
        "pointer_utils.resolve_device_pointers",
        "pointer_utils.iter_pointer_groups",
        "worker.resolve_device_pointers",
        "gpu_worker.iter_pointer_groups",
        "worker.iter_pointer_groups",
    ]
    assert report["patched"] == ["ptrres.vllm._pointers"] * 5
    assert report["unpatched"] == [POINTER_UTILS_MODULE] * 5


# --- a path whose code changed, in turn --------------------------------------------


def changed(*args: Any, out: Any = None) -> Any:
    """A stand-in for a vLLM method or function (other code)."""
    raise AssertionError("never called")


def guard(path: str) -> tuple[Any, str, str, tuple[str, ...]]:
    """Per path: an owner and name of code it depends on, the phrase naming
    it, and the paths that depend on it (each left alone when it changes):
    the path alone, but for pointer_utils' functions, which the connector
    and the file worker reproduce too."""
    if path == POINTER_UTILS:
        module = importlib.import_module(POINTER_UTILS_MODULE)
        return (
            module,
            "resolve_device_pointers",
            "pointer_utils.resolve_device_pointers",
            (POINTER_UTILS, CONNECTOR, FILE_WORKER),
        )
    if path == CONNECTOR:
        owner = importlib.import_module(CONNECTOR_MODULE).OffloadingConnectorWorker
        name = "start_kv_transfers"
        return owner, name, f"worker.OffloadingConnectorWorker.{name}", (path,)
    if path == FILE_WORKER:
        owner = importlib.import_module(FS_WORKER_MODULE).FSOffloadingWorker
        return owner, "_submit_io", "worker.FSOffloadingWorker._submit_io", (path,)
    if path == HANDLER:
        phrase = "gpu_worker.SingleDirectionOffloadingHandler.transfer_async"
        return Handler, "transfer_async", phrase, (path,)
    if path == SIMPLE:
        return cuda_mem_ops, "copy_blocks", "cuda_mem_ops.copy_blocks", (path,)
    phrase = "base_worker.NixlBaseConnectorWorker._compute_desc_ids"
    return Base, "_compute_desc_ids", phrase, (path,)


@pytest.mark.parametrize("how", ["patch", "register"])
@pytest.mark.parametrize("path", PRESENT)
def test_a_path_whose_code_changed_is_left_alone_and_the_others_patched(
    path: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One warning per path left alone, naming it and what differs from the
    release; none of its attributes replaced (all or nothing within it);
    every other path patched; unpatch() then restores every attribute to
    the very object it was."""
    owner, name, phrase, alone = guard(path)
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
    assert messages == [refusal(p, f"{phrase} has other code") for p in alone]
    assert states() == {
        other: "left alone"
        if other in alone
        else "patched"
        if other in PRESENT
        else idle(other, how)
        for other in PATHS
    }
    for other in alone:
        (reason,) = next(s for s in _patching.path_states() if s.path == other).detail
        assert messages[alone.index(other)].endswith(reason)
    after = attributes()
    replaced = {key for key in before if after[key] is not before[key]}
    theirs = {key for key, (_, _, other, _) in REPLACED.items() if other not in alone}
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


@pytest.mark.parametrize("path", PRESENT)
def test_a_path_whose_last_attribute_cannot_be_set_is_left_whole(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never half-patched: every attribute the path had replaced before the
    failing one is restored; the other paths are patched."""
    real_plan = _patching.plan_path
    frozen = ReadOnly("frozen_owner")

    def plan_with_a_frozen_attribute(which: str, variant: str) -> Any:
        replacements = real_plan(which, variant)
        if which == path:
            replacements.append(_state.Replacement(frozen, "frozen", None, object()))
        return replacements

    monkeypatch.setattr(_patching, "plan_path", plan_with_a_frozen_attribute)
    before = attributes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patched = plugin.patch()
    assert [
        str(w.message) for w in caught if w.category is plugin.VllmPatchWarning
    ] == [
        f"ptrres.vllm left vLLM's {path} unpatched: frozen_owner.frozen: "
        "AttributeError('frozen is read-only')"
    ]
    assert states() == {
        other: "left alone"
        if other == path
        else "patched"
        if other in PRESENT
        else "absent"
        for other in PATHS
    }
    after = attributes()
    for key, (_, _, which, qualified) in REPLACED.items():
        assert (after[key] is before[key]) == (which == path), qualified
        assert (qualified in patched) == (which != path)
    plugin.unpatch()
    assert all(attributes()[key] is before[key] for key in before)


def test_an_untested_release_with_tested_code_is_patched_path_by_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another version string: every attribute replaced as on the release
    itself, each path matched by fingerprint; unpatch() restores them."""
    import vllm

    before = attributes()
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error", plugin.VllmPatchWarning)
        plugin.patch()
    after = attributes()
    assert all(after[key] is not before[key] for key in before)
    assert states() == {p: "patched" if p in PRESENT else "absent" for p in PATHS}
    for path in PRESENT:
        release, variant = matching_release(path)
        assert _patching.path_states()[PATHS.index(path)].match == Match(
            release, variant, "0.35.0"
        )
    plugin.unpatch()
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
    """register() (this vLLM's modules imported already: at once) and `ptrres
    check`'s lines agree with what each switch says, path by path."""
    monkeypatch.setenv("PTRRES_VLLM", vllm)
    monkeypatch.setenv("PTRRES_VLLM_NIXL", nixl)
    monkeypatch.setenv("PTRRES_VLLM_COALESCE", coalesce)

    def switched_off(path: str) -> bool:
        return vllm == "0" or (path == NIXL and nixl == "0")

    expected = {
        path: "off"
        if switched_off(path)
        else "patched"
        if path in PRESENT
        else idle(path, "register")
        for path in PATHS
    }
    before = attributes()
    with caplog.at_level(logging.INFO, logger="ptrres.vllm"):
        plugin.register()
    assert states() == expected
    lines = [r.getMessage() for r in caplog.records if r.name == "ptrres.vllm"]
    assert lines == [
        f"ptrres {ptrres.__version__} checks vLLM {INSTALLED}'s {path}: patched "
        f"{', '.join(NAMES[path])}"
        + (" (coalescing on)" if coalesce == "1" and path in (HANDLER, SIMPLE) else "")
        + "; kernels are made ready at engine start-up"
        for path, state in expected.items()
        if state == "patched"
    ]
    assert _state.coalesce_requested() == (coalesce == "1")
    # Nothing left to wait for but, on 0.30-0.33, the modules they lack.
    waiting = {p for p, s in expected.items() if s == "waiting"}
    assert set(_hook.PatchOnImport.waiting_paths()) == waiting
    assert (_hook.PatchOnImport.installed is None) == (not waiting)
    after = attributes()
    for key, (_, _, path, _) in REPLACED.items():
        assert (after[key] is not before[key]) == (expected[path] == "patched")

    plugin.unpatch()
    findings = {f.topic: f.status for f in _check.path_findings()}
    assert findings == {
        path: "off" if switched_off(path) else "ok" if path in PRESENT else "none"
        for path in PATHS
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
    plugin.register()
    findings = {f.topic: (f.status, f.detail) for f in _check.path_findings()}
    assert findings[NIXL] == (
        "wait",
        "waiting for vLLM to import it (ptrres_never_imported_pull_worker); "
        "patched then",
    )
    for path in PRESENT:
        if path != NIXL:
            assert findings[path][0] == "ok"
    for path in ABSENT:  # 0.30-0.33: a module they never import, or none
        assert findings[path] == (
            ("none", "not in this vLLM: nothing to patch")
            if path == CONNECTOR
            else (
                "wait",
                f"waiting for vLLM to import it "
                f"({'pointer_utils' if path == POINTER_UTILS else 'fs.worker'}); "
                "patched then",
            )
        )
    assert states()[NIXL] == "waiting"  # check left the process as it was
    status, line = _check.summary(list(_check.path_findings()))
    assert (status, line) == (
        0,
        "The plugin will patch vLLM in every process vLLM starts.",
    )


def test_check_leaves_the_warnings_it_does_not_show_unsaid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """check patches each path to see what becomes of it, its warnings
    silenced (its lines say why): a patch() after it still warns, once."""
    owner, name, phrase, _ = guard(HANDLER)
    monkeypatch.setattr(owner, name, changed)
    reason = refusal(HANDLER, f"{phrase} has other code")
    with warnings.catch_warnings():
        warnings.simplefilter("error", plugin.VllmPatchWarning)
        findings = {f.topic: (f.status, f.detail) for f in _check.path_findings()}
    assert findings[HANDLER] == (
        "no",
        "left as vLLM has it: " + reason.split(": ", 1)[1],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin.patch()
        plugin.patch()
    assert [
        str(w.message) for w in caught if w.category is plugin.VllmPatchWarning
    ] == [reason]


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
    findings = check_lines(out.getvalue())
    topics = list(findings)
    assert [t for t in topics if t in PATHS] == list(PATHS)
    assert topics.index(NIXL) + 1 == topics.index("PTRRES_VLLM")
    triggers = {
        POINTER_UTILS: "pointer_utils",
        CONNECTOR: "offloading.worker",
        HANDLER: "gpu_worker",
        FILE_WORKER: "fs.worker",
        SIMPLE: "copy_backend or disk_backend",
        NIXL: "pull_worker or push_worker",
    }
    for path in PRESENT:
        status, detail = findings[path]
        assert status == "ok"
        assert detail.startswith(f"patched once vLLM imports {triggers[path]}: ")
    for path in ABSENT:
        assert findings[path] == ("none", "not in this vLLM: nothing to patch")


# In a trimmed vLLM: transformers cannot be imported (as where vLLM is
# installed --no-deps with only what its offloading workers import), and so
# neither can the NIXL connector, the offloading connector's worker, nor
# (0.34) the file worker. "check": `ptrres check`, ptrres's entry point
# visible to vLLM; "vllm": the plugin registered, then vLLM's imports of
# each path, then patch().
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
registered = {s.path: s.status for s in _patching.path_states()}
with warnings.catch_warnings(record=True) as patched:
    warnings.simplefilter("always")
    ptrres.vllm.patch()
print(json.dumps({
    "states": registered,
    "nixl": nixl,
    "warnings": [str(w.message) for w in caught],
    "patched": {s.path: s.status for s in _patching.path_states()},
    "patch_warnings": [str(w.message) for w in patched],
}))
"""
NO_TRANSFORMERS = "(ModuleNotFoundError(\"No module named 'transformers'\"))"
# The paths whose modules import transformers: left alone there, saying why.
TRIMMED_AWAY = (CONNECTOR, FILE_WORKER, NIXL) if DEVICE_POINTERS else (CONNECTOR, NIXL)


def test_in_a_trimmed_vllm_check_shows_what_cannot_be_imported_left_alone() -> None:
    """Without transformers the NIXL connector, the connector's worker and
    (0.34) the file worker cannot be imported: check says they are left
    alone, and why (on 0.30-0.33 too, for the connector's worker, whose
    path it cannot tell is absent), and the others patched or absent."""
    result = run_python(TRIMMED, "check")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    text = report["text"].splitlines()
    findings = check_lines(report["text"])
    modules = {
        CONNECTOR: CONNECTOR_MODULE,
        FILE_WORKER: FS_WORKER_MODULE,
        NIXL: f"{NIXL_PACKAGE}.pull_worker",
    }
    for path in PATHS:
        if path in TRIMMED_AWAY:
            assert findings[path] == (
                "no",
                f"left as vLLM has it: {modules[path]} cannot be imported "
                + NO_TRANSFORMERS,
            )
        else:
            assert findings[path][0] == ("ok" if path in PRESENT else "none"), path
    patched = spoken([p for p in PRESENT if p not in TRIMMED_AWAY])
    alone = spoken(list(TRIMMED_AWAY))
    assert text[-1] == (
        f"The plugin will patch vLLM's {patched}, and leave its {alone} as vLLM "
        "has it (why: above)."
    )
    assert report["status"] == 1


def test_in_a_trimmed_vllm_the_offloading_paths_are_patched() -> None:
    """In vLLM's process the paths vLLM imports are patched as it imports
    them, without a warning; the NIXL connector waits for an import that
    vLLM cannot make either. patch() then leaves each path that cannot be
    imported alone, with its warning (not absent)."""
    result = run_python(TRIMMED, "vllm")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    imported = {HANDLER, SIMPLE} | ({POINTER_UTILS} if DEVICE_POINTERS else set())
    assert report["states"] == {
        path: "patched" if path in imported else "waiting" for path in PATHS
    }
    assert "transformers" in report["nixl"]
    assert report["warnings"] == []
    first = {
        CONNECTOR: CONNECTOR_MODULE,
        FILE_WORKER: FS_WORKER_MODULE,
        NIXL: f"{NIXL_PACKAGE}.base_worker",
    }
    assert report["patch_warnings"] == [
        f"ptrres.vllm left vLLM's {path} unpatched: {first[path]} cannot be "
        f"imported {NO_TRANSFORMERS}"
        for path in TRIMMED_AWAY
    ]
    assert report["patched"] == {
        path: "left alone"
        if path in TRIMMED_AWAY
        else "patched"
        if path in PRESENT
        else "absent"
        for path in PATHS
    }


def spoken(names: list[str]) -> str:
    """ "a, b and c"."""
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def test_the_paths_modules_are_their_own() -> None:
    """Each path's triggers are its own; the modules several paths share are
    pointer_utils and vLLM's types (base), the offloading paths'."""
    for path, triggers in PATH_TRIGGERS.items():
        assert set(triggers) <= set(PATH_MODULES[path])
        for other in PATHS:
            if other != path:
                assert not set(triggers) & set(PATH_TRIGGERS[other]), (path, other)
    sharing: dict[str, set[str]] = {}
    for path, modules in PATH_MODULES.items():
        for module in modules:
            sharing.setdefault(module, set()).add(path)
    shared = {m: paths for m, paths in sharing.items() if len(paths) > 1}
    offloading = {POINTER_UTILS, CONNECTOR, HANDLER, FILE_WORKER}
    assert shared == {
        POINTER_UTILS_MODULE: offloading,
        "vllm.v1.kv_offload.base": offloading,
    }
    assert copy_backend.__name__ in PATH_TRIGGERS[SIMPLE]
    assert DISK_BACKEND in PATH_TRIGGERS[SIMPLE]
    importlib.import_module(PATH_TRIGGERS[NIXL][0])
