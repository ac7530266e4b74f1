"""Numba compilers for ptrres's kernels and their inline helpers.

Numba optimises a compiled function's LLVM IR three times: each function of a
module as it is added to a code library (O3 function passes), then the
library's final module with a cheap pass (which inlines, so that reference
counts can be pruned), then with the full O3 pipeline; it then generates
machine code. For ptrres:

- **Helpers** are only ever called from kernels, which link their IR and
  optimise it where it is used. A helper's own optimisation and machine code
  were never used: about 0.8 s of a 6 s cold compile, more for helpers
  calling helpers (optimised once per level). A helper's library now only
  links: its IR goes to its callers as Numba's lowering left it. The one
  thing the JIT engine still gets from a helper is its environment pointer, a
  global Numba fills in once the helper is compiled: a module that defines
  that global and nothing else.
- **Kernels** get the O3 pipeline once, on their final module, without loop
  unrolling or interleaving unless they ask (_tuning_options). The
  per-function passes optimised IR that the module pipeline optimises again,
  and the cheap pass serves reference-count pruning, which kernels compiled
  without Numba's runtime (_config) do not have. Together these were about
  10% of the cold compile, for the same speed of the compiled kernels.
- **Both** go through Numba's nopython pipeline less the passes for features
  they never use (closures, literal_unroll, array expressions...) and, without
  Numba's runtime, less the marking of where variables die: about 10% of a
  cold compile, for the same machine code but for registers and stack slots.

This subclasses Numba internals (JITCodeLibrary and its finalize steps, the JIT
engine), plugged in through njit's documented ``pipeline_class`` option; they
have been stable for years but are not public, and mypy does not check calls
into them (see pyproject.toml). Where they are missing, ``pipelines()``
returns Nones and functions are compiled like any njit function; a library
that lacks them when it is finalized is finalized by Numba as usual.
"""

from __future__ import annotations

from typing import Any

# Numba's passes for what ptrres's kernels and helpers never use, by class
# name. Each ran on every function: about 7% of a cold compile. Without its
# pass, such a feature fails to compile, or (inline="always") is called
# instead of inlined; the tests compile every kernel.
UNUSED_PASSES = frozenset(
    {
        "WithLifting",  # `with` blocks (objmode, parallel chunks)
        "InlineClosureLikes",  # closures and comprehensions defined inside
        "MakeFunctionToJitFunction",  # closures left over
        "InlineInlinables",  # njit(inline="always") callees
        "InlineOverloads",  # overload(inline="always") callees
        "FindLiterallyCalls",  # numba.literally()
        "LiteralUnroll",  # numba.literal_unroll()
        "LiteralPropagationSubPipelinePass",  # literal values through calls
        "RewriteSemanticConstants",  # len() of tuples, .ndim folded early
        "DeadBranchPrune",  # branches on constant arguments
        "GenericRewrites",  # constant getitems, raises, print() before typing
        "RewriteDynamicRaises",  # raise with values known at run time
        "NopythonRewrites",  # array expressions, arrays of constants
        "DumpParforDiagnostics",  # parallel=True
    }
)
# And without Numba's runtime: IRLegalization marks where each variable dies,
# for lowering to release its references there and zero its slot. Without
# references to release, that is code LLVM deletes again: about 3% of a cold
# compile. (It also turns some unsupported features into clearer errors.)
REFCOUNTING_PASSES = frozenset({"IRLegalization"})


