"""Domain errors of the runtime. The service maps each class to one HTTP status in one table
(app/errors.py); the runtime itself knows nothing of HTTP.

Every message is safe to show a client: it names the problem, never a path or a stack.
"""

from __future__ import annotations

from threading import Event


class EG2Error(Exception):
    """Base of every error the runtime raises on purpose."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InputError(EG2Error):
    """The client's input is unusable: malformed, undecodable, or not allowed."""


class MediaDecodeError(InputError):
    """A media payload could not be decoded (corrupt, truncated, unsupported format)."""


class InputTooLargeError(InputError):
    """Over a size limit: bytes, pixels, duration, frames, or number of items."""


class InputTooLongError(InputError):
    """Text over the token limit or audio over 30 s, with truncation turned off."""


class ModalityNotLoadedError(InputError):
    """The input needs a tower this engine did not load (e.g. an image on a text-only engine)."""


class EngineError(EG2Error):
    """The engine failed on a well-formed batch. Retrying later may succeed."""


class EngineOutOfMemory(EngineError):
    """The accelerator ran out of memory on this batch; a smaller batch may fit."""


class CheckpointError(EG2Error):
    """A checkpoint is missing, corrupt, or does not match the architecture."""


class Cancelled(Exception):
    """The caller's cancel flag was set while its items were being prepared: nobody waits for the work.

    Not an EG2Error on purpose: it aborts the whole `prepare_many` call instead of landing in one
    item's slot.
    """


def check_cancel(cancel: Event | None) -> None:
    """Raise Cancelled when `cancel` is set (decoders call it per frame / per block)."""
    if cancel is not None and cancel.is_set():
        raise Cancelled
