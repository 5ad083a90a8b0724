"""Text: the checkpoint's tokenizer.json through the `tokenizers` library, and its task prompts.

Assumes the layout transformers' GemmaTokenizer gives: the tokenizer's post-processor wraps every text
as `<bos> ... <eos>` (we read those wrapper ids off the tokenizer itself rather than assume them), and
media markers are special added tokens, so text on either side of a marker tokenizes independently.
Prompts come from config_sentence_transformers.json (`prompts`, `default_prompt_name`), as
sentence-transformers reads them.

Cut points. Text is tokenized as one BPE "word" (Gemma's pre-tokenizer never splits), so a 30 MB
string costs seconds and gigabytes before the 8192-token cut drops almost all of it. `cut_point`
finds where a string can be cut without changing how the part before it tokenizes: a position p
such that no vocabulary token contains the two characters around p. BPE only ever builds symbols
that are vocabulary tokens, so no symbol can span p, the merges on either side never interact, and
tokenize(text) == tokenize(text[:p]) + tokenize(text[p:]) exactly. The proof needs a BPE model
without merge shortcuts (ignore_merges), subword affixes or dropout, and a normalizer and
pre-tokenizer that map text character for character (Gemma's replaces " " with "▁"); for another
tokenizer `cuts_provable` is false, no cut point is proven, and callers cut past a margin (CUT_WINDOW).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tokenizers.models import BPE

from eg2_runtime.errors import CheckpointError
from eg2_runtime.inputs import resolve_prompt

MAX_TOKENS = 8192  # the model's context: longer inputs are cut (keeping EOS) or refused
# How far past the bound `cut_point` looks for a provable cut point. Text with spaces or punctuation
# has one every few characters; a run with none in 4096 characters is cut at the window's end
# anyway, where BPE would need a chain of conflicting merges 4096 characters long to differ.
CUT_WINDOW = 4096


class TextTokenizer:
    """Encodes strings to ids without the `<bos>`/`<eos>` wrapper, which `prefix`/`suffix` hold."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self.tokenizer = tokenizer
        # The wrapper the post-processor adds, found by diffing one probe with and without it.
        bare = tokenizer.encode("a", add_special_tokens=False).ids
        full = tokenizer.encode("a", add_special_tokens=True).ids
        at = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), None)
        if not bare or at is None:
            raise CheckpointError("tokenizer.json: cannot locate the text between its special tokens")
        self.prefix: list[int] = full[:at]  # [<bos>]
        self.suffix: list[int] = full[at + len(bare) :]  # [<eos>]
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        # One token covers at most this many characters, so n tokens come from at most n * this many.
        self.max_token_chars = max(map(len, vocab))
        model = tokenizer.model
        self.cuts_provable = (
            isinstance(model, BPE)
            and not model.ignore_merges  # a whole-word lookup would make a prefix tokenize differently
            and not model.continuing_subword_prefix
            and not model.end_of_word_suffix
            and not model.dropout
        )
        self._joins = _adjacent_pairs(vocab)  # (P,) sorted int64: char pairs found inside some token

    @classmethod
    def from_file(cls, path: str | Path) -> TextTokenizer:
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path.name} not found in the model directory")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exception on a malformed file
            raise CheckpointError(f"{path.name} could not be loaded: {e}") from e
        return cls(tokenizer)

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def cut_point(self, text: str, at: int, window: int = CUT_WINDOW) -> int | None:
        """The first position p in [at, at + window], 0 < p < len(text), where `text` can be cut without
        changing how text[:p] tokenizes (see the module docstring); None when there is none."""
        lo = max(at, 1)
        hi = min(len(text) - 1, at + window)
        if lo > hi:
            return None
        safe = self._cut_mask(text[lo - 1 : hi + 1])  # safe[i]: between window chars i and i + 1
        if safe is None or not safe.any():
            return None
        return lo + int(np.argmax(safe))

    def last_cut_point(self, text: str) -> int:
        """The last position 0 < p < len(text) where `text` can be cut (see `cut_point`); 0 if none."""
        safe = self._cut_mask(text) if len(text) > 1 else None
        if safe is None or not safe.any():
            return 0
        return len(safe) - int(np.argmax(safe[::-1]))

    def _cut_mask(self, text: str) -> np.ndarray | None:
        """(len(text) - 1,) bool: whether the position between text[i] and text[i + 1] is provably a
        token boundary; None when this tokenizer or this text is outside what the proof covers."""
        if not self.cuts_provable:
            return None
        view = self.tokenizer.normalizer.normalize_str(text) if self.tokenizer.normalizer else text
        if len(view) != len(text):  # not character for character: positions would not line up
            return None
        if self.tokenizer.pre_tokenizer is not None:
            pieces = self.tokenizer.pre_tokenizer.pre_tokenize_str(view)
            if "".join(piece for piece, _ in pieces) != view:  # it rewrote characters
                return None
        try:
            codes = np.frombuffer(view.encode("utf-32-le"), dtype="<u4").astype(np.int64)
        except UnicodeEncodeError:  # a lone surrogate
            return None
        pairs = (codes[:-1] << 21) | codes[1:]
        found = np.searchsorted(self._joins, pairs)
        inside_a_token = self._joins[np.minimum(found, len(self._joins) - 1)] == pairs
        return ~inside_a_token

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text without the wrapper; one call, parallel inside the tokenizers library.

        `encode_batch_fast` skips the character offsets we never use (about 2x faster)."""
        return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


def _adjacent_pairs(tokens: Iterable[str]) -> np.ndarray:
    """(P,) sorted unique int64 codes `ord(a) << 21 | ord(b)` of each two adjacent characters inside
    any of `tokens` (code points fit in 21 bits). Vectorized: Gemma's 262k tokens take milliseconds."""
    tokens = list(tokens)
    sep = next(c for c in ("\x00", "\uffff", "\U0010ffff") if not any(c in t for t in tokens))
    codes = np.frombuffer(sep.join(tokens).encode("utf-32-le"), dtype="<u4").astype(np.int64)
    a, b = codes[:-1], codes[1:]
    keep = (a != ord(sep)) & (b != ord(sep))  # not across two tokens
    return np.unique((a[keep] << 21) | b[keep])


class Prompts:
    """Named task prompts ("SearchQuery" -> "task: search result | query: ") and the default name."""

    def __init__(self, prompts: dict[str, str], default_name: str | None = None) -> None:
        if default_name is not None and default_name not in prompts:
            raise CheckpointError(f"default_prompt_name {default_name!r} is not one of the prompts")
        self.prompts = dict(prompts)
        self.default_name = default_name

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Prompts:
        path = Path(model_dir) / "config_sentence_transformers.json"
        if not path.is_file():
            return cls({})
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
            prompts, default = d.get("prompts") or {}, d.get("default_prompt_name")
        except (ValueError, UnicodeDecodeError, AttributeError) as e:
            raise CheckpointError(f"config_sentence_transformers.json is not valid: {e}") from None
        if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
            raise CheckpointError("config_sentence_transformers.json: `prompts` must map names to strings")
        return cls(prompts, default)

    def resolve(self, prompt_name: str | None = None, prompt: str | None = None) -> str | None:
        """The literal prefix for a request: `eg2_runtime.inputs.resolve_prompt` on these prompts."""
        return resolve_prompt(self.prompts, self.default_name, prompt_name, prompt)
