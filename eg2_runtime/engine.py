"""Engine: the runtime's side of the contract in eg2_runtime/api.py (EngineAPI).

    estimate_many(items, options) -> [Estimate] CPU only, thread-safe: each item's tokens from headers
    prepare(item, options) -> PreparedItem      CPU only, thread-safe: decode, tokenize, featurize
    prepare_many(items, options) -> [...]       the same for many items: media decoded on a thread
                                                pool, all text tokenized in one call
    prepare_segments(item, options) -> stream   an item with spans, a span at a time, one decode pass
    tokenize_many(items, options) -> [...]      what each item costs (usage), by the same preparing
    embed([PreparedItem, ...]) -> (B, 768) f32  the accelerator; call from exactly one thread
    warm_up / capture_graphs                    at boot, on that same thread

On a GPU the engine lives within a memory budget (memory_plan.py): the graph pool, the batch limits
and the token table's place follow from it. Vectors come back as unit-norm float32 numpy rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

import eg2_runtime
from eg2_runtime.api import (
    EngineGraphs,
    EngineMemory,
    Estimate,
    PreparedItem,
    SegmentStream,
    Span,
    TokenCount,
)
from eg2_runtime.errors import EG2Error, EngineOutOfMemory
from eg2_runtime.fused import use_fused_kernels
from eg2_runtime.gpu_memory import ProcessGpuMemory, bound_cublas_workspace, set_cuda_stack_limit
from eg2_runtime.graphs import LENGTH_LADDER, GraphedTextEncoder, GraphPool
from eg2_runtime.inputs import (
    IMAGE_TOKEN_BUDGETS,
    MATRYOSHKA_DIMS,
    Item,
    MediaPart,
    PrepareOptions,
    TextPart,
)
from eg2_runtime.loader import LoadReport, load_model
from eg2_runtime.memory_plan import (
    MIB,
    MIN_GRAPH_TEXT_TOKENS,
    ActivationCosts,
    Footprint,
    MemoryPlan,
    default_budget,
    plan,
)
from eg2_runtime.model import EG2Model
from eg2_runtime.packed_graphs import FIRST_USE, TOKEN_LADDER, PackedTextGraphs
from eg2_runtime.packing import Packing
from eg2_runtime.prepare_processes import PrepareProcesses
from eg2_runtime.preprocess import MediaLimits, Prepared, Preprocessor
from eg2_runtime.tower_graphs import GraphedTowers

log = logging.getLogger(__name__)

# The base (CUDA context, libraries) when NVML cannot measure it: the H200's, 754 MiB after load
# (benchmarks/probe_memory_media.py, 2026-12-01), rounded up.
DEFAULT_BASE = 768 * MIB
# Kernels that load after the base is measured (other shapes' Triton and attention kernels): up to
# 48 MiB on the H200 once the costliest requests had run (the base is measured again once warm).
BASE_MARGIN = 32 * MIB
# The graphs' static input buffers: text embeddings up to the largest bucket, tower pixels as uint8.
STATIC_BUFFERS = 24 * MIB


# The text buckets captured at boot (capture_graphs): one text of up to 512 tokens, batches of short
# texts. With one graph per tower, startup_graph_count counts them for the memory plan.
STARTUP_TEXT_BUCKETS = (*((1, t) for t in LENGTH_LADDER if t <= 512), *((b, 64) for b in (8, 32, 64)))
# The same for the packed text graphs (`packed_text`): every token bucket up to 64 texts of 64 tokens
# but the in-between long rungs, which are left to first use.
STARTUP_TOKEN_BUCKETS = tuple(n for n in TOKEN_LADDER if n <= MIN_GRAPH_TEXT_TOKENS and n not in FIRST_USE)


def startup_tower_graphs(modalities: Iterable[str]) -> int:
    """The towers' graphs capture_graphs takes at boot: one image of the default budget where images
    are served, one clip where audio is."""
    served = set(modalities)
    return int("image" in served) + int("audio" in served)


def startup_graph_count(
    modalities: Iterable[str], packed_text: bool, max_tokens: int = 1 << 62, towers: bool = True
) -> int:
    """How many graphs capture_graphs tries at boot: its text buckets within `max_tokens` (none when
    0: graphs off) and, with `towers`, the towers'. The pool's budget may refuse some of them."""
    if max_tokens <= 0:
        return 0
    if packed_text:
        text = [n for n in STARTUP_TOKEN_BUCKETS if n <= max_tokens]
    else:
        text = [(b, t) for b, t in STARTUP_TEXT_BUCKETS if b * t <= max_tokens]
    return len(text) + (startup_tower_graphs(modalities) if towers else 0)


# torch's CPU threads for the model's own CPU ops, read at import (on the importing thread, before any
# preparing thread set its own count to one, which threads started later would inherit).
MODEL_CPU_THREADS = torch.get_num_threads()


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs a loaded model: speed and memory trade-offs, not the architecture."""

    # The process's GPU memory budget in bytes, everything included (memory_plan.py sizes the graph
    # pool, the batch limits and the token table's place from it, and caps the allocator). None:
    # memory_plan.default_budget. CUDA only.
    gpu_memory_budget: int | None = None
    # The operator's cap on one forward's padded tokens (items x longest), over the memory plan's
    # own per-modality limits; on a CPU, the only limit. Larger batches are split into several
    # forwards. None: the plan's limits (on a CPU: no split).
    max_forward_tokens: int | None = None
    # CUDA graphs for the text encoder, for buckets up to this many padded tokens (and at most what
    # the memory plan's pool holds); 0 turns them off. Short inputs run ~10x faster (no launch
    # overhead), for ~0.1 s of capture per bucket, on first use or at start (capture_graphs).
    graph_max_tokens: int = 16384
    # One Triton kernel per RMSNorm on CUDA (rmsnorm_triton.py) instead of nine torch kernels: the
    # norms are most of the text encoder's launches. Agrees with the reference to float rounding.
    fused_norms: bool = True
    # Keep the 256 MiB token-embedding table in pinned host memory (CUDA only): fewer resident
    # bytes, for a host gather and a (B, T, H) copy per forward. None: the memory plan decides.
    host_token_table: bool | None = None
    # prepare_many's media threads. Images scale with threads (H200 host, 16 images: 20 ms each on
    # 1 thread, 5.2 on 16). Audio did not (7.7 ms per clip on 1 to 16 threads) until numpy's BLAS
    # was held to one thread (single_threaded_numpy_blas): 16 clips on 2 threads of the 2-core dev
    # machine, 2.75 -> 1.86 ms per clip (a lone clip 2.20 -> 2.75 ms; git history:
    # docs/results/2026-11-30-cpu/).
    prepare_threads: int = min(16, os.cpu_count() or 1)
    # The per-thread stack bytes the CUDA context reserves local memory for (gpu_memory.
    # set_cuda_stack_limit): 256 instead of the runtime's 1,024 gives back ~200 MiB of process
    # memory on the H200; a kernel that needs more makes the driver grow it. None leaves the default.
    cuda_stack_bytes: int | None = 256
    # cuBLAS's workspace per stream it runs on (gpu_memory.bound_cublas_workspace), set before the
    # first matmul: torch's 32 MiB default on the H200 holds 64 MiB for the engine's two streams.
    # At 4 MiB the text-only server held 62 MiB less at /ready (1,000 -> 938 MiB, H200) and the
    # bench's in-process cells stayed within their run-to-run spread of 32 MiB's (docs/PERF.md,
    # 2026-12-03). A bigger one may let some GEMMs split K; none measured faster for it here.
    # None leaves torch's default; an operator's CUBLAS_WORKSPACE_CONFIG wins either way.
    cublas_workspace_bytes: int | None = 4 << 20
    # CUDA graphs for the vision and audio towers (tower_graphs.py), with the text graphs: one image
    # 82 -> 12 ms, one 9.3 s clip 122 -> 8.4 ms (H200, packed, benchmarks/probe_memory_media.py).
    tower_graphs: bool = True
    # Unpack groups the Unpacker unpacks ahead of the one running (quant.Unpacker), each in a scratch
    # slot as large as the largest group (loader.LAYERS_PER_SLOT: 8 MiB on the full checkpoint),
    # taken from the graph pool at the same budget. More could hide unpacks behind runs of short matmuls; on the
    # H200 two measured within one's run-to-run spread and three cost the pool its 30 s clip and
    # video graphs (docs/PERF.md, benchmarks/probe_unpack.py).
    unpack_ahead: int = 1
    # The text encoder's memory-lean path (TextEncoder.forward `lean`): sliding-window layers of long
    # texts attend block by block (memory and work grow with T x 3 x window, not T^2) and each
    # layer's PLE slice is computed when it runs (24x fewer PLE bytes alive). The same result to
    # float rounding; off runs the reference's dense masks and up-front PLE.
    lean_text: bool = True
    # The text encoder's graphs take a batch's items end to end (packed_graphs.py: varlen attention,
    # one ladder of token buckets) instead of padded (rows x length) buckets (graphs.py): no work on
    # padding, and a bucket per token count rather than per pair. Off (or computing in FP32): the
    # padded buckets.
    packed_text: bool = True
    # torch's CPU threads on the thread that calls `embed`. None: every core on a CPU, where the model
    # runs on them; one on a GPU, where that thread's CPU work is collating, the token-table gather
    # and copies, and an OpenMP team's spinning threads took cores from the preparing threads (H200,
    # 2026-12-01, `eg2 serve` under OMP_NUM_THREADS=1 against the default in one call: 16 clients'
    # single images 92 -> 140 req/s, clips 96 -> 132, a 2,200-token text 11.3 -> 12.0 ms). torch's
    # count is per thread, but setting it also sets what threads started later begin with; the
    # preparing threads set their own (init_prepare_thread).
    cpu_threads: int | None = None


