"""ptrres uses Numba through its documented user API only (SPEC section 13).

Numba's internals change in minor releases: they broke every kernel compile on
numba 0.61. This parses every module of ``ptrres/`` and fails on any use of
them, so that the rule holds after whoever wrote it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ptrres"

# Numba's documented user API that ptrres may reach as ``numba.<name>``.
PUBLIC_NUMBA = {"njit", "jit", "config", "extending", "types", "typeof", "__version__"}
FORBIDDEN_MODULES = (
    "numba.core",
    "numba.misc",
    "numba.cpython",
    "numba.np",
    "llvmlite",
)
# njit()/jit() options that Numba documents, and that ptrres may pass.
DOCUMENTED_OPTIONS = {
    "cache",
    "nogil",
    "boundscheck",
    "error_model",
    "fastmath",
    "inline",
    "no_cpython_wrapper",
    "no_cfunc_wrapper",
}
# The modules that know vLLM (the plugin: the package vllm/, a module per
# room) reach into vLLM's (not Numba's) privates.
VLLM_BOUNDARY = PACKAGE / "vllm"
# Private names of the standard library that its documentation lists.
DOCUMENTED_PRIVATE = {"os._exit", "sys._getframe"}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def forbidden(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in FORBIDDEN_MODULES)


def dotted(node: ast.expr) -> str | None:
    """``a.b.c`` of an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def handles_numba_objects(tree: ast.Module) -> bool:
    """Whether a module imports Numba, or the kernels' dispatchers (KERNELS).

    Only there is a private attribute likely to be Numba's: elsewhere they
    are ptrres's own, on its own objects.
    """
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(a.name.split(".")[0] == "numba" for a in node.names):
                return True
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] == "numba":
                return True
            if any(a.name == "KERNELS" for a in node.names):
                return True
    return False


def imported_violations(tree: ast.Module) -> tuple[list[str], set[str]]:
    """Imports of Numba's internals; and the names imports bind to Numba."""
    found: list[str] = []
    numba_names = {"numba"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if forbidden(alias.name):
                    found.append(f"{node.lineno}: import {alias.name}")
                if alias.name.split(".")[0] == "numba":
                    numba_names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(forbidden(name) for name in names):
                found.append(f"{node.lineno}: from {node.module} import ...")
            if node.module.split(".")[0] == "numba":
                numba_names.update(alias.asname or alias.name for alias in node.names)
    return found, numba_names


def own_modules(tree: ast.Module) -> set[str]:
    """Names that imports bind to ptrres's own modules (``from . import vllm``):
    their private attributes are ptrres's, not Numba's."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level > 0 or (node.module or "").split(".")[0] == "ptrres":
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def attribute_violation(
    node: ast.Attribute, check_private: bool, own_names: set[str]
) -> str | None:
    """numba.<not public>, or a private attribute of an object not ptrres's."""
    chain = dotted(node)
    if chain and chain.startswith("numba.") and chain.split(".")[1] not in PUBLIC_NUMBA:
        return f"{node.lineno}: {chain}"
    base = node.value
    own = isinstance(base, ast.Name) and base.id in {"self", "cls", *own_names}
    if not check_private or own or chain in DOCUMENTED_PRIVATE:
        return None
    return (
        f"{node.lineno}: private attribute .{node.attr}" if private(node.attr) else None
    )


def call_violations(node: ast.Call, check_getattr: bool) -> list[str]:
    """getattr(x, "_private"), and njit()/jit() options Numba does not document."""
    name = dotted(node.func)
    found = []
    by_name = {"getattr", "hasattr", "setattr", "delattr"}
    if check_getattr and name in by_name and len(node.args) > 1:
        attribute = node.args[1]
        value = attribute.value if isinstance(attribute, ast.Constant) else None
        if isinstance(value, str) and private(value):
            found.append(f"{node.lineno}: {name}(..., {value!r})")
    if name in {"njit", "jit", "numba.njit", "numba.jit", "dict"}:
        for keyword in node.keywords:
            option = keyword.arg
            if option is None or option in DOCUMENTED_OPTIONS:
                continue
            if name != "dict" or private(option):  # dict(OPTIONS, _nrt=...)
                found.append(f"{node.lineno}: {name}({option}=...)")
    return found


def violations(path: Path) -> list[str]:
    """Every use of Numba's internals in one module, as 'line: what'."""
    tree = ast.parse(path.read_text(), str(path))
    found, numba_names = imported_violations(tree)
    knows_vllm = path.is_relative_to(VLLM_BOUNDARY)
    check_private = handles_numba_objects(tree) and not knows_vllm
    own_names = own_modules(tree) - {"KERNELS"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            found.extend(
                filter(None, [attribute_violation(node, check_private, own_names)])
            )
        elif isinstance(node, ast.Call):
            found.extend(call_violations(node, not knows_vllm))
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if "cache" in keys or "nogil" in keys:  # a dict of Numba options
                for key in sorted(str(k) for k in keys - DOCUMENTED_OPTIONS):
                    found.append(f"{node.lineno}: Numba option {key!r}")
        elif isinstance(node, ast.ClassDef):
            for base in node.bases:
                chain = dotted(base)
                if chain and chain.split(".")[0] in numba_names:
                    found.append(f"{node.lineno}: class {node.name}({chain})")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_ptrres_uses_only_numbas_public_api(path: Path) -> None:
    assert violations(path) == []


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ("from numba.core import types", "from numba.core import ..."),
        ("import llvmlite.binding as llvm", "import llvmlite.binding"),
        ("from numba.cpython.unsafe import numbers", "from numba.cpython.unsafe"),
        ("import numba\nnumba.core.config", "numba.core.config"),
        ("import numba\nf = numba.njit(_nrt=False)", "numba.njit(_nrt=...)"),
        ("import numba\nf = numba.njit(pipeline_class=1)", "numba.njit(pipeline_"),
        ("OPTIONS = {'cache': True, '_nrt': False}", "Numba option '_nrt'"),
        ("x = dict(OPTIONS, _nrt=False)", "dict(_nrt=...)"),
        (
            "from ._config import KERNELS\nx = KERNELS[0][0]._cache",
            "private attribute ._cache",
        ),
        ("def f(d):\n    return getattr(d, '_cache', None)", "getattr(..., '_cache')"),
        (
            "from numba.core.codegen import JITCodeLibrary\n"
            "class Library(JITCodeLibrary): pass",
            "class Library(JITCodeLibrary)",
        ),
        ("import numba\nclass D(numba.types.Type): pass", "class D(numba.types.Type)"),
    ],
)
def test_each_kind_of_internal_is_caught(
    tmp_path: Path, source: str, what: str
) -> None:
    """The checker itself, on one planted use of each kind."""
    module = tmp_path / "planted.py"
    module.write_text(source + "\n")
    found = violations(module)
    assert any(what in line for line in found), found


