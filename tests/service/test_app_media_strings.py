"""MediaResolver.items' fast path for a request of plain strings against `items_by_part`, the
reference that resolves every request part by part: the same Items (segments included), the same
refusals; requests with any part or message take the reference."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from app.media import MediaResolver
from app.schemas import EmbeddingRequest
from app.settings import Settings
from eg2_runtime.errors import EG2Error, InputTooLargeError
from eg2_runtime.inputs import Item, TextPart

STRINGS: list[Any] = [
    "a query",
    "",
    ["one", "", " ", "naïve café 😀 中文", "<|image|> is the client's text here", "x" * 40_000],
    [f"doc {i}" for i in range(64)],
]
MIXED: list[Any] = [
    ["a string", {"type": "text", "text": "a text part"}],
    [{"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, "c"],
]


def resolve(resolver: MediaResolver, body: dict[str, Any], reference: bool = False) -> list[Item] | EG2Error:
    request = EmbeddingRequest.model_validate(body)
    try:
        return asyncio.run(resolver.items_by_part(request) if reference else resolver.items(request))
    except EG2Error as e:
        return e


@pytest.mark.parametrize("segments", [None, {"tokens": 64, "overlap": 0.25}])
@pytest.mark.parametrize("value", STRINGS + MIXED, ids=lambda v: repr(v)[:24])
def test_the_items_equal_the_reference(value: Any, segments: dict[str, Any] | None) -> None:
    resolver = MediaResolver(Settings(), frozenset({"text"}))
    body = {"input": value, **({"segments": segments} if segments else {})}
    got, want = resolve(resolver, body), resolve(resolver, body, reference=True)
    assert isinstance(got, list) and got == want
    assert all(type(p) is TextPart for item in got for p in item.parts)
    if isinstance(value, str):
        assert got[0].segments is not None or segments is None


def test_messages_take_the_reference() -> None:
    resolver = MediaResolver(Settings(), frozenset({"text"}))
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "there"}]}
    assert (
        resolve(resolver, body)
        == resolve(resolver, body, reference=True)
        == [Item((TextPart("hi"), TextPart("there")))]
    )


def test_strings_skip_the_part_by_part_work(monkeypatch: pytest.MonkeyPatch) -> None:
    resolver = MediaResolver(Settings(), frozenset({"text"}))

    def refuse(*args: object) -> None:
        raise AssertionError("the fast path resolved a part by part")

    monkeypatch.setattr(resolver, "items_by_part", refuse)
    assert resolve(resolver, {"input": STRINGS[3]}) == [Item((TextPart(s),)) for s in STRINGS[3]]


@pytest.mark.parametrize("limit", ["max_item_parts", "max_request_media"])
def test_limits_outside_the_settings_bounds_still_refuse_as_the_reference(limit: str) -> None:
    """Settings hold both limits at 1 or more; a resolver given others still refuses what the reference
    refuses (413 for one part over a limit of 0), rather than assume the bounds."""
    settings = Settings().model_copy(update={limit: 0 if limit == "max_item_parts" else -1})
    resolver = MediaResolver(settings, frozenset({"text"}))
    got, want = resolve(resolver, {"input": ["a"]}), resolve(resolver, {"input": ["a"]}, reference=True)
    assert isinstance(want, InputTooLargeError)
    assert type(got) is type(want) and str(got) == str(want)
