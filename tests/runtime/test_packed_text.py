"""The packed text path (packing.py, packed_attention.py, TextEncoder.forward_packed) against the
padded reference path, in FP32 on the CPU on the tiny checkpoint.

The tiny config's sliding window is 8 tokens, so items of 9 to 45 tokens span up to five windows, and
block sizes of 4 and 16 cut them into many blocks: empty, partial and full block pairs all occur.
The dense backend runs the block mask element by element, so a block wrongly skipped or wrongly
taken as full changes the vectors here, not only on the GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from eg2_runtime.config import FULL, SLIDING
from eg2_runtime.loader import load_model
from eg2_runtime.model import pool
from eg2_runtime.packed_attention import PackedAttention, block_mask, element_mask
from eg2_runtime.packing import Packing
from eg2_runtime.text import TextEncoder, attention_masks

TOL = 1e-5
WINDOW = 8  # the tiny checkpoint's sliding_window

LAYOUTS: dict[str, list[int]] = {
    # 1 token up to five windows, around the window's edges
    "mixed": [1, 2, 7, 8, 9, 17, 30, 45],
    "one item": [45],
    # many short items, several to a block
    "many short": [1 + (i * 7) % 5 for i in range(40)],
}


@pytest.fixture(scope="module")
def encoder(tiny_fp32: Path) -> TextEncoder:
    return load_model(tiny_fp32, "cpu", modalities={"text"})[0].language_model


def padded_batch(
    encoder: TextEncoder, lengths: list[int], seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, H) embeddings of random ids and the (B, T) valid mask of items of these lengths."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.randint(10, 5000, (len(lengths), t), generator=g)
    valid = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    with torch.no_grad():
        return encoder.embed(ids), valid


def reference_vectors(encoder: TextEncoder, embeds: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return pool(encoder(embeds, valid).float(), valid.long())


@pytest.mark.parametrize("block_size", [4, 16, 128])
@pytest.mark.parametrize("layout", [*LAYOUTS, "bucket"])
def test_packed_equals_padded(encoder: TextEncoder, layout: str, block_size: int) -> None:
    """Each item's vector from the packed path equals the padded reference path's to 1e-5."""
    lengths = LAYOUTS["mixed" if layout == "bucket" else layout]
    embeds, valid = padded_batch(encoder, lengths)
    expected = reference_vectors(encoder, embeds, valid)
    tokens = embeds[valid]  # (N, H): the items end to end
    if layout == "bucket":  # a static bucket: a pad tail of zero embeddings, then empty items
        packing = Packing.from_lengths(lengths, tokens=160, items=len(lengths) + 3, max_len=160)
        tokens = torch.cat([tokens, tokens.new_zeros(160 - tokens.shape[0], tokens.shape[1])])
    else:
        packing = Packing.from_lengths(lengths)
    with torch.no_grad():
        per_token = encoder.forward_packed(tokens, packing, block_size=block_size)
        got = packing.pool(per_token.float())
    assert torch.isfinite(per_token).all(), "a packed row is not finite"
    got = got[: len(lengths)]
    diff = (got - expected).abs().amax(dim=1)
    assert float(diff.max()) <= TOL, (
        f"{layout}, block {block_size}: max abs diff per item {[f'{d:.1e}' for d in diff.tolist()]} > {TOL:.0e}"
    )


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_mlp_in_chunks_equals_padded(encoder: TextEncoder, rows: int) -> None:
    """The packed path with its MLP run `rows` tokens at a time (GatedMLP.in_rows: chunks cut across
    items, a last chunk short) gives each item the padded reference's vector to 1e-5."""
    lengths = LAYOUTS["mixed"]
    embeds, valid = padded_batch(encoder, lengths, seed=1)
    expected = reference_vectors(encoder, embeds, valid)
    packing = Packing.from_lengths(lengths)
    with torch.no_grad():
        got = packing.pool(encoder.forward_packed(embeds[valid], packing, mlp_rows=rows).float())
    diff = float((got[: len(lengths)] - expected).abs().max())
    assert diff <= TOL, f"MLP in chunks of {rows} rows: max abs diff {diff:.1e} > {TOL:.0e}"


def reference_mask(lengths: list[int], window: int | None) -> torch.Tensor:
    """(N, N) bool: the padded path's own masks (attention_masks) of each item, on the diagonal."""
    t = max(lengths)
    valid = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    per_item = attention_masks(valid, WINDOW, static=True)[SLIDING if window is not None else FULL]
    assert isinstance(per_item, torch.Tensor)
    per_item = per_item.expand(-1, -1, t, t)  # full layers' key-padding mask broadcasts over queries
    return torch.block_diag(*(per_item[b, 0, :n, :n] for b, n in enumerate(lengths)))


