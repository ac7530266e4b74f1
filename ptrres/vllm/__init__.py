"""ptrres inside vLLM's offloading and NIXL workers (0.30 to 0.34, and a
later release path by path where its code is a tested release's): a general
plugin.

vLLM's paths (``ptrres check`` lists them), each patched on its own:

- ``pointer_utils`` (0.34): ``resolve_device_pointers`` and
  ``iter_pointer_groups`` become ptrres's, returning vLLM's own types, every
  id checked (a bad one raises).
- the offloading connector (0.34): the resolve it calls on every store and
  load refuses a job's bad ids without raising in the engine step; the
  handler or file worker then fails that job as a failed copy fails it.
- the offloading handler (``SingleDirectionOffloadingHandler``,
  ``vllm/v1/kv_offload/cpu/gpu_worker.py``): its ``transfer_async`` builds
  the whole descriptor list with one ptrres plan, written straight into
  vLLM's own pooled pinned buffers, every id checked before anything is
  submitted. Where vLLM builds its handlers (the handler's ``__init__`` on
  0.30-0.33, ``CPUOffloadingWorker.__init__`` on 0.34), every ptrres kernel
  is made ready and the tables are built, so that no transfer compiles or
  loads anything.
- the file worker (0.34, ``FSOffloadingWorker._submit_io``): the file op
  lists, from one compiled plan.
- the simple offload path (``SimpleCPUOffloadConnector``'s
  ``cuda_mem_ops.build_params`` and ``copy_blocks``, everywhere vLLM looks
  them up): every id checked, the descriptors built by one kernel into
  reused buffers.
- the NIXL connector (``kv_connector/v1/nixl/``): its ``_compute_desc_ids``
  checks every block id on both sides (``PTRRES_VLLM_NIXL=0`` leaves it
  alone).

A path is patched where the installed vLLM's code on it (every function the
patch replaces, reproduces or reads) has the fingerprint of a tested
release's, whatever the version string says; a path whose code changed is
left as vLLM has it, with one warning naming it and what differs, and the
others are patched.

vLLM calls ``register()`` in every process (API server, engine core, workers)
through the entry point ``ptrres = "ptrres.vllm:register"``; ``PTRRES_VLLM=0``
turns it off. ``register()`` costs next to nothing: it imports no vLLM module,
no numba and no kernel. Each path is patched at once where vLLM has imported
its modules already, else right after vLLM itself first imports one of them,
and its patch imports that path's modules alone. Importing this package
imports neither vLLM nor numba, and ``import ptrres`` never imports it.

One module a room:

- ``_patching``: patch(), unpatch(), register(): what is replaced on each
  path, all or nothing within it, and when;
- ``_release``: the tested releases, each path's modules and triggers, the
  vLLM code each form of its patch depends on, and whose code the installed
  vLLM has on a path (``match_path``);
- ``_fingerprint``: the fingerprint of vLLM code; ``fingerprints.json``, the
  tested releases' (``_record`` writes the installed release's);
- ``_pointers``: pointer_utils' functions and the connector's job resolve;
- ``_handler`` and ``_handler_pointers``: the offloading handler path, in
  0.30-0.33's form and in 0.34's (its ``CPUOffloadingWorker``);
- ``_file_worker`` and ``_file_pages``: the file worker path (and the pages
  whose vLLM offsets overlap, refused);
- ``_simple``: the simple offload path (its patched ``build_params`` and
  ``copy_blocks``);
- ``_nixl``, ``_nixl_regions`` and ``_nixl_pairs``: the NIXL connector's
  path (0.30-0.33's ``_compute_desc_ids``; 0.34's, which pairs regions by
  layer name);
- ``_hook``: register()'s wait for vLLM's import of each path;
- ``_state``: the paths and which are patched, the lock, the logger, the
  switches;
- ``_warmup``: the kernels made ready where vLLM builds its workers;
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
