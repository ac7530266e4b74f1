"""Rerun every benchmark and rewrite docs/benchmarks.md.

Each section of the page is one command's output, as the command printed it,
under the command, the machine and the versions that made it. The prose of
each section lives here (SECTIONS), so that a rerun rewrites the whole page;
sections not rerun (``--only``) keep the figures the page already holds,
with the machine and commit they were measured on.

Run: PYTHONPATH=$PWD python benchmarks/report.py [--only NAME]... [--quick]
     [--page PATH] [--list]

``--quick`` runs every command with its shortest timings, to check that the
report still works (a minute or two); its sections say so. Pass
``--page /tmp/benchmarks.md`` to leave the real page alone.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ptrres._operator import cpu_model  # the one that ptrres check shows

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
# Distribution name, as the page writes it.
VERSIONS = {"numpy": "numpy", "numba": "numba", "torch": "torch", "vllm": "vLLM"}


@dataclass(frozen=True)
class Section:
    """One benchmark command and what the page says about its output."""

    name: str  # for --only
    title: str
    about: str  # Markdown, above the figures
    # As a reader types it: "ptrres ..." or "python benchmarks/....py ...".
    command: tuple[str, ...]
    # Arguments added under --quick: the command's shortest timings.
    quick: tuple[str, ...] = ()
    # True: the command prints Markdown tables, kept as Markdown. False: its
    # output is shown verbatim, in a code block.
    markdown: bool = False

    def shown(self, quick: bool) -> str:
        return " ".join(self.command + (self.quick if quick else ()))

    def argv(self, quick: bool) -> list[str]:
        """The command as run: this interpreter, the worktree's ptrres."""
        args = list(self.command + (self.quick if quick else ()))
        if args[0] == "ptrres":
            return [sys.executable, "-m", "ptrres", *args[1:]]
        if args[0] == "python":
            return [sys.executable, *args[1:]]
        return args


# Scripts of benchmarks/ that the page does not run, and why.
NOT_ON_THE_PAGE = {
    "ab_bench.py": "compares two checkouts (a change against its base)",
    "vllm_traces.py": "records vLLM's own block ids in a venv of its own "
    "(.venv-traces); the page's trace section, after the others, is written "
    "by hand from `ptrres bench --trace`, and kept by every rerun",
}

