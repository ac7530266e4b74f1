"""The shape of the house: data flows one way between ptrres' modules.

Every import in ptrres is read with ``ast`` (at the top, under
``TYPE_CHECKING``, inside functions), and no module may import one that
imports it back, however far round. The facade (PointerTable) calls the
planners with plain arrays; the planners never import the facade. And every
room stays small enough to hold one job: the size gauge (a module 500 lines,
a function 100, compiled code 200).
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ptrres"
ROOT = PACKAGE.name

Graph = dict[str, set[str]]


def module_name(path: Path, package: Path = PACKAGE) -> str:
    """``ptrres/_kernels/plan.py`` -> ``ptrres._kernels.plan``."""
    parts = [package.name, *path.relative_to(package).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imported_names(
    source: str, module: str, package: bool
) -> Iterator[tuple[str, str | None]]:
    """Every import of the source as (module, name), relative ones made
    absolute: ``import x.y`` is ("x.y", None), ``from x import y`` ("x", "y"),
    where y may be a module or a name x defines."""
    here = module if package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from ((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            yield from ((base, alias.name) for alias in node.names)


def import_graph(paths: Iterable[Path], package: Path = PACKAGE) -> Graph:
    """Module -> the modules of the package that importing it runs.

    Importing ``a.b.c`` runs ``a``, ``a.b`` and ``a.b.c``: each is an edge,
    but for the packages the importer sits in (they are already running).
    A name that is not a module (``from . import __version__``) is an edge
    to the module it comes from, the importer's own package included.
    """
    sources = {
        module_name(path, package): (path.read_text(), is_package(path))
        for path in paths
    }
    graph: Graph = {}
    for module, (source, package_init) in sources.items():
        inside = set(_parents(module)) | {module}
        targets = set()
        for base, name in imported_names(source, module, package_init):
            submodule = f"{base}.{name}"
            if name is not None and submodule in sources:
                target = submodule
            elif base in sources:
                target = base
            else:
                continue  # outside the package
            targets.add(target)
            targets.update(p for p in _parents(target) if p not in inside)
        targets.discard(module)
        graph[module] = targets
    return graph


def _parents(name: str) -> Iterator[str]:
    parts = name.split(".")
    for end in range(1, len(parts)):
        yield ".".join(parts[:end])


def cycles(graph: Graph) -> list[list[str]]:
    """One cycle (as a path back to its start) per set of modules that import
    each other (a strongly connected component)."""
    return [_path_through(graph, c) for c in strongly_connected(graph)]


def strongly_connected(graph: Graph) -> list[set[str]]:
    """The sets of two or more modules that import each other, however far
    round (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _path_through(graph: Graph, component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & component):
                if target == start:
                    return [*paths[node], start]
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover


def ptrres_sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = import_graph(ptrres_sources())
    found = strongly_connected(graph)
    assert not found, "import cycles among ptrres modules:\n" + "\n".join(
        f"{' -> '.join(_path_through(graph, c))} (in all: {', '.join(sorted(c))})"
        for c in found
    )


def test_the_graph_covers_the_package_and_its_kernels() -> None:
    graph = import_graph(ptrres_sources())
    assert {f"{ROOT}._table", f"{ROOT}._kernels", f"{ROOT}._kernels.plan"} <= set(graph)
    # The facade builds on its planners and the drop-ins on the facade.
    assert f"{ROOT}._plan" in graph[f"{ROOT}._table"]
    assert f"{ROOT}._table" in graph[f"{ROOT}._pointer_utils"]


def test_kernels_import_only_kernels_and_the_compile_options() -> None:
    graph = import_graph(ptrres_sources())
    kernels = f"{ROOT}._kernels"
    for module, targets in graph.items():
        if module == kernels or module.startswith(kernels + "."):
            outside = {
                t for t in targets if t != kernels and not t.startswith(kernels + ".")
            }
            assert outside <= {f"{ROOT}._config"}, (module, outside)


SCANNED = """
from __future__ import annotations
import pkg.top
from typing import TYPE_CHECKING
from . import sibling, name_in_init
from .sub.leaf import thing

if TYPE_CHECKING:
    from .typed_only import Hint

def lazily() -> None:
    from ..up import value
"""


def test_every_kind_of_import_is_read() -> None:
    names = set(imported_names(SCANNED, "pkg.a.mod", package=False))
    assert {
        ("pkg.top", None),
        ("pkg.a", "sibling"),
        ("pkg.a", "name_in_init"),
        ("pkg.a.sub.leaf", "thing"),
        ("pkg.a.typed_only", "Hint"),
        ("pkg.up", "value"),
    } <= names
    # Relative to a package's __init__, "." is the package itself.
    assert set(imported_names("from .x import y", "pkg.a", True)) == {("pkg.a.x", "y")}


def write_package(root: Path, files: dict[str, str]) -> list[Path]:
    paths = []
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
        paths.append(path)
    return paths


@pytest.mark.parametrize(
    "how",
    [
        "from .a import thing",
        "if TYPE_CHECKING:\n    from .a import thing",
        "def f():\n    from .a import thing",
        "from . import a",
    ],
)
def test_a_cycle_is_found_however_it_is_imported(tmp_path: Path, how: str) -> None:
    package = tmp_path / "pkg"
    paths = write_package(
        package,
        {
            "__init__.py": "",
            "a.py": "from .b import helper\n",
            "b.py": "from typing import TYPE_CHECKING\n" + how + "\n",
        },
    )
    found = cycles(import_graph(paths, package))
    assert found == [["pkg.a", "pkg.b", "pkg.a"]]


def test_a_subpackage_init_closes_a_cycle(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    paths = write_package(
        package,
        {
            "__init__.py": "from . import args\n",
            "args.py": "from .kernels.common import CAP\n",
            # Importing kernels.common runs kernels/__init__, which imports args.
            "kernels/__init__.py": "from .other import CAP\nfrom ..args import x\n",
            "kernels/common.py": "CAP = 1\n",
            # Siblings in a package do not import the package back.
            "kernels/other.py": "from .common import CAP\n",
        },
    )
    found = cycles(import_graph(paths, package))
    assert found == [["pkg.args", "pkg.kernels", "pkg.args"]]


def test_a_name_from_the_importers_own_package_is_an_edge(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    paths = write_package(
        package,
        {
            "__init__.py": "from .cli import main\n__version__ = '1'\n",
            "cli.py": "from . import __version__\nfrom . import util\n",
            "util.py": "",
        },
    )
    graph = import_graph(paths, package)
    assert graph["pkg.cli"] == {"pkg", "pkg.util"}
    assert cycles(graph) == [["pkg", "pkg.cli", "pkg"]]


def test_the_public_names_are_imported_on_first_use() -> None:
    """ptrres/__init__.py imports nothing (PEP 562): each name of __all__
    comes from the module its TYPE_CHECKING import names, on first use."""
    import ptrres

    init = PACKAGE / "__init__.py"
    typed = {
        name: base.rpartition(".")[2]
        for base, name in imported_names(init.read_text(), ROOT, package=True)
        if name is not None and base.startswith(f"{ROOT}._")
    }
    assert typed == ptrres._MODULE_OF
    assert sorted(typed) == sorted(ptrres.__all__)
    for name, module in typed.items():
        home = importlib.import_module(f"{ROOT}.{module}")
        assert getattr(ptrres, name) is getattr(home, name), name
    assert set(ptrres.__all__) <= set(dir(ptrres))
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        ptrres.no_such_name  # noqa: B018


def test_importing_ptrres_imports_none_of_it() -> None:
    """Neither numba nor numpy nor any of ptrres's modules, in a fresh
    interpreter; the first public name used imports its module."""
    code = (
        "import sys, ptrres\n"
        "heavy = [m for m in ('numba', 'numpy', 'ptrres._kernels', 'ptrres._table') "
        "if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "ptrres.BlockIdError\n"
        "assert 'numba' not in sys.modules\n"
        "ptrres.PointerTable\n"
        "assert 'numba' in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# The size gauge: past it, a module or a function holds more than one job.
MODULE_LINES = 500
FUNCTION_LINES = 100
# Compiled code (kernels, and the helpers compiled into them) may run longer:
# split into helpers that take arrays, a kernel pays Numba's reference
# counting on every call (docs/design.md, "Tried and dropped").
COMPILED_LINES = 200
COMPILED_DECORATORS = {"kernel", "inline_helper"}
# Modules allowed past MODULE_LINES for now (their functions are not): none.
OVER_THE_GAUGE: set[str] = set()


def is_compiled(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated with ``@kernel(...)`` or ``@inline_helper`` (ptrres._config)."""
    for decorator in function.decorator_list:
        if isinstance(decorator, ast.Call):
            decorator = decorator.func
        name = getattr(decorator, "id", getattr(decorator, "attr", None))
        if name in COMPILED_DECORATORS:
            return True
    return False


def over_the_gauge(path: Path, package: Path = PACKAGE) -> list[str]:
    """What in one module passes the gauge: the module itself (its lines),
    and each function or method, counted from its ``def`` to its last line
    (nested ones too)."""
    source = path.read_text()
    where = path.relative_to(package.parent).as_posix()
    found = []
    lines = len(source.splitlines())
    if lines > MODULE_LINES and path.relative_to(package).as_posix() not in (
        OVER_THE_GAUGE
    ):
        found.append(f"{where}: {lines} lines (a module: {MODULE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            compiled = is_compiled(node)
            limit = COMPILED_LINES if compiled else FUNCTION_LINES
            if length > limit:
                kind = "compiled" if compiled else "a function"
                found.append(f"{where}:{node.name}: {length} lines ({kind}: {limit})")
    return found


def test_every_module_and_function_is_under_the_size_gauge() -> None:
    found = [line for path in ptrres_sources() for line in over_the_gauge(path)]
    assert not found, "split along a seam it has:\n" + "\n".join(found)


def test_each_module_allowed_past_the_gauge_still_needs_it() -> None:
    for name in OVER_THE_GAUGE:
        lines = len((PACKAGE / name).read_text().splitlines())
        assert lines > MODULE_LINES, f"{name} is {lines} lines: drop its exception"


def test_the_gauge_reads_modules_functions_and_kernels(tmp_path: Path) -> None:
    def function(name: str, lines: int, decorator: str = "") -> str:
        return f"{decorator}def {name}() -> None:\n" + "    x = 1\n" * (lines - 1)

    def method(name: str, lines: int) -> str:
        return "class Table:\n" + textwrap.indent(function(name, lines), "    ")

    fits = {
        "functions.py": function("fits", FUNCTION_LINES)
        + method("method_fits", FUNCTION_LINES),
        "kernels.py": function("kernel_fits", COMPILED_LINES, "@kernel('int64()')\n")
        + function("helper_fits", COMPILED_LINES, "@inline_helper\n"),
        # Exactly as long as a module may be.
        "module.py": "# a line\n" * MODULE_LINES,
    }
    long = (
        function("too_long", FUNCTION_LINES + 1)
        + function("kernel_too_long", COMPILED_LINES + 1, "@config.kernel()\n")
        + function("jitted", FUNCTION_LINES + 1, "@numba.njit\n")
        + method("method_too_long", FUNCTION_LINES + 1)
        + "# a line\n" * MODULE_LINES
    )
    package = tmp_path / "pkg"
    for path in write_package(package, fits):
        assert over_the_gauge(path, package) == [], path.name
    (long_path,) = write_package(package, {"long.py": long})
    assert over_the_gauge(long_path, package) == [
        f"pkg/long.py: {len(long.splitlines())} lines (a module: 500)",
        "pkg/long.py:too_long: 101 lines (a function: 100)",
        "pkg/long.py:kernel_too_long: 201 lines (compiled: 200)",
        # Only ptrres's own decorators compile: a bare njit is a function here.
        "pkg/long.py:jitted: 101 lines (a function: 100)",
        "pkg/long.py:method_too_long: 101 lines (a function: 100)",
    ]
