"""ptrres inside vLLM's CPU offloading and NIXL workers (0.30 to 0.33): a
general plugin.

vLLM has two CPU offloading paths and a NIXL connector, and ``patch()``
takes each on its own:

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

- ``NixlConnector``'s workers (``kv_connector/v1/nixl/``): its
  ``_compute_desc_ids`` checks every block id on both sides
  (``PTRRES_VLLM_NIXL=0`` leaves it alone).

Where the installed vLLM has ``vllm.v1.kv_offload.pointer_utils``, its
``resolve_device_pointers`` and ``iter_pointer_groups`` become ptrres's (the
handler's path).

vLLM calls ``register()`` in every process (API server, engine core, workers)
through the entry point ``ptrres = "ptrres.vllm:register"``; ``PTRRES_VLLM=0``
turns it off. ``register()`` costs next to nothing: it imports no vLLM module,
no numba and no kernel. Each path is patched at once where vLLM has imported
its modules already, else right after vLLM itself first imports one of them,
and its patch imports that path's modules alone; a path that cannot be
patched is left as vLLM has it, with a warning, and the others are patched.
The kernels are made ready when the first handler, params or NIXL worker is
built. Importing this package imports neither vLLM nor numba, and
``import ptrres`` never imports it.

One module a room:

- ``_patching``: patch(), unpatch(), register(): what is replaced on each
  path, all or nothing within it, and when;
- ``_handler``: the offloading handler path (its patched ``__init__`` and
  ``transfer_async``, a handler's ``HandlerPlan``);
- ``_simple``: the simple offload path (its patched ``build_params`` and
  ``copy_blocks``);
- ``_nixl`` and ``_nixl_regions``: the NIXL connector's path (its patched
  ``_compute_desc_ids``, the regions and their checks);
- ``_release``: the tested releases, each path's modules, and the check that
  the installed vLLM's modules, names and signatures are theirs;
- ``_hook``: register()'s wait for vLLM's import of each path;
- ``_state``: the paths and which are patched, the lock, the logger, the
  switches;
- ``_warmup``: the kernels made ready where vLLM builds handlers and params;
- ``_check``: what ``ptrres check`` says of vLLM, the entry point, each
  path and the switches.
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