SECTIONS: tuple[Section, ...] = (
    Section(
        "bench",
        "Resolve, plans and coalescing against the reference",
        """\
The main job. For each of seven model-shaped layouts (SPEC section 8), at 1 to
4096 blocks per group, ptrres against `ptrres.reference`, the plain-numpy
oracle written the way vLLM's code is (and checking the same input):
`resolve` is `PointerTable.resolve(out=)`, `plan` a store of
`blocks_per_chunk` 4, `coalesce` the standalone `ptrres.coalesce()` against a
vectorised numpy merge. ptrres writes into preallocated `out=` buffers, as a
server does with pinned ones; the reference allocates, as vLLM does. The
layouts are described, never allocated: pointer math does not touch the
memory.

`ops` are copy descriptors before coalescing, `descr` after; `ns/op` is
ptrres's time per op; `x fill` is ptrres's time over a plain numpy fill of
the same output bytes, at the largest size: the floor any implementation
pays for writing its output. Small transfers (the per-step stores) gain the
most, since the reference pays Python and numpy overhead per ref; large ones
are bound by memory.

`ptrres bench` also takes `--preset NAME` and `--blocks 1,16,256` (a subset),
`--operation resolve|plan|coalesce|files|canonical`, `--json PATH` (the
results with versions and CPU) and `--plot PATH` (speedup against transfer
size; `pip install 'ptrres[plot]'`).""",
        ("ptrres", "bench"),
        ("--quick",),
    ),
    Section(
        "canonical",
        "Canonical layouts: flat and strided plans",
        """\
Canonical (parallelism-agnostic) layouts, [docs/canonical.md](canonical.md):
flat plans (`plan_transfer`) and strided plans (`plan_strided_transfer`, one
2-D descriptor per run) against a numpy transcription of vLLM 0.33's
`_fill_canonical_ops`, all writing into buffers allocated once (vLLM's
pooled pinned buffers, its fragment templates built beforehand, as its
handler does at start-up). Two presets: `llama-3.1-70b-tp4-nhd` (80 layers,
16 fragments per block, rank 1 of 4, a load) and `deepseek-v3-mla-tp8` (61
layers, one run per page, rank 3 of 8 writing every 8th page, a store).
Large flat plans are bound by memory (see `x fill`): there the strided plan,
with one descriptor per run instead of one per token, is the one to use.""",
        ("ptrres", "bench", "--operation", "canonical"),
        ("--quick",),
    ),
    Section(
        "vllm",
        "vLLM's transfer_async, patched and unpatched",
        """\
The CPU time of one `SingleDirectionOffloadingHandler.transfer_async`, vLLM's
own against the one the plugin patches in ([docs/vllm.md](vllm.md)), on
vLLM's real handler built through its `__init__`, in one process, in
interleaved rounds; streams are stubbed and the copy is skipped, so what is
timed is vLLM's Python and the descriptor fill, what a worker spends on the
CPU per store or load. Both sides' descriptors are checked equal first.
4 blocks per chunk; rows are small (pages divided by 1024) so that
2048-block transfers fit in memory: neither side touches the pages, and the
pointer math costs the same at any page size. The canonical rows run the
two canonical presets above through a `canonical_layout=True` handler, their
byte fields scaled alike so that the smallest is 8 B. A store where this
rank writes no block submits nothing on either side (0 descriptors).

On vLLM 0.34 the connector's worker resolves each job
(`pointer_utils.resolve_device_pointers`) and hands the handler the
`DevicePointers`, so a row times a whole job: vLLM's resolve and
`transfer_async` against the patched connector's resolve and the patched
`transfer_async` (the handler built without GPU tensors, its table from
the layout's KV caches). The second table times the resolve alone, vLLM's
`pointer_utils.resolve_device_pointers` against the one patched in (vLLM's
own `DevicePointers` returned by both, fresh arrays each call).""",
        ("python", "benchmarks/vllm_transfer.py"),
        ("--quick",),
        markdown=True,
    ),
    Section(
        "simple-copy-blocks",
        "vLLM's simple offload path: copy_blocks, patched and unpatched",
        """\
vLLM's second CPU offloading path, `SimpleCPUOffloadConnector`
([docs/vllm.md](vllm.md)), submits every copy through
`cuda_mem_ops.copy_blocks(src_ids, dst_ids, params)`: its DMA backend once
per transfer, its disk backend once per block. vLLM's own against the one the
plugin patches in, on the same params, in one process, in interleaved rounds,
the driver function (`cuMemcpyBatchAsync`) stubbed to a no-op: what is timed
is turning two lists of ids into the three descriptor arrays and handing them
over, which vLLM does on the CPU for every copy, and which the patched one
also checks. Both sides' driver calls are checked equal first. One layer per
ref of each preset (its page as the bytes per block), and a MiniMax-M3-like
rank of 118 regions of 32 KiB (vLLM PR #56110); random distinct ids; the
disk rows are the disk backend's calls, one block to or from a staging slot.
Tensors are never allocated: neither side touches the pages. From 256 blocks
on, both sides spend much of their time turning Python lists into arrays.

vLLM's own copy builds its three descriptor arrays and two temporaries with
numpy for every call (1 to 5 MiB each at 4096 blocks), so what it costs
depends on where malloc puts them, and that on what the process allocated
and freed before: the same cell (64 layers, 4096 blocks) took vLLM 589 us in
one run and 2273 us in another. The table therefore runs on two heaps, in
three child processes each (alternating; per cell the median over them, and
each one's speedup beside it), whose glibc malloc is set from the start.
First on a warm heap: the thresholds glibc reaches by itself once a process
has freed a block of 32 MiB, as a worker that has loaded a model has, so
that the memory one call frees, the next reuses; README quotes this table.
Then on fresh pages, as in the section on vLLM's NIXL index path below:
every array of 64 KiB or more mapped anew and faulted in as it is first
written, from 256 blocks on. A process left to itself lands between the
two; the page faults of one call of each side say where a cell ran. Last,
what loading the plugin adds to a process that never offloads (fresh
interpreters, vLLM's own `load_general_plugins()` with and without ptrres),
and what a process that offloads pays, once, when vLLM imports its backend
and builds its params.""",
        ("python", "benchmarks/simple_copy_blocks.py"),
        ("--quick",),
        markdown=True,
    ),
    Section(
        "file-tier",
        "File tier: op lists and the POSIX executor",
        """\
[docs/file-tier.md](file-tier.md). First, `plan_file_ops` against the op
building of vLLM PR #56076's file worker (a per-file list of
`(dev_ptr, size, file_offset)` built by walking `iter_pointer_groups`, as
`ptrres bench --operation files` times it), on three layouts at 16 and 256
blocks. Then the POSIX executor on a 128 MiB store of real CPU tensors
(8192 pages of 16 KiB into 16 files, in the page cache): `write_files` and
`read_files` against one `os.pwrite` (or `os.preadv`) per op. At 16 blocks
ptrres takes a few microseconds, so those cells move most from run to run.""",
        ("python", "benchmarks/file_tier.py"),
    ),
    Section(
        "coalesce-cost",
        "What coalescing costs",
        """\
Plain and coalesced plans timed side by side, `blocks_per_chunk` 4, into
`out=` buffers: store plans, canonical plans (both presets, loads and
stores) and file op lists. Block ids are random (with one adjacent pair),
runs of 1 to 8 consecutive ids (what a block allocator hands out), the same
runs counting down (eviction order; the chunks ascend, so nothing merges
and only the search for descending runs costs), or fully consecutive. The
target: a coalesced plan within 1.2x of the plain one. Where nothing merges
(random ids) coalescing can only cost; where runs merge it saves writing.
`+ submit` adds what submitting the descriptors costs the CPU (0.5 us each
to `cuMemcpyBatchAsync`, SPEC 6): coalesced over plain, target 1.01x. Last,
the standalone `coalesce()` at 4096 blocks against a numpy fill of its three
output buffers, and the floor any merge must pay
(reading every input, writing the survivors) in numpy: where most
descriptors survive (hybrid-4x12) that floor alone exceeds the 1.5x
target.""",
        ("python", "benchmarks/coalesce_cost.py"),
        ("--quick",),
        markdown=True,
    ),
    Section(
        "nixl-transfer",
        "NIXL transfers: vLLM's prepared indices against ptrres's",
        """\
[docs/nixl.md](nixl.md). Two engines in one process, one NIXL agent each
over UCX on loopback (progress thread off), the local one READing the
remote one's blocks with a notification, as vLLM's decode side does. Each
transfer is built and posted four ways: (a) vLLM 0.33's numpy formula for
prepared indices (`_compute_desc_ids`) and `make_prepped_xfer`; (b)
`ptrres.nixl.prepped_indices` and `make_prepped_xfer`, on the same
prepared lists (one strided row per ref); (c) `plan_peer_transfer` and
`peer_xfer_descs` (Nx3 arrays) and `initialize_xfer`; (d) the same,
coalesced. Ids are the shipped vLLM traces' (GPU ids local, CPU ids remote,
by transfer size), then synthetic patterns the traces lack. `build` is ids
to what NIXL takes, `make/init` NIXL's request, `transfer()` the post (UCX
here moves the bytes in it: RMA over tcp/lo), `completion` the wait after;
`posted` is NIXL's own descriptor count: `make_prepped_xfer` merges
consecutive indices itself, `initialize_xfer` does not. Pages are the
presets' divided by 64 (real ones would take 30 GiB), so `transfer()` and
`completion` are per-descriptor costs, not bandwidth. Last, NIXL's POSIX
backend against `write_files` on the same FilePlans.""",
        ("python", "benchmarks/nixl_transfer.py"),
        ("--quick",),
        markdown=True,
    ),
    Section(
        "nixl-desc-ids",
        "vLLM's NIXL index path: _compute_desc_ids, patched and unpatched",
        """\
[docs/nixl.md](nixl.md). vLLM's NIXL connector turns a request's block ids
into descriptor indices twice per `_read_blocks`, remote side then local
side (`_compute_desc_ids`); the plugin checks every id there. Both calls
timed together, three ways, interleaved in one process: vLLM's own, the
plugin's (every id checked, the indices built by one kernel: `compiled`),
and the same check followed by vLLM's own method (`wrap`). Bare workers
(only the attributes the method reads), ids as vLLM passes them (one list
of Python ints per group), scattered or consecutive; 32 regions
(Llama-3.1-8B) and 80 (Llama-3.1-70B at TP4); one group (vLLM's fast path)
and a hybrid model of 4 groups (its region-group mapping); the three
outputs are checked equal first. The first table runs on the benchmark's
warm heap (no page faults); the second in a process whose malloc hands
every large array fresh pages, as a serving process's may. Between them,
where the patched paths' time goes. `wrap - vLLM` is what the check costs
when vLLM builds the indices. Last, what an explicit `ptrres.vllm.patch()`
costs, which imports every path's modules: vLLM's NIXL worker modules, and
on vLLM 0.34 the offloading connector's worker module too (its import of
`vllm.config` is most of it), against the commit before the NIXL patch
where that commit patches the installed vLLM (it patches no vLLM past
0.33): in a process that has imported only vLLM's offloading worker, and in
one that has imported what a GPU worker has. A vLLM process patches through
`register()` instead, each path as vLLM imports it (the start-up section
below).""",
        ("python", "benchmarks/nixl_desc_ids.py"),
        ("--quick",),
        markdown=True,
    ),
    Section(
        "nixl-tp",
        "NIXL between engines of different TP: descriptors, building, UCX",
        """\
[docs/nixl.md](nixl.md). A prefill engine and a decode engine at different
tensor parallelism (prefill TP -> decode TP 1->2, 2->1, 1->4, 4->1, 2->8,
8->2), Llama-3.1-8B and 70B (8 KV heads, K and V apart: 64 and 160 refs,
HND pages of 4 KiB per head: 32 KiB a ref on a rank at TP 1, 4 KiB at TP 8).
One decode rank (the last) gathers its heads from its source ranks
(`ptrres.tp_mapping`): one prepared list pair and one transfer per source
rank. First the setup, once per peer engine, from the handshake's numbers
to both sides' prepared lists: vLLM 0.33's own `compute_tp_mapping`,
`_build_fa_local`, `_build_fa_remote` and `_build_local_splits_from_plan`
on a bare worker, against `PeerLayout.from_nixl_metadata`, `tp_mapping`
and `prepped_pair` (rows checked equal). Then building per transfer, on the
shipped traces' ids, interleaved in one process: vLLM's own
`_compute_desc_ids` (both sides, once per source rank, as `_read_blocks`
calls it) against `prepped_indices` (local ids once, remote ids per source
rank; and `ptrres/read`, both per source rank as vLLM does) into the same
prepared lists (indices checked equal), and the peer plans
(`plan_peer_transfer(heads=)`, `peer_xfer_descs`, plain and coalesced).
Last, build plus post over UCX on loopback: the decode rank's agent here,
one agent per source rank in a second process, host memory, pages divided
by 64, every head of the moved pages checked first; from the ids to every
transfer DONE. Head slices are not contiguous from block to block, so
coalescing merges nothing here and NIXL's own merge neither.

Reading: per transfer, ptrres's checked indices into the prepared lists
cost less than vLLM's unchecked ones on every pair, and the gap grows with
the source ranks (vLLM computes both sides again for each). The peer plans
write three address arrays and two Nx3 lists instead of two index arrays,
and lose to the indices from a few hundred blocks on: use prepared lists for
large transfers. The setup, once per peer engine, is where ptrres is slower
(milliseconds: every ref's slice is checked in Python). Over UCX the
transfer itself takes over 90% of the time, so the four ways end within
noise of each other.""",
        ("python", "benchmarks/nixl_tp.py"),
        ("--quick",),
        markdown=True,
    ),
    Section(
        "vllm-startup",
        "What the vLLM plugin costs at start-up, path by path",
        """\
[docs/vllm.md](vllm.md). Fresh interpreters with ptrres's entry point and
without it (`VLLM_PLUGINS` naming only vLLM's own plugins), alternating,
medians of wall and CPU time: `load_general_plugins()` where vLLM's
offloading worker and its connector's worker module are already imported
(`offloading`: ptrres patches the offloading paths there, on 0.34
pointer_utils, the connector's resolve and the handler, each matched by
its fingerprint first, and imports neither numba nor anything of the NIXL
connector), where
nothing of vLLM's paths is (`api`), and vLLM's own import of its NIXL
connector after it (`nixl`), inside which ptrres patches that path, timed
on its own. Each path is patched when vLLM imports its modules, and only
then (issue 35: before, a process that only offloaded paid 2755 ms for the
NIXL connector's modules). The comment under the table says what each
process had imported.""",
        ("python", "benchmarks/vllm_startup.py"),
        ("--rounds", "3"),
        markdown=True,
    ),
    Section(
        "core-targets",
        "Resolver targets",
        """\
The resolver's targets (issue 2): `PointerTable.resolve(out=)` and the
vLLM drop-in `resolve_device_pointers` against the reference and against a
transcription of vLLM's numpy resolver, at 1, 16 and 256 blocks; large
transfers (64 refs) against a numpy fill of the same bytes; and start-up in a
fresh process (import, `warmup()`, a first resolve) on an empty and a warm
Numba cache. The drop-in allocates its outputs on every call, as vLLM's
does; on a hot path keep a `PointerTable` and resolve into reused pinned
buffers with `out=`.""",
        ("python", "benchmarks/core_targets.py"),
        ("--quick",),
    ),
    Section(
        "plan-targets",
        "Transfer plan targets",
        """\
The plan targets (issue 3): store plans (`blocks_per_chunk` 4, into `out=`)
against a transcription of vLLM's numpy fill (`x vllm`) and the reference
(`x ref`); what `coalesce=True` adds to a plan (`coal+%`); and a coalesced
plan against numpy building the plan and then merging it (`x np+c`).""",
        ("python", "benchmarks/plan_targets.py"),
        ("--quick",),
    ),
    Section(
        "threads",
        "Two threads against one",
        """\
Kernels run without the GIL, so threads of one serving process resolve at
once on a shared `PointerTable`. The figure is the throughput of two threads
over one, each resolving 1M-op transfers into its own `out=` buffers: ptrres
as it is, the same kernel compiled to hold the GIL, and a control loop that
touches no memory, which says how much of two cores the machine gave.""",
        ("python", "benchmarks/threads.py"),
        ("--quick",),
    ),
    Section(
        "startup",
        "Compile time and start-up",
        """\
Each figure comes from fresh processes with a new, empty `NUMBA_CACHE_DIR`:
the compile time of every kernel signature, one after another in one
process, and start-up (`import ptrres`, `warmup()`, a first resolve) on an
empty cache, the first start after an install or on a new CPU model, and
on the cache a first process filled, every later start. Medians over the
processes. How kernels compile, and why: [docs/design.md](design.md).""",
        ("python", "benchmarks/compile_times.py"),
        ("--rounds", "1"),
    ),
)

