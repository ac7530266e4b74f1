"""patch(), unpatch(), register(): the gate (each path patched where its
code is a tested release's, by fingerprint, whatever the version string
says), the handler path's guards (the other paths patched when it is left
alone), pointer_utils and the modules that bind its functions, packaging.
Each path on its own: tests/vllm/test_vllm_paths.py; the fingerprints and
their record: tests/vllm/test_vllm_fingerprints.py.

What each release has is written here from vLLM itself (SPEC sections 12
and 16), not read from ptrres: the other tests of the gate import it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import inspect
import json
import logging
import os
import re
import subprocess
import sys
import types
import warnings
from collections.abc import Iterator
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import CONNECTOR_MODULE, DEVICE_POINTERS, worker

import ptrres
import ptrres.vllm as plugin
from ptrres.vllm import _patching, _state
from ptrres.vllm._fingerprint import RECORD_FILE, fingerprint
from ptrres.vllm._release import PATH_TRIGGERS, optional_module, path_code
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
POINTER_UTILS_MODULE = "vllm.v1.kv_offload.pointer_utils"
FS_WORKER_MODULE = "vllm.v1.kv_offload.fs.worker"
SWITCHES = ("PTRRES_VLLM", "PTRRES_VLLM_NIXL", "PTRRES_VLLM_COALESCE")

# --- what each release has (vLLM's own code, SPEC 12 and 16) -------------------

INSTALLED: str = importlib.import_module("vllm").__version__
RELEASE = ".".join(INSTALLED.split(".")[:2])
# The paths each tested release has: 0.34 added pointer_utils, the
# connector's resolve (its worker module is older: 0.30-0.33 have it without
# one) and the file worker.
RELEASE_PATHS: dict[str, tuple[str, ...]] = {
    "0.30": (HANDLER, SIMPLE, NIXL),
    "0.31": (HANDLER, SIMPLE, NIXL),
    "0.32": (HANDLER, SIMPLE, NIXL),
    "0.33": (HANDLER, SIMPLE, NIXL),
    "0.34": PATHS,
}
PRESENT = RELEASE_PATHS[RELEASE]
ABSENT = tuple(path for path in PATHS if path not in PRESENT)
_H = "SingleDirectionOffloadingHandler"
# What patch() replaces on each path (the handler's form is 0.34's where the
# handler takes DevicePointers), in the order it replaces them.
NAMES: dict[str, list[str]] = {
    POINTER_UTILS: [
        f"{POINTER_UTILS_MODULE}.resolve_device_pointers",
        f"{POINTER_UTILS_MODULE}.iter_pointer_groups",
    ],
    CONNECTOR: [f"{CONNECTOR_MODULE}.resolve_device_pointers"],
    HANDLER: [
        "CPUOffloadingWorker.__init__",
        f"{_H}.transfer_async",
        f"{worker.__name__}.iter_pointer_groups",
    ]
    if DEVICE_POINTERS
    else [f"{_H}.__init__", f"{_H}.transfer_async"],
    FILE_WORKER: [
        "FSOffloadingWorker.__init__",
        "FSOffloadingWorker._submit_io",
        f"{FS_WORKER_MODULE}.iter_pointer_groups",
    ],
    SIMPLE: [
        f"vllm.v1.simple_kv_offload.{module}.{name}"
        for name in ("build_params", "copy_blocks")
        for module in ("cuda_mem_ops", "copy_backend", "disk_backend")
    ],
    NIXL: [
        "NixlBaseConnectorWorker.__init__",
        "NixlBaseConnectorWorker._compute_desc_ids",
        "NixlPullConnectorWorker._read_blocks",
        "NixlPushConnectorWorker._xfer_blocks",
    ],
}
ALL_PATCHES = [name for path in PRESENT for name in NAMES[path]]


def patches_but(*left_alone: str) -> list[str]:
    """patch()'s list where the paths ``left_alone`` keep vLLM's code."""
    return [name for path in PRESENT if path not in left_alone for name in NAMES[path]]


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def recorded_releases() -> dict[str, dict[str, Any]]:
    """fingerprints.json's releases, as the file has them."""
    releases: dict[str, dict[str, Any]] = json.loads(RECORD_FILE.read_text())[
        "releases"
    ]
    return releases


