"""Block-id streams from vLLM 0.33's own allocators (issue 26).

Descriptor counts after coalescing depend on which GPU blocks and which CPU
blocks vLLM hands a transfer. This script runs vLLM 0.33's own scheduler,
KV-cache manager and CPU offloading connector over a request workload, with
the model and the offloading worker stood in for, and records every store
(GPU -> CPU) and load (CPU -> GPU) job exactly as the connector hands it to
its worker: the ``GPULoadStoreSpec`` (GPU block ids, block index) and the
``CPULoadStoreSpec`` (CPU chunk ids). It writes one ``.npz`` trace per
eviction policy into ``ptrres/bench/traces/``, which ``ptrres.bench.traces``
reads with numpy alone.

What runs as vLLM's own code (vllm==0.33.0, unmodified):

- ``vllm.v1.core.sched.scheduler.Scheduler``: admission, chunked prefill,
  decode, preemption, request completion (``max_tokens``), and the KV
  connector hooks it calls (``get_num_new_matched_tokens``,
  ``update_state_after_alloc``, ``build_connector_meta``,
  ``update_connector_output``, ``request_finished``).
- Its ``KVCacheManager``, ``FullAttentionManager`` and ``BlockPool`` with
  prefix caching on: GPU block ids come from the pool's free-block queue,
  cached blocks are evicted from it in vLLM's order, prefix hits reuse them.
  Block hashes come from ``get_request_block_hasher`` with vLLM's default
  hash function, as ``EngineCore`` sets it up.
- ``OffloadingConnector`` in its scheduler role, built by the scheduler
  from ``KVTransferConfig(kv_connector="OffloadingConnector")``: the
  ``OffloadingConnectorScheduler`` decides what to store (which chunks, with
  ``offload_prompt_only``, vLLM's default, on) and what to load (its lookup
  over the CPU cache past the GPU prefix hit), and builds every
  ``TransferJob``. Its ``CPUOffloadingSpec`` builds the
  ``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager`` with the ``lru``
  or ``arc`` policy (``eviction_policy``), which allocates, evicts and hands
  out the CPU chunk ids.

What this script reproduces (stands in for):

- The model: each step, every request whose scheduled tokens reach the end
  of its tokens samples one token (a seeded random id); partial prefills
  sample nothing, as vLLM's model runner discards them.
- The worker side of the connector (``OffloadingConnectorWorker`` with a
  CPU ``OffloadingWorker``), reduced to its bookkeeping: a store job is
  submitted at the start of the next step (``prepare_store_kv`` defers it),
  or at once when the step's ``jobs_to_flush`` names it; a load job is
  submitted in its own step. Every transfer completes within the step it
  was submitted in, and the step's output reports it
  (``OffloadingWorkerMetadata.completed_jobs``; ``finished_recving`` for
  asynchronous loads). The trace lists the jobs in that submission order.
  No byte is copied: the trace is the ids, which do not depend on timing
  beyond this one-step completion.
- ``EngineCore``'s loop (add the requests that arrived, ``schedule()``,
  execute, ``update_from_output()``), and the clients: the workload below.

The script re-runs itself under ``PYTHONHASHSEED=0``: the connector hands a
finished store's chunks to the CPU policy by iterating a set of keys, so the
order in which they become evictable, and the CPU ids handed out after they
are evicted, follow Python's (per-process random) bytes hashing. Fixed, a
rerun writes the same traces; vLLM itself runs with a random seed, so this
order is one draw of what it does.

The workload (every figure is in ``WORKLOAD`` and stored in each trace's
metadata): conversations arrive as a Poisson process (exponential gaps, in
engine steps); each uses one of a handful of system prompts (300-1500
tokens, Zipf-like popularity) and has a geometric number of turns; each turn
resends the system prompt and the whole history (earlier user messages and
model outputs) plus a new user message, whose length is lognormal (median 600
tokens), and generates a lognormal number of tokens (median 200); the next
turn arrives an exponential think time after the previous one finished. The
GPU pool is small enough that cached prefixes are evicted from it and later
come back from CPU (loads). One KV-cache group: a plain attention model
(Llama-3.1-8B's 32 layers, 8 KV heads, head size 128, bf16), block size 16.

Install (its own venv, ``.venv-traces`` at the repository root, ignored by
git; a CPU torch first, so that nothing pulls a CUDA build)::

    python3 -m venv .venv-traces
    .venv-traces/bin/pip install torch==2.13.0
    .venv-traces/bin/pip install --no-deps vllm==0.33.0
    .venv-traces/bin/pip install packaging regex requests psutil pyzmq \\
        msgspec numba==0.65.0 numpy pydantic cbor2 'transformers>=5.16.1,<5.21' \\
        aiohttp openai openai-harmony pillow pybase64 cachetools uvloop \\
        py-cpuinfo prometheus-client xgrammar fastapi partial-json-parser \\
        llguidance cloudpickle

(pip warns that vLLM 0.33 wants torch 2.14 and other pins; nothing here
needs them. vLLM's compiled ``_C`` extension does not load against the CPU
torch, and nothing here needs it either.)

Run (about a minute per trace on 2 cores)::

    .venv-traces/bin/python benchmarks/vllm_traces.py            # all traces
    .venv-traces/bin/python benchmarks/vllm_traces.py --trace vllm033-arc

The trace format (``ptrres.bench.traces`` documents it too): ``store``
(bool per transfer, True for GPU -> CPU), ``gpu_offsets`` (int64, n + 1) into
``gpu_ids`` (int32, GPU block ids in ``GPULoadStoreSpec`` order),
``cpu_offsets`` (int64, n + 1) into ``cpu_ids`` (int64, CPU chunk ids in
``CPULoadStoreSpec`` order), ``block_indices`` (int64, the request's block
index of each transfer's first GPU block) and ``metadata`` (a 0-d str array
of JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

VLLM_VERSION = "0.33.0"
HASH_SEED = "0"
OUT_DIR = Path(__file__).resolve().parent.parent / "ptrres" / "bench" / "traces"


@dataclass(frozen=True)
class Workload:
    """Every parameter of the workload and the engine; stored in the metadata."""

    seed: int = 2026
    # Engine.
    block_size: int = 16  # tokens per GPU block
    num_gpu_blocks: int = 3072  # 48K tokens: small, so cached prefixes are evicted
    # CPU capacity in GPU blocks' worth of bytes: num_cpu_blocks (chunks) is
    # this // blocks_per_chunk.
    cpu_capacity_gpu_blocks: int = 12288
    max_num_batched_tokens: int = 2048  # chunked prefill budget per step
    max_num_seqs: int = 64
    max_model_len: int = 32768
    # Model shape (sets bytes only): Llama-3.1-8B.
    num_layers: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    # Arrivals: new conversations per engine step (Poisson process).
    num_conversations: int = 220
    conversation_rate_per_step: float = 0.04
    # System prompts: lengths in tokens, popularity ~ 1 / (rank + 1).
    system_prompt_tokens: tuple[int, ...] = (320, 560, 800, 1150, 1500)
    # Turns per conversation: geometric with this mean, capped.
    mean_turns: float = 3.0
    max_turns: int = 8
    # User message (new prompt text per turn) and output lengths: lognormal.
    user_median_tokens: float = 600.0
    user_sigma: float = 0.8
    user_min_tokens: int = 16
    user_max_tokens: int = 6000
    output_median_tokens: float = 200.0
    output_sigma: float = 0.8
    output_min_tokens: int = 8
    output_max_tokens: int = 2000
    # Think time between a turn's end and the next turn's arrival: exponential.
    mean_think_steps: float = 600.0
    # A conversation ends when its next prompt plus output would exceed this.
    max_context_tokens: int = 16384
    vocab_size: int = 32000
    # Connector: vLLM 0.33's default, only prompt blocks are offloaded.
    offload_prompt_only: bool = True


WORKLOAD = Workload()

# The traces this script writes: name -> (eviction policy, blocks_per_chunk).
TRACES: dict[str, tuple[str, int]] = {
    "vllm033-lru": ("lru", 1),
    "vllm033-arc": ("arc", 1),
    "vllm033-lru-bpc4": ("lru", 4),
}


@dataclass
class Turn:
    user_tokens: list[int]
    # What the stand-in model samples, token by token.
    output_tokens: list[int]
    # Engine steps between the end of this turn and the next turn's arrival.
    think_steps: int


@dataclass
class Conversation:
    index: int
    arrival_step: int
    system: int
    turns: list[Turn]
    history: list[int] = field(default_factory=list)
    next_turn: int = 0


def make_workload(w: Workload) -> tuple[list[list[int]], list[Conversation]]:
    """System prompts (token ids) and conversations, all from ``w.seed``."""
    rng = np.random.default_rng(w.seed)
    systems = [
        [int(t) for t in rng.integers(1, w.vocab_size, n)]
        for n in w.system_prompt_tokens
    ]
    popularity = 1.0 / np.arange(1, len(systems) + 1)
    popularity /= popularity.sum()

    def lognormal(median: float, sigma: float, low: int, high: int) -> int:
        value = round(median * math.exp(sigma * rng.standard_normal()))
        return min(max(value, low), high)

    conversations = []
    clock = 0.0
    for index in range(w.num_conversations):
        clock += rng.exponential(1.0 / w.conversation_rate_per_step)
        n_turns = min(int(rng.geometric(1.0 / w.mean_turns)), w.max_turns)
        turns = []
        for _ in range(n_turns):
            n_user = lognormal(
                w.user_median_tokens, w.user_sigma, w.user_min_tokens, w.user_max_tokens
            )
            n_output = lognormal(
                w.output_median_tokens,
                w.output_sigma,
                w.output_min_tokens,
                w.output_max_tokens,
            )
            turns.append(
                Turn(
                    [int(t) for t in rng.integers(1, w.vocab_size, n_user)],
                    [int(t) for t in rng.integers(3, w.vocab_size, n_output)],
                    int(rng.exponential(w.mean_think_steps)),
                )
            )
        conversations.append(
            Conversation(
                index,
                int(clock),
                int(rng.choice(len(systems), p=popularity)),
                turns,
            )
        )
    return systems, conversations


class _Engine:
    """vLLM 0.33's scheduler with the OffloadingConnector, on a stand-in model."""

    def __init__(self, w: Workload, policy: str, blocks_per_chunk: int, model_dir: str):
        import torch
        from vllm import ModelRegistry
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import (
            get_request_block_hasher,
            init_none_hash,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        class TraceStandInForCausalLM(torch.nn.Module):
            """Registered so that ModelConfig validates; never run."""

            def __init__(self, *, vllm_config: Any = None, prefix: str = "") -> None:
                super().__init__()

            def forward(self, *args: Any, **kwargs: Any) -> Any:
                raise NotImplementedError

            def compute_logits(self, hidden_states: Any) -> Any:
                raise NotImplementedError

            def embed_input_ids(self, input_ids: Any) -> Any:
                raise NotImplementedError

        arch = "TraceStandInForCausalLM"
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, TraceStandInForCausalLM)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(
                {
                    "architectures": [arch],
                    "model_type": "llama",
                    "hidden_size": w.num_kv_heads * w.head_size * 4,
                    "intermediate_size": 14336,
                    "num_attention_heads": w.num_kv_heads * 4,
                    "num_key_value_heads": w.num_kv_heads,
                    "head_dim": w.head_size,
                    "num_hidden_layers": w.num_layers,
                    "vocab_size": w.vocab_size,
                    "max_position_embeddings": w.max_model_len,
                    "torch_dtype": "bfloat16",
                    "rms_norm_eps": 1e-5,
                    "bos_token_id": 1,
                    "eos_token_id": 2,
                },
                f,
            )

        spec = FullAttentionSpec(
            block_size=w.block_size,
            num_kv_heads=w.num_kv_heads,
            head_size=w.head_size,
            dtype=torch.bfloat16,
        )
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(w.num_layers)]
        page = spec.page_size_bytes
        num_cpu_blocks = w.cpu_capacity_gpu_blocks // blocks_per_chunk
        # CPUOffloadingSpec: num_chunks = cpu_bytes_to_use // (bytes per
        # block * blocks_per_chunk, rounded up to its alignment).
        chunk_bytes = page * w.num_layers * blocks_per_chunk
        align = 4096
        aligned = -(-chunk_bytes // align) * align
        model_config = ModelConfig(
            model=model_dir,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=w.max_model_len,
            seed=w.seed,
        )
        vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=w.block_size, enable_prefix_caching=True
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=w.max_num_batched_tokens,
                max_num_seqs=w.max_num_seqs,
                max_model_len=w.max_model_len,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config={
                    "cpu_bytes_to_use": aligned * num_cpu_blocks,
                    "eviction_policy": policy,
                    "blocks_per_chunk": blocks_per_chunk,
                    "offload_prompt_only": w.offload_prompt_only,
                },
            ),
            device_config=DeviceConfig(device="cpu"),
        )
        vllm_config.cache_config.num_gpu_blocks = w.num_gpu_blocks
        kv_cache_config = KVCacheConfig(
            num_blocks=w.num_gpu_blocks,
            # One backing allocation, layer-outermost, as vLLM lays it out.
            kv_cache_tensors=[
                KVCacheTensor(
                    size=page * w.num_layers * w.num_gpu_blocks,
                    layers=layers,
                    layer_stride=page * w.num_gpu_blocks,
                    block_stride=page,
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
        )
        kv_cache_config.hash_block_size = w.block_size
        self.scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=w.block_size,
            hash_block_size=w.block_size,
            log_stats=False,
        )
        connector = self.scheduler.connector
        assert connector is not None
        self.connector_scheduler = connector.scheduler
        manager = self.connector_scheduler.manager
        self.num_cpu_blocks: int = manager._num_chunks
        self.blocks_per_chunk: int = self.connector_scheduler.config.blocks_per_chunk
        self.policy_class = type(manager._policy).__name__
        assert self.num_cpu_blocks == num_cpu_blocks, (
            self.num_cpu_blocks,
            num_cpu_blocks,
        )
        assert self.blocks_per_chunk == blocks_per_chunk
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(w.block_size, hash_fn)


def run_trace(
    w: Workload, policy: str, blocks_per_chunk: int
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Drive the engine over the workload; the trace's arrays and metadata."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        OffloadingWorkerMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request

    systems, conversations = make_workload(w)
    with tempfile.TemporaryDirectory() as model_dir:
        engine = _Engine(w, policy, blocks_per_chunk, model_dir)
    scheduler = engine.scheduler

    # Arrivals: (step, conversation index), kept sorted by step.
    arrivals: list[tuple[int, int]] = sorted(
        (c.arrival_step, c.index) for c in conversations
    )
    # Requests in the engine: id -> (conversation, prompt, vLLM's Request).
    running: dict[str, tuple[Conversation, list[int], Any]] = {}

    store_flags: list[bool] = []
    gpu_chunks: list[np.ndarray] = []
    cpu_chunks: list[np.ndarray] = []
    block_indices: list[int] = []
    unsubmitted: list[tuple[int, Any]] = []  # (job id, TransferJob), stores
    counts = {
        "requests": 0,
        "turns_cut_by_context": 0,
        "steps": 0,
        "idle_steps_skipped": 0,
        "preemptions": 0,
        "prompt_tokens": 0,
        "output_tokens": 0,
        "cached_tokens_at_first_schedule": 0,
        "flushed_store_jobs": 0,
    }

    def record(job: Any, store: bool) -> None:
        gpu_spec = job.src_spec if store else job.dst_spec
        cpu_spec = job.dst_spec if store else job.src_spec
        assert len(gpu_spec.group_sizes) == 1
        store_flags.append(store)
        gpu_chunks.append(np.asarray(gpu_spec.block_ids, dtype=np.int32))
        cpu_chunks.append(np.asarray(cpu_spec.block_ids, dtype=np.int64))
        block_indices.append(int(gpu_spec.block_indices[0]))

    def add_turn(conv: Conversation) -> None:
        turn = conv.turns[conv.next_turn]
        prompt = (
            systems[conv.system] if conv.next_turn == 0 else conv.history
        ) + turn.user_tokens
        if len(prompt) + len(turn.output_tokens) > w.max_context_tokens:
            counts["turns_cut_by_context"] += len(conv.turns) - conv.next_turn
            return
        req_id = f"c{conv.index}-t{conv.next_turn}"
        request = Request(
            request_id=req_id,
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(
                max_tokens=len(turn.output_tokens), ignore_eos=True, detokenize=False
            ),
            pooling_params=None,
            arrival_time=float(step),
            block_hasher=engine.block_hasher,
        )
        scheduler.add_request(request)
        running[req_id] = (conv, prompt, request)
        counts["requests"] += 1
        counts["prompt_tokens"] += len(prompt)

    step = 0
    start = time.perf_counter()
    while arrivals or scheduler.has_requests() or unsubmitted:
        if not scheduler.has_requests() and not unsubmitted and arrivals[0][0] > step:
            counts["idle_steps_skipped"] += arrivals[0][0] - step
            step = arrivals[0][0]
        while arrivals and arrivals[0][0] <= step:
            _, index = arrivals.pop(0)
            add_turn(conversations[index])

        out = scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata)
        counts["preemptions"] += len(out.preempted_req_ids or ())
        # Prompt tokens found cached when first scheduled: GPU prefix hits
        # and tokens loaded from CPU.
        for new_req in out.scheduled_new_reqs:
            counts["cached_tokens_at_first_schedule"] += new_req.num_computed_tokens
        # The worker: flushed stores now, then last step's deferred stores
        # (handle_preemptions), this step's loads (start_kv_transfers); this
        # step's other stores wait for the next step (prepare_store_kv).
        flushed = [
            (job_id, meta.store_jobs[job_id])
            for job_id in sorted(meta.jobs_to_flush or ())
            if job_id in meta.store_jobs
        ]
        counts["flushed_store_jobs"] += len(flushed)
        completed: dict[int, int] = {}
        for job_id, job in [*flushed, *unsubmitted]:
            record(job, store=True)
            completed[job_id] = 1
        flushed_ids = {job_id for job_id, _ in flushed}
        unsubmitted = [
            (job_id, job)
            for job_id, job in sorted(meta.store_jobs.items())
            if job_id not in flushed_ids
        ]
        finished_recving = set()
        for job_id, job in sorted(meta.load_jobs.items()):
            record(job, store=False)
            completed[job_id] = 1
            if not job.sync:
                finished_recving.add(job.req_id)

        # The model: one sampled token for each request whose scheduled
        # tokens reach its end (the turn's next output token); partial
        # prefills sample nothing.
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = scheduler.requests[req_id]
            if request.num_computed_tokens >= request.num_tokens:
                conv = running[req_id][0]
                outputs = conv.turns[conv.next_turn].output_tokens
                sampled.append([outputs[len(request.output_token_ids)]])
            else:
                sampled.append([])
        model_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_recving=finished_recving or None,
                kv_connector_worker_meta=(
                    OffloadingWorkerMetadata(completed_jobs=completed)
                    if completed
                    else None
                ),
            ),
        )
        engine_outputs = scheduler.update_from_output(out, model_output)
        for outputs in engine_outputs.values():
            for output in outputs.outputs:
                if not output.finished:
                    continue
                conv, prompt, request = running.pop(output.request_id)
                outputs_of_turn = list(request.output_token_ids)
                assert outputs_of_turn == conv.turns[conv.next_turn].output_tokens
                counts["output_tokens"] += len(outputs_of_turn)
                # The next turn resends the history: prompt and output.
                conv.history = prompt + outputs_of_turn
                conv.next_turn += 1
                if conv.next_turn < len(conv.turns):
                    think = conv.turns[conv.next_turn - 1].think_steps
                    arrivals.append((step + 1 + think, conv.index))
                    arrivals.sort()
        step += 1
        counts["steps"] += 1
    elapsed = time.perf_counter() - start
    assert not running, sorted(running)

    arrays = _pack(store_flags, gpu_chunks, cpu_chunks, block_indices)
    n_store = int(arrays["store"].sum())
    gpu_lengths = np.diff(arrays["gpu_offsets"])
    counts.update(
        transfers=len(store_flags),
        stores=n_store,
        loads=len(store_flags) - n_store,
        blocks_stored=int(gpu_lengths[arrays["store"]].sum()),
        blocks_loaded=int(gpu_lengths[~arrays["store"]].sum()),
        chunks_stored=int(np.diff(arrays["cpu_offsets"])[arrays["store"]].sum()),
        chunks_loaded=int(np.diff(arrays["cpu_offsets"])[~arrays["store"]].sum()),
    )
    import torch
    import vllm

    assert vllm.__version__ == VLLM_VERSION, vllm.__version__
    metadata: dict[str, Any] = {
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "policy": policy,
        "policy_class": engine.policy_class,
        "blocks_per_chunk": engine.blocks_per_chunk,
        "num_gpu_blocks": w.num_gpu_blocks,
        "num_cpu_blocks": engine.num_cpu_blocks,
        "block_size": w.block_size,
        "seed": w.seed,
        "python_hash_seed": os.environ.get("PYTHONHASHSEED"),
        "kv_cache_groups": 1,
        "workload": asdict(w),
        "counts": counts,
        "generator": "benchmarks/vllm_traces.py",
        "seconds": round(elapsed, 1),
    }
    return arrays, metadata


