"""The GPU memory budget: one number in, every allocation the engine makes sized from it.

    budget = the process's GPU memory, everything included (what nvidia-smi shows for it)
           = base      CUDA context, the libraries' kernels and handles: not ours to size, measured
           + weights   resident weights; the token table moves to pinned host memory when needed
           + fixed     the Unpacker's scratch slots and the graphs' static input buffers
           + eager     the activations of the largest single item that no graph holds
           + graphs    one CUDA graph pool, shared by the text and tower graphs
The allocator is capped at budget - base (torch's per-process fraction), so the process stays
within the budget whatever arrives: a batch that would not fit fails with an out-of-memory error,
which the batcher answers by splitting it.

How the working memory is shared: the eager share is the peak of the largest item no graph takes
(an 8,192-token text, a 1,120-token image), which a budget must hold to serve every valid request;
the rest is the graph pool. A graph pool keeps the activations of its largest graphs for good, and
graphs never run at once, so smaller graphs of the same kind (text, image, audio) reuse their
blocks: the pool admits a capture no larger than its kind's largest by its executable, a larger one
or the first of its kind by its whole estimate, beside what the captures so far measurably took;
on first use, one its estimate refuses is tried with its warm-up under a small allocator cap
(graphs.GraphPool). Graphs take any batch whose rows fit a bucket, in chunks, refused buckets
handing their rows to smaller ones (graphs.py, tower_graphs.py): more pool means larger buckets and
fewer replays per batch, not a different result.

Activation costs are per token of the batch (text, with padding) or per patch slot (vision tower),
from the config dimensions (ActivationCosts.from_config), set at or above the allocator's peaks on
the H200 (benchmarks/probe_costs.py, 2026-12-01: lean text 27.7-32.6 kB per token, the vision tower
23.3-23.7 kB per patch slot, the audio tower 102.4-103.1 kB per soft token), with room for
fragmentation. Pure arithmetic: no torch, tested on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from eg2_runtime.config import ModelConfig

MIB = 1 << 20
MAX_IMAGE_TOKENS = 1120  # the largest soft-token budget of one image
MAX_AUDIO_TOKENS = 750  # 30 s at 25 soft tokens per second
# Below this the graph pool cannot hold the buckets short requests want (64 short texts, one image
# of the default 280 tokens): the token table then moves to host memory, where it costs a host-side
# gather of each batch's rows instead (H200: 64 short docs 3,067 vs 3,177 items/s, in the noise).
# It is also the packed start-up set's largest bucket (engine.STARTUP_TOKEN_BUCKETS), past which a
# packed batch runs its full layers' queries and its MLP in chunks of it (packed_attention.QUERY_ROWS).
MIN_GRAPH_TEXT_TOKENS = 64 * 64
# An eager forward's peak beside the graph pool and the weights came out up to ~20% over its own
# activations (the caching allocator's split blocks; H200, 2026-12-01: an 8,192-token text needed
# ~360 MiB under the cap against a 264 MB peak measured alone).
EAGER_MARGIN = 1.4
MIN_GRAPH_VISION_SLOTS = 280 * 9
# The audio tower's start-up graph: one clip of up to ~10 s (tower_graphs.FRAME_LADDER[3] log-mel
# frames, 4 a soft token; a test holds them equal).
STARTUP_AUDIO_TOKENS = 1024 // 4
# What a captured graph holds outside its activations (the instantiated graph's kernel nodes): ~4 MiB
# on the H200 (2026-12-01, benchmarks/probe_boot.py: the text-only server's one start-up graph added
# 180 MiB, the full start-up set of 18 graphs 246 MiB: 66 MiB for 17 graphs whose activations the
# first one's blocks held). The pool counts it per graph, and its minimum holds the start-up set's
# (Footprint.startup_graphs).
GRAPH_EXECUTABLE = 4 * MIB


class BudgetTooSmall(ValueError):
    """The budget cannot hold the weights and the largest valid request."""


@dataclass(frozen=True)
class ActivationCosts:
    """Peak activation bytes per unit of a batch, on the engine's paths (lean text, graphs)."""

    text_token: int  # per (padded) token through the text encoder
    vision_slot: int  # per patch slot through the vision tower
    vision_input: int  # per patch slot of a batch's pixels on the device (uint8 codes)
    slots_per_token: int  # patch slots per image soft token (pooling kernel squared)
    audio_token: int  # per audio soft token (4 log-mel frames) through the audio tower

    @classmethod
    def from_config(cls, config: ModelConfig, dtype_bytes: int = 2) -> ActivationCosts:
        t = config.text
        hd, kv = max(t.head_dims), max(t.kv_heads)
        # One layer's live set on top of a few hidden-size rows: the larger of the MLP's gate,
        # activation and product (3 x I) and attention's q, the kv heads repeated, the output and the
        # k, v themselves (full layers: 4 x 4 x 512 + 2 x 512 values); the banded sliding layers add
        # their key spans (3 windows of repeated k and v per block) and a bool + float mask row.
        attention = 4 * t.num_heads * hd + 2 * kv * hd
        text = dtype_bytes * (max(3 * t.intermediate_size, attention) + 4 * t.hidden_size)
        text += 3 * (2 * dtype_bytes * t.num_heads * min(t.head_dims) + 3 * t.sliding_window)
        vision = vision_input = audio = 0
        slots = 1
        if config.vision is not None:
            v = config.vision
            vision = dtype_bytes * (3 * v.intermediate_size + 6 * v.hidden_size)  # the MLP dominates
            vision_input = 3 * v.patch_size**2  # one uint8 code per pixel value
            slots = v.pooling_kernel_size**2
        if config.audio is not None:
            # The first subsampling conv: (C0, 2 steps, 64 bins) per soft token, its LayerNorm in
            # fp32, beside the conformer's states.
            a = config.audio
            audio = (dtype_bytes + 4) * 2 * a.subsampling_conv_channels[
                0
            ] * 64 + 4 * dtype_bytes * a.hidden_size
        return cls(
            text_token=text,
            vision_slot=vision,
            vision_input=vision_input,
            slots_per_token=slots,
            audio_token=audio,
        )

    def batch_token(self, modality: str) -> int:
        """Bytes per token of a batch of `modality` beyond the vision tower, which runs in chunks of
        bounded size (tower_graphs.py): the text encoder, the pixels on the device, the audio tower."""
        image = self.text_token + self.slots_per_token * self.vision_input
        audio = max(self.text_token, self.audio_token)
        return {"text": self.text_token, "image": image, "video": image, "audio": audio}.get(
            modality, max(image, audio)
        )

    def image(self, tokens: int) -> int:
        """Bytes of one image of `tokens` soft tokens: its tower at once, then the text encoder."""
        return tokens * self.slots_per_token * self.vision_slot + tokens * self.batch_token("image")