def matching_release(path: str, installed: str = INSTALLED) -> tuple[str, str]:
    """(release, variant) a vLLM with the code of ``installed`` on ``path``
    matches where it is not that release: the newest tested release whose
    record of the path is the installed release's (read from the file)."""
    releases = recorded_releases()
    own = releases[installed][path]
    same = [release for release, paths in releases.items() if paths.get(path) == own]
    return max(same, key=version_key), own["variant"]


def refusal(path: str, *phrases: str, closest: str = INSTALLED) -> str:
    """The warning for ``path`` on the installed release, where its code has
    ``phrases`` as differences from ``closest``'s."""
    return (
        f"ptrres.vllm left vLLM's {path} unpatched: vLLM {INSTALLED} (a tested "
        f"release) has other code here than every tested release; closest, "
        f"{closest}: {'; '.join(phrases)}"
    )


# Every present path's trigger imported, as in a vLLM process that uses them
# all, and the connector's worker (0.30-0.33 have it, without a resolve).
for _module in dict.fromkeys(
    (CONNECTOR_MODULE, *(PATH_TRIGGERS[p][0] for p in PRESENT))
):
    importlib.import_module(_module)


@pytest.fixture(autouse=True)
def _unpatched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    plugin.unpatch()
    _patching._warned.clear()
    yield
    plugin.unpatch()


def states() -> dict[str, str]:
    return {s.path: s.status for s in _patching.path_states()}


def patch_warns(*expected: str) -> list[str]:
    """patch(), which warns ``expected`` (each once, in this order) and no
    more; again, it warns nothing. Returns what it patched."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patched = plugin.patch()
    messages = [str(w.message) for w in caught if w.category is plugin.VllmPatchWarning]
    assert messages == list(expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error", plugin.VllmPatchWarning)
        assert plugin.patch() == patched
    return patched


# --- every path, as the release has it ---------------------------------------------


def test_the_paths_each_release_has() -> None:
    """RELEASE_PATHS against vLLM itself: pointer_utils and the file worker
    are modules of 0.34; the connector's worker binds a resolve from 0.34."""
    connector = importlib.import_module(CONNECTOR_MODULE)
    assert (POINTER_UTILS in PRESENT) == (
        optional_module(POINTER_UTILS_MODULE) is not None
    )
    assert (FILE_WORKER in PRESENT) == (optional_module(FS_WORKER_MODULE) is not None)
    assert (CONNECTOR in PRESENT) == hasattr(connector, "resolve_device_pointers")
    assert set(PRESENT) >= {HANDLER, SIMPLE, NIXL}
    assert DEVICE_POINTERS is (RELEASE == "0.34")


def test_patch_replaces_each_path_and_unpatch_restores_it() -> None:
    """Every path this release has is patched (in PATHS order), the others
    are absent; the patched constructor shows vLLM's signature; unpatch()
    restores the very objects."""
    constructor = worker.CPUOffloadingWorker if DEVICE_POINTERS else Handler
    originals = {name: vars(Handler)[name] for name in ("__init__", "transfer_async")}
    original_init = vars(constructor)["__init__"]
    vllm_signature = inspect.signature(constructor)
    assert not plugin.is_patched()
    assert patch_warns() == ALL_PATCHES
    assert plugin.is_patched()
    assert states() == {
        path: "patched" if path in PRESENT else "absent" for path in PATHS
    }
    assert _state.absent == set(ABSENT)
    assert all(
        _state.matches[path] == Match(INSTALLED, matching_release(path)[1], INSTALLED)
        for path in PRESENT
    )
    transfer = vars(Handler)["transfer_async"]
    assert transfer is not originals["transfer_async"]
    assert transfer.__module__.startswith("ptrres.vllm.")
    assert vars(constructor)["__init__"] is not original_init
    assert vars(constructor)["__init__"].__wrapped__ is original_init
    # The patched constructor takes (and shows) this release's arguments.
    assert inspect.signature(constructor) == vllm_signature
    plugin.unpatch()
    assert not plugin.is_patched()
    assert states() == dict.fromkeys(PATHS, "unpatched")
    for name, original in originals.items():
        assert vars(Handler)[name] is original
    assert vars(constructor)["__init__"] is original_init
    plugin.unpatch()  # a second unpatch changes nothing
    assert vars(Handler)["transfer_async"] is originals["transfer_async"]