def _pack(
    store_flags: Sequence[bool],
    gpu_chunks: Sequence[np.ndarray],
    cpu_chunks: Sequence[np.ndarray],
    block_indices: Sequence[int],
) -> dict[str, np.ndarray]:
    def offsets(chunks: Sequence[np.ndarray]) -> np.ndarray:
        out = np.zeros(len(chunks) + 1, np.int64)
        np.cumsum([len(c) for c in chunks], out=out[1:])
        return out

    return {
        "store": np.array(store_flags, dtype=bool),
        "gpu_offsets": offsets(gpu_chunks),
        "gpu_ids": np.concatenate(gpu_chunks).astype(np.int32),
        "cpu_offsets": offsets(cpu_chunks),
        "cpu_ids": np.concatenate(cpu_chunks).astype(np.int64),
        "block_indices": np.array(block_indices, dtype=np.int64),
    }


def main(argv: Sequence[str] | None = None) -> int:
    if os.environ.get("PYTHONHASHSEED") != HASH_SEED:
        # The connector completes a job's chunks by iterating a set of keys,
        # and that order sets the CPU policy's eviction order, hence the CPU
        # ids handed out later: fix str/bytes hashing so that a rerun
        # reproduces the traces (vLLM itself runs with a random seed).
        os.environ["PYTHONHASHSEED"] = HASH_SEED
        os.execv(sys.executable, [sys.executable, __file__, *(argv or sys.argv[1:])])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", action="append", choices=sorted(TRACES))
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    for name in args.trace or TRACES:
        policy, bpc = TRACES[name]
        arrays, metadata = run_trace(WORKLOAD, policy, bpc)
        metadata["name"] = name
        path = args.out_dir / f"{name}.npz"
        np.savez_compressed(path, metadata=np.array(json.dumps(metadata)), **arrays)
        print(
            f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB): {metadata['counts']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
