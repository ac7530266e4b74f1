"""What ``ptrres check`` says of vLLM and of the plugin's switches: the vLLM
found and whether it is a tested release, whether vLLM sees the plugin's
entry point, each of vLLM's paths on a line of its own (patched, and on an
untested release whose tested code it has; waiting for vLLM to import it;
left alone and why; not in this vLLM; or switched off), and the switches
PTRRES_VLLM, PTRRES_VLLM_COALESCE and PTRRES_VLLM_NIXL. ``ptrres._operator``
adds Numba's findings and prints them all; a Finding is one line of that
report.

Importing this module imports neither vLLM nor numba: the findings import
vLLM's modules only where vLLM is installed, each path's as vLLM imports it.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from . import _patching, _state
from ._hook import PatchOnImport
from ._patching import PathState, VllmPatchWarning, patch_path, path_states, unpatch
from ._release import (
    PATH_TRIGGERS,
    SIMPLE_BACKEND_MODULES,
    SIMPLE_MODULE,
    SUPPORTED_VLLM,
)

# The topics of the lines that concern one path only: one of them "no" or
# "off" leaves that path alone, not the plugin.
PATH_TOPICS = (*_state.PATHS, "PTRRES_VLLM_NIXL")


@dataclass(frozen=True)
class Finding:
    """One line of `ptrres check`: what was looked at, and what was found."""

    # "ok"; "warn" (the plugin patches, but something costs time or is
    # untested); "no" (the plugin will not patch); "off" (a switch is off, by
    # choice); "wait" (a path patched once vLLM imports it); "none" (this
    # vLLM has no such path).
    status: str
    topic: str
    detail: str


def vllm_findings() -> list[Finding]:
    """The vLLM found, the entry point vLLM would load, and what patch() would
    replace (or why nothing)."""
    import importlib.metadata
    import importlib.util

    findings = []
    tested = ", ".join(SUPPORTED_VLLM)
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is None:
        findings.append(Finding("no", "vLLM", f"not installed here (tested: {tested})"))
    elif version not in SUPPORTED_VLLM:
        findings.append(
            Finding(
                "warn",
                "vLLM",
                f"{version}, not a tested release ({tested}): each path is "
                "patched where its code is a tested release's",
            )
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

    if version is not None:
        findings += path_findings()
    return findings


def path_findings() -> list[Finding]:
    """One line per path of vLLM: what the plugin does with it in a vLLM
    process, found by doing it here, where nothing is patched yet: each
    path's first trigger imported, as vLLM imports it, then that path alone
    patched (the switches honoured); everything restored afterwards. In a
    process where the plugin has patched or waits already, its state as it
    stands."""
    if _state.applied or _state.refused or PatchOnImport.installed is not None:
        return [path_finding(state) for state in path_states()]
    unimportable: dict[str, str] = {}
    # The warnings patch_path() gives here are not shown: they stay unsaid,
    # so that a patch() after this check still says them, once.
    warned = set(_patching._warned)
    try:
        with warnings.catch_warnings():
            # The reasons are the lines' own.
            warnings.simplefilter("ignore", VllmPatchWarning)
            for path in _state.PATHS:
                if _state.switched_off(path) is not None:
                    continue
                trigger = PATH_TRIGGERS[path][0]
                try:
                    importlib.import_module(trigger)
                except ModuleNotFoundError as error:
                    if error.name is not None and (
                        trigger == error.name or trigger.startswith(f"{error.name}.")
                    ):  # this vLLM has no such module: absent, not broken
                        patch_path(path)
                        continue
                    unimportable[path] = f"{trigger} cannot be imported ({error!r})"
                    continue
                except Exception as error:  # its own imports may fail
                    unimportable[path] = f"{trigger} cannot be imported ({error!r})"
                    continue
                patch_path(path)
            states = path_states()
    finally:
        unpatch()
        _patching._warned.intersection_update(warned)
    return [
        path_finding(
            PathState(state.path, "left alone", (unimportable[state.path],))
            if state.path in unimportable
            else state
        )
        for state in states
    ]


def path_finding(state: PathState) -> Finding:
    """One path's line: patched (what), waiting (for which modules), left
    alone (why), or switched off (by which switch)."""
    if state.status == "patched":
        return Finding("ok", state.path, _patched_detail(state))
    if state.status == "waiting":
        modules = " or ".join(_trigger_name(m) for m in state.detail)
        return Finding(
            "wait",
            state.path,
            f"waiting for vLLM to import it ({modules}); patched then",
        )
    if state.status == "left alone":
        return Finding("no", state.path, f"left as vLLM has it: {state.detail[0]}")
    if state.status == "absent":
        return Finding("none", state.path, "not in this vLLM: nothing to patch")
    if state.status == "off":
        return Finding(
            "off", state.path, f"switched off ({state.detail[0]}): left as vLLM has it"
        )
    return Finding("no", state.path, "not patched: the plugin is not registered here")


def _trigger_name(module: str) -> str:
    """A trigger as a line names it: its last part, or its last two where
    another path's trigger ends the same (the offloading connector's
    ``offloading.worker``, the file worker's ``fs.worker``)."""
    last = module.rpartition(".")[2]
    alike = {
        m for ms in PATH_TRIGGERS.values() for m in ms if m.rpartition(".")[2] == last
    }
    return last if len(alike) == 1 else ".".join(module.split(".")[-2:])