# The modules that bind pointer_utils' functions by name (0.34), and which.
BINDINGS = (
    (POINTER_UTILS_MODULE, "resolve_device_pointers"),
    (POINTER_UTILS_MODULE, "iter_pointer_groups"),
    (CONNECTOR_MODULE, "resolve_device_pointers"),
    (worker.__name__, "iter_pointer_groups"),
    (FS_WORKER_MODULE, "iter_pointer_groups"),
)


@pytest.mark.skipif(not DEVICE_POINTERS, reason="vLLM 0.30-0.33 have no pointer_utils")
def test_pointer_utils_and_every_module_that_bound_its_functions() -> None:
    """pointer_utils' functions become ptrres's, and so does every binding
    the offloading modules made of them at import (the connector's: a job
    resolver around vLLM's resolve); unpatch() gives back vLLM's own."""
    from ptrres.vllm import _pointers

    modules = {name: importlib.import_module(name) for name, _ in BINDINGS}
    vllms = {(m, n): getattr(modules[m], n) for m, n in BINDINGS}
    assert {f.__module__ for f in vllms.values()} == {POINTER_UTILS_MODULE}
    plugin.patch()
    now = {(m, n): getattr(modules[m], n) for m, n in BINDINGS}
    ours = {
        "resolve_device_pointers": _pointers.resolve_device_pointers,
        "iter_pointer_groups": _pointers.iter_pointer_groups,
    }
    for (module, name), function in now.items():
        if module == CONNECTOR_MODULE:
            assert function.__module__ == _pointers.__name__
            assert function.__wrapped__ is vllms[module, name]
        else:
            assert function is ours[name], (module, name)
    plugin.unpatch()
    for key, original in vllms.items():
        assert getattr(modules[key[0]], key[1]) is original


@pytest.mark.skipif(DEVICE_POINTERS, reason="vLLM 0.34 has pointer_utils")
def test_a_release_without_pointer_utils_has_none_of_its_paths() -> None:
    """0.30-0.33: pointer_utils, the connector's resolve and the file worker
    are absent, without a warning; check says so, and nothing else."""
    from ptrres.vllm import _check

    assert ABSENT == (POINTER_UTILS, CONNECTOR, FILE_WORKER)
    assert optional_module(POINTER_UTILS_MODULE) is None
    assert patch_warns() == ALL_PATCHES
    assert {p for p, s in states().items() if s == "absent"} == set(ABSENT)
    plugin.unpatch()
    findings = {f.topic: (f.status, f.detail) for f in _check.path_findings()}
    for path in ABSENT:
        assert findings[path] == ("none", "not in this vLLM: nothing to patch")
    assert _check.summary(_check.path_findings()) == (
        0,
        "The plugin will patch vLLM in every process vLLM starts.",
    )


def test_the_installed_release_is_a_tested_one() -> None:
    """CI runs these tests on each tested release, and every tested release
    has its record in fingerprints.json."""
    tested = ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
    assert INSTALLED in plugin.SUPPORTED_VLLM
    assert tested == plugin.SUPPORTED_VLLM
    assert tuple(sorted(recorded_releases(), key=version_key)) == tested
    for release, paths in recorded_releases().items():
        assert tuple(paths) == RELEASE_PATHS[release[:4]], release


# --- a version string is not code ------------------------------------------------