@dataclass(frozen=True)
class Footprint:
    """What the model needs, in bytes, before a budget is applied to it."""

    base: int  # CUDA context and the libraries' kernels and handles, measured at boot
    weights: int  # resident weights, the token table included while it is on the GPU
    table: int  # the token table's bytes on the GPU (0 when it already lives in host memory)
    fixed: int  # the Unpacker's scratch slots and the graphs' static input buffers
    costs: ActivationCosts
    modalities: frozenset[str]
    max_text_tokens: int
    # The graphs the engine captures at boot for these modalities (engine.startup_graph_count): the
    # minimum pool holds their executables.
    startup_graphs: int
    max_batch_tokens: int | None = None  # the operator's cap on one batch, over the plan's limits


@dataclass(frozen=True)
class MemoryPlan:
    budget: int  # bytes, the process total
    base: int  # CUDA context and libraries, measured at boot
    weights: int  # resident weights on the GPU after the table decision
    fixed: int  # scratch and static buffers
    host_token_table: bool
    eager: int  # bytes for the largest item that no graph holds
    graph_pool: int  # bytes for the shared CUDA graph pool
    graph_text_tokens: int  # text buckets hold Bb x Tb <= this
    graph_vision_slots: int  # image buckets hold Nb x S <= this
    graph_audio_tokens: int  # audio buckets hold Bb x Fb / 4 <= this
    # An eager vision tower call takes at most this many patch slots: the eager share with the same
    # room for fragmentation as a batch (H200: a 32-frame video's frames in chunks of the whole share
    # ran out of memory beside a full graph pool).
    tower_slots: int
    max_batch_tokens: dict[str, int]  # per modality: what one forward may take
    costs: ActivationCosts  # what the graphs estimate a bucket at before capturing it

    @property
    def allocator_limit(self) -> int:
        """What torch's caching allocator may hold: everything but the base."""
        return self.budget - self.base

    def describe(self) -> str:
        mib = lambda b: f"{b / MIB:,.0f} MiB"  # noqa: E731
        table = ", token table in host memory" if self.host_token_table else ""
        return (
            f"budget {mib(self.budget)} = base {mib(self.base)} + weights {mib(self.weights)}{table} "
            f"+ fixed {mib(self.fixed)} + eager {mib(self.eager)} + graph pool {mib(self.graph_pool)}; "
            f"graphs up to {self.graph_text_tokens} text tokens, {self.graph_vision_slots} patch slots, "
            f"{self.graph_audio_tokens} audio tokens; batch tokens {self.max_batch_tokens}"
        )