def test_public_use_is_not_flagged(tmp_path: Path) -> None:
    module = tmp_path / "fine.py"
    module.write_text(
        "import numba\n"
        "OPTIONS = {'cache': True, 'nogil': True, 'error_model': 'numpy'}\n"
        "f = numba.njit(**dict(OPTIONS, cache=False, no_cpython_wrapper=True))\n"
        "def g(dispatcher):\n"
        "    return dispatcher.stats.cache_path, numba.config.DISABLE_JIT\n"
    )
    assert violations(module) == []


def test_the_declared_numba_range_is_the_tested_range() -> None:
    """pyproject.toml's lower bound is the lowest numba .ci/numba-matrix runs;
    .ci/vllm-releases runs it on vLLM's pin, in the releases' venv; there is
    no upper cap (CI runs the newest)."""
    root = PACKAGE.parent
    pyproject = (root / "pyproject.toml").read_text()
    [requirement] = re.findall(r'"numba([<>=!~][^"]*)"', pyproject)
    matrix = (root / ".ci" / "numba-matrix").read_text()
    [defaults] = re.findall(r"versions=\(([\d. ]+)\)", matrix)
    releases = (root / ".ci" / "vllm-releases").read_text()
    [pin] = re.findall(r"^NUMBA=([\d.]+)$", releases, re.M)
    assert pin == "0.65.0"  # vLLM 0.30-0.33 pin it
    assert '.ci/numba-matrix "$NUMBA"' in releases
    assert f"numba=={pin}" in (root / ".ci" / "vllm-requirements.txt").read_text()
    tested = sorted(
        [*defaults.split(), pin], key=lambda v: tuple(map(int, v.split(".")))
    )
    assert requirement == f">={tested[0]}"
    run = (root / ".ci" / "run").read_text()
    assert "\n.ci/numba-matrix\n" in run
    assert "\n.ci/vllm-releases\n" in run
