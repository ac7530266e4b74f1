"""What the vLLM plugin keeps in a process, which every vLLM path reads:
the paths, the attributes patch() replaced on each (none while unpatched) and
why a path was left alone, the lock that patch(), unpatch() and the import
hook take, the logger, and the switches ``PTRRES_VLLM``,
``PTRRES_VLLM_COALESCE`` and ``PTRRES_VLLM_NIXL``.

``ptrres.vllm._patching`` alone sets ``applied`` and ``refused``; each path
reads at every call whether it is patched, so that a handler, params or a
worker built before unpatch() keep vLLM's own code after it. Importing this
module imports nothing of vLLM, numba or ptrres.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("ptrres.vllm")
# vLLM configures only its own "vllm" logger: where nobody handles ptrres's
# records (the usual case inside vLLM), register() reports through a child of
# it, so its line shows among vLLM's.
_VLLM_CHILD_LOGGER = "vllm.ptrres"

# PTRRES_VLLM values that turn the plugin off.
OFF_VALUES = ("0", "false", "off", "no")


@dataclass(frozen=True)
class Replacement:
    """One attribute patch() replaces: where it lives, vLLM's own, and ours."""

    owner: Any  # a class or a module
    name: str
    original: Any
    replacement: Any

    @property
    def qualified_name(self) -> str:
        owner = getattr(self.owner, "__qualname__", None) or self.owner.__name__
        return f"{owner}.{self.name}"


# vLLM's paths, each patched or left alone on its own, when vLLM imports it
# (in this order, where one import brings several): pointer_utils' functions
# (0.34 and later); the OffloadingConnector's worker, which resolves each
# job's blocks with them (0.34); its CPU handler; its file worker (0.34);
# SimpleCPUOffloadConnector's cuda_mem_ops; and the NIXL connector's workers.
POINTER_UTILS = "pointer_utils"
CONNECTOR = "offloading connector"
HANDLER = "offloading handler"
FILE_WORKER = "file worker"
SIMPLE = "simple offload path"
NIXL = "NIXL connector"
PATHS = (POINTER_UTILS, CONNECTOR, HANDLER, FILE_WORKER, SIMPLE, NIXL)


@dataclass(frozen=True)
class Match:
    """Whose code the installed vLLM has on a path: a tested release's."""

    # The tested release whose recorded fingerprint the path's code has
    # ("0.34.0"): the installed release itself, or, for an untested one, a
    # tested release whose code on this path it kept.
    release: str
    # The form of the patch that applies (the first release it was made for).
    variant: str
    # The installed vLLM's version.
    installed: str

    @property
    def by_fingerprint(self) -> bool:
        """Whether the path is patched on an untested vLLM, for its code."""
        return self.release != self.installed


# What patch() replaced on each patched path, in the order the paths were
# patched; empty when vLLM is not patched.
applied: dict[str, list[Replacement]] = {}
# Whose code each patched path has.
matches: dict[str, Match] = {}
# Why a path was left as vLLM has it (its code is no tested release's).
refused: dict[str, str] = {}
# The paths the installed vLLM does not have (none of their modules).
absent: set[str] = set()
lock = threading.RLock()


def vllm_own(obj: Any) -> Any:
    """The vLLM object a patched attribute replaced, where ``obj`` is one of
    ptrres's replacements (another path's, say, which a module imported by
    name); else ``obj`` itself."""
    for replacements in applied.values():
        for r in replacements:
            if r.replacement is obj:
                return r.original
    return obj


def is_patched() -> bool:
    """Whether vLLM is patched: patch() replaced the attributes of at least one
    of its paths (and unpatch() has not restored them)."""
    return bool(applied)


def patched(path: str) -> bool:
    """Whether ``path`` (one of PATHS) is patched now."""
    return path in applied


def switched_off(path: str) -> str | None:
    """The switch that leaves ``path`` as vLLM has it, or None."""
    if os.environ.get("PTRRES_VLLM", "1").strip().lower() in OFF_VALUES:
        return "PTRRES_VLLM=0"
    if path == NIXL and not nixl_requested():
        return "PTRRES_VLLM_NIXL=0"
    return None


def reporter() -> logging.Logger:
    """ptrres's logger, or vLLM's child logger where nothing handles ptrres's."""
    return logger if logger.hasHandlers() else logging.getLogger(_VLLM_CHILD_LOGGER)


def nixl_requested() -> bool:
    """Whether the NIXL connector is patched too (PTRRES_VLLM_NIXL=0: not)."""
    return os.environ.get("PTRRES_VLLM_NIXL", "1").strip().lower() not in OFF_VALUES


def coalesce_requested() -> bool:
    """Whether PTRRES_VLLM_COALESCE=1 asks the paths to merge descriptors."""
    return os.environ.get("PTRRES_VLLM_COALESCE", "0").strip() == "1"
