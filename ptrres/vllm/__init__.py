"""ptrres inside vLLM's CPU offloading workers (0.30 to 0.33): a general plugin.

vLLM has two CPU offloading paths, and ``patch()`` takes both:

- ``OffloadingConnector``'s ``SingleDirectionOffloadingHandler``
  (``vllm/v1/kv_offload/cpu/gpu_worker.py``) builds its copy descriptors with
  a numpy pass per group, ref and side, unchecked. Its ``transfer_async``
  becomes one that builds the whole descriptor list with one ptrres plan,
  written straight into vLLM's own pooled pinned buffers, checking every id
  before anything is submitted. Its ``__init__`` is wrapped: once vLLM's own
  has run, every ptrres kernel is made ready (``ptrres.warmup()``: loaded from
  Numba's cache, or compiled) and the handler's PointerTable and
  OffloadedLayout are built, so that no transfer compiles or loads anything.
- ``SimpleCPUOffloadConnector`` (``vllm/v1/simple_kv_offload/``) submits its
  copies through ``cuda_mem_ops.copy_blocks``: its ``build_params`` and
  ``copy_blocks`` become ptrres's, everywhere vLLM looks them up, so that
  every id is checked and the descriptors are built by one kernel into reused
  buffers.

Where the installed vLLM has ``vllm.v1.kv_offload.pointer_utils``, its
``resolve_device_pointers`` and ``iter_pointer_groups`` become ptrres's.

vLLM calls ``register()`` in every process (API server, engine core, workers)
through the entry point ``ptrres = "ptrres.vllm:register"``; ``PTRRES_VLLM=0``
turns it off. ``register()`` costs next to nothing: it imports no vLLM module,
no numba and no kernel. It patches at once where vLLM's offloading modules
are already imported, else right after vLLM itself first imports one; the
kernels are made ready when the first handler or the first params are built.
Importing this package imports neither vLLM nor numba, and ``import ptrres``
never imports it.

One module a room:

- ``_patching``: patch(), unpatch(), register(): what is replaced, all or
  nothing, and when;
- ``_handler``: the offloading handler path (its patched ``__init__`` and
  ``transfer_async``, a handler's ``HandlerPlan``);
- ``_simple``: the simple offload path (its patched ``build_params`` and
  ``copy_blocks``);
- ``_release``: the tested releases, and the check that the installed
  vLLM's modules, names and signatures are theirs;
- ``_hook``: register()'s wait for vLLM's first offloading import;
- ``_state``: whether vLLM is patched, the lock, the logger, the switches;
- ``_warmup``: the kernels made ready where vLLM builds handlers and params;
- ``_check``: what ``ptrres check`` says of vLLM, the entry point and the
  switches.
"""

from __future__ import annotations

from ._patching import VllmPatchWarning, patch, register, unpatch
from ._release import SUPPORTED_VLLM
from ._state import is_patched

__all__ = [
    "SUPPORTED_VLLM",
    "VllmPatchWarning",
    "is_patched",
    "patch",
    "register",
    "unpatch",
]
