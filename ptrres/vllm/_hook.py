"""register()'s import hook: vLLM is patched right after vLLM itself first
imports one of its offloading modules, so that a process that never offloads
(the API server) imports none of them.

The hook is given the modules to wait for and what to run then (register()
gives PATCH_TRIGGERS and its patch-and-report); patch() and unpatch() take
it out. Importing this module imports nothing of vLLM, numba or ptrres.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, ClassVar

from . import _state


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches vLLM right after vLLM first imports a module of its triggers.

    An entry of ``sys.meta_path`` that finds nothing itself: it asks the
    finders after it for a trigger's spec, and wraps the spec's loader
    (ThenPatch) so that patch() runs once the module has. patch() takes it
    out of ``sys.meta_path``, and so does unpatch().
    """

    installed: ClassVar[PatchOnImport | None] = None
    # Triggers whose module is running now, in any thread: patch() waits for
    # the last, since it would find the others half-built.
    running: ClassVar[set[str]] = set()

    def __init__(self, triggers: tuple[str, ...], patch: Callable[[], None]) -> None:
        # The modules whose import means this process may offload.
        self.triggers = triggers
        # What runs once the last running trigger has (patch(), reported).
        self.patch = patch

    @classmethod
    def install(cls, triggers: tuple[str, ...], patch: Callable[[], None]) -> None:
        with _state.lock:
            if cls.installed is None:
                cls.installed = cls(triggers, patch)
                sys.meta_path.insert(0, cls.installed)

    @classmethod
    def remove(cls) -> None:
        with _state.lock:
            finder, cls.installed = cls.installed, None
            if finder is not None and finder in sys.meta_path:
                sys.meta_path.remove(finder)

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in self.triggers:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: ModuleSpec | None = find(fullname, path, target)
            if spec is not None:
                if hasattr(spec.loader, "exec_module"):
                    spec.loader = ThenPatch(spec.loader)
                return spec
        return None


class ThenPatch(importlib.abc.Loader):
    """A trigger's loader: the module runs as its own loader runs it, then
    patch() does (once no other trigger is running)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self.loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The module keeps its own loader, as if nothing had come between.
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        name = module.__name__
        PatchOnImport.running.add(name)
        try:
            self.loader.exec_module(module)
        finally:
            PatchOnImport.running.discard(name)
        finder = PatchOnImport.installed
        if finder is not None and not PatchOnImport.running:
            try:
                finder.patch()
            except Exception:  # a plugin must never take vLLM's import down
                _state.logger.warning(
                    "ptrres: could not patch vLLM; it runs unchanged", exc_info=True
                )

    def __getattr__(self, name: str) -> Any:
        """What else the import system asks of the loader, its own answers."""
        if name == "loader":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)
