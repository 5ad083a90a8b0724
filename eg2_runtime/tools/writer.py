"""A streaming safetensors writer: the header is laid out from known names, dtypes and shapes, then
tensors are written one at a time, so a 1.5 GB checkpoint never sits whole in host memory.

The file is byte-compatible with `safetensors.torch.save_file` readers (8-byte little-endian header
length, JSON header padded with spaces to 8 bytes, tensors in header order).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

import torch

DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int32: "I32",
               torch.int64: "I64", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}  # fmt: skip


class SafetensorsWriter:
    def __init__(
        self,
        path: Path,
        layout: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = path
        self.order = list(layout)
        self.layout = layout
        header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for name in self.order:
            dtype, shape = layout[name]
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": DTYPE_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.fh = path.open("wb")
        self.fh.write(struct.pack("<Q", len(blob)) + blob)
        self.next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        _, shape = self.layout.get(name, (None, ()))
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{name}: got shape {list(tensor.shape)}, layout says {list(shape)}")
        self.write_parts(name, [tensor])

    def write_parts(self, name: str, parts: Iterable[torch.Tensor]) -> None:
        """Write one tensor given as consecutive row blocks (so a large one is never whole in memory)."""
        if self.next >= len(self.order) or name != self.order[self.next]:
            expected = self.order[self.next] if self.next < len(self.order) else "nothing"
            raise ValueError(f"tensors must be written in layout order: got {name}, expected {expected}")
        dtype, shape = self.layout[name]
        written = 0
        for part in parts:
            if part.dtype != dtype:
                raise ValueError(f"{name}: got {part.dtype}, layout says {dtype}")
            # Raw little-endian bytes; a uint8 view works for bf16, which numpy lacks.
            self.fh.write(part.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
            written += part.numel()
        if written != math.prod(shape):
            raise ValueError(f"{name}: wrote {written} elements, layout says {math.prod(shape)}")
        self.next += 1

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.fh.close()
        if exc_type is None and self.next != len(self.order):
            self.path.unlink()
            raise ValueError(f"only {self.next} of {len(self.order)} tensors were written")