INTRO = """\
Every comparison here is measured side by side: the contenders of one table
take turns in interleaved rounds, in one process, so that what the machine
does meanwhile slows them alike. Read the ratios: absolute times (and
start-up, timed in fresh processes) depend on the machine and on how busy it
was. On a shared machine single cells move by a quarter or more between
runs; geometric means move less. No test asserts a timing.

Regenerate the page with `PYTHONPATH=$PWD python benchmarks/report.py` (every
section), `--only NAME` (one section, repeatable; the others keep their
figures and say where they came from) or `--quick` (shortest timings, to
check that the report still works; pass `--page /tmp/benchmarks.md` to leave
this page alone). The prose of each section lives in `benchmarks/report.py`.
Each section says the load average when it started: above the number of
CPUs, the contenders shared them with other work. Writing this page also
rewrites README's table of headline figures from it."""


@dataclass(frozen=True)
class Headline:
    """One row of README's table: a figure read from a section's output."""

    what: str
    against: str
    section: str
    pattern: str  # its groups are the figures
    shown: str  # str.format of the groups, as floats


HEADLINES: tuple[Headline, ...] = (
    Headline(
        "vLLM 0.34's offloading job (resolve, `transfer_async`), patched",
        "vLLM's own, 1 to 2048 blocks",
        "vllm",
        r"geometric mean ([\d.]+)x .*lowest ([\d.]+)x",
        "{0:.1f}x faster (geometric mean), lowest {1:.1f}x",
    ),
    Headline(
        "vLLM's `copy_blocks` (simple CPU offload), patched",
        "vLLM's own, 1 to 4096 blocks",
        "simple-copy-blocks",
        # Both tables' lines: the warm heap's figures, fresh pages' beside.
        r"(?s)warm heap: geometric mean ([\d.]+)x .*?lowest ([\d.]+)x; .*?lowest "
        r"([\d.]+)x.*?fresh pages: geometric mean ([\d.]+)x",
        "{0:.1f}x faster (geometric mean, warm heap; {3:.1f}x on fresh pages), "
        "lowest {1:.1f}x; {2:.1f}x at one block",
    ),
    Headline(
        "resolve into `out=`, 1 and 16 blocks",
        "the numpy reference",
        "core-targets",
        r"1 and 16 blocks: resolve\(out=\), geomean x +([\d.]+)",
        "{0:.0f}x faster (geometric mean)",
    ),
    Headline(
        "`ptrres bench`: resolve, plan, coalesce",
        "the numpy reference, 1 to 4096 blocks",
        "bench",
        r"geometric mean ([\d.]+)x",
        "{0:.1f}x faster (geometric mean)",
    ),
    Headline(
        "resolve, 4096 blocks of 64 refs",
        "a numpy fill of the same bytes",
        "core-targets",
        r"4096 blocks: ptrres / numpy fill +([\d.]+)",
        "{0:.2f}x the fill's time",
    ),
    Headline(
        "file-tier op lists",
        "vLLM PR #56076's Python",
        "file-tier",
        r"plan_file_ops: geometric mean ([\d.]+)x",
        "{0:.1f}x faster (geometric mean)",
    ),
    Headline(
        "start-up: import, `warmup()`, a resolve",
        "warm / empty Numba cache",
        "startup",
        r"cold cache ([\d.]+) s, warm cache ([\d.]+) s",
        "{1:.2f} s / {0:.1f} s",
    ),
)