def plan(budget: int, need: Footprint) -> MemoryPlan:
    """Size the graph pool and the batch limits to `budget` bytes.

    The token table moves to host memory when the budget would otherwise leave less than the minimum
    graph pool (or cannot hold the largest request). The operator's `max_batch_tokens` caps every
    modality's batch further.
    """
    costs, modalities = need.costs, need.modalities
    eager = _largest_item(costs, modalities, need.max_text_tokens)
    host_table, weights = False, need.weights
    working = budget - need.base - weights - need.fixed
    if working < eager + _minimum_pool(costs, modalities, need.startup_graphs) and need.table:
        host_table, weights = True, weights - need.table
        working += need.table
    if working < eager:
        least = need.base + weights + need.fixed + eager
        raise BudgetTooSmall(
            f"a GPU memory budget of {budget / MIB:,.0f} MiB cannot hold the base ({need.base / MIB:,.0f} "
            f"MiB), the weights ({weights / MIB:,.0f} MiB) and the largest request ({eager / MIB:,.0f} MiB): "
            f"give it at least {-(-least // MIB):,} MiB (gpu_memory_mib), or load fewer modalities"
        )
    pool = working - eager
    # A batch that no graph bucket holds runs eagerly beside the pool, within the eager share, with
    # the same room for fragmentation as the largest item (H200, 2026-12-01: batches sized to the
    # whole share ran out of memory beside a full pool).
    wanted = {"text"} | (modalities & {"image", "video", "audio"})
    if len(wanted) > 2:
        wanted.add("mixed")  # interleaved items of several media
    limits = {m: max(1, int(round(eager / (EAGER_MARGIN * costs.batch_token(m)), 2))) for m in sorted(wanted)}
    if need.max_batch_tokens is not None:
        limits = {m: min(v, need.max_batch_tokens) for m, v in limits.items()}
    vision = costs.vision_slot if modalities & {"image", "video"} else 0
    audio = costs.batch_token("audio") if "audio" in modalities else 0
    largest_image = MAX_IMAGE_TOKENS * costs.slots_per_token
    return MemoryPlan(
        budget=budget,
        base=need.base,
        weights=weights,
        fixed=need.fixed,
        host_token_table=host_table,
        eager=eager,
        graph_pool=pool,
        graph_text_tokens=pool // costs.text_token,
        graph_vision_slots=pool // vision if vision else 0,
        graph_audio_tokens=pool // audio if audio else 0,
        tower_slots=max(largest_image, int(eager / (EAGER_MARGIN * vision))) if vision else 0,
        max_batch_tokens=limits,
        costs=costs,
    )


def _minimum_pool(costs: ActivationCosts, modalities: frozenset[str], graphs: int) -> int:
    """The start-up set: the largest start-up bucket's activations of each kind (a graph reuses the
    blocks of its own kind only: graphs.GraphPool) and each of its `graphs` executables. None with
    graphs off (no start-up graphs: no graph is ever captured)."""
    if graphs == 0:
        return 0
    vision = MIN_GRAPH_VISION_SLOTS * costs.vision_slot if modalities & {"image", "video"} else 0
    audio = STARTUP_AUDIO_TOKENS * costs.batch_token("audio") if "audio" in modalities else 0
    return MIN_GRAPH_TEXT_TOKENS * costs.text_token + vision + audio + graphs * GRAPH_EXECUTABLE


def _largest_item(costs: ActivationCosts, modalities: frozenset[str], max_text_tokens: int) -> int:
    """Activation bytes of the costliest single valid request of the loaded modalities, with room
    for the caching allocator's fragmentation (EAGER_MARGIN)."""
    sizes = [max_text_tokens * costs.text_token]
    if modalities & {"image", "video"}:
        sizes.append(costs.image(MAX_IMAGE_TOKENS))
    if "audio" in modalities:
        sizes.append(MAX_AUDIO_TOKENS * costs.batch_token("audio"))
    return int(EAGER_MARGIN * max(sizes))


# The default budget with a media tower loaded: what the product promises a co-located language
# model on the H200 (half the process memory of sentence-transformers serving the same model).
DEFAULT_MEDIA_BUDGET = 2000 * MIB


def default_budget(need: Footprint) -> int:
    """The budget when the operator sets none: DEFAULT_MEDIA_BUDGET with a media tower, and with text
    only (or where that is too small) the least that holds the weights with the token table in host
    memory, the largest request and the minimum graph pool."""
    eager = _largest_item(need.costs, need.modalities, need.max_text_tokens)
    least = (
        need.base
        + need.weights
        - need.table
        + need.fixed
        + eager
        + _minimum_pool(need.costs, need.modalities, need.startup_graphs)
    )
    return max(least, DEFAULT_MEDIA_BUDGET if need.modalities - {"text"} else 0)
