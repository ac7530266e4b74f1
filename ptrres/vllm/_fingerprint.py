"""Fingerprints of the vLLM code each path's patch depends on, and those of
the tested releases.

A path's patch replaces some of vLLM's functions, reproduces the results of
others, and reads the fields and attributes of others still (a PathCode
names all of them). Each is named by a locator, ``"module:Qualname"``: a
module-level name (a binding counts: ``gpu_worker:iter_pointer_groups`` is
the function that module imported), or a class attribute, looked up in the
class's own namespace, so that an override a subclass does not have is
"missing". Its fingerprint:

- a function, a property or a class: where it is defined and its source,
  the lines of its block as its module's file has them (decorators,
  signature, body, comments), so that any change to its code changes it. A
  function defined elsewhere than vLLM defines it (someone's wrapper) has
  another fingerprint;
- anything else: ``present``; an attribute that is not there: ``missing``.

The source is read from the file (``linecache``) and cut by indentation, not
tokenized or parsed: it costs microseconds per function and reads the same
on every Python. ``ptrres.vllm`` patches a path where its fingerprint equals
that of a tested release (``RECORDED``, from ``fingerprints.json``, which
``python -m ptrres.vllm._fingerprint`` writes for the installed release).

Importing this module imports nothing of vLLM, numba or ptrres's kernels.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import linecache
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

RECORD_FILE = Path(__file__).with_name("fingerprints.json")
MISSING: Final = "missing"
PRESENT: Final = "present"
# A function or class whose file cannot be read (vLLM installed as bytecode
# alone): no tested release's, and said so.
NO_SOURCE: Final = "no source"


@dataclass(frozen=True)
class PathCode:
    """The vLLM code one variant of a path's patch depends on, by locator."""

    # What the patch replaces: the attributes it sets.
    replaces: tuple[str, ...]
    # vLLM code whose results the replacement gives (or calls on the way).
    reproduces: tuple[str, ...] = ()
    # Classes, functions and names whose fields, attributes or behaviour the
    # replacement relies on without giving their results.
    reads: tuple[str, ...] = ()

    def locators(self) -> tuple[str, ...]:
        return (*self.replaces, *self.reproduces, *self.reads)


Fingerprint = dict[str, str]


def fingerprint(
    code: PathCode, original: Callable[[Any], Any] | None = None
) -> Fingerprint:
    """The fingerprint of every locator of ``code`` in the vLLM imported here.

    Args:
        original: maps an object to the one it replaced, where ptrres has
            patched it already (another path's binding), so that a patched
            vLLM fingerprints as vLLM's own.
    """
    return {locator: digest(find(locator), original) for locator in code.locators()}


def find(locator: str) -> Any:
    """The object a locator names, or MISSING (its module imported first)."""
    module_name, _, qualname = locator.partition(":")
    module = sys.modules.get(module_name)
    if module is None:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return MISSING
    found: Any = module
    for part in qualname.split("."):
        if isinstance(found, type):
            found = vars(found).get(part, MISSING)
        else:
            found = getattr(found, part, MISSING)
        if found is MISSING:
            return MISSING
    return found


def digest(obj: Any, original: Callable[[Any], Any] | None = None) -> str:
    """One object's fingerprint (see the module's docstring)."""
    if obj is MISSING:
        return MISSING
    if original is not None:
        obj = original(obj)
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property) and obj.fget is not None:
        obj = obj.fget
    code = getattr(obj, "__code__", None)
    if code is not None:
        source = _block(linecache.getlines(code.co_filename), code.co_firstlineno - 1)
        where = f"{obj.__module__}:{obj.__qualname__}"
    elif isinstance(obj, type):
        source = _class_source(obj)
        where = f"{obj.__module__}:{obj.__qualname__}"
    else:
        return PRESENT
    if source == _NO_SOURCE:
        return NO_SOURCE
    text = f"{where}\n{source}".encode()
    return hashlib.sha256(text).hexdigest()[:16]


def _class_source(cls: type) -> str:
    """A class's block, found by its ``class`` line in its module's file."""
    module = sys.modules.get(cls.__module__)
    filename = getattr(module, "__file__", None)
    if filename is None:
        return _NO_SOURCE
    lines = linecache.getlines(filename)
    header = re.compile(rf"\s*class {re.escape(cls.__name__)}\b")
    for index, line in enumerate(lines):
        if header.match(line):
            start = index
            while start > 0 and lines[start - 1].lstrip().startswith("@"):
                start -= 1
            return _block(lines, start)
    return _NO_SOURCE


_CLOSING = (")", "]", "}")
_NO_SOURCE = "<no source>"


def _block(lines: list[str], start: int) -> str:
    """The lines of the block whose first line (a decorator, ``def`` or
    ``class``) is ``lines[start]``: up to the next line, past its header,
    indented no deeper than it that does not close a bracket (the end of a
    signature spread over lines), blank lines and comments aside."""
    if not 0 <= start < len(lines):
        return _NO_SOURCE
    indent = _indent(lines[start])
    body = start + 1
    # Past the decorators to the def or class line.
    while body <= len(lines) and lines[body - 1].lstrip().startswith("@"):
        body += 1
    end = len(lines)
    for index in range(body, len(lines)):
        line = lines[index]
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if _indent(line) <= indent and not stripped.startswith(_CLOSING):
            end = index
            break
    return "".join(line.rstrip() + "\n" for line in lines[start:end]).rstrip() + "\n"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


# --- the tested releases ---------------------------------------------------


@dataclass(frozen=True)
class Recorded:
    """One path of one tested release: which variant of its patch applies,
    and the fingerprint of the code that variant depends on."""

    variant: str
    fingerprint: Mapping[str, str]


def load_records(path: Path = RECORD_FILE) -> dict[str, dict[str, Recorded]]:
    """The tested releases (newest first), each with its paths' records."""
    with open(path, encoding="utf-8") as file:
        raw = json.load(file)
    releases = sorted(raw["releases"], key=_version_key, reverse=True)
    return {
        release: {
            path: Recorded(entry["variant"], entry["fingerprint"])
            for path, entry in raw["releases"][release].items()
        }
        for release in releases
    }


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def differences(found: Mapping[str, str], recorded: Mapping[str, str]) -> list[str]:
    """What differs between two fingerprints, one phrase per locator."""
    phrases = []
    for locator in recorded:
        have, want = found.get(locator, MISSING), recorded[locator]
        if have == want:
            continue
        module, _, qualname = locator.partition(":")
        name = f"{module.rpartition('.')[2]}.{qualname}"
        if have == MISSING:
            phrases.append(f"{name} is missing")
        elif have == NO_SOURCE:
            phrases.append(f"{name} has no source to read (installed as bytecode?)")
        elif want == MISSING:
            phrases.append(f"{name} is new")
        else:
            phrases.append(f"{name} has other code")
    return phrases
