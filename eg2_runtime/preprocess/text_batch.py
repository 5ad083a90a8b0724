"""A batch of text alone: the fast path of `Preprocessor.prepare_batch`.

The general path (`Preprocessor.prepare_staged`, the reference) gives every item a `_Staged`, renders
it piece by piece, and builds its ids through `expand`, a numpy array and a tensor of its own: for 64
short documents that Python cost more than the tokenizer call itself. Here an item the general path
would neither cut nor refuse (text parts only, the prompt and the text within `text_bound`
characters, no media marker string) is what `_render` makes of it: the prompt's tail after its cached
head (`Preprocessor.prompt_head`), then its parts joined. Those strings go through one tokenizer call,
and every item's `<bos> head ids <eos>` into one int64 array, each item's input_ids a slice of it.

Every other item (no parts, a marker string, text past the bound) is prepared by the reference path
itself, in a call of its own; ids past the context go through `Preprocessor.expand_ids`, the reference's
own truncation. tests/preprocess/test_preprocess_text_batch.py holds the two paths equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from threading import Event
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from eg2_runtime.errors import EG2Error, check_cancel
from eg2_runtime.inputs import IMAGE_TOKEN_BUDGETS, Item, PrepareOptions, TextPart
from eg2_runtime.preprocess.layout import Prepared

if TYPE_CHECKING:
    from eg2_runtime.preprocess.preprocessor import Preprocessor

# Joins the batch's texts for one marker search: no marker string holds it, so a marker found in the
# joined string lies within one text.
_SEPARATOR = "\n"


def prepare_texts(
    pre: Preprocessor,
    items: Sequence[Item],
    options: PrepareOptions,
    *,
    raise_errors: bool = False,
    cancel: Event | None = None,
) -> list[Prepared | EG2Error] | None:
    """What `pre.prepare_staged(items, options, ...)` gives, for a batch without media; None when the
    batch holds media (or options every item's staging refuses): the caller takes the general path."""
    prompt = options.prompt or ""
    markers = pre.markers.strings
    if options.image_tokens not in IMAGE_TOKEN_BUDGETS or any(m in prompt for m in markers):
        return None
    check_cancel(cancel)
    room = pre.text_bound - len(prompt)  # the most characters of text `_render` keeps whole
    fast: list[int] = []  # items on this path, in order
    slow: list[int] = []  # items the reference path prepares
    texts: list[str] = []  # each fast item's parts, joined
    for i, item in enumerate(items):
        parts = item.parts
        part = parts[0] if len(parts) == 1 else None
        if type(part) is TextPart:
            text = part.text
        else:
            pieces = [p.text for p in parts if isinstance(p, TextPart)]
            if len(pieces) < len(parts):
                return None  # media
            text = "".join(pieces)
        if parts and len(text) <= room:
            fast.append(i)
            texts.append(text)
        else:
            slow.append(i)
    if any(m in _SEPARATOR.join(texts) for m in markers):  # rare: texts holding one go the reference's way
        clean = [not any(m in text for m in markers) for text in texts]
        slow = sorted([*slow, *(i for i, ok in zip(fast, clean, strict=True) if not ok)])
        fast = [i for i, ok in zip(fast, clean, strict=True) if ok]
        texts = [text for text, ok in zip(texts, clean, strict=True) if ok]

    out: list[Prepared | EG2Error | None] = [None] * len(items)
    if slow:
        # First, as the reference raises (with raise_errors) every staging error before any of expand's:
        # a slow item's errors are all staging errors, a fast item's all expand's (truncate off).
        done = pre.prepare_staged([items[i] for i in slow], options, raise_errors=raise_errors, cancel=cancel)
        for i, p in zip(slow, done, strict=True):
            out[i] = p
    tok = pre.tokenizer
    head, head_ids = pre.prompt_head(prompt) if prompt else (0, ())
    tail = prompt[head:]
    encoded = tok.encode_batch([tail + t for t in texts] if tail else texts) if texts else []
    check_cancel(cancel)

    # The most ids of an item's own that fit the context whole, with <bos>, the head's ids and <eos>.
    fits = pre.max_tokens - len(tok.prefix) - len(tok.suffix) - len(head_ids)
    flat: list[int] = []  # every fitting item's <bos> head ids <eos>, end to end
    ends: list[int] = []  # where each one's ends in `flat`
    fitting: list[int] = []
    for i, ids in zip(fast, encoded, strict=True):
        if len(ids) <= fits:
            flat += tok.prefix
            flat += head_ids
            flat += ids
            flat += tok.suffix
            ends.append(len(flat))
            fitting.append(i)
            continue
        try:  # over the context: the reference's truncation (or refusal), as `_finish` runs it
            input_ids, truncated = pre.expand_ids([*head_ids, *ids], {}, options)
            out[i] = Prepared(input_ids=input_ids, modality="text", text_truncated=truncated)
        except EG2Error as e:
            if raise_errors:
                raise
            out[i] = e
    # One conversion for the batch's ids; each item's tensor is a slice with a storage of its own
    # (torch.split's views would each pickle the whole batch's storage).
    array = np.fromiter(flat, np.int64, len(flat))
    start = 0
    for i, end in zip(fitting, ends, strict=True):
        out[i] = Prepared(torch.from_numpy(array[start:end]), "text")  # positional: the cheaper call
        start = end
    assert all(p is not None for p in out)
    return cast("list[Prepared | EG2Error]", out)
