"""patch(), unpatch(), register(): the version guard, the handler path's
guards (the other paths patched when it is left alone), the switches,
packaging. Each path on its own: tests/vllm/test_vllm_paths.py."""

from __future__ import annotations

import importlib.metadata
import inspect
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
from vllm_harness import worker

import ptrres
import ptrres.vllm as plugin
from ptrres.vllm import _handler, _hook, _patching, _state
from ptrres.vllm._release import optional_module

ROOT = Path(__file__).resolve().parents[2]
Handler = worker.SingleDirectionOffloadingHandler
POINTER_UTILS = "vllm.v1.kv_offload.pointer_utils"


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    plugin.unpatch()
    _patching._warned.clear()
    yield
    plugin.unpatch()


# The handler path's replacements (without pointer_utils, which no tested
# release has).
HANDLER_ONLY = [
    "SingleDirectionOffloadingHandler.__init__",
    "SingleDirectionOffloadingHandler.transfer_async",
]
# The other paths' replacements, patched when the handler's is left alone.
OTHER_PATCHES = [
    # The simple offload path's (tests/vllm/test_vllm_simple.py).
    *(
        f"vllm.v1.simple_kv_offload.{module}.{name}"
        for name in ("build_params", "copy_blocks")
        for module in ("cuda_mem_ops", "copy_backend", "disk_backend")
    ),
    # The NIXL connector's (tests/vllm/test_vllm_nixl.py).
    "NixlBaseConnectorWorker.__init__",
    "NixlBaseConnectorWorker._compute_desc_ids",
    "NixlPullConnectorWorker._read_blocks",
    "NixlPushConnectorWorker._xfer_blocks",
]
HANDLER_PATCHES = [*HANDLER_ONLY, *OTHER_PATCHES]


def test_patch_replaces_the_handlers_methods_and_unpatch_restores_them() -> None:
    original = vars(Handler)["transfer_async"]
    original_init = vars(Handler)["__init__"]
    vllm_signature = inspect.signature(Handler)
    assert not plugin.is_patched()
    assert plugin.patch() == HANDLER_PATCHES
    assert plugin.is_patched()
    assert vars(Handler)["transfer_async"] is _handler.transfer_async
    assert vars(Handler)["__init__"] is not original_init
    # The patched constructor takes (and shows) this release's arguments.
    assert inspect.signature(Handler) == vllm_signature
    assert plugin.patch() == HANDLER_PATCHES
    plugin.unpatch()
    assert not plugin.is_patched()
    assert vars(Handler)["transfer_async"] is original
    assert vars(Handler)["__init__"] is original_init
    plugin.unpatch()  # a second unpatch changes nothing
    assert vars(Handler)["transfer_async"] is original
    assert vars(Handler)["__init__"] is original_init


def fake_pointer_utils(**overrides: Any) -> types.ModuleType:
    """A vLLM pointer_utils module (the pull request's) with vLLM's signatures."""
    module = types.ModuleType(POINTER_UTILS)

    def resolve_device_pointers(device_spec: Any, kv_caches: Any) -> Any:
        raise AssertionError("vLLM's resolver must not run once patched")

    def iter_pointer_groups(device_ptrs: Any, blocks_per_chunk: int) -> Any:
        raise AssertionError("vLLM's iterator must not run once patched")

    module.resolve_device_pointers = resolve_device_pointers  # type: ignore[attr-defined]
    module.iter_pointer_groups = iter_pointer_groups  # type: ignore[attr-defined]
    for name, value in overrides.items():
        setattr(module, name, value)
    return module


def test_pointer_utils_gets_ptrres_drop_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fake_pointer_utils()
    originals = (module.resolve_device_pointers, module.iter_pointer_groups)
    monkeypatch.setitem(sys.modules, POINTER_UTILS, module)
    patched = plugin.patch()
    assert f"{POINTER_UTILS}.resolve_device_pointers" in patched
    assert f"{POINTER_UTILS}.iter_pointer_groups" in patched
    assert module.resolve_device_pointers is ptrres.resolve_device_pointers
    assert module.iter_pointer_groups is ptrres.iter_pointer_groups
    plugin.unpatch()
    assert (module.resolve_device_pointers, module.iter_pointer_groups) == originals
    assert module.resolve_device_pointers is originals[0]


def test_names_the_worker_imported_from_pointer_utils_are_replaced_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = fake_pointer_utils()
    original = module.resolve_device_pointers
    monkeypatch.setitem(sys.modules, POINTER_UTILS, module)
    monkeypatch.setattr(worker, "resolve_device_pointers", original, raising=False)
    assert f"{worker.__name__}.resolve_device_pointers" in plugin.patch()
    assert worker.resolve_device_pointers is ptrres.resolve_device_pointers
    assert not hasattr(worker, "iter_pointer_groups")  # never added
    plugin.unpatch()
    assert worker.resolve_device_pointers is original


