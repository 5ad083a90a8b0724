"""Engine: the one contract between the service and the model.

    estimate_many(items, options) -> [int, ...] CPU only, thread-safe: each item's tokens from headers
    prepare(item, options) -> PreparedItem      CPU only, thread-safe: decode, tokenize, featurize
    prepare_many(items, options) -> [...]       the same for many items: media decoded on a thread
                                                pool, all text tokenized in one call
    embed([PreparedItem, ...]) -> (B, 768) f32  the accelerator; call from exactly one thread

The service sees only a PreparedItem's `modality`, `num_tokens` and `cost`; the model inputs it
carries are opaque to it. Vectors come back as unit-norm float32 numpy rows; `matryoshka` cuts them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from eg2_runtime.errors import EG2Error, EngineOutOfMemory
from eg2_runtime.graphs import GraphedTextEncoder
from eg2_runtime.inputs import (
    IMAGE_TOKEN_BUDGETS,
    MATRYOSHKA_DIMS,
    Item,
    MediaPart,
    Modality,
    PrepareOptions,
    TextPart,
)
from eg2_runtime.layers import use_fused_norms
from eg2_runtime.loader import LoadReport, load_model
from eg2_runtime.model import EG2Model
from eg2_runtime.preprocess import MediaLimits, Prepared, Preprocessor
from eg2_runtime.preprocess.image import unit_pixels
from eg2_runtime.preprocess.layout import PIXEL_INPUTS
from eg2_runtime.tower_graphs import GraphedTowers

log = logging.getLogger(__name__)


@dataclass
class PreparedItem:
    modality: Modality  # batch key: items of one modality are batched together
    num_tokens: int  # tokens the text encoder sees, soft tokens and markers included (usage)
    cost: int  # what this item spends of a batch's token budget
    inputs: Any = field(repr=False, default=None)  # model inputs (tensors); opaque to the service


def matryoshka(vectors: np.ndarray, dim: int) -> np.ndarray:
    """Keep the leading `dim` dimensions of (B, 768) unit vectors and L2-renormalize them."""
    if dim not in MATRYOSHKA_DIMS:
        raise ValueError(f"dimensions must be one of {MATRYOSHKA_DIMS}, got {dim}")
    cut = vectors[:, :dim].astype(np.float32, copy=True)
    cut /= np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
    return cut


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs a loaded model: speed and memory trade-offs, not the architecture."""

    # Padded tokens (items x longest) per forward: larger batches are split into several forwards.
    # Bounds activation memory (and what the allocator keeps afterwards) at a small cost in
    # throughput for very large calls. None: no split.
    max_forward_tokens: int | None = 16384
    # CUDA graphs for the text encoder, for buckets up to this many padded tokens; 0 turns them
    # off. Short inputs run ~10x faster (no launch overhead), for ~0.1 s of capture per bucket
    # (125 buckets: 14 s on the H200) and one shared graph memory pool as large as the largest
    # bucket's activations (~1.3 GB with every bucket captured).
    graph_max_tokens: int = 16384
    # One Triton kernel per RMSNorm on CUDA (rmsnorm_triton.py) instead of nine torch kernels: the
    # norms are most of the text encoder's launches. Agrees with the reference to float rounding.
    fused_norms: bool = True
    # Keep the 256 MiB token-embedding table in pinned host memory (CUDA only): fewer resident
    # bytes, for a host gather and a (B, T, H) copy per forward.
    host_token_table: bool = False
    # prepare_many's media threads. Images scale with threads (H200 host, 16 images: 20 ms each on
    # 1 thread, 5.2 on 16). Audio did not (7.7 ms per clip on 1 to 16 threads) until numpy's BLAS
    # was held to one thread (single_threaded_numpy_blas): 16 clips on 2 threads of the 2-core dev
    # machine, 2.75 -> 1.86 ms per clip (a lone clip 2.20 -> 2.75 ms; docs/results/2026-11-30-cpu/).
    prepare_threads: int = min(16, os.cpu_count() or 1)
    # CUDA graphs for the vision and audio towers at small batches (tower_graphs.py), with the text
    # graphs. Off until the capture has run on a GPU: tested on the CPU only so far.
    tower_graphs: bool = False


