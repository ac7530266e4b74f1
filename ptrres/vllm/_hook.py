"""register()'s import hook: each of vLLM's paths is patched right after vLLM
itself first imports one of that path's modules, so that a process imports
only the paths it uses (the API server none of them).

The hook is given the paths to wait for, each with its triggers, and what to
run for a path then (register() gives PATH_TRIGGERS and its patch-and-report
of one path). It leaves ``sys.meta_path`` once no path is waiting; patch()
and unpatch() take it out. Importing this module imports nothing of vLLM,
numba or ptrres.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable, Mapping
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, ClassVar

from . import _state


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches each waiting path right after vLLM first imports one of its
    triggers.

    An entry of ``sys.meta_path`` that finds nothing itself: it asks the
    finders after it for a trigger's spec, and wraps the spec's loader
    (ThenPatch) so that the path is patched once the module has run. It
    leaves ``sys.meta_path`` when no path waits any more, and patch() and
    unpatch() take it out.
    """

    installed: ClassVar[PatchOnImport | None] = None
    # Triggers whose module is running now, in any thread: paths are patched
    # once the last has run, since the patch would find the others half-built.
    running: ClassVar[set[str]] = set()

    def __init__(
        self, waiting: Mapping[str, tuple[str, ...]], patch: Callable[[str], None]
    ) -> None:
        # The paths not patched yet, each with the modules whose import means
        # this process may use it.
        self.waiting = dict(waiting)
        # Every waiting path's triggers, looked up on every import.
        self.triggers = frozenset(t for ts in self.waiting.values() for t in ts)
        # What runs for a path once its trigger has (patch_path(), reported).
        self.patch = patch

    @classmethod
    def install(
        cls, waiting: Mapping[str, tuple[str, ...]], patch: Callable[[str], None]
    ) -> None:
        with _state.lock:
            if cls.installed is None and waiting:
                cls.installed = cls(waiting, patch)
                sys.meta_path.insert(0, cls.installed)

    @classmethod
    def remove(cls) -> None:
        with _state.lock:
            finder, cls.installed = cls.installed, None
            if finder is not None and finder in sys.meta_path:
                sys.meta_path.remove(finder)

    @classmethod
    def waiting_paths(cls) -> dict[str, tuple[str, ...]]:
        """The paths the hook waits for, each with its triggers."""
        finder = cls.installed
        return {} if finder is None else dict(finder.waiting)

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

    def patch_imported(self) -> None:
        """Patch every waiting path one of whose triggers is imported; leave
        ``sys.meta_path`` once no path waits."""
        with _state.lock:
            ready = [
                path
                for path, triggers in self.waiting.items()
                if any(name in sys.modules for name in triggers)
            ]
            # Out of the waiting list first: the patch imports the path's
            # other modules, which may be triggers of the same path.
            for path in ready:
                del self.waiting[path]
            self.triggers = frozenset(t for ts in self.waiting.values() for t in ts)
            if not self.waiting and PatchOnImport.installed is self:
                PatchOnImport.remove()
            for path in ready:
                try:
                    self.patch(path)
                except Exception:  # a plugin must never take vLLM's import down
                    _state.logger.warning(
                        "ptrres: could not patch vLLM's %s; it runs unchanged",
                        path,
                        exc_info=True,
                    )


class ThenPatch(importlib.abc.Loader):
    """A trigger's loader: the module runs as its own loader runs it, then
    the waiting paths it triggers are patched (once no other trigger is
    running)."""

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
            finder.patch_imported()

    def __getattr__(self, name: str) -> Any:
        """What else the import system asks of the loader, its own answers."""
        if name == "loader":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)