def test_an_attribute_that_cannot_be_set_undoes_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Never half-patched: a failure on the last attribute restores the first."""

    class ReadOnly(types.ModuleType):
        def __setattr__(self, name: str, value: Any) -> None:
            if value is ptrres.iter_pointer_groups:
                raise AttributeError(f"{name} is read-only")
            super().__setattr__(name, value)

    module = fake_pointer_utils()
    module.__class__ = ReadOnly
    originals = (module.resolve_device_pointers, module.iter_pointer_groups)
    transfer = vars(Handler)["transfer_async"]
    monkeypatch.setitem(sys.modules, POINTER_UTILS, module)
    assert_warns_once("iter_pointer_groups is read-only")
    assert_untouched(transfer, module)
    assert (module.resolve_device_pointers, module.iter_pointer_groups) == originals


def test_no_pointer_utils_no_replacement() -> None:
    assert POINTER_UTILS not in sys.modules
    assert plugin.patch() == HANDLER_PATCHES


def assert_untouched(original: Any, module: types.ModuleType | None = None) -> None:
    """The handler's path is vLLM's (the other paths may be patched)."""
    assert not _state.patched(_state.HANDLER)
    assert vars(Handler)["transfer_async"] is original
    if module is not None:
        assert module.resolve_device_pointers is not ptrres.resolve_device_pointers


def assert_warns_once(match: str, patched: list[str] = OTHER_PATCHES) -> None:
    """patch() warns once, naming the handler's path (or vLLM, for a release
    it leaves alone entirely), and patches ``patched`` (the other paths)."""
    path = "vLLM" if patched == [] else f"vLLM's {_state.HANDLER}"
    with pytest.warns(
        plugin.VllmPatchWarning, match=f"^ptrres.vllm left {path} unpatched: .*{match}"
    ) as caught:
        assert plugin.patch() == patched
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plugin.patch() == patched


def installed_release() -> str:
    """The installed vLLM's release series ("0.33" for 0.33.0)."""
    import vllm

    return ".".join(vllm.__version__.split(".")[:2])


def test_the_installed_release_is_a_tested_one() -> None:
    """CI runs these tests on each tested release, never on another."""
    assert installed_release() in plugin.SUPPORTED_VLLM
    assert plugin.SUPPORTED_VLLM == ("0.30", "0.31", "0.32", "0.33")


