"""Images: bytes -> upright RGB uint8 -> the reference's aspect-preserving resize -> padded patches.

Matches transformers' `Gemma4ImageProcessor` (torchvision backend) fed a PIL image that was opened and
EXIF-transposed: the same target size, the same kernel (on CPU torchvision's resize of a uint8 tensor
*is* `F.interpolate(uint8, mode="bicubic", antialias=True)`, native uint8, so the result is bit-exact),
the same `(py, px, c)` patch flattening, positions `(x = column, y = row)` and padding (zero patches at
position `(-1, -1)`). Pixels come out as `uint8 * (1/255)` in [0, 1]; the model does its own 2(p - 0.5).

Decoding assumes untrusted bytes: only the formats the API lists are opened, the pixel count is checked
from the header before the pixels are decoded, and any decoder failure becomes a `MediaDecodeError`.
Video frames reuse `resize_uint8` and `patchify` with their own (smaller) budget.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from eg2_runtime.errors import InputTooLargeError, MediaDecodeError
from eg2_runtime.preprocess.limits import reason
from eg2_runtime.vision import RESCALE as RESCALE  # re-exported: the model rescales the codes
from eg2_runtime.vision import unit_pixels as unit_pixels

Image.init()  # register every plugin now: open(formats=...) looks the names up before it would
# Pillow plugin names, in sniffing order (MPO, the phones' multi-picture JPEG, where Pillow has it as
# its own plugin). Anything else (EPS would run Ghostscript, PSD, ICO, ...) is refused unopened.
FORMATS = tuple(f for f in ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF") if f in Image.OPEN)
# A progressive JPEG's scans each pass over the whole image, and nothing in the format bounds their
# number: a 1.3 MB file of one 6000x6000 scan repeated 20,000 times kept a core busy for minutes in one
# Pillow call, which no cancel flag can stop. libjpeg's default progression has 10 scans (6 for grey)
# and hand-written scan scripts a few dozen.
MAX_JPEG_SCANS = 100


@dataclass(frozen=True)
class PatchGeometry:
    """How images become patches: from the vision config and the processor config."""

    patch_size: int = 16
    pooling_kernel_size: int = 3

    @property
    def side_multiple(self) -> int:
        return self.patch_size * self.pooling_kernel_size  # 48: sides are whole pooling blocks

    def max_patches(self, budget: int) -> int:
        return budget * self.pooling_kernel_size**2  # 280 soft tokens -> 2520 patches


@dataclass
class PatchedImages:
    pixel_values: (
        torch.Tensor
    )  # (N, max_patches, p*p*3) uint8 codes (`unit_pixels`), zero rows after the real ones
    position_ids: torch.Tensor  # (N, max_patches, 2) int64 (x, y); (-1, -1) for padding
    num_soft_tokens: int  # per image: real patches / pooling_kernel_size^2


def decode_image(data: bytes, *, max_pixels: int) -> np.ndarray:
    """Decode an image to (H, W, 3) uint8 RGB (writable), upright (EXIF orientation applied), alpha on
    white.

    The first frame of animated GIF/WebP/TIFF. Raises InputTooLargeError past `max_pixels` (checked from
    the header, before decoding) and MediaDecodeError for anything undecodable.
    """
    try:
        im = Image.open(io.BytesIO(data), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        # Pillow's own header check (89 MP) can fire inside open(), before ours; warnings are errors in tests.
        raise InputTooLargeError(f"image is too large: more than {max_pixels} pixels", param="input") from e
    except UnidentifiedImageError as e:
        raise MediaDecodeError(
            "could not decode image: not a PNG, JPEG, WebP, GIF, BMP or TIFF file", param="input"
        ) from e
    except Exception as e:  # a malformed header can raise nearly anything from a plugin
        raise MediaDecodeError(f"could not decode image: {reason(e)}", param="input") from e
    with im:
        width, height = im.size
        if width <= 0 or height <= 0:
            raise MediaDecodeError(f"could not decode image: empty size {width}x{height}", param="input")
        if width * height > max_pixels:
            raise InputTooLargeError(
                f"image is too large: {width}x{height} = {width * height} pixels, the limit is {max_pixels}",
                param="input",
            )
        # Start-of-scan markers: entropy-coded data stuffs every 0xFF it holds, so only a marker (or an
        # embedded thumbnail's) reads FF DA.
        if im.format in ("JPEG", "MPO") and (scans := data.count(b"\xff\xda")) > MAX_JPEG_SCANS:
            raise InputTooLargeError(
                f"image has too many scans to decode: {scans} JPEG scans, the limit is {MAX_JPEG_SCANS}",
                param="input",
            )
        try:
            ImageOps.exif_transpose(im, in_place=True)  # loads the pixels; no copy when upright
            return _to_rgb(im)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise InputTooLargeError(
                f"image is too large: more than {max_pixels} pixels", param="input"
            ) from e
        except MemoryError as e:
            raise InputTooLargeError("image is too large to decode", param="input") from e
        except Exception as e:
            raise MediaDecodeError(f"could not decode image: {reason(e)}", param="input") from e


def probe_tokens(data: bytes, budget: int, geometry: PatchGeometry, max_pixels: int) -> int:
    """Soft tokens this image will take, from its header alone (nothing decoded).

    Raises InputTooLargeError past `max_pixels`, as decode_image would. A header that cannot be read
    counts as the whole budget: the decoder has the last word on the file. EXIF orientation is not
    read (for PNG, Pillow would decode the image to find it): a quarter turn swaps height and width,
    which gives the same patch count.
    """
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as im:
            width, height = im.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise InputTooLargeError(f"image is too large: more than {max_pixels} pixels", param="input") from e
    except Exception:
        return budget
    if width <= 0 or height <= 0:
        return budget
    if width * height > max_pixels:
        raise InputTooLargeError(
            f"image is too large: {width}x{height} = {width * height} pixels, the limit is {max_pixels}",
            param="input",
        )
    return soft_tokens(height, width, budget, geometry)


def soft_tokens(height: int, width: int, budget: int, geometry: PatchGeometry) -> int:
    """Soft tokens of an image of this size resized for `budget` (what `prepare_image` gives it)."""
    th, tw = target_size(height, width, budget, geometry)
    p = geometry.patch_size
    return (th // p) * (tw // p) // geometry.pooling_kernel_size**2


def _to_rgb(im: Image.Image) -> np.ndarray:
    """(H, W, 3) uint8, the way transformers' `convert_to_rgb` does it for PIL images, 16-bit fixed.

    Converted in strips of rows into one array: every conversion here works pixel by pixel, and a whole
    40 MP image converted at once held two more full copies (Pillow's bytes and numpy's array, +400 MB
    peak with its 160 MB RGBX decode) where a strip holds ~8 MB.
    """
    width, height = im.size
    out = np.empty((height, width, 3), dtype=np.uint8)
    rows = max(1, _STRIP_BYTES // (16 * width))  # 16: the widest pixel met on the way (RGBA as int64)

    def strips() -> Iterator[tuple[int, Image.Image]]:  # one at a time: together they are a full copy
        for y in range(0, height, rows):
            yield y, im.crop((0, y, width, min(height, y + rows)))

    scale = 1.0
    if im.mode == "F":  # a float image holds [0, 1] or [0, 255]: decided on the whole image
        top = max(float(_finite(np.asarray(strip, dtype=np.float32)).max()) for _, strip in strips())
        scale = 255.0 if top <= 1.0 else 1.0
    for y, strip in strips():
        out[y : y + rows] = _rgb_rows(strip, scale)
    return out


def _finite(f: np.ndarray) -> np.ndarray:
    return np.nan_to_num(f, nan=0.0, posinf=255.0, neginf=0.0)


_STRIP_BYTES = 8 << 20


def _rgb_rows(im: Image.Image, float_scale: float) -> np.ndarray:
    """One strip of `_to_rgb`. Transparency is composited on white. Pillow's own I;16 -> RGB conversion
    clips (a 16-bit grayscale PNG turns white); we keep the high byte instead, which is what an 8-bit
    export of that file holds."""
    if im.mode.startswith("I;16") or im.mode == "I":
        gray = np.asarray(im).astype(np.int64)
        gray = (np.clip(gray, 0, 65535) >> 8).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if im.mode == "F":
        f = _finite(np.asarray(im, dtype=np.float32))
        gray = np.clip(np.rint(f * float_scale), 0, 255).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))
    return np.asarray(im if im.mode == "RGB" else im.convert("RGB"))


def target_size(height: int, width: int, budget: int, geometry: PatchGeometry) -> tuple[int, int]:
    """The reference's `get_aspect_ratio_preserving_size`: largest multiples of 48 within budget x 9 patches.

    Upscales small images too. A side that would round to 0 becomes one block (48) and the other side is
    capped at budget blocks, so extreme aspect ratios stay within the budget.
    """
    p, k = geometry.patch_size, geometry.pooling_kernel_size
    max_patches = geometry.max_patches(budget)
    target_px = max_patches * p * p
    factor = math.sqrt(target_px / (height * width))
    side = geometry.side_multiple
    th = math.floor(factor * height / side) * side
    tw = math.floor(factor * width / side) * side
    max_side = (max_patches // k**2) * side
    if th == 0:
        th, tw = side, min(math.floor(width / height) * side, max_side)
    elif tw == 0:
        th, tw = min(math.floor(height / width) * side, max_side), side
    return th, tw


def channels_last(pixels: np.ndarray) -> torch.Tensor:
    """(H, W, 3) or (N, H, W, 3) uint8 -> (N, 3, H, W), a channels-last view of the same memory.

    What `resize_uint8` is fast on, and answers in kind. The batch dimension is added by torch, before
    the permute: numpy's `[None]` and a `[None]` after the permute both leave the batch a stride (0 or
    3) by which torch takes the input for contiguous NCHW, and the resize then converts on the way in
    and back out (docs/PERF.md has what that cost).
    """
    x = torch.from_numpy(pixels)
    return (x[None] if x.dim() == 3 else x).permute(0, 3, 1, 2)


def resize_uint8(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(N, 3, H, W) uint8 -> (N, 3, h, w) uint8, antialiased bicubic; identity when the size already fits.

    torchvision's `resize` on a CPU uint8 tensor calls exactly this (native uint8 AA kernel, rounded and
    clamped inside), so the reference's pixels are reproduced bit for bit. The reference passes
    contiguous NCHW; a channels-last view of (N, H, W, 3) pixels gives the same bytes (the kernel
    works channels-last inside; tests compare against the reference) without the transpose, 2-5x faster,
    and its output is channels-last too, which `patchify` reads in one pass (`channels_last`).
    """
    if tuple(frames.shape[-2:]) == size:
        return frames
    return torch.nn.functional.interpolate(
        frames, size=list(size), mode="bicubic", align_corners=False, antialias=True
    )