@pytest.mark.parametrize(
    "version",
    [
        "0.35.0",
        "0.29.1",
        "1.0.0",
        "0.330.0",
        "dev",
        f"{RELEASE}.7",
        f"{RELEASE}.1.dev5+g1234abc",
        f"{INSTALLED}+cu129",
    ],
)
def test_another_version_string_with_this_code_is_patched_by_fingerprint(
    version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each path is patched, without a warning, as the newest tested
    release whose code it has (the version string only labels it)."""
    import vllm

    monkeypatch.setattr(vllm, "__version__", version)
    assert patch_warns() == ALL_PATCHES
    for path in PRESENT:
        release, variant = matching_release(path)
        assert _state.matches[path] == Match(release, variant, version)
        assert _state.matches[path].by_fingerprint
    assert {p for p, s in states().items() if s == "absent"} == set(ABSENT)


def test_register_on_an_untested_version_says_whose_code_each_path_has(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import vllm

    from ptrres.vllm import _check

    monkeypatch.setattr(vllm, "__version__", "0.40.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error", plugin.VllmPatchWarning)
        with caplog.at_level(logging.INFO, logger="ptrres.vllm"):
            plugin.register()
    lines = [r.getMessage() for r in caplog.records if r.name == "ptrres.vllm"]
    assert lines == [
        f"ptrres {ptrres.__version__} checks vLLM 0.40.0's {path}: patched "
        f"{', '.join(NAMES[path])} (untested release: its code here is "
        f"{matching_release(path)[0]}'s); kernels are made ready at engine start-up"
        for path in PRESENT
    ]
    findings = {f.topic: (f.status, f.detail) for f in _check.path_findings()}
    for path in PRESENT:
        status, detail = findings[path]
        release = matching_release(path)[0]
        assert status == "ok"
        assert f" (vLLM 0.40.0 is untested; its code here is {release}'s): " in detail


def test_each_release_is_held_to_its_own_constructor() -> None:
    """0.31 added host_memory_is_pinned to the handler's __init__, 0.34 took
    its GPU tensors away: the installed constructor is recorded for the
    releases that have it, and only those."""
    signature = inspect.signature(Handler).parameters
    has_pinned = "host_memory_is_pinned" in signature
    assert has_pinned == (RELEASE != "0.30")
    assert ("gpu_tensors" in signature) == (not DEVICE_POINTERS)
    locator = f"{worker.__name__}:{_H}.__init__"
    installed = fingerprint(path_code(HANDLER, "0.30"))[locator]
    same = {
        release
        for release, paths in recorded_releases().items()
        if paths[HANDLER]["fingerprint"].get(locator) == installed
    }
    assert INSTALLED in same
    assert ("0.30.0" in same) == (not has_pinned)
    if DEVICE_POINTERS:
        assert same == {"0.34.0"}
    else:
        assert "0.34.0" not in same


# --- the handler path's guards ---------------------------------------------------


def assert_handler_untouched(transfer: Any) -> None:
    """The handler's path is vLLM's (the other paths are patched)."""
    assert not _state.patched(HANDLER)
    assert states()[HANDLER] == "left alone"
    assert vars(Handler)["transfer_async"] is transfer


def test_a_changed_handler_method_leaves_its_path_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def transfer_async(self: Any, job_id: int, spec: Any) -> bool:
        return True

    monkeypatch.setattr(Handler, "transfer_async", transfer_async)
    patched = patch_warns(
        refusal(HANDLER, f"gpu_worker.{_H}.transfer_async has other code")
    )
    assert patched == patches_but(HANDLER)
    assert_handler_untouched(transfer_async)


def test_a_missing_attribute_leaves_the_handlers_path_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = vars(Handler)["transfer_async"]
    monkeypatch.delattr(Handler, "_fill_direct_ops")
    patch_warns(refusal(HANDLER, f"gpu_worker.{_H}._fill_direct_ops is missing"))
    assert_handler_untouched(original)
    monkeypatch.undo()
    plugin.unpatch()
    _patching._warned.clear()
    monkeypatch.delattr(worker, "_new_descriptor_buffers")
    patch_warns(refusal(HANDLER, "gpu_worker._new_descriptor_buffers is missing"))
    assert_handler_untouched(original)


def test_a_method_replaced_by_a_callable_object_is_other_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What is not a function, property or class fingerprints as "present":
    never as the function it stands in for."""

    class Callable:
        def __call__(self) -> None:
            pass

    monkeypatch.setattr(Handler, "get_finished", Callable())
    patch_warns(refusal(HANDLER, f"gpu_worker.{_H}.get_finished has other code"))
    assert not _state.patched(HANDLER)


def test_a_missing_handler_class_leaves_its_path_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not absent: CPUOffloadingWorker, which 0.34's form replaces, is in
    every release, so the path is there and its code changed. The warning
    names the methods gone, the first that the form replaces first."""
    monkeypatch.delattr(worker, _H)
    first = "transfer_async" if DEVICE_POINTERS else "__init__"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert plugin.patch() == patches_but(HANDLER)
    (message,) = [
        str(w.message) for w in caught if w.category is plugin.VllmPatchWarning
    ]
    assert message.startswith(refusal(HANDLER, f"gpu_worker.{_H}.{first} is missing; "))
    assert states()[HANDLER] == "left alone"


# --- pointer_utils, and the paths that depend on it ---------------------------------


def vllm_like_pointer_utils(*, missing: bool) -> types.ModuleType:
    """A pointer_utils of vLLM's signatures, as a pull request had it before
    0.34 (without iter_pointer_groups where ``missing``)."""
    module = types.ModuleType(POINTER_UTILS_MODULE)

    def resolve_device_pointers(device_spec: Any, kv_caches: Any) -> Any:
        raise AssertionError("never called")

    def iter_pointer_groups(device_ptrs: Any, blocks_per_chunk: int) -> Any:
        raise AssertionError("never called")

    module.resolve_device_pointers = resolve_device_pointers  # type: ignore[attr-defined]
    if not missing:
        module.iter_pointer_groups = iter_pointer_groups  # type: ignore[attr-defined]
    return module


@pytest.mark.parametrize("missing", [False, True])
def test_a_changed_pointer_utils_leaves_alone_every_path_that_depends_on_it(
    missing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0.34: iter_pointer_groups changed (or gone) leaves pointer_utils, the
    handler and the file worker alone (each reproduces it), each with its
    warning; the connector, which reproduces only the resolve, is patched.
    0.30-0.33: a pointer_utils that is no tested release's (a pull
    request's, put there) is left alone; no other path of theirs reads it."""
    phrase = "is missing" if missing else "has other code"
    if DEVICE_POINTERS:
        module = importlib.import_module(POINTER_UTILS_MODULE)
        if missing:
            monkeypatch.delattr(module, "iter_pointer_groups")
        else:
            monkeypatch.setattr(
                module, "iter_pointer_groups", lambda device_ptrs, bpc: iter(())
            )
        alone = (POINTER_UTILS, HANDLER, FILE_WORKER)
        expected = [
            refusal(path, f"pointer_utils.iter_pointer_groups {phrase}")
            for path in alone
        ]
        assert patch_warns(*expected) == patches_but(*alone)
        assert {p for p, s in states().items() if s == "left alone"} == set(alone)
        return
    module = vllm_like_pointer_utils(missing=missing)
    originals = dict(vars(module))
    monkeypatch.setitem(sys.modules, POINTER_UTILS_MODULE, module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patched = plugin.patch()
    (message,) = [
        str(w.message) for w in caught if w.category is plugin.VllmPatchWarning
    ]
    assert message.startswith(
        refusal(
            POINTER_UTILS,
            "pointer_utils.resolve_device_pointers has other code",
            f"pointer_utils.iter_pointer_groups {phrase}",
            "base.DevicePointers is missing",
            "base.DevicePointerGroupInfo is missing",
            closest="0.34.0",
        )
    )
    assert patched == ALL_PATCHES
    assert states() == {
        path: "left alone"
        if path == POINTER_UTILS
        else "patched"
        if path in PRESENT
        else "absent"
        for path in PATHS
    }
    assert vars(module) == originals  # nothing replaced


# --- register(): the entry point -----------------------------------------------


def test_register_patches_once_and_logs_one_line_per_path(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="ptrres.vllm"):
        plugin.register()
        plugin.register()
        plugin.register()
    assert plugin.patch() == ALL_PATCHES  # every path, by register()
    lines = [r for r in caplog.records if r.name == "ptrres.vllm"]
    assert [r.levelno for r in lines] == [logging.INFO] * len(PRESENT)
    assert [r.getMessage() for r in lines] == [
        f"ptrres {ptrres.__version__} checks vLLM {INSTALLED}'s {path}: patched "
        f"{', '.join(NAMES[path])}; kernels are made ready at engine start-up"
        for path in PRESENT
    ]


def test_register_reports_among_vllms_lines_when_nobody_handles_ptrres(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside vLLM only its "vllm" logger has a handler: report through it."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    monkeypatch.setattr(_state.logger, "hasHandlers", lambda: False)
    child = logging.getLogger("vllm.ptrres")
    handler = Collect(logging.INFO)
    child.addHandler(handler)
    monkeypatch.setattr(child, "level", logging.INFO)
    try:
        plugin.register()
    finally:
        child.removeHandler(handler)
    assert [r.levelno for r in records] == [logging.INFO] * len(PRESENT)
    assert f"{PRESENT[0]}: patched {NAMES[PRESENT[0]][0]}" in records[0].getMessage()


@pytest.mark.parametrize("value", ["0", "false", "OFF"])
def test_ptrres_vllm_0_keeps_the_plugin_off(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = vars(Handler)["transfer_async"]
    monkeypatch.setenv("PTRRES_VLLM", value)
    plugin.register()
    assert not plugin.is_patched()
    assert vars(Handler)["transfer_async"] is original
    assert states() == dict.fromkeys(PATHS, "off")


def test_register_never_raises(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(path: str) -> list[str]:
        raise RuntimeError("boom")

    monkeypatch.setattr(_patching, "patch_path", broken)
    with caplog.at_level(logging.WARNING, logger="ptrres.vllm"):
        plugin.register()
    assert "could not patch vLLM" in caplog.text


def test_the_entry_point_is_declared() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(
        r'^\[project\.entry-points\."vllm\.general_plugins"\]\n(.*?)(?:^\[|\Z)',
        text,
        re.M | re.S,
    )
    assert section is not None
    assert re.search(r'^ptrres = "ptrres\.vllm:register"$', section.group(1), re.M)
    assert re.search(r'^vllm = \["vllm>=0\.30,<0\.35"\]$', text, re.M)


def test_vllm_finds_the_installed_entry_point() -> None:
    """Where ptrres is installed (as in CI), vLLM's loader finds register()."""
    # The installed distribution: the one pip recorded (an editable install
    # also leaves ptrres.egg-info in the checkout, which pip did not record).
    installed = [
        dist
        for dist in importlib.metadata.distributions(name="ptrres")
        if dist.read_text("direct_url.json")
    ]
    if not installed:
        pytest.skip("ptrres is not installed (the pyproject test covers this)")
    dist = installed[0]
    if f"file://{ROOT}" not in (dist.read_text("direct_url.json") or ""):
        pytest.skip("the installed ptrres is another checkout's (as in dev venvs)")
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    assert DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    declared = [ep for ep in dist.entry_points if ep.group == DEFAULT_PLUGINS_GROUP]
    assert [ep.value for ep in declared] == ["ptrres.vllm:register"]
    assert load_plugins_by_group(DEFAULT_PLUGINS_GROUP)["ptrres"] is plugin.register


def test_importing_ptrres_never_imports_vllm() -> None:
    code = (
        "import sys, ptrres, ptrres.vllm\n"
        "loaded = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]\n"
        "assert not loaded, loaded\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


# --- a vLLM that cannot be imported ------------------------------------------------


class Broken(importlib.abc.MetaPathFinder):
    """Makes importing one module raise, as a module whose own imports fail."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> ModuleSpec | None:
        if fullname == self.name:
            raise ImportError("broken here")
        return None


def test_a_vllm_that_cannot_be_imported_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every path, each with its warning (this vLLM cannot say which it has)."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # import raises ImportError
    expected = [
        f"ptrres.vllm left vLLM's {path} unpatched: vLLM cannot be imported"
        for path in PATHS
    ]
    assert patch_warns(*expected) == []
    assert states() == dict.fromkeys(PATHS, "left alone")


def test_a_module_of_a_path_that_cannot_be_imported_leaves_that_path_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gpu_worker is in this vLLM but its import fails: the handler's path is
    left alone, saying so (not absent, as where vLLM has no such module);
    the others are patched."""
    monkeypatch.delitem(sys.modules, worker.__name__)
    monkeypatch.setattr(sys, "meta_path", [Broken(worker.__name__), *sys.meta_path])
    patched = patch_warns(
        f"ptrres.vllm left vLLM's {HANDLER} unpatched: {worker.__name__} cannot "
        "be imported (ImportError('broken here'))"
    )
    assert patched == patches_but(HANDLER)
    assert states()[HANDLER] == "left alone"


def test_a_module_this_vllm_does_not_have_is_missing_not_broken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the import of a path's module fails for that very module (as
    vLLM says None in sys.modules), the path is as in a release without it."""
    monkeypatch.setitem(sys.modules, worker.__name__, None)
    assert patch_warns() == patches_but(HANDLER)
    assert states()[HANDLER] == "absent"


def test_optional_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    assert optional_module("json") is sys.modules["json"]
    monkeypatch.delitem(sys.modules, "wave", raising=False)  # found, then imported
    assert optional_module("wave").__name__ == "wave"
    assert optional_module("vllm.no_such_package.pointer_utils") is None
    assert (optional_module(POINTER_UTILS_MODULE) is None) == (
        POINTER_UTILS not in PRESENT
    )
