"""What the vLLM plugin keeps in a process, which every vLLM path reads:
the attributes patch() replaced (none while unpatched), the lock that
patch(), unpatch() and the import hook take, the logger, and the switches
``PTRRES_VLLM``, ``PTRRES_VLLM_COALESCE`` and ``PTRRES_VLLM_NIXL``.

``ptrres.vllm._patching`` alone sets ``applied``; the paths read it at every
call, so that a handler or params built before unpatch() keep vLLM's copies
after it. Importing this module imports nothing of vLLM, numba or ptrres.
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


# What patch() replaced, in order; None when vLLM is not patched.
applied: list[Replacement] | None = None
lock = threading.RLock()


def is_patched() -> bool:
    """Whether patch() has replaced vLLM's attributes (and unpatch() has not)."""
    return applied is not None


def reporter() -> logging.Logger:
    """ptrres's logger, or vLLM's child logger where nothing handles ptrres's."""
    return logger if logger.hasHandlers() else logging.getLogger(_VLLM_CHILD_LOGGER)


def nixl_requested() -> bool:
    """Whether the NIXL connector is patched too (PTRRES_VLLM_NIXL=0: not)."""
    return os.environ.get("PTRRES_VLLM_NIXL", "1").strip().lower() not in OFF_VALUES


def coalesce_requested() -> bool:
    """Whether PTRRES_VLLM_COALESCE=1 asks the paths to merge descriptors."""
    return os.environ.get("PTRRES_VLLM_COALESCE", "0").strip() == "1"
