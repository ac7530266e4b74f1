"""What the vLLM plugin costs a process at start-up, path by path (issue 35).

Fresh interpreters, with ptrres's entry point and without it (``VLLM_PLUGINS``
naming only the plugins vLLM ships), alternating, medians:

- ``offloading``: vLLM's offloading worker (``gpu_worker``, and the
  OffloadingConnector's worker module, which on 0.34 resolves each job
  through ``pointer_utils``) imported first, as in a worker that offloads;
  then ``load_general_plugins()`` timed. With ptrres it patches the
  offloading paths there (on 0.34: pointer_utils, the connector's resolve,
  the handler; each path's fingerprint computed there), imports no numba,
  and nothing of the NIXL connector (before issue 35 it did: 2755 ms more).
- ``api``: nothing of vLLM's paths imported (the API server); then
  ``load_general_plugins()`` timed.
- ``nixl``: ``load_general_plugins()``, then vLLM's import of its NIXL
  connector (``nixl.connector``, which imports both workers) timed; with
  ptrres the NIXL path is patched inside that import, and the time
  ``patch_path()`` took there is timed on its own.

Usage: ``python benchmarks/vllm_startup.py [--rounds N]`` in a venv where
ptrres is installed (so that vLLM's loader finds its entry point) with a
tested vLLM; the NIXL case needs what vLLM's NIXL connector imports.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import os
import statistics
import subprocess
import sys
from typing import Any

CHILD = """
import json, sys, time
case = sys.argv[1]
import vllm.plugins
if case == "offloading":
    import vllm.v1.kv_offload.cpu.gpu_worker
    import vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker
report = {}
start, cpu = time.perf_counter(), time.process_time()
vllm.plugins.load_general_plugins()
report["load"] = time.perf_counter() - start
report["load_cpu"] = time.process_time() - cpu
if case == "nixl":
    patching = sys.modules.get("ptrres.vllm._patching")
    report["patch"] = report["patch_cpu"] = 0.0
    if patching is not None:
        patch_path = patching.patch_path
        def timed(path):
            start, cpu = time.perf_counter(), time.process_time()
            try:
                return patch_path(path)
            finally:
                report["patch"] += time.perf_counter() - start
                report["patch_cpu"] += time.process_time() - cpu
        patching.patch_path = timed
    start, cpu = time.perf_counter(), time.process_time()
    import vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector
    report["import"] = time.perf_counter() - start
    report["import_cpu"] = time.process_time() - cpu
report["numba"] = "numba" in sys.modules
report["nixl_modules"] = sum(".nixl." in m for m in sys.modules)
states = {}
if "ptrres.vllm._patching" in sys.modules:
    from ptrres.vllm._patching import path_states
    states = {s.path: s.status for s in path_states()}
report["states"] = states
print(json.dumps(report))
"""


def run(case: str, env: dict[str, str]) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, case],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(result.stderr)
    report: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--cases", default="offloading,api,nixl", help="comma-separated cases"
    )
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PTRRES_VLLM")}
    env.pop("VLLM_PLUGINS", None)
    # Python's bytecode cache on, as for an installed package.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    others = [
        ep.name
        for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
        if ep.value != "ptrres.vllm:register"
    ]
    if len(others) == len(
        importlib.metadata.entry_points(group="vllm.general_plugins")
    ):
        raise SystemExit("ptrres's entry point is not installed here")
    envs = {"with": env, "without": {**env, "VLLM_PLUGINS": ",".join(others)}}
    import vllm

    print(
        f"vLLM {vllm.__version__}, Python {sys.version.split()[0]}, "
        f"{args.rounds} fresh interpreters each, alternating; medians (ms): "
        "wall time, and the process's CPU time (time.process_time(), which a "
        "busy machine disturbs less)\n"
    )
    print("| case | measured | clock | without ptrres | with ptrres | added |")
    print("|---|---|---|---:|---:|---:|")
    for case in args.cases.split(","):
        results: dict[str, list[dict[str, Any]]] = {"with": [], "without": []}
        for round_ in range(args.rounds + 1):  # the first writes bytecode caches
            for how in ("with", "without") if round_ % 2 else ("without", "with"):
                report = run(case, envs[how])
                if round_:
                    results[how].append(report)

        def median_ms(
            how: str, key: str, results: dict[str, list[dict[str, Any]]] = results
        ) -> float:
            return float(statistics.median(r[key] for r in results[how])) * 1e3

        keys = ["load"] + (["import"] if case == "nixl" else [])
        for key, clock in itertools.product(keys, ("wall", "cpu")):
            measured = (
                "load_general_plugins()"
                if key == "load"
                else "vLLM's import of nixl.connector"
            )
            name = key if clock == "wall" else f"{key}_cpu"
            added = median_ms("with", name) - median_ms("without", name)
            print(
                f"| {case} | {measured} | {clock} | {median_ms('without', name):.1f} "
                f"| {median_ms('with', name):.1f} | {added:+.1f} |"
            )
        if case == "nixl":
            for clock, name in (("wall", "patch"), ("cpu", "patch_cpu")):
                print(
                    f"| nixl | patch_path(NIXL connector), inside that import | "
                    f"{clock} | | {median_ms('with', name):.1f} | |"
                )
        last = results["with"][-1]
        print(
            f"<!-- {case}: numba imported {last['numba']}, NIXL modules "
            f"{last['nixl_modules']} (without ptrres: "
            f"{results['without'][-1]['nixl_modules']}), paths {last['states']} -->"
        )


if __name__ == "__main__":
    main()
