"""`ptrres warmup` and `ptrres check`: what an operator runs before turning
the vLLM plugin on (an image build filling Numba's cache; whether the plugin
will patch vLLM here, and why). `ptrres._cli` parses their arguments; what
`ptrres check` says of vLLM, the entry point and the switches is
`ptrres.vllm._check`'s, and this module adds Numba's findings."""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from .vllm._check import Finding


def warmup_command(processes: int | None, out: TextIO) -> int:
    """`ptrres warmup`: every kernel into Numba's cache; 1 where none can be."""
    from . import warmup
    from .vllm._warmup import describe_warmup

    if processes is not None and processes < 1:
        raise SystemExit("ptrres warmup: --processes must be at least 1")
    if _jit_disabled():
        out.write(
            "ptrres warmup: NUMBA_DISABLE_JIT is set, so the kernels run as "
            "Python: there is nothing to compile or cache.\n"
        )
        return 1
    refused = _cache_refused()
    if refused is not None:
        out.write(
            f"ptrres warmup: Numba cannot cache here ({refused}), so every "
            "process would compile the kernels again. Set NUMBA_CACHE_DIR to a "
            "writable directory.\n"
        )
        return 1
    report = warmup(processes=processes)
    out.write(describe_warmup(report) + "\n")
    for how in ("compiled", "loaded", "ready", "interpreted"):
        kernels = [k.kernel for k in report.kernels if k.how == how]
        if kernels:
            names = ", ".join(
                f"{name} ({kernels.count(name)})" if kernels.count(name) > 1 else name
                for name in dict.fromkeys(kernels)
            )
            out.write(f"  {how:<8} {len(kernels):>3}  {names}\n")
    out.write(f"Numba's cache: {_cache_location(_cache_paths())}\n")
    out.write(
        f"Compiled for this CPU ({cpu_model()}): on another CPU model the "
        "kernels compile again.\n"
    )
    return 0


def _jit_disabled() -> bool:
    import numba

    return bool(numba.config.DISABLE_JIT)  # type: ignore[attr-defined]


def _cache_refused() -> str | None:
    """Why Numba cannot cache ptrres's kernels in this process (None if it can)."""
    from . import _config

    return _config.cache_refused


def _cache_paths() -> list[str]:
    """Where Numba caches ptrres's kernels (one folder, unless they differ)."""
    from ._config import KERNELS

    paths = (getattr(getattr(d, "stats", None), "cache_path", None) for d, _ in KERNELS)
    return list(dict.fromkeys(str(path) for path in paths if path))


def _cache_location(paths: list[str]) -> str:
    """The cache folder(s), and what chose them."""
    chosen = os.environ.get("NUMBA_CACHE_DIR")
    why = f"NUMBA_CACHE_DIR={chosen}" if chosen else "NUMBA_CACHE_DIR unset"
    return f"{', '.join(paths) or 'none'} ({why})"


def _inside(path: str, folder: str) -> bool:
    """Whether path is folder or inside it."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def _writable(path: str) -> str | None:
    """Why a cache folder cannot be written (None when a file can be made in
    it, which is what Numba does; the folder is made first, as Numba would)."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        return error.strerror or str(error)
    return None


def check_findings(*, kernels: bool = True) -> list[Finding]:
    """Everything `ptrres check` reports, in order; the plugin will patch vLLM
    when no finding says "no" or "off"."""
    from .vllm._check import switch_findings, vllm_findings

    findings = vllm_findings()
    findings += switch_findings()
    findings += _numba_findings(kernels=kernels)
    return findings


def numba_probe(*, kernels: bool) -> dict[str, Any]:
    """What Numba does with ptrres's kernels in this process: its version,
    where it caches them (or why it cannot), and with ``kernels`` what
    warmup() did, by how. `ptrres check` runs this in a fresh interpreter."""
    import numba

    from . import warmup

    probe: dict[str, Any] = {
        "numba": numba.__version__,
        "jit_disabled": _jit_disabled(),
        "cache_refused": _cache_refused(),
        "cache_paths": _cache_paths(),
    }
    if kernels:
        report = warmup()
        probe["signatures"] = len(report.kernels)
        probe["counts"] = {k.how: report.count(k.how) for k in report.kernels}
        probe["seconds"] = report.seconds
    return probe


