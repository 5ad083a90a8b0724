"""A batch of text alone (preprocess/text_batch.py) against the general path (`prepare_staged`), on the
demo tokenizer (one token per character: the context's edge falls on exact character counts) and on
a BPE with real merges (tests/support/merged_tokenizer.py): every field of every item, and every error
with its message, alike. Then the engine's PreparedItems and their embeddings (tiny checkpoint, CPU).
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from eg2_runtime.engine import Engine
from eg2_runtime.errors import Cancelled, EG2Error, InputError, InputTooLongError
from eg2_runtime.inputs import Item, PrepareOptions, Segments, TextPart
from eg2_runtime.preprocess import Prepared, Preprocessor
from tests.support.merged_tokenizer import WORDS, write_merged_checkpoint


@pytest.fixture(scope="module")
def merged_dir(tiny_bf16: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_merged_checkpoint(tiny_bf16, tmp_path_factory.mktemp("tiny-merged"))


@pytest.fixture(scope="module", params=["demo", "merged"])
def pair(
    request: pytest.FixtureRequest, tiny_bf16: Path, merged_dir: Path
) -> tuple[Preprocessor, Preprocessor]:
    """(fast, reference): the same checkpoint, the text fast path on and off."""
    model_dir = tiny_bf16 if request.param == "demo" else merged_dir
    return Preprocessor.from_dir(model_dir), Preprocessor.from_dir(model_dir, batched_text=False)


def assert_same(got: list[Prepared | EG2Error], want: list[Prepared | EG2Error], context: str) -> None:
    assert len(got) == len(want), context
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        where = f"{context}, item {i}"
        if isinstance(w, EG2Error):
            assert type(g) is type(w), f"{where}: {g!r} != {w!r}"
            assert isinstance(g, EG2Error) and (g.message, g.param) == (w.message, w.param), where
            continue
        assert isinstance(g, Prepared), f"{where}: {g!r}"
        for f in dataclasses.fields(Prepared):
            a, b = getattr(g, f.name), getattr(w, f.name)
            if isinstance(b, torch.Tensor):
                assert isinstance(a, torch.Tensor) and a.dtype == b.dtype, f"{where}: {f.name}"
                assert torch.equal(a, b), f"{where}: {f.name} differ\n{a.tolist()}\n{b.tolist()}"
            else:
                assert a == b, f"{where}: {f.name} {a!r} != {b!r}"
        # Its own storage: a view into the batch's would carry (and pickle) every item's ids.
        assert g.input_ids.untyped_storage().nbytes() == g.input_ids.numel() * 8, where


def at_the_edge(pre: Preprocessor, prompt: str, base: str) -> list[str]:
    """Prefixes of `base` that, behind `prompt` and with <bos>/<eos>, are max_tokens - 1, max_tokens
    and max_tokens + 1 ids long untruncated (each found, else the test is not testing the edge)."""
    tok = pre.tokenizer
    fixed = len(tok.prefix) + len(tok.suffix)
    base = base[: 12 * pre.max_tokens]  # at least 12 characters a token: past the edge

    def ids(end: int) -> int:  # ids of the prompt and base[:end], wrapped
        return len(tok.encode_batch([prompt + base[:end]])[0]) + fixed

    whole = tok.tokenizer.encode(base, add_special_tokens=False)
    ends = [e for _, e in whole.offsets]  # base's token ends: the candidates
    lo, hi = 0, len(ends) - 1
    while lo < hi:  # the first end at max_tokens - 1 ids or more (ids grow with the end)
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if ids(ends[mid]) < pre.max_tokens - 1 else (lo, mid)
    found: dict[int, str] = {}
    for end in ends[lo : lo + 40]:
        found.setdefault(ids(end), base[:end])
    want = [pre.max_tokens - 1, pre.max_tokens, pre.max_tokens + 1]
    assert all(n in found for n in want), sorted(found)
    return [found[n] for n in want]


def batch(pre: Preprocessor, prompt: str, *, long: bool = False) -> list[Item]:
    """Short texts, texts at the context's edge and past it, and items the general path refuses; with
    `long`, the texts at `text_bound` characters (the cost of a tokenizer call over the bound)."""
    words = " ".join(WORDS)
    base = (words + ", ") * (pre.text_bound // len(words) + 10)
    bound = pre.text_bound - len(prompt)  # the most characters of text the fast path keeps whole
    texts = [
        "",
        " ",
        "a",
        "the cat sat on the mat",
        "naïve café — 😀€é ß 中文 \u0301 \u200b\t\n",  # byte fallback, combining marks, controls
        "<bos> and <eos> typed out",
        "a | b || c |> <| d",  # the markers' characters, but no marker
        *(base[: 20 + 7 * k] for k in range(10)),
        *at_the_edge(pre, prompt, base),
        base[: min(12 * pre.max_tokens, bound // 2)],  # over the context, under the bound: cut by `expand`
    ]
    if long:
        texts += [
            base[:bound],  # the longest text kept whole
            base[: bound + 1],  # the shortest the bound cuts (the general path)
            "a" * (bound + 50),  # a run with no cut point
        ]
    items = [Item((TextPart(t),)) for t in texts]
    if long:
        items.append(
            Item((TextPart(base[: bound // 2]), TextPart(base[: bound // 2 + 5])))
        )  # joined: past it
    items += [
        Item((TextPart("first "), TextPart(""), TextPart("second"))),  # parts joined
        Item((TextPart("<|ima"), TextPart("ge|> split across parts"))),  # no part holds a marker
        Item(()),  # no parts: refused in its slot
        Item((TextPart("holds a marker <|image|> here"),)),  # refused in its slot
        Item((TextPart("also <audio|>"), TextPart("x"))),
        Item((TextPart("with segments, prepared whole"),), Segments(tokens=64)),
    ]
    return items


def prompts(pre: Preprocessor) -> list[str | None]:
    named = sorted({pre.resolve_prompt(prompt_name=name) for name in pre.prompts.prompts} - {None})
    return [None, "", *named, "é😀 ", "a" * 300, "tail<|ima"]


def test_text_batches_equal_the_general_path(pair: tuple[Preprocessor, Preprocessor]) -> None:
    fast, ref = pair
    for prompt in prompts(fast):
        items = batch(fast, prompt or "")
        for truncate in (True, False):
            options = PrepareOptions(prompt=prompt, truncate=truncate)
            got, want = fast.prepare_batch(items, options), ref.prepare_batch(items, options)
            assert_same(got, want, f"prompt {prompt!r:.40}, truncate {truncate}")
            assert any(isinstance(w, Prepared) and w.text_truncated for w in want) == truncate
            assert sum(isinstance(w, EG2Error) for w in want) == 3 + 2 * (not truncate)
            # Each item alone (Engine.prepare): the same, errors raised.
            for item, w in zip(items, want, strict=True):
                try:
                    one: Prepared | EG2Error = fast.prepare(item, options)
                except EG2Error as e:
                    one = e
                assert_same([one], [w], f"prompt {prompt!r:.40}, alone")


@pytest.mark.parametrize("prompt", [None, "task: search result | query: ", "a" * 300])
def test_texts_at_the_bound_equal_the_general_path(
    pair: tuple[Preprocessor, Preprocessor], prompt: str | None
) -> None:
    fast, ref = pair
    items = batch(fast, prompt or "", long=True)
    for truncate in (True, False):
        options = PrepareOptions(prompt=prompt, truncate=truncate)
        got, want = fast.prepare_batch(items, options), ref.prepare_batch(items, options)
        assert_same(got, want, f"prompt {prompt!r:.40}, truncate {truncate}")


def test_a_prompt_alone_past_the_bound_and_options_every_item_refuses(
    pair: tuple[Preprocessor, Preprocessor],
) -> None:
    fast, ref = pair
    items = [Item((TextPart("short"),)), Item((TextPart(""),))]
    for options in (
        PrepareOptions(prompt="p" * (fast.text_bound + 10)),  # the prompt itself is cut
        PrepareOptions(prompt="p" * (fast.text_bound + 10), truncate=False),
        PrepareOptions(prompt="a <|audio|> prompt"),
        PrepareOptions(image_tokens=100),
    ):
        assert_same(fast.prepare_batch(items, options), ref.prepare_batch(items, options), repr(options)[:80])


def test_plain_texts_take_the_fast_path_and_only_the_rest_take_the_general_one(
    pair: tuple[Preprocessor, Preprocessor], monkeypatch: pytest.MonkeyPatch
) -> None:
    fast, _ = pair
    staged: list[list[Item]] = []
    real = fast.prepare_staged

    def spy(items: list[Item], *args: object, **kwargs: object) -> list[Prepared | EG2Error]:
        staged.append(list(items))
        return real(items, *args, **kwargs)

    monkeypatch.setattr(fast, "prepare_staged", spy)
    plain = [Item((TextPart(f"doc {i}"),)) for i in range(64)]
    fast.prepare_batch(plain, PrepareOptions(prompt="task: search result | query: "))
    assert staged == []
    marked = Item((TextPart("<|video|>"),))
    fast.prepare_batch([*plain[:3], marked, plain[3]], PrepareOptions())
    assert staged == [[marked]]


def test_a_staging_error_is_raised_before_an_over_long_item_s(
    pair: tuple[Preprocessor, Preprocessor],
) -> None:
    """With raise_errors, the general path stages every item before `expand` refuses one: the fast path
    raises the same error."""
    fast, ref = pair
    long = "the cat sat on the mat " * 2000  # over the context, under the bound
    items = [Item((TextPart(long),)), Item((TextPart("a <|image> marker"),))]
    options = PrepareOptions(truncate=False)
    raised = []
    for pre in (fast, ref):
        with pytest.raises(EG2Error) as e:
            pre.prepare_batch(items, options, raise_errors=True)
        raised.append((type(e.value), e.value.message))
    assert raised[0] == raised[1] and raised[0][0] is InputError, raised
    with pytest.raises(InputTooLongError):
        fast.prepare_batch(items[:1], options, raise_errors=True)


def test_a_cancelled_batch_raises(pair: tuple[Preprocessor, Preprocessor]) -> None:
    fast, _ = pair
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Cancelled):
        fast.prepare_batch([Item((TextPart("x"),))], PrepareOptions(), cancel=cancel)


def test_the_engine_prepares_and_embeds_text_batches_as_the_general_path(tiny_fp32: Path) -> None:
    engine = Engine.from_dir(tiny_fp32, device="cpu")
    pre = engine.preprocessor
    rng = np.random.default_rng(0)
    items = [Item((TextPart(" ".join(rng.choice(WORDS, size=int(rng.integers(5, 20))))),)) for _ in range(24)]
    items += [
        Item((TextPart(""),)),
        Item((TextPart("😀 naïve"), TextPart(" café"))),
        Item((TextPart("the mat " * 2000),)),  # truncated
        Item((TextPart("<|image|>"),)),  # an error in its slot
    ]
    for name in (None, "query", "document"):
        options = PrepareOptions(prompt=pre.resolve_prompt(prompt_name=name))
        got = engine.prepare_many(items, options)
        pre.batched_text = False
        try:
            want = engine.prepare_many(items, options)
        finally:
            pre.batched_text = True
        assert_same(
            [g.inputs if not isinstance(g, EG2Error) else g for g in got],
            [w.inputs if not isinstance(w, EG2Error) else w for w in want],
            f"engine, {name}",
        )
        ok = [i for i, w in enumerate(want) if not isinstance(w, EG2Error)]
        for i in ok:
            g, w = got[i], want[i]
            assert not isinstance(g, EG2Error) and not isinstance(w, EG2Error)
            assert (g.modality, g.num_tokens, g.cost, g.span) == (w.modality, w.num_tokens, w.cost, w.span), i
        # The 8192-token item takes minutes on the CPU: its ids are proven equal above.
        short = [i for i in ok if want[i].num_tokens < 1000]  # type: ignore[union-attr]
        a, b = engine.embed([got[i] for i in short]), engine.embed([want[i] for i in short])  # type: ignore[misc]
        err = float(np.abs(a - b).max())
        assert err == 0.0, f"embeddings of the two paths' items: max abs diff {err:.2e} > 0"