def _patched_detail(state: PathState) -> str:
    """What a patched path's line says: the attributes replaced, and when."""
    triggers = " or ".join(_trigger_name(m) for m in PATH_TRIGGERS[state.path])
    when = f"once vLLM imports {triggers}"
    match = state.match
    if match is not None and match.by_fingerprint:
        when += (
            f" (vLLM {match.installed} is untested; its code here is {match.release}'s)"
        )
    if state.path == _state.SIMPLE:
        modules = (SIMPLE_MODULE, *SIMPLE_BACKEND_MODULES)
        simple = [n for n in state.detail if n.rpartition(".")[0] in modules]
        functions = ", ".join(dict.fromkeys(n.rpartition(".")[2] for n in simple))
        where = ", ".join(
            dict.fromkeys(n.rpartition(".")[0].rpartition(".")[2] for n in simple)
        )
        return f"patched {when}: {functions} (SimpleCPUOffloadConnector), in {where}"
    if state.path == _state.NIXL:
        return (
            f"patched {when}: {', '.join(state.detail)} (NixlConnector, pull and "
            "push): every block id checked on both sides"
        )
    return f"patched {when}: {', '.join(state.detail)}"


def summary(findings: Sequence[Finding]) -> tuple[int, str]:
    """`ptrres check`'s exit status and last line: 0 where the plugin will
    patch every path of vLLM that no switch turns off; else 1, naming what
    keeps the plugin off, or the paths it leaves alone and those it patches."""
    blocking = [
        f for f in findings if f.status in ("no", "off") and f.topic not in PATH_TOPICS
    ]
    paths = [f for f in findings if f.topic in _state.PATHS and f.status != "none"]
    patched = [f.topic for f in paths if f.status in ("ok", "wait")]
    if not blocking and paths and not patched:
        blocking = [f for f in paths if f.status == "no"] or paths
    if blocking:
        return 1, (
            "The plugin will not patch vLLM: "
            + "; ".join(f.topic for f in blocking)
            + "."
        )
    alone = [f.topic for f in paths if f.status == "no"]
    off = [f.topic for f in paths if f.status == "off"]
    if alone:
        return 1, (
            f"The plugin will patch vLLM's {_and(patched)}, and leave its "
            f"{_and(alone)} as vLLM has it (why: above)."
        )
    if off:
        return 0, (
            f"The plugin will patch vLLM's {_and(patched)} in every process "
            f"vLLM starts ({_and(off)}: switched off)."
        )
    return 0, "The plugin will patch vLLM in every process vLLM starts."


def _and(names: Sequence[str]) -> str:
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


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
            f"{'unset' if nixl is None else nixl}: "
            + (
                "on for vLLM's NIXL connector (PTRRES_VLLM_NIXL=0 leaves it alone)"
                if _state.nixl_requested()
                else "vLLM's NIXL connector is left alone"
            ),
        )
    )
    return findings