LAYOUT_CASES = {**LAYOUTS, "bucket": [*LAYOUTS["mixed"], 160 - sum(LAYOUTS["mixed"])]}


@pytest.mark.parametrize("block_size", [4, 16, 128])
@pytest.mark.parametrize("window", [WINDOW, None], ids=["sliding", "full"])
@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_block_mask_equals_reference_mask(layout: str, window: int | None, block_size: int) -> None:
    """The pairs the BlockMask lets through (full blocks, and the mask function on partial blocks)
    are exactly the padded path's masks of each item, the pad tail counting as one more item."""
    lengths = LAYOUT_CASES[layout]
    packing = Packing.from_lengths(lengths)
    got = element_mask(block_mask(packing, window, block_size))
    expected = reference_mask(lengths, window)
    wrong = (got != expected).nonzero()
    assert not len(wrong), (
        f"{len(wrong)} pairs differ from the reference mask, first (q, k): {wrong[:5].tolist()}"
    )


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [WINDOW, None], ids=["sliding", "full"])
@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_block_mask_skips_every_masked_block(layout: str, window: int | None, block_size: int) -> None:
    """The blocks listed are exactly those holding an allowed pair (nothing masked is computed), and
    the full ones exactly those where every pair is allowed (no mask function where none is needed)."""
    lengths = LAYOUT_CASES[layout]
    packing = Packing.from_lengths(lengths)
    mask = block_mask(packing, window, block_size)
    n = packing.num_tokens
    nb = -(-n // block_size)
    allowed = torch.zeros(nb * block_size, nb * block_size, dtype=torch.bool)
    allowed[:n, :n] = reference_mask(lengths, window)
    inside = torch.zeros_like(allowed)
    inside[:n, :n] = True
    cells = lambda m: m.view(nb, block_size, nb, block_size).transpose(1, 2).reshape(nb, nb, -1)  # noqa: E731
    any_allowed = cells(allowed).any(-1)
    all_allowed = (cells(allowed) | ~cells(inside)).all(-1)  # the ragged last block's outside is no pair

    def listed(counts: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        dense = torch.zeros(nb, nb, dtype=torch.bool)
        for row in range(nb):
            dense[row, indices[0, 0, row, : counts[0, 0, row]].long()] = True
        return dense

    assert mask.full_kv_num_blocks is not None and mask.full_kv_indices is not None
    partial = listed(mask.kv_num_blocks, mask.kv_indices)
    full = listed(mask.full_kv_num_blocks, mask.full_kv_indices)
    assert not (partial & full).any(), "a block is listed both partial and full"
    assert torch.equal(partial | full, any_allowed), (
        f"listed blocks {int((partial | full).sum())}, blocks with an allowed pair {int(any_allowed.sum())}"
    )
    assert torch.equal(full, all_allowed), (
        f"full blocks {int(full.sum())}, all-allowed {int(all_allowed.sum())}"
    )


def test_sliding_blocks_grow_linearly_with_length() -> None:
    """One item of 64 windows: each query block lists only the key blocks its window reaches."""
    block, n = 16, 64 * WINDOW
    mask = block_mask(Packing.from_lengths([n]), WINDOW, block)
    per_row = (mask.kv_num_blocks + mask.full_kv_num_blocks)[0, 0]
    assert int(per_row.max()) <= 3, f"up to {int(per_row.max())} of {n // block} key blocks per query block"


def random_qkv(n: int, kv_heads: int, head_dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, heads, head_dim, generator=g) for heads in (4, kv_heads, kv_heads))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kind", [SLIDING, FULL])
def test_flex_backend_matches_dense(encoder: TextEncoder, kind: str) -> None:
    """The flex backend (eager on the CPU) and the dense backend agree on the same packing: the
    layout, grouped heads and scale reach flex_attention as they reach SDPA."""
    cfg = encoder.cfg
    layer = cfg.layer_types.index(kind)
    packing = Packing.from_lengths(LAYOUTS["mixed"])
    q, k, v = random_qkv(packing.num_tokens, cfg.kv_heads[layer], cfg.head_dims[layer], seed=1)
    dense = PackedAttention(packing, cfg, {SLIDING: "dense", FULL: "dense"}, block_size=16)
    flex = PackedAttention(packing, cfg, {SLIDING: "flex", FULL: "flex"}, block_size=16)
    diff = float((flex(kind, q, k, v) - dense(kind, q, k, v)).abs().max())
    assert diff <= TOL, f"{kind}: flex vs dense max abs diff {diff:.2e}"


@pytest.mark.slow
def test_compiled_flex_kernel_walks_the_block_lists() -> None:
    """flex_attention compiled (inductor's CPU kernel, which skips unlisted blocks and runs no mask
    function on full ones) equals the dense backend: the block lists themselves are right, not only
    the mask function that eager flex applies everywhere. Compiling takes about a minute, once."""
    compiled = torch.compile(flex_attention, fullgraph=True)
    packing = Packing.from_lengths(LAYOUTS["mixed"])
    for window, kv_heads, head_dim in ((WINDOW, 2, 16), (None, 1, 32)):
        q, k, v = random_qkv(packing.num_tokens, kv_heads, head_dim, seed=2)
        mask = block_mask(packing, window, 16)
        heads_first = lambda x: x.transpose(0, 1)[None]  # noqa: E731
        out = compiled(
            heads_first(q), heads_first(k), heads_first(v), block_mask=mask, scale=1.0, enable_gqa=True
        )
        expected = torch.nn.functional.scaled_dot_product_attention(
            heads_first(q),
            heads_first(k),
            heads_first(v),
            attn_mask=element_mask(mask),
            scale=1.0,
            enable_gqa=True,
        )
        diff = float((out - expected).abs().max())
        assert diff <= 1e-4, f"window {window}: compiled flex vs dense max abs diff {diff:.2e}"


def test_packing_layout() -> None:
    p = Packing.from_lengths([2, 3, 1], tokens=8, items=5, max_len=8)
    assert p.cu_seqlens.tolist() == [0, 2, 5, 6, 8, 8]
    assert p.doc_ids.tolist() == [0, 0, 1, 1, 1, 2, 3, 3]
    assert p.positions.tolist() == [0, 1, 0, 1, 2, 0, 0, 1]
    assert (p.num_tokens, p.max_len) == (8, 8)
    q = Packing.from_lengths([5, 1], tokens=8, items=5)
    p.copy_(q)
    assert p.doc_ids.tolist() == [0, 0, 0, 0, 0, 1, 2, 2] and p.cu_seqlens.tolist() == [0, 5, 6, 8, 8, 8]
    # A pad tail longer than every item bounds the length by default (the H200's GPU test packed 64
    # short items into whole 128-token blocks this way, and the bound raised).
    assert Packing.from_lengths([3, 5], tokens=32).max_len == 24
    assert Packing.from_lengths([3, 5]).max_len == 5
    for bad in (
        {"lengths": []},
        {"lengths": [2, 0]},
        {"lengths": [5, 5], "tokens": 8},
        {"lengths": [3, 5], "tokens": 32, "max_len": 23},
    ):
        with pytest.raises(ValueError):
            Packing.from_lengths(**bad)
    with pytest.raises(ValueError):
        p.copy_(Packing.from_lengths([5, 1], tokens=9, items=5))


def test_pool_equals_padded_pool() -> None:
    """Packing.pool (a weighted matmul) equals model.pool (masked mean) item by item."""
    lengths = [3, 1, 6]
    g = torch.Generator().manual_seed(3)
    padded = torch.randn(3, 6, 16, generator=g)
    valid = torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]
    packing = Packing.from_lengths(lengths, tokens=12, items=5)
    tokens = torch.cat([padded[valid], torch.randn(2, 16, generator=g)])  # pad tail rows: ignored
    got = packing.pool(tokens)
    assert got.shape == (5, 16)
    diff = float((got[:3] - pool(padded, valid.long())).abs().max())
    assert diff <= 1e-6, f"pool max abs diff {diff:.2e}"
    assert torch.equal(got[4], torch.zeros(16)), "an empty item pools to a zero vector, not NaN"


def test_backends_are_checked(encoder: TextEncoder) -> None:
    packing = Packing.from_lengths([3])
    for backends, says in (
        ({SLIDING: "flash", FULL: "dense"}, "needs CUDA"),
        ({SLIDING: "dense", FULL: "nope"}, "choose from"),
        ({SLIDING: "efficient", FULL: "dense"}, "no bidirectional window"),
    ):
        with pytest.raises(ValueError, match=says):
            PackedAttention(packing, encoder.cfg, backends)