@pytest.mark.parametrize(
    "version", ["0.34.0", "0.29.1", "1.0.0", "0.330.0", "0.3", "0.3.30", "dev"]
)
def test_untested_versions_are_left_alone(
    version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm

    original = vars(Handler)["transfer_async"]
    monkeypatch.setattr(vllm, "__version__", version)
    assert_warns_once(
        re.escape(version) + r" is not a tested version \(0\.30\.x, ", patched=[]
    )
    assert_untouched(original)
    assert not plugin.is_patched()


@pytest.mark.parametrize("suffix", [".0", ".7", ".1.dev5+g1234abc", ".0+cu129", ""])
def test_tested_versions_include_patch_releases(
    suffix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", installed_release() + suffix)
    assert plugin.patch() == HANDLER_PATCHES


def test_each_release_is_held_to_its_own_constructor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """0.31 added host_memory_is_pinned to the handler's __init__: a vLLM
    whose constructor is not its release's is left alone."""
    import vllm

    has_pinned = "host_memory_is_pinned" in inspect.signature(Handler).parameters
    assert has_pinned == (installed_release() != "0.30")
    original = vars(Handler)["transfer_async"]
    for other in plugin.SUPPORTED_VLLM:
        if (other != "0.30") == has_pinned:
            continue
        monkeypatch.setattr(vllm, "__version__", f"{other}.0")
        assert_warns_once(r"__init__ has the signature")
        assert_untouched(original)
        _patching._warned.clear()


def test_another_signature_leaves_the_handlers_path_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pointer_utils that changed refuses the handler's patch too (one
    path); the other paths are patched."""
    original = vars(Handler)["transfer_async"]

    def resolve_device_pointers(spec: Any, caches: Any, out: Any = None) -> Any:
        raise AssertionError

    module = fake_pointer_utils(resolve_device_pointers=resolve_device_pointers)
    monkeypatch.setitem(sys.modules, POINTER_UTILS, module)
    assert_warns_once("resolve_device_pointers has the signature")
    assert_untouched(original, module)


def test_a_changed_handler_method_leaves_its_path_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def transfer_async(self: Any, job_id: int, spec: Any) -> bool:
        return True

    monkeypatch.setattr(Handler, "transfer_async", transfer_async)
    assert_warns_once("transfer_async has the signature")
    assert_untouched(transfer_async)


def test_a_missing_attribute_leaves_the_handlers_path_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = vars(Handler)["transfer_async"]
    monkeypatch.delattr(Handler, "_fill_direct_ops")
    assert_warns_once("_fill_direct_ops is missing")
    assert_untouched(original)
    monkeypatch.undo()
    monkeypatch.delattr(worker, "_new_descriptor_buffers")
    assert_warns_once("_new_descriptor_buffers is missing")
    assert_untouched(original)


def test_a_missing_pointer_utils_function_leaves_the_handlers_path_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = vars(Handler)["transfer_async"]
    module = fake_pointer_utils()
    del module.iter_pointer_groups
    monkeypatch.setitem(sys.modules, POINTER_UTILS, module)
    assert_warns_once("iter_pointer_groups is missing")
    assert_untouched(original, module)


# --- register(): the entry point -----------------------------------------------


def test_register_patches_once_and_logs_one_line_per_path(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PTRRES_VLLM", raising=False)
    monkeypatch.delenv("PTRRES_VLLM_NIXL", raising=False)
    with caplog.at_level(logging.INFO, logger="ptrres.vllm"):
        plugin.register()
        plugin.register()
        plugin.register()
    assert plugin.patch() == HANDLER_PATCHES  # every path, by register()
    lines = [r for r in caplog.records if r.name == "ptrres.vllm"]
    assert [r.levelno for r in lines] == [logging.INFO] * 3
    import vllm

    for line, path, first in zip(
        lines,
        _state.PATHS,
        ("SingleDirectionOffloadingHandler.__init__", *OTHER_PATCHES[::6]),
        strict=True,
    ):
        assert line.getMessage().startswith(
            f"ptrres {ptrres.__version__} checks vLLM {vllm.__version__}'s {path}: "
            f"patched {first}, "
        )


def test_register_reports_among_vllms_lines_when_nobody_handles_ptrres(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside vLLM only its "vllm" logger has a handler: report through it."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    monkeypatch.delenv("PTRRES_VLLM", raising=False)
    monkeypatch.setattr(_state.logger, "hasHandlers", lambda: False)
    child = logging.getLogger("vllm.ptrres")
    handler = Collect(logging.INFO)
    child.addHandler(handler)
    monkeypatch.setattr(child, "level", logging.INFO)
    try:
        plugin.register()
    finally:
        child.removeHandler(handler)
    assert [r.levelno for r in records] == [logging.INFO] * len(_state.PATHS)
    assert "transfer_async" in records[0].getMessage()


@pytest.mark.parametrize("value", ["0", "false", "OFF"])
def test_ptrres_vllm_0_keeps_the_plugin_off(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = vars(Handler)["transfer_async"]
    monkeypatch.setenv("PTRRES_VLLM", value)
    plugin.register()
    assert_untouched(original)


def test_register_never_raises(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(path: str) -> list[str]:
        raise RuntimeError("boom")

    monkeypatch.setattr(_patching, "patch_path", broken)
    with caplog.at_level(logging.WARNING, logger="ptrres.vllm"):
        plugin.register()
    assert "could not patch vLLM" in caplog.text


def test_register_on_an_untested_version_warns_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import vllm

    original = vars(Handler)["transfer_async"]
    monkeypatch.setattr(vllm, "__version__", "0.40.0")
    with pytest.warns(plugin.VllmPatchWarning) as caught:
        plugin.register()
    assert [str(w.message) for w in caught] == [
        "ptrres.vllm left vLLM unpatched: vLLM 0.40.0 is not a tested version "
        "(0.30.x, 0.31.x, 0.32.x, 0.33.x)"
    ]
    assert_untouched(original)
    assert not plugin.is_patched()
    assert [s.status for s in _patching.path_states()] == ["left alone"] * 3
    assert _hook.PatchOnImport.installed is None  # nothing left to wait for


def test_the_entry_point_is_declared() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(
        r'^\[project\.entry-points\."vllm\.general_plugins"\]\n(.*?)(?:^\[|\Z)',
        text,
        re.M | re.S,
    )
    assert section is not None
    assert re.search(r'^ptrres = "ptrres\.vllm:register"$', section.group(1), re.M)
    assert re.search(r'^vllm = \["vllm>=0\.30,<0\.34"\]$', text, re.M)


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


@pytest.mark.parametrize(
    ("module", "reason", "patched"),
    [
        ("vllm", "vLLM cannot be imported", []),
        (worker.__name__, "gpu_worker cannot be imported", OTHER_PATCHES),
    ],
)
def test_a_vllm_that_cannot_be_imported_is_left_alone(
    module: str, reason: str, patched: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    original = vars(Handler)["transfer_async"]
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    assert_warns_once(reason, patched)
    assert_untouched(original)


def test_a_missing_handler_class_leaves_vllm_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(worker, "SingleDirectionOffloadingHandler")
    assert_warns_once("SingleDirectionOffloadingHandler is missing")
    assert not _state.patched(_state.HANDLER)


def test_a_method_without_a_signature_leaves_vllm_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Unreadable:
        __signature__ = "not a Signature"  # inspect.signature raises TypeError

        def __call__(self) -> None:
            pass

    monkeypatch.setattr(Handler, "get_finished", Unreadable())
    assert_warns_once("get_finished has no readable signature")
    assert not _state.patched(_state.HANDLER)


def test_optional_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    assert optional_module("json") is sys.modules["json"]
    monkeypatch.delitem(sys.modules, "wave", raising=False)  # found, then imported
    assert optional_module("wave").__name__ == "wave"  # type: ignore[union-attr]
    assert optional_module("vllm.no_such_package.pointer_utils") is None
    assert optional_module(POINTER_UTILS) is None  # not in vLLM 0.33