HEADLINE_BEGIN = "<!-- headline:begin (benchmarks/report.py writes this table) -->"
HEADLINE_END = "<!-- headline:end -->"
BEGIN = "<!-- report:begin {} -->"
END = "<!-- report:end {} -->"
BLOCK = re.compile(
    r"^<!-- report:begin (?P<name>[\w-]+) -->\n(?P<body>.*?)"
    r"^<!-- report:end (?P=name) -->$",
    re.S | re.M,
)


@dataclass(frozen=True)
class Result:
    """A section's figures: the command that printed them, where, and what."""

    command: str
    ran_on: str
    output: str  # Markdown, as it goes on the page


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def commit() -> str:
    """HEAD's short hash, and whether code that makes the figures differs."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--", "ptrres", "benchmarks"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"
    return f"commit {head}" + (" with uncommitted changes" if changed else "")


def environment(quick: bool = False) -> str:
    """One line: the machine, the versions and the commit of this run."""
    versions = [f"Python {platform.python_version()}"]
    versions += [
        f"{shown} {v}" for p, shown in VERSIONS.items() if (v := version(p)) is not None
    ]
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    line = (
        f"{cpu_model()} ({os.cpu_count()} CPUs), {platform.system()}; "
        f"{', '.join(versions)}; {commit()}; {today}"
    )
    return line + ("; quick run (`--quick`): shortest timings" if quick else "")


def as_markdown(output: str, markdown: bool) -> str:
    """A command's output for the page: tables kept, anything else verbatim."""
    output = output.strip("\n")
    if not markdown:
        return f"```text\n{output}\n```"
    lines: list[str] = []
    for line in output.splitlines():
        in_table = bool(lines) and lines[-1].startswith("|")
        if line.strip() and lines and lines[-1] and in_table != line.startswith("|"):
            lines.append("")  # a table needs blank lines around it
        lines.append(line.rstrip())
    return "\n".join(lines)


