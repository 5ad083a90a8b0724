"""Decoder errors as short client-safe reasons. The limits themselves are `eg2_runtime.inputs.MediaLimits`
(values from the service's Settings)."""

from __future__ import annotations

# Exception types whose message describes the data (Pillow uses SyntaxError for bad headers); anything
# else out of a decoder (AttributeError, KeyError, ...) is a library tripping on garbage, not news.
_DESCRIPTIVE = (OSError, ValueError, EOFError, SyntaxError, RuntimeError)


def reason(e: BaseException) -> str:
    """A decoder exception as a short client-safe reason: never a traceback, a path or a repr."""
    strerror = getattr(e, "strerror", None)  # PyAV / OSError: the message without errno and file name
    if isinstance(strerror, str) and strerror:
        return strerror[:200]
    text = str(e).strip()
    if not isinstance(e, _DESCRIPTIVE) or not text:
        return "corrupt or unsupported data"
    return text.splitlines()[0][:200]
