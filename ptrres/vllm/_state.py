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


# vLLM's paths, each patched or left alone on its own, when vLLM imports it:
# OffloadingConnector's handler, SimpleCPUOffloadConnector's cuda_mem_ops,
# and the NIXL connector's workers.
HANDLER = "offloading handler"
SIMPLE = "simple offload path"
NIXL = "NIXL connector"
PATHS = (HANDLER, SIMPLE, NIXL)

# What patch() replaced on each patched path, in the order the paths were
# patched; empty when vLLM is not patched.
applied: dict[str, list[Replacement]] = {}
# Why a path was left as vLLM has it (a name or signature not its release's).
refused: dict[str, str] = {}
lock = threading.RLock()


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