def run(section: Section, quick: bool) -> Result:
    """Run one section's command, echoing its output as it comes."""
    env = dict(os.environ)
    env.pop("NUMBA_DISABLE_JIT", None)  # figures of the interpreter mean nothing
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH")) if p
    )
    print(f"\n$ {section.shown(quick)}", file=sys.stderr, flush=True)
    # How busy the machine was: on a shared one, the figures' main caveat.
    load = (
        f" at load average {os.getloadavg()[0]:.1f}"
        if hasattr(os, "getloadavg")
        else ""
    )
    start = time.perf_counter()
    process = subprocess.Popen(
        section.argv(quick), cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        sys.stderr.write(line)
        lines.append(line)
    if process.wait():
        raise RuntimeError(
            f"`{section.shown(quick)}` exited with status {process.returncode}"
        )
    seconds = time.perf_counter() - start
    print(f"({seconds:.0f} s)", file=sys.stderr)
    return Result(
        section.shown(quick),
        f"{environment(quick)}; took {seconds:.0f} s{load}",
        as_markdown("".join(lines), section.markdown),
    )


def parse_page(text: str) -> dict[str, Result]:
    """The figures a page holds, by section name."""
    results = {}
    for match in BLOCK.finditer(text):
        body = match["body"]
        command = re.search(r"^Command: `(.*)`\s*$", body, re.M)
        ran_on = re.search(r"^Ran on: (.*)$", body, re.M)
        if command is None or ran_on is None:
            continue  # a section not measured yet
        output = body[ran_on.end() :].strip("\n")
        results[match["name"]] = Result(command[1], ran_on[1], output)
    return results


def render_section(section: Section, result: Result | None) -> str:
    lines = [BEGIN.format(section.name), f"## {section.title}", "", section.about, ""]
    if result is None:
        lines.append(
            f"Not measured yet: `python benchmarks/report.py --only {section.name}`."
        )
    else:
        lines += [
            f"Command: `{result.command}`",
            "",
            f"Ran on: {result.ran_on}",
            "",
            result.output,
        ]
    lines.append(END.format(section.name))
    return "\n".join(lines)


def appendix(text: str) -> str:
    """What a page holds after its last section: sections written by hand
    (from commands this script does not run), which a rerun keeps."""
    ends = list(re.finditer(r"^<!-- report:end [\w-]+ -->$", text, re.M))
    return text[ends[-1].end() :].strip("\n") if ends else ""


def render_page(
    results: dict[str, Result],
    sections: Sequence[Section] | None = None,
    kept: str = "",
) -> str:
    """The whole page: intro, where each section ran, the sections, then
    ``kept`` (the old page's appendix())."""
    sections = SECTIONS if sections is None else sections
    runs: dict[str, list[str]] = {}
    for section in sections:
        if section.name in results:
            ran_on = results[section.name].ran_on.split("; took ")[0]
            runs.setdefault(ran_on, []).append(section.name)
    lines = [
        "# Benchmarks",
        "",
        "<!-- Written by benchmarks/report.py: edit the prose there. -->",
        "",
        INTRO,
        "",
    ]
    if len(runs) == 1 and len(next(iter(runs.values()))) == len(sections):
        lines.append(f"Every section ran on: {next(iter(runs))}.")
    else:
        lines += ["Measured on:", ""]
        lines += [
            f"- {', '.join(f'[{n}](#{anchor(sections, n)})' for n in names)}: {ran_on}"
            for ran_on, names in runs.items()
        ] or ["- nothing yet"]
    lines += ["", "| section | command |", "| --- | --- |"]
    lines += [
        f"| [{s.title}](#{anchor(sections, s.name)}) | `{s.shown(False)}` |"
        for s in sections
    ]
    for section in sections:
        lines += ["", render_section(section, results.get(section.name))]
    if kept:
        lines += ["", kept]
    return "\n".join(lines) + "\n"


def headline_table(results: dict[str, Result]) -> str:
    """README's table of headline figures, read from the sections' outputs.

    Raises:
        ValueError: a section is missing, or its output lacks a figure.
    """
    lines = [
        "| | against | ptrres |",
        "| --- | --- | --- |",
    ]
    for row in HEADLINES:
        if row.section not in results:
            raise ValueError(f"section {row.section!r} was never measured")
        match = re.search(row.pattern, results[row.section].output)
        if match is None:
            raise ValueError(f"no {row.pattern!r} in section {row.section!r}")
        figure = row.shown.format(*map(float, match.groups()))
        lines.append(f"| {row.what} | {row.against} | {figure} |")
    return "\n".join(lines)


def with_headlines(readme: str, results: dict[str, Result]) -> str:
    """README with its headline table (between the markers) rewritten."""
    start, end = readme.find(HEADLINE_BEGIN), readme.find(HEADLINE_END)
    if start < 0 or end < start:
        raise ValueError("README has no headline markers")
    table = headline_table(results)
    return f"{readme[: start + len(HEADLINE_BEGIN)]}\n{table}\n{readme[end:]}"


def anchor(sections: Iterable[Section], name: str) -> str:
    """GitHub's anchor of a section's heading."""
    title = next(s.title for s in sections if s.name == name)
    kept = re.sub(r"[^\w\- ]", "", title.lower())
    return kept.replace(" ", "-")


def main(argv: Sequence[str] | None = None) -> int:
    names = [s.name for s in SECTIONS]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        action="append",
        choices=names,
        metavar="NAME",
        help=f"rerun this section only (repeatable): {', '.join(names)}",
    )
    parser.add_argument("--quick", action="store_true", help="shortest timings")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page to write")
    parser.add_argument("--list", action="store_true", help="list the sections")
    args = parser.parse_args(argv)
    if args.list:
        for s in SECTIONS:
            print(f"{s.name:<14} {s.shown(False)}")
        return 0

    old_page = args.page.read_text() if args.page.exists() else ""
    results, kept = parse_page(old_page), appendix(old_page)
    failed = []
    for section in SECTIONS:
        if args.only and section.name not in args.only:
            continue
        try:
            results[section.name] = run(section, args.quick)
        except (OSError, RuntimeError) as exc:
            print(f"{section.name}: {exc}; its figures are kept", file=sys.stderr)
            failed.append(section.name)
        args.page.write_text(render_page(results, kept=kept))  # after each
    print(f"wrote {args.page}", file=sys.stderr)
    if args.page.resolve() == PAGE:
        try:
            README.write_text(with_headlines(README.read_text(), results))
            print(f"wrote the headline table of {README}", file=sys.stderr)
        except ValueError as exc:
            print(f"README left as it is: {exc}", file=sys.stderr)
            failed.append("headlines")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
