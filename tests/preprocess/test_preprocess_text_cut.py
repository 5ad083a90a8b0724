"""Text bounded before tokenizing, and the prompt tokenized once per prompt: the same ids as tokenizing
each item's whole string (the reference path), on the demo tokenizer and on a BPE with real merges.

The demo tokenizer has no merges (one token per character), so it cannot show a cut changing a
merge. `merged_dir` is the demo checkpoint with a tokenizer that has Gemma's structure (Replace
" " -> "▁", a Split that never fires, byte fallback, the same special ids) plus ~3,000 merges learnt
from a generated corpus (tests/support/merged_tokenizer.py), long tokens and runs of one character
included, so cuts land where merges compete.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eg2_runtime import samples
from eg2_runtime.errors import InputTooLongError
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions, TextPart
from eg2_runtime.preprocess import Preprocessor
from eg2_runtime.preprocess.text import CUT_WINDOW, TextTokenizer
from tests.support.merged_tokenizer import WORDS, write_merged_checkpoint


@pytest.fixture(scope="module")
def merged_dir(tiny_bf16: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_merged_checkpoint(tiny_bf16, tmp_path_factory.mktemp("tiny-merged"))


@pytest.fixture(scope="module")
def tokenizers_(tiny_bf16: Path, merged_dir: Path) -> dict[str, TextTokenizer]:
    return {
        "demo": TextTokenizer.from_file(tiny_bf16 / "tokenizer.json"),
        "merged": TextTokenizer.from_file(merged_dir / "tokenizer.json"),
    }


def test_the_merged_tokenizer_really_merges(tokenizers_: dict[str, TextTokenizer]) -> None:
    merged = tokenizers_["merged"]
    text = "the tokenizer sat on the mat " * 4 + "a" * 60
    assert len(merged.encode_batch([text])[0]) < len(text) / 3
    assert merged.max_token_chars > 20 and merged.cuts_provable


# Pieces of text: single characters (byte fallback ones too), words, special tokens' strings, runs.
TEXT = st.lists(
    st.sampled_from([*"abtxe ,.-▁é€😀", "<bos>", "<eos>", "ab" * 5, "a" * 9, *WORDS]), max_size=40
).map("".join)


@settings(
    max_examples=300,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(pieces=st.lists(TEXT, min_size=1, max_size=6))
def test_a_cut_point_splits_the_tokenization_exactly(
    tokenizers_: dict[str, TextTokenizer], pieces: list[str]
) -> None:
    """The proof, checked: at every position `cut_point` accepts, tokenize(text) ==
    tokenize(text[:p]) + tokenize(text[p:]); on both tokenizers."""
    text = "".join(pieces)
    for name, tok in tokenizers_.items():
        whole = tok.encode_batch([text])[0]
        safe = tok._cut_mask(text) if len(text) > 1 else np.zeros(0, bool)
        assert safe is not None
        for p in np.flatnonzero(safe) + 1:
            left, right = tok.encode_batch([text[:p], text[p:]])
            assert left + right == whole, (name, text, int(p))
        for at in range(0, len(text), 7):
            p = tok.cut_point(text, at)
            assert p is None or (at <= p < len(text) and safe[p - 1]), (name, text, at, p)


def test_cut_points_exist_in_ordinary_text(tokenizers_: dict[str, TextTokenizer]) -> None:
    text = "the cat sat on the mat, " * 200
    for tok in tokenizers_.values():
        p = tok.cut_point(text, 1000)
        assert p is not None and p - 1000 < 30, p


# --- the preprocessor: bounded (fast) path against the reference path --------------------------------


def preprocessors(model_dir: Path) -> tuple[Preprocessor, Preprocessor]:
    return Preprocessor.from_dir(model_dir), Preprocessor.from_dir(model_dir, bounded_text=False)


def same(fast: Preprocessor, ref: Preprocessor, items: list[Item], options: PrepareOptions) -> None:
    got = fast.prepare_batch(items, options)
    want = ref.prepare_batch(items, options)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if isinstance(w, Exception):
            assert type(g) is type(w), (i, g, w)
            continue
        assert not isinstance(g, Exception), (i, g)
        np.testing.assert_array_equal(g.input_ids.numpy(), w.input_ids.numpy(), err_msg=f"item {i}")
        assert g.text_truncated == w.text_truncated, i


def long_texts(bound: int) -> list[str]:
    words = " ".join(WORDS)
    base = (words + " ") * (bound // len(words) + 400)
    return [
        base[: bound - 1],
        base[:bound],
        base[: bound + 1],
        base[: bound + 3 * CUT_WINDOW],
        "a" * (bound + 5000),  # one run: no provable cut point past the bound in the merged vocabulary
        "ab" * (bound // 2 + 3000),
        base[: bound - 3] + "<bos>" + base[:9000],  # a special token's string straddles the bound
        "😀€é" * (bound // 3 + 100),  # byte fallback
    ]


@pytest.mark.parametrize("which", ["demo", "merged"])
def test_bounded_text_equals_whole_text(which: str, tiny_bf16: Path, merged_dir: Path) -> None:
    fast, ref = preprocessors(tiny_bf16 if which == "demo" else merged_dir)
    bound = fast.text_bound
    png = samples.png(64, 48)
    texts = long_texts(bound)
    items = [Item((TextPart(t),)) for t in texts]
    items += [
        Item((TextPart(texts[3]), MediaPart("image", png), TextPart("after the image"))),
        Item((TextPart("before"), MediaPart("image", png), TextPart(texts[2]), TextPart(texts[0]))),
        Item(
            (TextPart(texts[0][: bound // 2]), TextPart(texts[0][: bound // 2 + 10]), MediaPart("image", png))
        ),
        Item((TextPart(texts[1]), TextPart("next part"))),  # the bound falls exactly at a part's end
        Item((TextPart(texts[1]), MediaPart("image", png), TextPart("next part"))),
        Item((TextPart("short"),)),
    ]
    for prompt in (None, "task: search result | query: ", "a" * 300, texts[0][: bound - 2]):
        same(fast, ref, items, PrepareOptions(prompt=prompt))
    over = [Item((TextPart(texts[3]),)), Item((TextPart("fits"),))]
    same(fast, ref, over, PrepareOptions(truncate=False))
    assert isinstance(fast.prepare_batch(over, PrepareOptions(truncate=False))[0], InputTooLongError)


@pytest.mark.parametrize("which", ["demo", "merged"])
def test_prompt_is_tokenized_once_per_prompt(which: str, tiny_bf16: Path, merged_dir: Path) -> None:
    """An 8 kB prompt over 256 one-letter items: the ids of the reference path, while the tokenizer
    sees the prompt's characters once instead of 256 times."""
    fast, ref = preprocessors(tiny_bf16 if which == "demo" else merged_dir)
    prompt = ("task: search result | query: the embedding of the token " * 150)[:8000]
    items = [Item((TextPart(chr(ord("a") + i % 26)),)) for i in range(256)]
    seen = count_chars(fast)
    same(fast, ref, items, PrepareOptions(prompt=prompt))
    assert sum(seen) < len(prompt) + 256 * 100, f"tokenized {sum(seen)} characters"
    seen.clear()
    fast.prepare_batch(items, PrepareOptions(prompt=prompt))
    assert sum(seen) < 256 * 100, f"tokenized {sum(seen)} characters with the prompt's head cached"


def count_chars(pre: Preprocessor) -> list[int]:
    """Characters handed to the tokenizer from now on (the real tokenizer still runs)."""
    seen: list[int] = []
    lock = threading.Lock()
    real = pre.tokenizer.encode_batch

    def counting(texts: list[str]) -> Any:
        with lock:
            seen.append(sum(map(len, texts)))
        return real(texts)

    pre.tokenizer.encode_batch = counting  # type: ignore[method-assign]
    return seen


def test_a_huge_string_costs_only_its_bound(tiny_bf16: Path) -> None:
    """30 MB of text: the tokenizer sees the bound plus at most a window, not 30 million characters."""
    fast = Preprocessor.from_dir(tiny_bf16)
    seen = count_chars(fast)
    text = ("the cat sat on the mat " * 1_400_000)[:30_000_000]
    out = fast.prepare(Item((TextPart(text),)), PrepareOptions())
    assert out.text_truncated and out.num_tokens == fast.max_tokens
    assert sum(seen) <= fast.text_bound + CUT_WINDOW, sum(seen)
