"""Numba's compiler for inline helpers: their LLVM IR is only ever linked.

Numba finalizes every compiled function's code library on its own: its module
optimised at O3, then turned into machine code. A helper's library is then
linked into each caller's, whose finalization optimises it again, inlined, and
generates the code that runs. The helper's own O3 and machine code are never
used: nothing calls it from Python (it has no wrapper), and its callers have
their own copy. That was about 0.8 s of ptrres's 6 s cold compile time, more
for helpers calling helpers (optimised once per level).

So a helper's library only links: its IR goes to its callers as Numba's
per-function passes left it, and the callers' O3 optimises it where it is used.
(Callers inline more of their helpers that way, not fewer.) The one thing the
JIT engine still gets from a helper is its environment pointer, a global Numba
fills in once the helper is compiled: a module that defines that global and
nothing else.

This subclasses Numba internals (JITCodeLibrary and its finalize steps, the JIT
engine), plugged in through njit's documented ``pipeline_class`` option; they
have been stable for years but are not public, and mypy does not check calls
into them (see pyproject.toml). Where they are missing, ``helper_pipeline()``
returns None and helpers are compiled like any njit function; a library that
lacks them when it is finalized is finalized by Numba as usual.
"""

from __future__ import annotations

from typing import Any


def helper_pipeline() -> Any:
    """A Numba compiler class (``pipeline_class``) for helpers, or None."""
    try:
        import llvmlite.binding as llvm
        from llvmlite import ir
        from numba.core import cgutils, compiler
        from numba.core.codegen import JITCodeLibrary
    except ImportError:  # pragma: no cover - another Numba's layout
        return None
    methods = (
        "_raise_if_finalized",
        "_get_module_for_linking",
        "_finalize_dynamic_globals",
        "_verify_declare_only_symbols",
    )
    if not all(hasattr(JITCodeLibrary, name) for name in methods):
        return None  # pragma: no cover - another Numba's layout
    attributes = ("_codegen", "_linking_libraries", "_final_module", "_reload_init")

    class LinkOnlyLibrary(JITCodeLibrary):
        """A helper's code library: linked into its callers', never compiled."""

        def finalize(self) -> None:
            """Link in the helpers it calls; give the engine its environment."""
            engine = getattr(getattr(self, "_codegen", None), "_engine", None)
            if engine is None or not all(hasattr(self, a) for a in attributes):
                super().finalize()  # pragma: no cover - another Numba's layout
                return
            self._raise_if_finalized()
            seen = set()
            for library in self._linking_libraries:
                if library not in seen:
                    seen.add(library)
                    self._reload_init.update(library._reload_init)
                    self._final_module.link_in(
                        library._get_module_for_linking(), preserve=True
                    )
            self._final_module.verify()
            self._finalize_dynamic_globals()
            self._verify_declare_only_symbols()
            # Numba declares the environment pointer with common linkage, and
            # writes it (codegen.set_env) through the engine's address of it.
            environment = self._codegen._create_empty_module(self.name)
            null = cgutils.get_null_value(cgutils.voidptr_t)
            for variable in self._final_module.global_variables:
                if variable.linkage == llvm.Linkage.common:
                    pointer = ir.GlobalVariable(
                        environment, cgutils.voidptr_t, name=variable.name
                    )
                    pointer.linkage = "common"
                    pointer.initializer = null
            self._codegen._add_module(llvm.parse_assembly(str(environment)))
            engine.finalize_object()
            self._finalized = True

    class HelperCompiler(compiler.Compiler):
        """Numba's default pipeline, lowering into a LinkOnlyLibrary."""

        def compile_extra(self, func: Any) -> Any:
            if self.state.library is None:
                codegen = self.state.targetctx.codegen()
                self.state.library = LinkOnlyLibrary(codegen, func.__qualname__)
            return super().compile_extra(func)

    return HelperCompiler