class Engine:
    """A loaded model with its preprocessor. Build it with `Engine.from_dir`."""

    def __init__(
        self,
        model: EG2Model,
        report: LoadReport,
        preprocessor: Preprocessor,
        model_dir: Path,
        options: EngineOptions | None = None,
    ) -> None:
        self.model = model
        self.report = report
        self.preprocessor = preprocessor
        self.model_dir = model_dir
        self.options = options = options or EngineOptions()
        self.device = model.language_model.embedding_projection.weight.device
        self.modalities = frozenset(model.modalities)
        self.prompts = dict(preprocessor.prompts.prompts)
        self.max_text_tokens = preprocessor.max_tokens
        self._digest: str | None = None
        self._digest_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()  # prepare_many runs on many threads (the service's pool)
        single_threaded_numpy_blas()  # items are prepared in parallel: here, and by the service
        if options.host_token_table:
            report.host_bytes = model.language_model.keep_table_on_host()
            report.resident_bytes -= report.host_bytes
        if options.fused_norms and self.device.type == "cuda":
            _fuse_norms(model)
        self.graphs: GraphedTextEncoder | None = None
        if options.graph_max_tokens and self.device.type == "cuda":
            self.graphs = GraphedTextEncoder(model.language_model, options.graph_max_tokens)
        self.towers: GraphedTowers | None = None
        if self.graphs is not None and options.tower_graphs and self.modalities - {"text"}:
            self.towers = GraphedTowers(model)

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
        wanted = frozenset(modalities) if modalities is not None else None
        model, report = load_model(model_dir, device, wanted, dtype=dtype, pack=pack, group_size=group_size)
        media = sorted(model.modalities - {"text"})
        pre = Preprocessor.from_dir(model_dir, model.config, limits=limits, modalities=media)  # type: ignore[arg-type]
        engine = cls(model, report, pre, model_dir, options)
        log.info("engine ready in %.1f s on %s: %s", time.perf_counter() - t0, device, report.summary())
        return engine

    # ---- CPU side: any thread -------------------------------------------------------------------

    def prepare(self, item: Item, options: PrepareOptions) -> PreparedItem:
        prepared = self.preprocessor.prepare(item, options)
        return _wrap(prepared)

    def estimate_many(self, items: Sequence[Item], options: PrepareOptions) -> list[int | EG2Error]:
        """Each item's cost in tokens before anything is decoded (`Preprocessor.estimate`: headers only),
        or the error its headers already prove, in its slot. Thread-safe; milliseconds per video."""
        out: list[int | EG2Error] = []
        for item in items:
            try:
                out.append(self.preprocessor.estimate(item, options))
            except EG2Error as e:
                out.append(e)
        return out

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
        return [p if isinstance(p, EG2Error) else _wrap(p) for p in out]

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.options.prepare_threads, thread_name_prefix="eg2-prepare"
                )
            return self._pool

    def warmup_batches(self, max_batch_tokens: int, max_batch_items: int) -> list[list[PreparedItem]]:
        """A full-size batch per loaded modality, so an out-of-memory shows at boot, not under load."""
        from eg2_runtime.tools import samples

        longest = max(IMAGE_TOKEN_BUDGETS)
        # Built only for the loaded modalities: a text-only server warms up without PyAV or media.
        biggest: dict[str, Callable[[], tuple[Item, PrepareOptions]]] = {
            "text": lambda: (Item((TextPart("warm up " * self.max_text_tokens),)), PrepareOptions()),
            "image": lambda: (
                Item((MediaPart("image", samples.png(1280, 960)),)),
                PrepareOptions(image_tokens=longest),
            ),
            "audio": lambda: (Item((MediaPart("audio", samples.wav(30.0)),)), PrepareOptions()),
            "video": lambda: (Item((MediaPart("video", samples.mp4(32)),)), PrepareOptions()),
        }
        batches = []
        for modality, build in biggest.items():
            if modality not in self.modalities:
                continue
            one = self.prepare(*build())
            n = max(1, min(max_batch_items, max_batch_tokens // one.cost))
            batches.append([one] * n)
        return batches

    # ---- accelerator side: one thread -----------------------------------------------------------

    @torch.inference_mode()
    def capture_graphs(self) -> int:
        """Capture every text-graph bucket now (at boot), rather than each on its first use, when
        the capture (~0.1 s) would land on a request. Returns how many graphs there are."""
        if self.graphs is None:
            return 0
        n = self.graphs.capture_all()
        log.info("captured %d text graphs in %.1f s", n, self.graphs.capture_seconds)
        return n

    @torch.inference_mode()
    def embed(self, batch: Sequence[PreparedItem]) -> np.ndarray:
        """(B, 768) float32 unit vectors, in batch order."""
        try:
            parts = [self._forward([p.inputs for p in chunk]).cpu() for chunk in self._chunks(batch)]
        except torch.OutOfMemoryError as e:
            torch.cuda.empty_cache()  # the engine stays usable: the caller retries smaller batches
            raise EngineOutOfMemory(f"out of accelerator memory on a batch of {len(batch)}") from e
        return torch.cat(parts).numpy()

    def _chunks(self, batch: Sequence[PreparedItem]) -> Iterator[Sequence[PreparedItem]]:
        """Consecutive runs of the batch whose padded size stays within max_forward_tokens."""
        limit = self.options.max_forward_tokens
        start, longest = 0, 0
        for i, p in enumerate(batch):
            longest = max(longest, p.num_tokens)
            if limit is not None and i > start and (i - start + 1) * longest > limit:
                yield batch[start:i]
                start, longest = i, p.num_tokens
        yield batch[start:]

    def _forward(self, items: Sequence[Prepared]) -> torch.Tensor:
        return self.forward(*self.device_batch(items))

    def device_batch(self, items: Sequence[Prepared]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Prepared items -> (input_ids on the host, the other model inputs on the device).

        The ids stay on the host: the embedding lookup moves what it needs. Pixel patches travel as
        uint8 codes (a quarter of the bytes to collate and copy) and become [0, 1] floats here.
        """
        inputs = collate(items, self.model.config.text.pad_token_id, pin=self.device.type == "cuda")
        ids = inputs.pop("input_ids")
        on_device = {k: v.to(self.device, non_blocking=True) for k, v in inputs.items()}
        return ids, {k: unit_pixels(v) if k in PIXEL_INPUTS else v for k, v in on_device.items()}

    def forward(self, input_ids: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """A batch as `device_batch` gives it -> (B, D) fp32 unit vectors on the device.

        The reference path is EG2Model.forward. With graphs, the text encoder plus pooling replay a
        captured graph; the media towers replay theirs when `tower_graphs` is on (else run eagerly),
        and the scatter of their soft tokens runs eagerly.
        """
        inputs = dict(inputs)  # the attention mask is taken out below; the caller's dict stays whole
        if self.graphs is None:
            return self.model(input_ids, **inputs)
        mask = inputs.pop("attention_mask")
        embeds = self.model.input_embeddings(input_ids, **inputs, towers=self.towers)
        vectors = self.graphs(embeds, mask.bool())
        if vectors is None:  # no bucket holds it: a large batch, already GPU-bound
            vectors = self.model.encode(embeds, mask)
        return vectors

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
            "version": _version(),
        }

    def memory(self) -> dict[str, int]:
        on_gpu = self.device.type == "cuda"
        return {
            "weight_bytes_resident": self.report.resident_bytes,
            "weight_bytes_bf16_equivalent": self.report.bf16_bytes,
            "gpu_allocated_bytes": torch.cuda.memory_allocated(self.device) if on_gpu else 0,
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
    """Fused norms, after one probe launch: Triton needs a C compiler for its launcher, and a
    machine without one keeps serving on the reference path."""
    if not use_fused_norms(model):
        log.warning("Triton is not installed: RMSNorm runs the reference path")
        return
    try:
        weight = model.language_model.embedding_projection.weight
        model.language_model.norm(
            torch.ones(2, model.config.text.hidden_size, dtype=weight.dtype, device=weight.device)
        )
    except Exception as e:
        use_fused_norms(model, enable=False)
        log.warning("fused RMSNorm kernel unavailable (%s); using the reference path", e)


def _wrap(prepared: Prepared) -> PreparedItem:
    return PreparedItem(prepared.modality, prepared.num_tokens, max(prepared.num_tokens, 1), inputs=prepared)


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


def _version() -> str:
    try:
        return version("eg2-serve")
    except PackageNotFoundError:
        return "0.0.0+source"
