"""What ``ptrres check`` says of vLLM and of the plugin's switches: the vLLM
found and whether it is a tested release, whether vLLM sees the plugin's
entry point, what patch() would replace (or why nothing), and the switches
PTRRES_VLLM, PTRRES_VLLM_COALESCE and PTRRES_VLLM_NIXL. ``ptrres._operator``
adds Numba's findings and prints them all; a Finding is one line of that
report.

Importing this module imports neither vLLM nor numba: the findings import
vLLM's offloading modules only where a tested vLLM is installed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import _state
from ._patching import plan_replacements
from ._release import (
    NIXL_METHODS,
    SIMPLE_BACKEND_MODULES,
    SIMPLE_MODULE,
    SUPPORTED_VERSION,
    SUPPORTED_VLLM,
)

# The NIXL connector's classes patch() replaces methods of.
NIXL_CLASSES = {class_name for _, class_name, _ in NIXL_METHODS}


@dataclass(frozen=True)
class Finding:
    """One line of `ptrres check`: what was looked at, and what was found."""

    # "ok"; "warn" (the plugin patches, but something costs time); "no" (the
    # plugin will not patch); "off" (a switch is off, by choice).
    status: str
    topic: str
    detail: str


def vllm_findings() -> list[Finding]:
    """The vLLM found, the entry point vLLM would load, and what patch() would
    replace (or why nothing)."""
    import importlib.metadata
    import importlib.util

    findings = []
    tested = ", ".join(f"{release}.x" for release in SUPPORTED_VLLM)
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is None:
        findings.append(Finding("no", "vLLM", f"not installed here (tested: {tested})"))
    elif SUPPORTED_VERSION.match(version) is None:
        findings.append(
            Finding("no", "vLLM", f"{version}, not a tested release ({tested})")
        )
    else:
        where = importlib.util.find_spec("vllm")
        place = f" ({os.path.dirname(where.origin)})" if where and where.origin else ""
        findings.append(Finding("ok", "vLLM", f"{version}, a tested release{place}"))

    group = "vllm.general_plugins"
    ours = [
        ep
        for ep in importlib.metadata.entry_points(group=group)
        if ep.value == "ptrres.vllm:register"
    ]
    if not ours:
        findings.append(
            Finding(
                "no",
                "entry point",
                f"none in {group}: install ptrres into vLLM's environment",
            )
        )
    else:
        ep = ours[0]
        dist = getattr(ep, "dist", None)
        source = f", from {dist.name} {dist.version}" if dist is not None else ""
        findings.append(
            Finding("ok", "entry point", f"{ep.name} = {ep.value} in {group}{source}")
        )
        allowed = os.environ.get("VLLM_PLUGINS")
        if allowed is None:
            findings.append(
                Finding("ok", "VLLM_PLUGINS", "unset: vLLM loads every general plugin")
            )
        elif ep.name in allowed.split(","):
            findings.append(Finding("ok", "VLLM_PLUGINS", f"{allowed}: includes it"))
        else:
            findings.append(
                Finding(
                    "no", "VLLM_PLUGINS", f"{allowed}: vLLM will not load {ep.name!r}"
                )
            )

    if version is not None and findings[0].status == "ok":
        replacements, refusal = plan_replacements()
        if refusal is None:
            findings += _patch_findings([r.qualified_name for r in replacements])
        else:
            findings.append(Finding("no", "patches", f"nothing: {refusal}"))
    return findings


def _patch_findings(names: list[str]) -> list[Finding]:
    """What patch() would replace: the handler's methods (and pointer_utils')
    on one line, the simple offload path's functions on another, the NIXL
    connector's methods on a third."""
    modules = (SIMPLE_MODULE, *SIMPLE_BACKEND_MODULES)
    simple = [n for n in names if n.rpartition(".")[0] in modules]
    nixl = [n for n in names if n.split(".")[0] in NIXL_CLASSES]
    findings = [
        Finding(
            "ok",
            "patches",
            ", ".join(n for n in names if n not in simple and n not in nixl),
        )
    ]
    if simple:
        functions = ", ".join(dict.fromkeys(n.rpartition(".")[2] for n in simple))
        where = ", ".join(
            dict.fromkeys(n.rpartition(".")[0].rpartition(".")[2] for n in simple)
        )
        findings.append(
            Finding(
                "ok",
                "simple offload",
                f"{functions} (SimpleCPUOffloadConnector), in {where}",
            )
        )
    if nixl:
        findings.append(
            Finding(
                "ok",
                "NIXL connector",
                f"{', '.join(nixl)} (NixlConnector, pull and push): every block "
                "id checked on both sides",
            )
        )
    elif not _state.nixl_requested():
        findings.append(
            Finding(
                "off",
                "NIXL connector",
                "left as vLLM has it: its block ids are not checked "
                "(PTRRES_VLLM_NIXL=0)",
            )
        )
    return findings


def switch_findings() -> list[Finding]:
    """The switches: PTRRES_VLLM (on or off), PTRRES_VLLM_COALESCE,
    PTRRES_VLLM_NIXL."""
    switch = os.environ.get("PTRRES_VLLM")
    off = switch is not None and switch.strip().lower() in _state.OFF_VALUES
    findings = [
        Finding(
            "off" if off else "ok",
            "PTRRES_VLLM",
            f"{'unset' if switch is None else switch}: the plugin is "
            + ("off" if off else "on (PTRRES_VLLM=0 turns it off)"),
        )
    ]
    coalesce = os.environ.get("PTRRES_VLLM_COALESCE")
    findings.append(
        Finding(
            "ok",
            "PTRRES_VLLM_COALESCE",
            f"{'unset' if coalesce is None else coalesce}: coalescing "
            + (
                "on, where vLLM copies with cuMemcpyBatchAsync"
                if _state.coalesce_requested()
                else "off (PTRRES_VLLM_COALESCE=1 turns it on)"
            ),
        )
    )
    nixl = os.environ.get("PTRRES_VLLM_NIXL")
    findings.append(
        Finding(
            "ok" if _state.nixl_requested() else "off",
            "PTRRES_VLLM_NIXL",
            f"{'unset' if nixl is None else nixl}: vLLM's NIXL connector is "
            + (
                "patched (PTRRES_VLLM_NIXL=0 leaves it alone)"
                if _state.nixl_requested()
                else "left alone"
            ),
        )
    )
    return findings