# `ptrres check`'s child: numba_probe() in a fresh interpreter, as JSON.
_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from ptrres._operator import numba_probe
print(json.dumps(numba_probe(kernels=sys.argv[2] == "1")))
"""


def _run_probe(*, kernels: bool) -> dict[str, Any]:
    """numba_probe() in a fresh interpreter with this environment: what a
    vLLM worker started now would find (this process may have compiled or
    loaded kernels already, which warmup() then reports as "ready")."""
    import subprocess

    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, package_parent, "1" if kernels else "0"],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"a fresh interpreter could not warm up ptrres: {last}")
    probe: dict[str, Any] = json.loads(lines[-1])
    return probe


def _numba_findings(*, kernels: bool) -> list[Finding]:
    from .vllm._check import Finding

    try:
        probe = _run_probe(kernels=kernels)
    except (OSError, RuntimeError) as error:
        return [Finding("warn", "kernels", str(error))]
    return probe_findings(probe)


def probe_findings(probe: dict[str, Any]) -> list[Finding]:
    """`ptrres check`'s findings about Numba, from a numba_probe() report."""
    from .vllm._check import Finding

    findings = [Finding("ok", "numba", probe["numba"])]
    if probe["jit_disabled"]:
        findings.append(
            Finding("warn", "Numba cache", "none: NUMBA_DISABLE_JIT is set, kernels "
                    "run as Python (slowly)")
        )  # fmt: skip
        return findings
    refused = probe["cache_refused"]
    if refused is not None:
        findings.append(
            Finding("warn", "Numba cache", f"none: {refused}; every process compiles")
        )
    else:
        paths = probe["cache_paths"]
        problems = [
            f"{p} is not writable: {why}" for p in paths if (why := _writable(p))
        ]
        chosen = os.environ.get("NUMBA_CACHE_DIR")
        if chosen and not all(_inside(p, chosen) for p in paths):
            # Numba passes over a NUMBA_CACHE_DIR it cannot use, silently.
            why = _writable(chosen) or "Numba did not use it"
            problems.append(f"NUMBA_CACHE_DIR is not used ({why})")
        findings.append(
            Finding(
                "warn" if problems else "ok",
                "Numba cache",
                _cache_location(paths)
                + "".join(f"; {problem}" for problem in problems)
                + ("" if problems else ", writable"),
            )
        )
    if "counts" in probe:  # the probe made the kernels ready
        counts, total = probe["counts"], probe["signatures"]
        compiled = counts.get("compiled", 0)
        if compiled == 0:
            detail = f"warm: {counts.get('loaded', 0)} of {total} signatures loaded"
        else:
            detail = f"cold: {compiled} of {total} signatures compiled" + (
                ", into the cache (a second check finds it warm)"
                if refused is None
                else ""
            )
        findings.append(
            Finding(
                "ok" if compiled == 0 else "warn",
                "kernels",
                f"{detail}, in {probe['seconds']:.2f} s by a fresh interpreter "
                f"(on {cpu_model()}; another CPU model recompiles)",
            )
        )
    return findings


def check_command(out: TextIO, *, kernels: bool = True) -> int:
    """`ptrres check`: the findings, one a line; 0 when the plugin will patch
    every path of vLLM no switch turns off (the last line says which paths
    it patches and which it leaves alone)."""
    from . import __version__
    from .vllm._check import summary

    out.write(f"ptrres {__version__} ({os.path.dirname(__file__)})\n")
    findings = check_findings(kernels=kernels)
    width = max(len(f.topic) for f in findings)
    for f in findings:
        out.write(f"  {f.status:<4} {f.topic:<{width}}  {f.detail}\n")
    status, last_line = summary(findings)
    out.write(last_line + "\n")
    return status


def cpu_model() -> str:
    """The CPU's model name (Numba's cache is keyed by it)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