def patchify(frames: torch.Tensor, max_patches: int, geometry: PatchGeometry) -> PatchedImages:
    """(N, 3, H, W) uint8, H and W multiples of 48 -> padded (py, px, c)-flattened uint8 patches.

    numpy, single-threaded on purpose: requests are prepared on many threads at once, and torch's
    intra-op threads on top of those only contend for the same cores. The one copy reads runs of
    p x C contiguous bytes from channels-last frames (what `resize_uint8` gives a `channels_last`
    view); from NCHW frames it gathers byte by byte.
    """
    p = geometry.patch_size
    n, c, h, w = frames.shape
    ph, pw = h // p, w // p
    real = ph * pw
    if real > max_patches:
        raise ValueError(f"{h}x{w} gives {real} patches, more than {max_patches}")
    # (N, C, ph, py, pw, px) -> (N, ph, pw, py, px, C): patch-major, then row, column, channel inside a
    # patch. Written straight into the output through a 6-D view of its real rows: one pass.
    src = frames.numpy().reshape(n, c, ph, p, pw, p).transpose(0, 2, 4, 3, 5, 1)
    pixel_values = np.zeros((n, max_patches, p * p * c), dtype=np.uint8)  # calloc: padding rows stay 0
    pixel_values[:, :real].reshape(n, ph, pw, p, p, c)[...] = src
    positions = np.full((n, max_patches, 2), -1, dtype=np.int64)
    idx = np.arange(real)
    positions[:, :real, 0] = idx % pw  # x = column
    positions[:, :real, 1] = idx // pw  # y = row
    return PatchedImages(
        torch.from_numpy(pixel_values), torch.from_numpy(positions), real // geometry.pooling_kernel_size**2
    )


def prepare_image(rgb: np.ndarray, budget: int, geometry: PatchGeometry) -> PatchedImages:
    """(H, W, 3) uint8 (writable) -> one image's padded patches for a soft-token budget (70 ... 1120)."""
    frames = channels_last(rgb)  # (1, 3, H, W)
    size = target_size(rgb.shape[0], rgb.shape[1], budget, geometry)
    return patchify(resize_uint8(frames, size), geometry.max_patches(budget), geometry)
