"""The GPU memory budget's sizing (memory_plan.py): given a budget and a model, which buckets, which
batch limits, and where the token table lives. Pure arithmetic, on the CPU; the H200 run of
`eg2 bench` checks the process's real memory against the budget."""

from __future__ import annotations

import pytest

from eg2_runtime.config import ModelConfig
from eg2_runtime.memory_plan import (
    DEFAULT_MEDIA_BUDGET,
    EAGER_MARGIN,
    MAX_IMAGE_TOKENS,
    MIB,
    MIN_GRAPH_TEXT_TOKENS,
    ActivationCosts,
    BudgetTooSmall,
    Footprint,
    default_budget,
    plan,
)
from eg2_runtime.tools.demo_model import demo_config

ALL = frozenset({"text", "image", "video", "audio"})
FULL = ModelConfig.from_dict(demo_config("full", "bfloat16"))
COSTS = ActivationCosts.from_config(FULL)


def footprint(modalities: frozenset[str] = ALL, **kw: int | None) -> Footprint:
    """The full model as the H200 measured it (2026-12-01): a 574 MiB base (the CUDA context with the
    engine's stack limit, and the libraries), 774 MiB of hybrid-w4 weights of which 256 MiB are the
    token table (text alone: 517 MiB)."""
    weights = 774 * MIB if modalities - {"text"} else 517 * MIB
    # The packed text path's 14 start-up buckets, one image graph and one clip graph where served.
    graphs = 14 + len(modalities & {"image", "audio"})
    args: dict = {
        "base": 574 * MIB,
        "weights": weights,
        "table": 256 * MIB,
        "fixed": 40 * MIB,
        "startup_graphs": graphs,
    }
    args |= kw
    return Footprint(costs=COSTS, modalities=modalities, max_text_tokens=8192, **args)


def test_costs_cover_the_h200_peaks() -> None:
    """The cost model at or above the allocator's peaks on the H200, within 30% (benchmarks/
    probe_costs.py, 2026-12-01, full checkpoint, the engine's paths): lean text 32.6 kB per token at
    most (1 x 2,200 tokens; 27.7 for 64 x 64), the vision tower 23.7 kB per patch slot (1 to 32
    images), the audio tower 103.1 kB per soft token (1 x 30 s to 16 x 10 s)."""
    for cost, peak in ((COSTS.text_token, 32_582), (COSTS.vision_slot, 23_686), (COSTS.audio_token, 103_082)):
        assert peak <= cost <= 1.3 * peak, (cost, peak)
    assert COSTS.slots_per_token == 9


def test_every_byte_of_the_budget_is_accounted_for() -> None:
    p = plan(2000 * MIB, footprint())
    assert p.allocator_limit == p.budget - p.base
    assert p.weights + p.fixed + p.eager + p.graph_pool == p.allocator_limit
    largest = max(COSTS.image(MAX_IMAGE_TOKENS), 8192 * COSTS.text_token)
    assert p.eager == int(EAGER_MARGIN * largest), "the costliest request, with room for fragmentation"


def test_default_budget_moves_the_table_and_sizes_the_graphs() -> None:
    """2,000 MiB with every tower: the table leaves the GPU (else the pool would be under the minimum),
    and the pool holds 64 short texts and several default images per bucket."""
    p = plan(default_budget(footprint()), footprint())
    assert p.budget == DEFAULT_MEDIA_BUDGET
    assert p.host_token_table and p.weights == 518 * MIB
    assert p.graph_text_tokens >= MIN_GRAPH_TEXT_TOKENS
    assert p.graph_vision_slots >= 4 * 280 * 9
    assert p.tower_slots >= MAX_IMAGE_TOKENS * 9, "one image of the largest budget runs in one tower call"
    assert EAGER_MARGIN * p.tower_slots * COSTS.vision_slot <= p.eager, "a tower chunk keeps the margin"
    assert set(p.max_batch_tokens) == {"text", "image", "video", "audio", "mixed"}
    assert p.max_batch_tokens["text"] >= 8192, "the longest text fits one batch"
    assert p.max_batch_tokens["audio"] >= 750, "one 30 s clip fits one batch"


def test_a_bigger_budget_keeps_the_table_and_grows_the_pool() -> None:
    small, big = plan(2000 * MIB, footprint()), plan(4000 * MIB, footprint())
    assert not big.host_token_table
    assert big.graph_pool > small.graph_pool and big.graph_text_tokens > small.graph_text_tokens
    assert all(big.max_batch_tokens[m] >= small.max_batch_tokens[m] for m in small.max_batch_tokens)


def test_too_small_a_budget_names_the_least_that_works() -> None:
    need = footprint()
    with pytest.raises(BudgetTooSmall, match="at least") as info:
        plan(1200 * MIB, need)
    least = int(str(info.value).split("at least ")[1].split(" MiB")[0].replace(",", ""))
    p = plan(least * MIB, need)  # that much is enough: the table in host memory, no graph pool to speak of
    assert p.host_token_table and 0 <= p.graph_pool < MIB
    with pytest.raises(BudgetTooSmall):
        plan((least - 1) * MIB, need)


def test_text_only_loads_no_tower_limits_and_a_leaner_default() -> None:
    need = footprint(frozenset({"text"}))
    budget = default_budget(need)
    assert budget < DEFAULT_MEDIA_BUDGET
    p = plan(budget, need)
    assert p.host_token_table, "the leanest default keeps the table in host memory"
    assert set(p.max_batch_tokens) == {"text"} and p.graph_text_tokens
    assert p.graph_vision_slots == p.graph_audio_tokens == p.tower_slots == 0
    assert p.eager == int(EAGER_MARGIN * 8192 * COSTS.text_token)


def test_graphs_off_keep_no_pool_in_the_default_budget() -> None:
    """With CUDA graphs off (no start-up graphs) the leanest default holds no graph pool: the
    text-only budget shrinks by the start-up set's activations and executables."""
    on, off = footprint(frozenset({"text"})), footprint(frozenset({"text"}), startup_graphs=0)
    assert default_budget(on) - default_budget(off) >= MIN_GRAPH_TEXT_TOKENS * COSTS.text_token
    p = plan(default_budget(off), off)
    assert p.host_token_table and p.graph_pool == 0


def test_the_operators_batch_cap_bounds_every_modality() -> None:
    p = plan(2000 * MIB, footprint(max_batch_tokens=1000))
    assert max(p.max_batch_tokens.values()) == 1000


def test_tiny_model_costs_scale_with_its_config() -> None:
    tiny = ActivationCosts.from_config(ModelConfig.from_dict(demo_config("tiny", "float32")), dtype_bytes=4)
    assert 0 < tiny.text_token < COSTS.text_token and 0 < tiny.vision_slot < COSTS.vision_slot
