"""The demo checkpoint with a tokenizer that merges: Gemma's structure (Replace " " -> "▁", a Split
that never fires, byte fallback, the same special ids) plus ~3,000 BPE merges learnt here from a
generated corpus, long tokens and runs of one character included, so cuts land where merges compete.
The demo tokenizer itself has no merges (one token per character)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "mat",
    "embedding",
    "gemma",
    "token",
    "tokenizer",
    "aaaa",
    "ab",
    "ba",
    "x",
]


def corpus(n: int = 4000, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        words = rng.choice(WORDS, size=int(rng.integers(1, 30)))
        sep = rng.choice([" ", " ", " ", ", ", ". ", "-", ""])
        lines.append(str(sep).join(words))
    lines += (
        ["a" * k for k in range(1, 80)] + ["ab" * k for k in range(1, 40)] + [" " * k for k in range(1, 20)]
    )
    return lines


def write_merged_checkpoint(tiny_bf16: Path, out: Path) -> Path:
    """The demo checkpoint `tiny_bf16` copied into `out` with 3,000 BPE merges added to its tokenizer
    (new ids 200000..)."""
    trainer_tok = Tokenizer(BPE(unk_token="<unk>", byte_fallback=True))
    trainer_tok.normalizer = normalizers.Replace(" ", "▁")
    # Learnt on words that start at each "▁", as SentencePiece learns Gemma's pieces (no token holds a
    # "▁" after another character); served with Gemma's own pre-tokenizer, which never splits.
    trainer_tok.pre_tokenizer = pre_tokenizers.Split(pattern="▁", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=3100, show_progress=False, max_token_length=64)
    trainer_tok.train_from_iterator(corpus(), trainer)
    learnt = json.loads(trainer_tok.to_str())["model"]["merges"]
    spec = json.loads((tiny_bf16 / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    merges = []
    next_id = 200_000
    for merge in learnt:
        a, b = merge.split(" ") if isinstance(merge, str) else merge
        if a not in vocab or b not in vocab:
            continue
        if a + b not in vocab:
            vocab[a + b] = next_id
            next_id += 1
        merges.append([a, b])
    spec["model"]["merges"] = merges
    for f in tiny_bf16.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    (out / "tokenizer.json").write_text(json.dumps(spec))
    assert len(merges) > 2000, len(merges)
    return out