class Engine:
    """A loaded model with its preprocessor. Build it with `Engine.from_dir`."""

    def __init__(
        self,
        model: EG2Model,
        report: LoadReport,
        preprocessor: Preprocessor,
        model_dir: Path,
        options: EngineOptions | None = None,
        gpu_memory: ProcessGpuMemory | None = None,
    ) -> None:
        """`gpu_memory`: the reader of this process's GPU memory, made before the weights loaded
        (its fallback needs the device's memory from before this process used it)."""
        self.model = model
        self.report = report
        self.preprocessor = preprocessor
        self.model_dir = model_dir
        self.options = options = options or EngineOptions()
        self.device = model.language_model.embedding_projection.weight.device
        self.cpu_threads = options.cpu_threads or (1 if self.device.type == "cuda" else MODEL_CPU_THREADS)
        # Text runs packed where its varlen kernels run: FlashAttention-2 takes BF16 on Ampere (sm80)
        # or newer; elsewhere the padded graphs serve.
        self.packs_text = (
            options.packed_text
            and self.device.type == "cuda"
            and model.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(self.device) >= (8, 0)
        )
        self.modalities = frozenset(model.modalities)
        self.prompts = dict(preprocessor.prompts.prompts)
        self.default_prompt_name = preprocessor.prompts.default_name
        self.max_text_tokens = preprocessor.max_tokens
        self._digest: str | None = None
        self._digest_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()  # prepare_many runs on many threads (the service's pool)
        single_threaded_numpy_blas()  # items are prepared in parallel: here, and by the service
        self.gpu_memory = gpu_memory or ProcessGpuMemory()
        self.plan: MemoryPlan | None = None
        self._cap_fraction = 1.0  # of the device's memory: the allocator's cap (_cap_allocator)
        self.graphs: GraphedTextEncoder | None = None
        self.packed: PackedTextGraphs | None = None
        self._eager_text = False  # warm-up: text runs without graphs, as batches no graph holds
        self.towers: GraphedTowers | None = None
        if self.device.type != "cuda":
            if options.host_token_table:
                self._place_table(True)
            return
        if options.fused_norms:
            _fuse_norms(model)
        if options.cuda_stack_bytes is not None:
            torch.cuda.synchronize(self.device)
            set_cuda_stack_limit(options.cuda_stack_bytes)
        self.plan = self._plan()
        self._place_table(self.plan.host_token_table)  # the operator's place, where set (_plan)
        torch.cuda.empty_cache()
        # The allocator's hard cap: a batch that does not fit fails (the batcher splits it) instead of
        # taking memory past the budget. Graph pools count too.
        self._cap_allocator()
        # The text and the tower graphs' one pool; the allocator's cap follows each capture.
        pool = GraphPool(
            self.plan.graph_pool, self._process_bytes, grew=self._cap_allocator, trial_cap=self._trial_cap
        )
        costs = self.plan.costs
        if options.graph_max_tokens:
            tokens = min(options.graph_max_tokens, self.plan.graph_text_tokens)
            if self.packs_text:
                self.packed = PackedTextGraphs(
                    model.language_model, tokens, pool=pool, token_bytes=costs.text_token
                )
            else:
                self.graphs = GraphedTextEncoder(
                    model.language_model, tokens, pool=pool, token_bytes=costs.text_token
                )
        graphs_on = self.graphs is not None or self.packed is not None
        if graphs_on and options.tower_graphs and self.modalities - {"text"}:
            self.towers = GraphedTowers(
                model,
                vision_slots=self.plan.graph_vision_slots,
                audio_tokens=self.plan.graph_audio_tokens,
                tower_slots=self.plan.tower_slots,
                pool=pool,
                slot_bytes=costs.vision_slot,
                audio_token_bytes=costs.batch_token("audio"),
            )
        log.info("GPU memory plan: %s", self.plan.describe())

    def _plan(self) -> MemoryPlan:
        """The memory plan for this model, from the base measured now (after a small forward has
        loaded the libraries' kernels)."""
        cfg = self.model.config
        self._load_kernels()
        reading = self.gpu_memory.read()
        if reading is None:
            log.warning(
                "NVML is unavailable: the GPU memory plan assumes a base of %d MiB", DEFAULT_BASE // MIB
            )
            base = DEFAULT_BASE
        else:
            base = reading.bytes - torch.cuda.memory_reserved(self.device) + BASE_MARGIN
        # The table may still be in host memory, where the loader leaves it for the plan to place;
        # where the operator placed it (host_token_table), the plan sizes around that place.
        table = self.model.language_model.embed_tokens.weight.nbytes
        forced = self.options.host_token_table
        unpacker = self.model.unpacker
        footprint = Footprint(
            base=base,
            weights=self.report.resident_bytes + self.report.host_bytes - (table if forced else 0),
            table=table if forced is None else 0,
            fixed=(unpacker.scratch_bytes if unpacker is not None else 0) + STATIC_BUFFERS,
            costs=ActivationCosts.from_config(cfg, self.model.dtype.itemsize),
            modalities=self.modalities,
            max_text_tokens=self.max_text_tokens,
            startup_graphs=startup_graph_count(
                self.modalities,
                self.packs_text,
                self.options.graph_max_tokens,
                towers=self.options.tower_graphs,
            ),
            max_batch_tokens=self.options.max_forward_tokens,
        )
        budget = self.options.gpu_memory_budget
        planned = plan(budget if budget is not None else default_budget(footprint), footprint)
        return dataclasses.replace(planned, host_token_table=True) if forced else planned

    @torch.inference_mode()
    def _load_kernels(self) -> None:
        """Small forwards through every loaded path, so the libraries load their kernels (memory
        outside the allocator) before the base is measured: short and banded text, padded and
        packed (FlashAttention and the CUTLASS varlen kernels), and each tower."""
        model, dev, dt = self.model, self.device, self.model.dtype
        h, window = model.config.text.hidden_size, model.config.text.sliding_window
        for t in (8, 3 * window + 1):
            model.encode(torch.zeros(1, t, h, dtype=dt, device=dev), torch.ones(1, t, device=dev), lean=True)
            if self.packs_text:  # the served text path's kernels, pooling included
                packing = Packing.from_lengths([t], dev)
                packing.pool(
                    model.language_model.forward_packed(torch.zeros(t, h, dtype=dt, device=dev), packing)
                )
        if model.vision_tower is not None:
            cfg = model.vision_tower.cfg
            s = 70 * cfg.pooling_kernel_size**2
            positions = torch.full((1, s, 2), -1, dtype=torch.long, device=dev)
            positions[0, 0] = 0
            model.image_soft_tokens(
                torch.zeros(1, s, 3 * cfg.patch_size**2, dtype=torch.uint8, device=dev), positions
            )
        if model.audio_tower is not None:
            bins = model.audio_tower.cfg.subsampling_conv_channels[0]
            features = torch.zeros(1, 256, bins, dtype=dt, device=dev)
            model.audio_soft_tokens(features, torch.ones(1, 256, dtype=torch.bool, device=dev))
        torch.cuda.synchronize(dev)

    def _process_bytes(self) -> int | None:
        reading = self.gpu_memory.read()
        return reading.bytes if reading is not None else None

    def _cap_allocator(self) -> None:
        """Cap the allocator at the budget less the base: from the plan's base at first, and again
        once warm and after every graph capture (GraphPool's `grew`), from the base measured then
        (kernels and CUDA graph executables loaded since take memory outside the allocator), so the
        process as a whole stays within the budget."""
        assert self.plan is not None
        base = self.plan.base
        if (now := self._process_bytes()) is not None:
            base = max(base, now - torch.cuda.memory_reserved(self.device) + BASE_MARGIN)
        total = torch.cuda.get_device_properties(self.device).total_memory
        self._cap_fraction = min(1.0, (self.plan.budget - base) / total)
        torch.cuda.set_per_process_memory_fraction(self._cap_fraction, self.device)

    def _trial_cap(self, room: int) -> Callable[[], AbstractContextManager[None]]:
        """A context that caps the allocator at what it holds now plus `room` bytes (never past the
        budget's cap), for a graph capture's trial (GraphPool): its warm-up then fits, or runs out of
        memory with the pool inside its budget. The budget's cap comes back on exit. The limit is
        fixed when the context is made (once the trial's buffers are measured), not when entered."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        fraction = min((torch.cuda.memory_reserved(self.device) + room) / total, self._cap_fraction)

        @contextlib.contextmanager
        def capped() -> Iterator[None]:
            torch.cuda.set_per_process_memory_fraction(fraction, self.device)
            try:
                yield
            finally:
                torch.cuda.set_per_process_memory_fraction(self._cap_fraction, self.device)

        return capped

    def _place_table(self, host: bool) -> None:
        """The token table in pinned host memory or on the device, the load report to match."""
        text = self.model.language_model
        moved = text.keep_table_on_host() if host else -text.keep_table_on_device()
        self.report.host_bytes += moved
        self.report.resident_bytes -= moved

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        *,
        device: str = "auto",
        modalities: Iterable[str] | None = None,
        pack: bool = False,
        group_size: int = 128,
        limits: MediaLimits | None = None,
        dtype: torch.dtype | None = None,
        options: EngineOptions | None = None,
    ) -> Engine:
        """Load the towers for `modalities` (all the checkpoint has when None; text is always on).

        `pack`: serve a BF16 checkpoint's tower Linears as int4, quantized at load time.
        """
        model_dir = Path(model_dir)
        t0 = time.perf_counter()
        gpu_memory = ProcessGpuMemory()  # before the weights: see ProcessGpuMemory
        wanted = frozenset(modalities) if modalities is not None else None
        opts = options or EngineOptions()
        if opts.cublas_workspace_bytes is not None:
            bound_cublas_workspace(opts.cublas_workspace_bytes)
        # The table waits in host memory for the memory plan to place it (Engine.__init__) unless
        # the operator asked for it on the device.
        host_table = opts.host_token_table is not False
        model, report = load_model(
            model_dir,
            device,
            wanted,
            dtype=dtype,
            pack=pack,
            group_size=group_size,
            unpack_ahead=opts.unpack_ahead,
            table_on_host=host_table,
        )
        media = sorted(model.modalities - {"text"})
        pre = Preprocessor.from_dir(model_dir, model.config, limits=limits, modalities=media)  # type: ignore[arg-type]
        engine = cls(model, report, pre, model_dir, options, gpu_memory)
        log.info("engine ready in %.1f s on %s: %s", time.perf_counter() - t0, device, report.summary())
        return engine

    # ---- CPU side: any thread -------------------------------------------------------------------

    def prepare(self, item: Item, options: PrepareOptions) -> PreparedItem:
        prepared = self.preprocessor.prepare(item, options)
        return wrap_prepared(prepared)

    def estimate_many(self, items: Sequence[Item], options: PrepareOptions) -> list[Estimate | EG2Error]:
        """Each item's cost in tokens before anything is decoded (`Preprocessor.estimate`: headers only),
        or the error its headers already prove, in its slot. Thread-safe; milliseconds per video."""
        out: list[Estimate | EG2Error] = []
        for item in items:
            try:
                out.append(self.preprocessor.estimate(item, options))
            except EG2Error as e:
                out.append(e)
        return out

    def init_prepare_thread(self) -> None:
        """Run once on each thread that will prepare items (the service's pool, this engine's own):
        torch's CPU ops there (the images' and frames' resize) use one thread. Items are prepared on
        many threads at once, and each thread's ops spreading over every core again made the OpenMP
        teams thrash (dev machine, 2 cores: one 641x479 PNG on a pool worker 8.9 -> 5.0 ms, 16 on 8
        workers 121 -> 68 ms; benchmarks/probe_prepare.py). torch's count is per thread, but threads
        started after this one begin with one too: `embed` gives its thread the model's count
        (EngineOptions.cpu_threads: all cores on a CPU, which the model's CPU ops need). On the H200's 16-core host one thread
        was no faster (probe_prepare, 2026-12-01: 16 images on 8 threads 39.0 ms with 16 torch
        threads, 43.7 with one); docs/PERF.md has both figures."""
        torch.set_num_threads(1)

    def prepare_many(
        self, items: Sequence[Item], options: PrepareOptions, cancel: threading.Event | None = None
    ) -> list[PreparedItem | EG2Error]:
        """`prepare` for many items at once; a failing item gives its error in its slot. Thread-safe.

        Media of several items are decoded on the engine's thread pool; a single item is prepared on
        the calling thread (the service hands each media item to a thread of its own already).
        `cancel`: once set (the caller's client left), decoding stops within a frame or an audio block
        and the call raises eg2_runtime.errors.Cancelled."""
        executor = self._executor() if len(items) > 1 else None
        out = self.preprocessor.prepare_batch(items, options, executor=executor, cancel=cancel)
        return [p if isinstance(p, EG2Error) else wrap_prepared(p) for p in out]

    def prepare_segments(
        self, item: Item, options: PrepareOptions, cancel: threading.Event | None = None
    ) -> SegmentStream:
        """An item with spans (`Item.span_unit`) as a stream of PreparedItems, each with its `span`
        (None: the item itself), a step at a time (`Preprocessor.prepare_segments`). Nothing is decoded
        before the first `next()`; `cancel` stops the decoding within a block or a frame."""
        steps = self.preprocessor.prepare_segments(item, options, cancel)
        return SegmentStream([wrap_prepared(p, span) for span, p in step] for step in steps)

    def tokenize_many(
        self, items: Sequence[Item], options: PrepareOptions, cancel: threading.Event | None = None
    ) -> list[TokenCount | EG2Error]:
        """What each item would cost an embeddings request (its `usage`), from the same preparing that
        request runs (`prepare_many`, `prepare_segments`), without the model: tokens, whether anything
        was cut, a text item's ids, each media part's tokens, each span's tokens."""
        plain = [i for i, item in enumerate(items) if item.span_unit is None]
        out: list[TokenCount | EG2Error | None] = [None] * len(items)
        prepared = self.prepare_many([items[i] for i in plain], options, cancel) if plain else []
        for i, p in zip(plain, prepared, strict=True):
            out[i] = p if isinstance(p, EG2Error) else token_count(items[i], [p])
        for i, item in enumerate(items):
            if item.span_unit is None:
                continue
            stream = self.prepare_segments(item, options, cancel)
            try:
                parts: list[PreparedItem] = []
                while (step := stream.next()) is not None:
                    # Counted and dropped a step at a time: the tensors of a long file never pile up.
                    parts.extend(p if p.span is None else replace(p, inputs=None) for p in step)
                out[i] = token_count(item, parts)
            except EG2Error as e:
                out[i] = e
            finally:
                stream.close()
        return [o for o in out if o is not None]

    def prepare_processes(self, n: int) -> PrepareProcesses:
        """`n` worker processes that run `prepare_many`'s work outside this process's GIL, on this
        engine's model directory, limits and media (prepare_processes.py); not started yet."""
        pre = self.preprocessor
        media = sorted(pre.modalities)
        return PrepareProcesses(n, self.model_dir, pre.config, pre.limits, media)

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.options.prepare_threads,
                    thread_name_prefix="eg2-prepare",
                    initializer=self.init_prepare_thread,
                )
            return self._pool

    def batch_token_limits(self) -> dict[str, int]:
        """Per modality, the most tokens one batch may carry: the memory plan's (GPU), else
        `max_forward_tokens`'s, else none (an empty dict: the service's own limit applies)."""
        if self.plan is not None:
            return dict(self.plan.max_batch_tokens)
        cap = self.options.max_forward_tokens
        return {m: cap for m in (*self.modalities, "mixed")} if cap is not None else {}

    def _warmup_items(self) -> dict[str, tuple[Item, PrepareOptions]]:
        """The costliest valid item of each loaded modality (built only for those: a text-only server
        warms up without PyAV or media)."""
        from eg2_runtime import samples

        longest = max(IMAGE_TOKEN_BUDGETS)
        biggest: dict[str, Callable[[], tuple[Item, PrepareOptions]]] = {
            "text": lambda: (Item((TextPart("warm up " * self.max_text_tokens),)), PrepareOptions()),
            "image": lambda: (
                Item((MediaPart("image", samples.png(1280, 960)),)),
                PrepareOptions(image_tokens=longest),
            ),
            "audio": lambda: (Item((MediaPart("audio", samples.wav(30.0)),)), PrepareOptions()),
            "video": lambda: (Item((MediaPart("video", samples.mp4(32)),)), PrepareOptions()),
        }
        return {m: build() for m, build in biggest.items() if m in self.modalities}

    @torch.inference_mode()
    def warm_up(self, max_batch_items: int, max_batch_tokens: int | None = None) -> dict[str, int]:
        """Run a full batch of each modality's costliest item, eagerly (no graph is captured), so an
        out-of-memory shows at boot, not under load; then hand the activations back to the driver.
        A batch that does not fit is halved until it does, and its modality's limit lowered to
        match; the costliest single item must fit. Returns the batch token limits that held.
        Call on the GPU thread."""
        limits = self.batch_token_limits()
        self._eager_text = True
        eager = self.towers.eager() if self.towers is not None else contextlib.nullcontext()
        try:
            with eager:
                for modality, (item, options) in self._warmup_items().items():
                    one = self.prepare(item, options)
                    cap = min(limits.get(modality, one.cost * max_batch_items), max_batch_tokens or 1 << 62)
                    wanted = max(1, min(max_batch_items, cap // one.cost))
                    if (n := self._fit(one, wanted)) < wanted:
                        limits[modality] = n * one.cost
                    if self.device.type == "cuda":
                        # Each modality's batch leaves cached blocks shaped for its own tensors,
                        # which the next one's mostly cannot reuse: handed back now, the boot peaks
                        # at the costliest modality's batch rather than near their sum (H200,
                        # 2026-12-03: all four modalities 1,932 MiB without this, docs/PERF.md).
                        torch.cuda.empty_cache()
        finally:
            self._eager_text = False
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
                self._cap_allocator()
        return limits

    def _fit(self, one: PreparedItem, n: int) -> int:
        """Embed n copies of `one`, halving n until it fits; the n that ran."""
        start = time.perf_counter()
        while True:
            try:
                self.embed([one] * n)
                break
            except EngineOutOfMemory:
                if n == 1:
                    raise EngineOutOfMemory(
                        f"warm-up ran out of memory on one {one.modality} item of {one.cost} tokens: "
                        "raise the GPU memory budget (gpu_memory_mib)"
                    ) from None
                n //= 2
                log.warning("warm-up: a full %s batch did not fit; %d items now", one.modality, n)
        seconds = time.perf_counter() - start
        log.info(
            "warm-up batch done",
            extra={"modality": one.modality, "items": n, "tokens": n * one.cost, "seconds": seconds},
        )
        return n

    # ---- accelerator side: one thread -----------------------------------------------------------

    @torch.inference_mode()
    def capture_graphs(self) -> int:
        """Capture, at boot, the graphs short requests take: one text of up to 512 tokens, batches of
        short texts, one image of the default budget, one clip of up to ~10 s. Other buckets are
        captured on first use, within the memory plan (~0.1 s each). Returns how many graphs exist."""
        text: GraphedTextEncoder | PackedTextGraphs | None = self.packed or self.graphs
        if text is None:
            return 0
        t0 = time.perf_counter()
        startup: Sequence[Any] = STARTUP_TOKEN_BUCKETS if self.packed is not None else STARTUP_TEXT_BUCKETS
        # The largest first (see GraphPool): the text buckets of 2,048 tokens and more, the towers',
        # then the smaller text buckets, which reuse the blocks of the first. The towers' graphs are
        # admitted at their whole estimates (blocks of their own kind only), but captured after the
        # large text graph they measurably take less: a towers-first order held 32 MiB more at
        # /ready and lost the 4-clip bucket (H200, 2026-12-03, docs/PERF.md). Each leaves room for
        # the executables of those after it, a query's small bucket must not lose to the largest,
        # and one passed over for that room is tried again on first use.
        small = [k for k in startup if text.tokens(k) < 2048 and text.admissible(k)]
        towers = self.towers
        image, audio = "image" in self.modalities, "audio" in self.modalities
        tower_graphs = startup_tower_graphs(self.modalities) if towers is not None else 0
        text.capture_buckets((k for k in startup if text.tokens(k) >= 2048), then=len(small) + tower_graphs)
        if towers is not None:
            towers.capture_startup(IMAGE_TOKEN_BUDGETS[2] if image else None, audio, then=len(small))
        text.capture_buckets(startup)  # the allocator's cap followed each capture (GraphPool.grew)
        n = len(text.graphs) + (len(towers.graphs) if towers is not None else 0)
        log.info("captured %d graphs in %.1f s", n, time.perf_counter() - t0)
        return n

    @torch.inference_mode()
    def embed(self, batch: Sequence[PreparedItem]) -> np.ndarray:
        """(B, 768) float32 unit vectors, in batch order."""
        if torch.get_num_threads() != self.cpu_threads:  # per thread: set on the model's own
            torch.set_num_threads(self.cpu_threads)
        if self.towers is not None:
            self.towers.miscount = None  # a batch that raised midway may have left its flag
        try:
            parts = [self._forward([p.inputs for p in chunk]).cpu() for chunk in self._chunks(batch)]
        except torch.OutOfMemoryError as e:
            torch.cuda.empty_cache()  # the engine stays usable: the caller retries smaller batches
            raise EngineOutOfMemory(f"out of accelerator memory on a batch of {len(batch)}") from e
        if self.towers is not None:
            self.towers.check_counts()  # after the copies above: the flag is ready, no further wait
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).numpy()

    def _chunks(self, batch: Sequence[PreparedItem]) -> Iterator[Sequence[PreparedItem]]:
        """Consecutive runs of the batch whose padded size stays within its modality's limit."""
        limit = self.batch_token_limits().get(batch[0].modality) if batch else None
        start, longest = 0, 0
        for i, p in enumerate(batch):
            longest = max(longest, p.num_tokens)
            if limit is not None and i > start and (i - start + 1) * longest > limit:
                yield batch[start:i]
                start, longest = i, p.num_tokens
        yield batch[start:]

    def _forward(self, items: Sequence[Prepared]) -> torch.Tensor:
        if self.packed is not None and all(p.modality == "text" for p in items):
            return self._packed_text(items)
        return self.forward(*self.device_batch(items))

    def _packed_text(self, items: Sequence[Prepared]) -> torch.Tensor:
        """Text items on the packed path straight from their ids, end to end: what `forward` does
        with the padded batch `device_batch` makes of them, without making it. Fewer torch calls on
        the host, each of which gives the GIL up and waits to win it back (docs/PERF.md)."""
        flat = np.concatenate([p.input_ids.numpy() for p in items])
        return self._packed(torch.from_numpy(flat)[None], [p.num_tokens for p in items], {})

    def device_batch(self, items: Sequence[Prepared]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Prepared items -> (input_ids on the host, the other model inputs on the device, but the
        attention mask, which stays on the host beside the ids).

        The ids and the mask stay on the host: the embedding lookup moves what it needs, and the
        packed path reads the items' lengths without a device sync. Pixel patches stay uint8 codes (a
        quarter of the bytes to collate, copy and hold); the vision tower scales them.
        """
        inputs = collate(items, self.model.config.text.pad_token_id, pin=self.device.type == "cuda")
        ids = inputs.pop("input_ids")
        mask = inputs.pop("attention_mask")
        on_device = {k: v.to(self.device, non_blocking=True) for k, v in inputs.items()}
        return ids, {"attention_mask": mask, **on_device}

    def forward(self, input_ids: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """A batch as `device_batch` gives it -> (B, D) fp32 unit vectors on the device.

        The reference path is EG2Model.forward. Here, with `packed_text`, the items' valid tokens are
        laid end to end and the text encoder plus pooling replay the packed graphs
        (packed_graphs.py); else they replay a padded bucket's graph where one holds the batch, or
        run eagerly, on the memory-lean path when `lean_text`. The media towers replay theirs when
        `tower_graphs` is on (else run eagerly), and the scatter of their soft tokens runs eagerly.
        The towers' graphs leave a wrong soft-token count to `self.towers.check_counts()`, which
        `embed` calls after its sync: a caller of this alone checks it too.
        """
        inputs = dict(inputs)  # the attention mask is taken out below; the caller's dict stays whole
        mask = inputs.pop("attention_mask")
        if self.packed is not None:
            valid = mask.cpu().numpy().astype(bool)  # (B, T); on the host already from device_batch
            ids = torch.from_numpy(input_ids.cpu().numpy()[valid])[None]  # (1, N)
            return self._packed(ids, valid.sum(1).tolist(), inputs)
        mask = mask.to(self.device, non_blocking=True)
        embeds = self.model.input_embeddings(input_ids, **inputs, towers=self.towers)
        graphs = None if self._eager_text else self.graphs
        vectors = graphs(embeds, mask.bool()) if graphs is not None else None
        if vectors is None:  # no graph, or no bucket holds it: a large batch, already GPU-bound
            vectors = self.model.encode(embeds, mask, lean=self.options.lean_text)
        return vectors

    def _packed(self, ids: torch.Tensor, lengths: list[int], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(1, N) host ids of items end to end, each item's length, the media inputs -> (B, D): the
        input embeddings of that one row (placeholders keep their reading order, so the media soft
        tokens scatter into the same places as in the padded batch), through the packed graphs."""
        assert self.packed is not None
        flat = self.model.input_embeddings(ids, **inputs, towers=self.towers)[0]  # (N, H)
        return self.packed.eager(flat, lengths) if self._eager_text else self.packed(flat, lengths)

    # ---- reports --------------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        r = self.report
        return {
            "model_dir": self.model_dir.name,
            "weights_sha256": self.weights_digest(),
            "device": str(self.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "modalities": sorted(self.modalities),
            "dimensions": list(MATRYOSHKA_DIMS),
            "max_text_tokens": self.max_text_tokens,
            "quantization": {
                "format": "compressed-tensors pack-quantized int4" if r.packed_total else None,
                "group_size": r.group_size,
                "packed_layers": dict(r.packed),
                "dense_tensors": r.dense_tensors,
                "resident_bytes": r.resident_bytes,
                "bf16_equivalent_bytes": r.bf16_bytes,
                "summary": r.summary(),
            },
            "memory_plan": self.plan.describe() if self.plan is not None else None,
            "version": eg2_runtime.__version__,
        }

    def memory(self) -> EngineMemory:
        """Bytes: weights as loaded and as BF16; on a GPU, the process's own GPU memory (NVML: what a
        co-located model cannot have), the allocator's counters and the budget."""
        out: EngineMemory = {
            "weight_bytes_resident": self.report.resident_bytes,
            "weight_bytes_bf16_equivalent": self.report.bf16_bytes,
        }
        if self.device.type == "cuda":
            reading = self.gpu_memory.read()
            out["process_gpu_bytes"] = reading.bytes if reading is not None else 0
            out["gpu_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            out["gpu_reserved_bytes"] = torch.cuda.memory_reserved(self.device)
            out["gpu_budget_bytes"] = self.plan.budget if self.plan is not None else 0
        return out

    def graph_stats(self) -> EngineGraphs:
        """The graph buckets of the text graphs and the towers, counted together, and their shared pool.
        Stand-ins for graphs (capture off: the padded steps run eagerly; tests) count as no bucket
        captured, though their admission adds to the pool and the seconds as a capture would."""
        sets: list[GraphedTextEncoder | PackedTextGraphs | GraphedTowers] = [
            g for g in (self.graphs, self.packed, self.towers) if g is not None
        ]
        pools = {id(g.pool): g.pool for g in sets}  # one pool, shared (memory_plan.py)
        return {
            "captured": sum(g.captured() for g in sets),
            "refused": sum(len(g.refused) for g in sets),
            "deferred": sum(len(g.deferred) for g in sets),
            "capture_seconds": sum((g.capture_seconds for g in sets), 0.0),
            "pool_used_bytes": sum(p.used for p in pools.values()),
            "pool_budget_bytes": sum(p.budget or 0 for p in pools.values()),
        }

    def weights_digest(self) -> str:
        """sha256 of the weight files, computed once (a 0.8 GB file takes a few seconds)."""
        with self._digest_lock:
            if self._digest is None:
                h = hashlib.sha256()
                for f in sorted(self.model_dir.glob("*.safetensors")):
                    with f.open("rb") as fh:
                        while chunk := fh.read(1 << 22):
                            h.update(chunk)
                self._digest = h.hexdigest()
            return self._digest


def single_threaded_numpy_blas() -> int:
    """Limit numpy's own OpenBLAS to one thread, process-wide; returns how many libraries changed.

    The log-mel projection is a small (F, 257) @ (257, 128) matmul that OpenBLAS spreads over every
    core; with several prepare threads doing it at once the BLAS threads thrash, and 16 threads
    prepared audio no faster than one (H200 host, 7.7 ms per clip either way). One BLAS thread per
    item lets the items themselves run in parallel. The product's bits do not depend on the
    thread count (OpenBLAS splits the output, not the sums). torch's own BLAS and OpenMP are left alone.
    """
    from threadpoolctl import ThreadpoolController

    controller = ThreadpoolController()
    numpy_blas = [
        c.filepath for c in controller.lib_controllers if "numpy" in c.filepath and c.user_api == "blas"
    ]
    if numpy_blas:
        controller.select(filepath=numpy_blas).limit(limits=1)
    return len(numpy_blas)


def _fuse_norms(model: EG2Model) -> None:
    """The fused Triton kernels (eg2_runtime/fused.py: norms, norm + RoPE, gelu x up, add + norm),
    after one probe launch: Triton needs a C compiler for its launcher, and a machine without one
    keeps serving on the reference paths."""
    if not use_fused_kernels(model):
        log.warning("Triton is not installed: the reference paths run")
        return
    try:
        weight = model.language_model.embedding_projection.weight
        model.language_model.norm(
            torch.ones(2, model.config.text.hidden_size, dtype=weight.dtype, device=weight.device)
        )
    except Exception as e:
        use_fused_kernels(model, enable=False)
        log.warning("fused kernels unavailable (%s); using the reference paths", e)


def wrap_prepared(prepared: Prepared, span: Span | None = None) -> PreparedItem:
    """The service's view of a prepared item: its modality and cost, the model inputs inside."""
    n = prepared.num_tokens
    return PreparedItem(prepared.modality, n, max(n, 1), inputs=prepared, span=span)


def token_count(item: Item, prepared: Sequence[PreparedItem]) -> TokenCount:
    """An item's TokenCount from its PreparedItems (the item itself, whose `inputs` it reads, and its
    spans): `tokens` is their `num_tokens` added up, what the embeddings route reports as `usage`."""
    whole = next(p for p in prepared if p.span is None)
    inputs: Prepared = whole.inputs
    text = all(isinstance(part, TextPart) for part in item.parts)
    return TokenCount(
        tokens=sum(p.num_tokens for p in prepared),
        truncated=inputs.text_truncated or inputs.audio_truncated,
        ids=tuple(inputs.input_ids.tolist()) if text else None,
        parts=tuple(inputs.media_tokens),
        spans=tuple((p.span, p.num_tokens) for p in prepared if p.span is not None),
    )


def collate(items: Sequence[Prepared], pad_id: int, pin: bool = False) -> dict[str, torch.Tensor]:
    """Prepared items -> one padded batch of model inputs.

    Text is right-padded with the pad id (attention_mask 0). Media of all items are concatenated in
    item order, which is the order their placeholders appear in the flattened (B, T) ids. Images with
    different soft-token budgets are padded to the largest patch count with empty patches (-1
    positions), and audio to the longest clip (mask 0): neither changes a valid output.
    `pin`: build the batch in pinned host memory, so the copy to the GPU is asynchronous and runs at
    full bus speed (16 images are 31 MB of uint8 patches; as fp32 they took ~35 ms from pageable
    memory on the H200).
    """
    # One C++ call for the ids (64 short texts: 0.1 ms, against 0.8 ms row by row; dev machine).
    ids = pad_sequence([p.input_ids for p in items], batch_first=True, padding_value=pad_id)  # (B, T)
    lengths = torch.tensor([p.input_ids.shape[0] for p in items])
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    out = (
        {"input_ids": ids.pin_memory(), "attention_mask": mask.pin_memory()}
        if pin
        else {"input_ids": ids, "attention_mask": mask}
    )
    for pixels, positions in (
        ("pixel_values", "image_position_ids"),
        ("pixel_values_videos", "video_position_ids"),
    ):
        chunks = [
            (getattr(p, pixels), getattr(p, positions)) for p in items if getattr(p, pixels) is not None
        ]
        if chunks:
            s = max(v.shape[1] for v, _ in chunks)
            out[pixels] = _concat_padded([v for v, _ in chunks], s, 0, pin)
            out[positions] = _concat_padded([q for _, q in chunks], s, -1, pin)
    audio = [(p.input_features, p.input_features_mask) for p in items if p.input_features is not None]
    if audio:
        f = max(x.shape[1] for x, _ in audio)
        out["input_features"] = _concat_padded([x for x, _ in audio], f, 0, pin)
        masks = [m for _, m in audio if m is not None]
        out["input_features_mask"] = _concat_padded(masks, f, 0, pin)
    return out


def _concat_padded(chunks: Sequence[torch.Tensor], length: int, fill: float, pin: bool) -> torch.Tensor:
    """(n_i, s_i, ...) chunks -> (sum n_i, length, ...): concatenated on dim 0, each padded on dim 1
    with `fill`, written once into a fresh (optionally pinned) tensor."""
    first = chunks[0]
    out = torch.empty(
        (sum(c.shape[0] for c in chunks), length, *first.shape[2:]), dtype=first.dtype, pin_memory=pin
    )
    row = 0
    for c in chunks:
        n, s = c.shape[0], c.shape[1]
        out[row : row + n, :s] = c
        out[row : row + n, s:] = fill
        row += n
    return out
