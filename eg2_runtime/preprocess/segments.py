"""Where the spans of an item with segments lie: one rule for audio (in samples), video (in seconds)
and text (in tokens), used alike by the estimates and the decoders.

Spans of `size` units start every `step = size * (1 - overlap)` units from 0; each ends `size` later
or at the end, whichever comes first; the first span that reaches the end is the last (so a shorter
last span is never followed by one inside it):

    length 25, size 10, overlap 0      [0, 10) [10, 20) [20, 25)
    length 18, size 10, overlap 0.5    [0, 10) [5, 15) [10, 18)
"""

from __future__ import annotations

import math


def step_of(size: int, overlap: float) -> int:
    """Units between the starts of two spans (at least 1)."""
    return max(1, round(size * (1 - overlap)))


def spans(length: int, size: int, overlap: float) -> list[tuple[int, int]]:
    """The [start, end) spans over `length` units (one span, maybe empty, when length <= size)."""
    step = step_of(size, overlap)
    out = []
    start = 0
    while True:
        end = min(start + size, length)
        out.append((start, end))
        if end >= length:
            return out
        start += step


def count(length: int, size: int, overlap: float) -> int:
    """len(spans(length, size, overlap)), without listing them."""
    if length <= size:
        return 1
    return 1 + math.ceil((length - size) / step_of(size, overlap))


def covered(length: int, size: int, overlap: float) -> int:
    """The spans' lengths added up (units counted once per span that holds them)."""
    n = count(length, size, overlap)
    if n == 1:
        return length
    last = length - (n - 1) * step_of(size, overlap)
    return (n - 1) * size + last
