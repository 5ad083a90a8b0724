"""Service settings: every knob an operator turns, from `EG2_*` environment variables or `eg2 serve` flags.

One `Settings` object is built at start and passed down; nothing else in the project reads os.environ.
Each field's description states what it does and what it trades; `eg2 serve --help` and
docs/SETTINGS.md are generated from these descriptions (`python -m app.settings > docs/SETTINGS.md`).
Architecture parameters are not here: they come from the checkpoint's config.json (eg2_runtime.config).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from eg2_runtime.inputs import MediaLimits

ModalityName = Literal["text", "image", "audio", "video"]


def _split_csv(value: Any) -> Any:
    """`a,b , c` -> ["a", "b", "c"]: lists are comma-separated in env vars and flags, not JSON."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


CsvList = Annotated[list[str], NoDecode, BeforeValidator(_split_csv)]
CsvModalities = Annotated[list[ModalityName] | None, NoDecode, BeforeValidator(_split_csv)]


def _default_workers() -> int:
    # Preprocessing (decode, resize, resample, tokenize) is CPU-bound and releases the GIL in the
    # codecs; more threads than cores only adds contention.
    return max(1, min(8, os.cpu_count() or 1))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EG2_", extra="forbid", frozen=True, validate_default=True)

    # --- The model -------------------------------------------------------------------------------
    model: Path | None = Field(
        default=None,
        description="Checkpoint directory (config.json + safetensors). Unset: serve a tiny demo checkpoint "
        "with random weights, built once under cache_dir: the API works, the vectors mean nothing.",
    )
    served_name: str = Field(
        default="eg2",
        min_length=1,
        description="The model name /v1/models lists and requests may send; another name gets 404.",
    )
    aliases: CsvList = Field(
        default=[],
        description="Other names accepted in `model` (comma-separated), e.g. the Hugging Face repo id, so "
        "clients configured for it work unchanged. Not listed by /v1/models.",
    )
    device: str = Field(
        default="auto",
        description="`auto` (CUDA when present, else CPU), `cuda`, `cuda:N` or `cpu`.",
    )
    modalities: CsvModalities = Field(
        default=None,
        description="Towers to load (comma-separated: text,image,audio,video). Unset: every tower in the "
        "checkpoint. `text` alone loads the 270M text encoder only: less memory and a faster start, "
        "and media requests get 400.",
    )
    pack: bool = Field(
        default=False,
        description="Serve a plain BF16 checkpoint's vision and audio Linears as int4, quantized at load "
        "(hybrid-w4 checkpoints are always served packed). Saves ~45% of weight memory for a few seconds "
        "of start-up; `eg2 quantize` does the same once, ahead of time.",
    )
    gpu_memory_mib: int | None = Field(
        default=None,
        ge=256,
        description="The most GPU memory the process may hold, in MiB, everything included (what nvidia-smi "
        "shows for it: CUDA context, weights, CUDA graphs, activations). The engine sizes its graph pool, "
        "its per-modality batch limits and the token table's place from it, and caps its allocator there: "
        "a batch that would not fit is split, never run past the budget. Unset: 2000 with a media tower "
        "loaded, and with text only the least that serves an 8,192-token text. Larger: bigger graph "
        "buckets and batches (fewer replays per batch), for memory a co-located model loses; too small "
        "to hold the weights and the largest request fails the start, naming the minimum. GPU only; "
        "docs/PERF.md measures what each size buys.",
    )
    host_token_table: bool | None = Field(
        default=None,
        description="Keep the 256 MiB token-embedding table in pinned host memory (GPU only): resident "
        "weights drop from 0.56x to 0.38x of BF16, for a host-side gather and one copy of the batch's "
        "embeddings per forward (H200: 64 short docs 3,067 vs 3,177 items/s, within run-to-run noise "
        "elsewhere). Vectors are bit-identical. Unset: the memory budget decides (it keeps the table in "
        "host memory when the graph pool would otherwise be too small; the 2,000 MiB default does).",
    )
    cuda_graph_max_tokens: int = Field(
        default=16384,
        ge=0,
        description="CUDA graphs for the text encoder, for batches up to this many tokens (packed: the "
        "items' tokens end to end; padded: items x longest), and at most what the GPU memory budget's "
        "graph pool holds; 0 turns them off. Short inputs run up to 10x faster (1 query: 3.5 vs 41 ms "
        "on the H200; launches are most of their cost). A larger batch runs as several replays. With 0, the "
        "text-only default budget keeps no graph pool (218 MiB less, by the memory plan's arithmetic) and "
        "every short request pays for its kernel launches. GPU only.",
    )
    engine_cpu_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch's CPU threads on the engine's thread. Unset: every core on a CPU, where the "
        "model runs on them; one on a GPU, where that thread only collates, gathers token rows and "
        "copies, and a wider OpenMP team's spinning threads take cores from the threads preparing media "
        "(docs/PERF.md measures it). More threads on a GPU: faster host gathers of very large text "
        "batches, slower media preparing beside them.",
    )
    packed_text: bool = Field(
        default=True,
        description="Run text batches packed: the items' tokens end to end, attention kept within each "
        "item by varlen kernels, CUDA graphs per token bucket: no work on padding, and one graph per "
        "token count instead of one per (items, length) pair (docs/PERF.md measures both). False: "
        "padded graph buckets, for comparison. GPU, BF16 only; elsewhere text runs padded.",
    )
    cuda_graphs_at_start: bool = Field(
        default=True,
        description="Capture at start the graphs short requests take (one text up to 512 tokens, batches "
        "of short texts, one image, one clip), so they never pay for a capture; other buckets are "
        "captured on first use (~0.1 s each), within the memory budget. False captures every bucket on "
        "first use: a faster start.",
    )
    cache_dir: Path = Field(
        default_factory=lambda: Path.home() / ".cache" / "eg2",
        description="Where the demo checkpoint is built and cached. Must be writable when `model` is unset.",
    )

    # --- Batching --------------------------------------------------------------------------------
    max_batch_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Token budget of one forward pass (sum of item costs, media soft tokens included); "
        "unset: on a GPU the memory budget's per-modality limits (gpu_memory_mib), on a CPU 2048 (where "
        "a full batch of 1120-token images takes seconds). Set, it caps those limits. Larger: better GPU "
        "utilisation and throughput, more activation memory and a longer wait for the items in the "
        "batch. Warm-up runs a full batch of each modality, so a value too large for the GPU fails at "
        "start, not under traffic. An item larger than the budget runs alone.",
    )
    max_batch_items: int = Field(
        default=64,
        ge=1,
        description="Most items in one forward pass. Caps per-item overhead (image and audio towers run "
        "per item) independently of the token budget.",
    )
    max_queue_delay_ms: float = Field(
        default=2.0,
        ge=0,
        description="How long the next batch's first request (the front of its modality's line: the "
        "longest-waiting request, or the one whose last turn is oldest) may wait, while the GPU is idle, "
        "for items of its modality still in preprocessing (a burst of requests), so they share its batch. "
        "With none on the way its batch runs at once. Larger: fuller batches from bursts, at up to that much added latency; "
        "0 never waits.",
    )
    max_request_gather_ms: float = Field(
        default=50.0,
        ge=0,
        allow_inf_nan=False,
        description="How much longer than max_queue_delay_ms a batch waits for the media of its first "
        "request still in preprocessing, so that a call's images or clips run as one GPU "
        "batch rather than as the waves they finish decoding in (docs/PERF.md measures it, on and off); "
        "a request that needs several batches gathers an even share for each. It counts from when that "
        "request joined its line or had its last turn, and ends when the queue holds the batch's share "
        "(other requests' items queued count toward it), when the batch fills, or at this limit. Items still "
        "decoding are sized by their header estimates (an item's text at one token per character). "
        "Larger: bigger requests gathered whole; the cost is up to that long with the GPU idle for "
        "that modality, while other requests' items of it wait in the same batch (other modalities' "
        "batches run meanwhile). 0 batches what is ready.",
    )
    gil_switch_interval_ms: float = Field(
        default=0.1,
        gt=0,
        description="How long a thread holding Python's GIL keeps it while another waits (sys.setswitchinterval). "
        "The GPU thread gives the GIL up at every blocking step of a batch (copies, syncs) and must win it back "
        "from a busy event loop each time, waiting up to this long (Python's default is 5 ms; measured in "
        "docs/PERF.md, with 0.1 against 0.5 ms). Smaller: the GPU thread gets the interpreter back sooner; the "
        "event loop is interrupted more often, each switch a few microseconds of its time.",
    )
    preprocess_workers: int = Field(
        default_factory=_default_workers,
        ge=1,
        description="Threads that decode and tokenize (engine.prepare_many), overlapping with the GPU. More: media "
        "decoding keeps up with a fast GPU; each holds a decoded item in memory. Default: cores, at most 8.",
    )
    preprocess_processes: int | None = Field(
        default=None,
        ge=0,
        description="Worker processes that decode and preprocess media items (images, audio, video), each "
        "with a GIL of its own, so decoding does not wait on the event loop and the GPU thread. Unset: on a "
        "GPU, one per two of the cores the process may use (its CPU affinity, capped by a container's CPU quota), "
        "at most 8; on a CPU, or with text alone, none. 0: media are prepared on the preprocessing "
        "threads, as text always is. Each process holds a tokenizer and torch's CPU runtime (host memory, "
        "measured in docs/PERF.md; no GPU memory) and hands its items back through /dev/shm (give a container "
        "`--shm-size 1g`; where it is full they go through a pipe, slower). Fewer: less host memory, "
        "slower media under concurrent load (docs/PERF.md measures it).",
    )
    inline_prepare_chars: int = Field(
        default=512,
        ge=0,
        description="A request whose text (its text items together, the prompt counted once per item; at most "
        "8 items) has at most this many characters is tokenized on the event loop instead of a preprocessing "
        "thread: for a short query the hand-off costs "
        "more than the tokenizer call (dev machine: ~0.08 ms of server CPU per request, against 12-69 us to "
        "tokenize 30-500 characters). Larger: more requests skip the hop, but each stalls the event loop while "
        "it tokenizes; 0 sends all text to the threads.",
    )

    # --- Admission and request limits ------------------------------------------------------------
    max_prepared_media_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Most media soft tokens (images, audio, video; estimated from their headers) being decoded "
        "or decoded and waiting for the GPU, across all requests; further media wait to be decoded. Each token "
        "holds ~7 kB of patches until its batch runs (a 1120-token image: 7.7 MB), so this bounds that memory; "
        "unset: twice max_batch_tokens (32,768 tokens, ~230 MB, on a GPU; 4,096, ~29 MB, on a CPU). Larger "
        "lets decoding run further ahead of the GPU, smaller saves memory. An item larger than it is decoded "
        "alone.",
    )
    max_queued_items: int = Field(
        default=4096,
        ge=1,
        description="Admission limit: items accepted and not yet answered. Past it, requests get 429 with "
        "Retry-After at once instead of queueing. Larger absorbs bursts but lets latency and memory "
        "grow (a waiting image holds its pixels).",
    )
    max_request_items: int = Field(
        default=2048,
        ge=1,
        description="Most items in one request (OpenAI allows 2048); more gets 413.",
    )
    max_request_bytes: int = Field(
        default=32 * 1024 * 1024,
        ge=1024,
        description="Largest request body in bytes (base64 media included); checked against Content-Length "
        "and while streaming, so an oversized body gets 413 before it is read. The body is held in "
        "memory, so this times concurrency bounds the memory requests can take.",
    )
    max_item_parts: int = Field(
        default=64,
        ge=1,
        description="Most parts (text and media) in one `content` item or one `messages` request; more gets "
        "413 before anything is decoded. An item's media must fit the model's 8192 tokens anyway (29 images "
        "at the default 280 tokens); this bounds the work spent finding that out. Larger allows longer "
        "interleaved documents.",
    )
    max_request_media: int = Field(
        default=64,
        ge=1,
        description="Most media parts (images, audio, videos) in one request, across its items; more gets 413 "
        "before anything is decoded. Each decoded image holds up to 7.7 MB of patches (1120 tokens) and a video "
        "up to 15.5 MB until its batch runs: larger lets bulk clients send fewer requests, for more memory "
        "and a longer hold on the decoding threads per request.",
    )
    max_request_tokens: int = Field(
        default=2_000_000,
        ge=1,
        description="Most tokens one request may cost, estimated before anything is decoded or tokenized: text "
        "at one token per character (real text has fewer; a character outside the vocabulary has up to 4 "
        "byte tokens), media from their headers (exact soft tokens), each item at most the model's 8192 "
        "tokens; more gets 413. OpenAI refuses requests over 300,000 real tokens (~1.2M characters of "
        "English), which pass. Lower bounds how long one request may hold the GPU and the tokenizer; higher "
        "admits larger batches of long documents.",
    )
    max_image_pixels: int = Field(
        default=40_000_000,
        ge=1,
        description="Largest decoded image (width x height, read from its header before decoding); more gets "
        "413. Guards against decompression bombs: a 40 MP image is 120 MB as RGB while it is resized, and the "
        "model sees at most 2.6 MP (1120 tokens) anyway. Lower saves memory and decode time per image; "
        "higher accepts larger photos.",
    )
    max_audio_channels: int = Field(
        default=32,
        ge=1,
        description="Most audio channels accepted (they are averaged to mono); more gets 400. A forged header "
        "could otherwise ask for gigabytes per second of audio; 32 covers multichannel studio formats.",
    )
    min_audio_rate: int = Field(
        default=1_000,
        ge=1,
        description="Lowest audio sample rate accepted, in Hz; lower gets 400. Audio is resampled to 16 kHz, "
        "so a lower rate only adds upsampling work for no signal.",
    )
    max_audio_rate: int = Field(
        default=384_000,
        ge=1,
        description="Highest audio sample rate accepted, in Hz; higher gets 400. Only the first 30 s is ever "
        "decoded, but decoding and resampling time per second grows with the rate (max_audio_decode_samples "
        "bounds it); 384 kHz is the highest rate studio formats use.",
    )
    max_audio_decode_samples: int = Field(
        default=24_000_000,
        ge=1,
        description="Most samples decoding one audio may produce: its channels x its rate x the seconds decoded "
        "(its first 30 s, or all of it when shorter), from its header before decoding and counted while "
        "decoding; more gets 413. CPU time follows it, not the duration: 31 s of 8 channels at 384 kHz is "
        "93 million samples (a 100 KB FLAC of silence; 0.46 s of one dev-machine core, and 64 in one request "
        "took 49 s), 30 s of 16 kHz mono 0.48 million. The default admits 30 s of stereo at 384 kHz or of "
        "7.1 at 96 kHz (23 million, ~0.1-0.25 s of a core). Lower bounds decode time per clip more tightly; "
        "higher accepts more channels at high rates.",
    )
    max_video_seconds: float = Field(
        default=120.0,
        gt=0,
        description="Longest video accepted (from container metadata, before decoding); more gets 413. Past "
        "32 s the model sees 32 frames whatever the length, so longer clips buy little. Higher accepts longer "
        "clips; their decoding cost is bounded by max_video_decode_pixels. Audio needs no such limit: only its "
        "first 30 s is ever decoded, under max_audio_decode_samples.",
    )
    max_video_frame_pixels: int = Field(
        default=3840 * 2160,
        ge=1,
        description="Largest video frame (width x height, from container metadata); more gets 413. 4K by "
        "default; a sampled frame is held at full size only while it is resized.",
    )
    max_video_frames: int = Field(
        default=14_400,
        ge=1,
        description="Most frames a video may declare (120 s at 120 fps); more gets 413.",
    )
    max_video_decode_pixels: int = Field(
        default=4_000_000_000,
        ge=1,
        description="Most pixels decoding one video may produce: frame width x height x the frames decoded "
        "to reach its last sampled frame, from container metadata before decoding; more gets 413. CPU time "
        "follows it (every frame up to the last sampled one is decoded): a 60 s 4K clip at 30 fps is 15 "
        "billion pixels, 17 s of CPU on the dev machine; the default allows 60 s of 1080p at 30 fps. Lower "
        "bounds decode time per video more tightly; higher accepts longer high-resolution clips.",
    )
    max_segment_audio_seconds: float = Field(
        default=3600.0,
        gt=0,
        description="Longest audio a request with `segments` may send (from its header before decoding, and "
        "while decoding); more gets 413. Such audio is decoded whole, once, a span at a time (memory holds "
        "one span), and each span is a GPU item: an hour in 10 s spans is 360 items. Decoding and featurizing "
        "an hour of audio takes ~10-20 s of one core, so raise request_timeout_s with it. Lower bounds how "
        "long one request may hold a decoding thread.",
    )
    max_segment_audio_decode_samples: int = Field(
        default=400_000_000,
        ge=1,
        description="Most samples decoding one audio with `segments` may produce: its channels x its rate x "
        "all its seconds, from its header before decoding and counted while decoding; more gets 413. The "
        "default admits an hour of 48 kHz stereo (346 million samples; decoding and resampling 10 minutes "
        "of it took 0.53 s of one dev-machine core), where an hour of 8 channels at 384 kHz would be 11 "
        "billion. Lower bounds decode time per request more tightly; higher accepts long audio with more "
        "channels or higher rates.",
    )
    max_segment_video_seconds: float = Field(
        default=1800.0,
        gt=0,
        description="Longest video a request with `segments` may send (from container metadata, before "
        "decoding); more gets 413. Every frame of such a video is decoded, once, and frames are sampled "
        "per span (1 fps, at most 32 a span); the decode cost is bounded by "
        "max_segment_video_decode_pixels. Raise request_timeout_s with it: decoding long videos takes "
        "minutes of one core.",
    )
    max_segment_video_decode_pixels: int = Field(
        default=120_000_000_000,
        ge=1,
        description="Most pixels decoding one video with `segments` may produce: frame width x height x all "
        "its frames, from container metadata before decoding; more gets 413. The default allows 30 minutes "
        "of 1080p at 30 fps (112 billion pixels, about 2 minutes of one core of the dev machine at ~1.1 ns "
        "a pixel). Lower bounds decode time per request more tightly; higher accepts longer or larger "
        "videos with segments.",
    )
    max_request_segments: int = Field(
        default=512,
        ge=1,
        description="Most segments one request may ask for, all its items together, estimated before "
        "decoding (media from their headers, text at one token per character) and counted again as they "
        "are cut; more gets 413. Each segment is one more item in the admission limit and the GPU "
        "batches, and one more vector in the response (a 768-float vector is ~8 kB of JSON). Larger lets "
        "one request embed longer media in shorter spans.",
    )
    request_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Longest a request may take from admission to its vectors; then 503 and its items are "
        "dropped. Shorter frees capacity sooner under overload; too short fails big batches on CPU.",
    )
    body_read_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Longest a client may take to send its request body; then 408 and the connection is "
        "closed. Defends against slow-body (slowloris) clients holding connections; too short hurts "
        "large uploads on slow links.",
    )

    # --- Connections -----------------------------------------------------------------------------
    header_read_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Longest a client may take to send a request's line and headers, counted from the "
        "connection's opening (or, on a kept-alive connection, from the request's first byte); then 408 "
        "(a plain close if nothing was sent) and the connection is closed. Frees descriptors held by idle "
        "or slow-header (slowloris) clients, which the API key cannot stop: it is read from the headers. "
        "Too short cuts off clients on very slow links.",
    )
    max_header_bytes: int = Field(
        default=32 * 1024,
        ge=1024,
        description="Largest request line plus headers, in bytes; more gets 431 and the connection is "
        "closed, checked as bytes arrive. Requests here need a few hundred bytes; larger allows long "
        "tokens or cookies, at that much memory per connection still sending its headers.",
    )
    max_connections: int = Field(
        default=2048,
        ge=1,
        description="Most client connections open at once. At the limit, a new connection closes the one "
        "waiting longest for a request (idle keep-alive, or still sending headers), so /health and "
        "real clients still get in; when every connection has a request in flight, the new one gets "
        "503 at once. Kept below the process's file-descriptor limit, which `eg2 serve` raises toward "
        "its hard limit if needed (past it, every new connection fails). Larger serves more clients "
        "that keep connections open, at a socket buffer each.",
    )

    # --- Lifecycle -------------------------------------------------------------------------------
    drain_deadline_s: float = Field(
        default=20.0,
        ge=0,
        description="On SIGTERM: /ready turns 503, new requests get 503, in-flight ones get this long to "
        "finish before the process exits anyway. Keep it below the orchestrator's grace period "
        "(Kubernetes: 30 s; compose: stop_grace_period).",
    )
    stall_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="/health turns 503 when one GPU call has run longer than this (a wedged device or driver). "
        "Too short restarts a healthy server that is running a huge batch on CPU.",
    )

    malloc_trim_idle_s: float = Field(
        default=10.0,
        ge=0,
        description="Once no embedding or tokenize request has come, and no work is held, for this long, "
        "`eg2 serve` gives the memory the last burst freed back to the OS (glibc's malloc_trim, on a thread; the "
        "`eg2_malloc_trim_seconds` histogram times each), once per burst. glibc keeps freed small "
        "blocks resident between live ones, so without it the RSS stays at the largest burst's "
        "level (docs/RELIABILITY.md). The first request after a trim faults some of those pages in "
        "again; on the dev machine that was within the noise of a first request after a pause. "
        "Shorter returns memory sooner, at more trims between bursts. 0 never trims. `eg2 serve-ray`'s replicas "
        "never trim.",
    )

    # --- Security --------------------------------------------------------------------------------
    api_key: SecretStr | None = Field(
        default=None,
        description="When set, every route but /health and /ready requires `Authorization: Bearer <key>` "
        "(compared in constant time). Prefer the environment variable over the flag: flags show in `ps`.",
    )
    metrics_require_key: bool = Field(
        default=True,
        description="Whether /metrics needs the API key too. Off lets a Prometheus without credentials scrape "
        "it, at the price of exposing traffic volumes.",
    )
    cors_origins: CsvList = Field(
        default=[],
        description="Browser origins allowed to call the API (comma-separated, `*` for any). Empty: no CORS "
        "headers, browsers on other origins are refused.",
    )
    allow_remote_urls: bool = Field(
        default=False,
        description="Fetch `http(s)://` media URLs. Off: only inline `data:` URIs. On lets any client make the "
        "server fetch any URL, internal addresses included (SSRF): enable behind a trusted network only.",
    )
    media_dir: Path | None = Field(
        default=None,
        description="A directory whose files (`file://` URLs or absolute paths inside it) clients may name as "
        "media. Unset: file paths are refused. Anything readable in it is readable by every client.",
    )
    remote_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Timeout of one remote media fetch (when allow_remote_urls is on).",
    )

    # --- Server ----------------------------------------------------------------------------------
    host: str = Field(
        default="127.0.0.1",
        description="Interface to listen on. 127.0.0.1 serves this machine only; 0.0.0.0 every interface "
        "(the Docker image sets it).",
    )
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port (0 picks a free one).")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Log verbosity."
    )
    log_json: bool = Field(
        default=True,
        description="One JSON object per log line (with the request id), for log shippers; off prints plain "
        "text for a terminal.",
    )
    access_log: bool = Field(
        default=True,
        description="One info line per request: method, path, status, milliseconds and request id. Off "
        "saves a measurable share of the service's CPU per short request (docs/PERF.md), which is what "
        "caps single-text requests/s, but loses that per-request record: which request got which "
        "status, and how long it took; the request counters in /metrics remain. At log_level warning "
        "or above there are none either way.",
    )

    @field_validator("api_key", "model", "media_dir", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        # `EG2_API_KEY=` (e.g. an unset compose variable) must mean "no key", not "the empty key";
        # `EG2_MODEL=` means "no model" (the demo), not the current directory.
        if isinstance(value, str) and not value.strip():
            return None
        return value

    @field_validator("modalities")
    @classmethod
    def _some_modality(cls, value: list[ModalityName] | None) -> list[ModalityName] | None:
        return sorted(set(value)) if value else None

    @model_validator(mode="after")
    def _coherent(self) -> Settings:
        if self.max_request_items > self.max_queued_items:
            raise ValueError(
                f"max_request_items ({self.max_request_items}) must not exceed max_queued_items "
                f"({self.max_queued_items}): such a request could never be admitted"
            )
        if self.min_audio_rate > self.max_audio_rate:
            raise ValueError(
                f"min_audio_rate ({self.min_audio_rate}) must not exceed max_audio_rate ({self.max_audio_rate})"
            )
        return self

    def media_limits(self) -> MediaLimits:
        """The engine's decoding limits: these settings are their one source."""
        return MediaLimits(**{f.name: getattr(self, f.name) for f in dataclasses.fields(MediaLimits)})


def env_name(field: str) -> str:
    return f"EG2_{field.upper()}"


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def describe_default(field: str) -> str:
    info = Settings.model_fields[field]
    if field == "preprocess_workers":
        return "cores, at most 8"
    if field == "preprocess_processes":
        return "GPU: usable cores / 2, at most 8; CPU or text only: 0"
    if field == "cache_dir":
        return "~/.cache/eg2"
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join(value) if value else "none"
    return str(value)


def markdown_table() -> str:
    """The settings table of docs/SETTINGS.md, generated from the field descriptions."""
    rows = ["| flag / env var | default | what it does, and the trade-off |", "|---|---|---|"]
    for field, info in Settings.model_fields.items():
        description = (info.description or "").replace("|", "\\|")
        rows.append(
            f"| `{flag_name(field)}` `{env_name(field)}` | {describe_default(field)} | {description} |"
        )
    return "\n".join(rows) + "\n"


SETTINGS_INTRO = """\
# Settings

<!-- Generated from app/settings.py: `python -m app.settings > docs/SETTINGS.md`. A test fails when
     this page and the code drift apart. -->

Every setting is a flag of `eg2 serve` and an `EG2_*` environment variable (flags win); lists are
comma-separated. Nothing else of the service reads the environment. The architecture is never a
setting: it comes from the checkpoint's `config.json`.

Two variables belong to the libraries underneath; where one is unset, `eg2 serve` applies its own:
- `MALLOC_ARENA_MAX` (glibc): one malloc arena per usable core, at least 2. Fewer arenas keep the
  resident memory flatter under mixed load, but the tokenizer's threads then wait on each other's
  locks (2 arenas prepared 64 short docs in 4-4.6x the time on a 16-core host, docs/PERF.md).
- `CUBLAS_WORKSPACE_CONFIG` (cuBLAS): `:4096:1`, a 4 MiB workspace per stream instead of torch's
  32 MiB on Hopper: 62 MiB less GPU memory for the text-only server, and no benchmark cell
  consistently slower. Larger gives cuBLAS room to split long reductions, at 28 MiB more per stream.

"""


def settings_page() -> str:
    """docs/SETTINGS.md: the introduction, then `markdown_table`."""
    return SETTINGS_INTRO + markdown_table()


if __name__ == "__main__":
    print(settings_page(), end="")