def pipelines(refcounts: bool) -> tuple[Any, Any, Any]:
    """Numba compiler classes (``pipeline_class``): kernels', kernels' with
    unrolled loops, helpers'.

    Args:
        refcounts: whether kernels are compiled with Numba's runtime. They
            then keep Numba's cheap pass, so that their reference counts are
            pruned as before.

    Returns:
        The three classes, or Nones where Numba's internals differ.
    """
    try:
        import llvmlite.binding as llvm
        from llvmlite import ir
        from numba.core import cgutils, compiler
        from numba.core.codegen import JITCodeLibrary
        from numba.core.compiler_machinery import PassManager
    except ImportError:  # pragma: no cover - another Numba's layout
        return None, None, None
    methods = (
        "_optimize_functions",
        "_optimize_final_module",
        "_raise_if_finalized",
        "_get_module_for_linking",
        "_finalize_dynamic_globals",
        "_verify_declare_only_symbols",
    )
    internals = all(hasattr(JITCodeLibrary, name) for name in methods)
    if not internals or not hasattr(compiler, "DefaultPassBuilder"):
        return None, None, None  # pragma: no cover - another Numba's layout
    attributes = ("_codegen", "_linking_libraries", "_final_module", "_reload_init")
    tuning = _tuning_options(llvm)
    unused = UNUSED_PASSES if refcounts else UNUSED_PASSES | REFCOUNTING_PASSES

    class KernelLibrary(JITCodeLibrary):
        """A kernel's code library: its final module optimised once, at O3."""

        unroll = False  # whether LLVM unrolls and interleaves its loops

        def _optimize_functions(self, ll_module: Any) -> None:
            """No per-function passes: the module pipeline runs them all."""
            ll_module.data_layout = self._codegen._data_layout

        def _optimize_final_module(self) -> None:
            machine = getattr(self._codegen, "_tm", None)  # the target machine
            if refcounts or tuning is None or machine is None:  # pragma: no cover
                super()._optimize_final_module()  # other Numbas: as Numba does
                return
            builder = llvm.create_pass_builder(machine, tuning(self.unroll))
            manager = builder.getModulePassManager()
            with self._recorded_timings.record("Module passes (O3)", builder):
                manager.run(self._final_module, builder)

    class UnrolledKernelLibrary(KernelLibrary):
        """A kernel's code library, its loops unrolled and interleaved."""

        unroll = True

    class LinkOnlyLibrary(KernelLibrary):
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

    def compiler_for(library_class: type, cached: bool) -> type:
        class LibraryCompiler(compiler.Compiler):
            """Numba's nopython pipeline less the passes ptrres does not need
            (UNUSED_PASSES, REFCOUNTING_PASSES), lowering into a
            library_class."""

            def define_pipelines(self) -> Any:
                if self.state.flags.force_pyobject:  # pragma: no cover
                    return super().define_pipelines()  # object mode: as Numba
                full = compiler.DefaultPassBuilder.define_nopython_pipeline(self.state)
                pipeline = PassManager(full.pipeline_name)
                pipeline.passes.extend(
                    (pass_class, description)
                    for pass_class, description in full.passes
                    if pass_class.__name__ not in unused
                )
                pipeline.finalize()
                return [pipeline]

            def compile_extra(self, func: Any) -> Any:
                if self.state.library is None:
                    codegen = self.state.targetctx.codegen()
                    library = library_class(codegen, func.__qualname__)
                    if cached:  # as Numba's lowering does: it can be saved
                        library.enable_object_caching()
                    self.state.library = library
                return super().compile_extra(func)

        LibraryCompiler.__name__ = LibraryCompiler.__qualname__ = (
            library_class.__name__.replace("Library", "Compiler")
        )
        return LibraryCompiler

    return (
        compiler_for(KernelLibrary, True),
        compiler_for(UnrolledKernelLibrary, True),
        compiler_for(LinkOnlyLibrary, False),
    )


def _tuning_options(llvm: Any) -> Any:
    """A function making the LLVM pipeline options of a kernel, or None.

    Numba's level and vectorisers (NUMBA_OPT, NUMBA_LOOP_VECTORIZE and
    NUMBA_SLP_VECTORIZE still apply); loops unrolled and interleaved only
    where asked. Plans, merged plans and coalesce() ran as fast without (side
    by side in ``ptrres bench``: 0.96-0.99x, geometric means), for 8% less
    cold compile time; the resolver's loops ran up to 1.37x slower.
    """
    from numba.core import config

    make = getattr(llvm, "create_pipeline_tuning_options", None)
    if make is None or not hasattr(llvm, "create_pass_builder"):
        return None  # pragma: no cover - another llvmlite

    def tuning(unroll: bool) -> Any:
        settings = vars(config)  # read at each compile, as Numba does
        options = make()
        options.speed_level = min(int(settings["OPT"]), 3)
        options.loop_vectorization = bool(settings["LOOP_VECTORIZE"])
        options.slp_vectorization = bool(settings["SLP_VECTORIZE"])
        options.loop_unrolling = unroll
        options.loop_interleaving = unroll
        return options

    return tuning
