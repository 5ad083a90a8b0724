"""Images against transformers' Gemma4ImageProcessor (torchvision backend, constructed with its defaults).

The reference is fed what a user of sentence-transformers hands it: the file opened with Pillow and
EXIF-transposed. Its pixels must be within 1/255 of ours (they are bit-equal: same uint8 kernel) and
its positions and soft-token counts equal.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from eg2_runtime.preprocess import image as image_module
from eg2_runtime.preprocess.image import (
    PatchGeometry,
    channels_last,
    decode_image,
    patchify,
    prepare_image,
    resize_uint8,
    target_size,
    unit_pixels,
)
from tests.support import media

GEOMETRY = PatchGeometry()
MAX_PIXELS = 40_000_000


def reference(pil: Image.Image, budget: int = 280) -> dict[str, torch.Tensor]:
    from transformers.models.gemma4.image_processing_gemma4 import Gemma4ImageProcessor

    return Gemma4ImageProcessor(max_soft_tokens=budget)(pil, return_tensors="pt")


def ours(data: bytes, budget: int = 280) -> tuple[torch.Tensor, torch.Tensor, int]:
    patched = prepare_image(decode_image(data, max_pixels=MAX_PIXELS), budget, GEOMETRY)
    assert patched.pixel_values.dtype == torch.uint8  # codes until the model runs
    return unit_pixels(patched.pixel_values), patched.position_ids, patched.num_soft_tokens


def assert_matches(data: bytes, pil: Image.Image | None = None, budget: int = 280) -> None:
    """Our preprocessing of `data` equals the reference's of `pil` (default: the file, EXIF-transposed)."""
    if pil is None:
        pil = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    ref = reference(pil, budget)
    pixels, positions, n = ours(data, budget)
    assert pixels.shape == ref["pixel_values"].shape == (1, budget * 9, 768)
    diff = (pixels - ref["pixel_values"]).abs().max().item()
    assert diff <= 1 / 255, f"max |diff| {diff} > 1/255"
    assert torch.equal(positions, ref["image_position_ids"])
    assert n == int(ref["num_soft_tokens_per_image"][0])


def test_target_size_equals_reference_everywhere() -> None:
    from transformers.models.gemma4.image_processing_gemma4 import get_aspect_ratio_preserving_size

    rng = np.random.default_rng(0)
    sizes = [(1, 1), (3, 3), (1, 100_000), (100_000, 1), (2000, 10), (10, 2000), (4000, 3000), (47, 49)]
    sizes += [tuple(int(v) for v in rng.integers(1, 6000, 2)) for _ in range(300)]
    for budget in (70, 140, 280, 560, 1120):
        for h, w in sizes:
            want = get_aspect_ratio_preserving_size(
                h, w, patch_size=16, max_patches=budget * 9, pooling_kernel_size=3
            )
            got = target_size(h, w, budget, GEOMETRY)
            assert got == want, (h, w, budget)
            assert got[0] % 48 == 0 and got[1] % 48 == 0 and got[0] * got[1] <= budget * 9 * 256


@pytest.mark.parametrize(
    ("height", "width"),
    [(1, 1), (3, 3), (480, 640), (768, 768), (2000, 10), (10, 2000), (333, 4001)],
    ids=lambda v: str(v),
)
def test_sizes_and_aspect_ratios(height: int, width: int) -> None:
    assert_matches(media.encode_image(media.picture(height, width), "PNG"))


@pytest.mark.slow
def test_huge_photo() -> None:
    """12 MP JPEG: a large antialiasing support, the decoder's largest buffers."""
    data = media.encode_image(media.picture(3000, 4000), "JPEG", quality=85)
    assert_matches(data)
    assert_matches(data, budget=1120)


@pytest.mark.parametrize("budget", [70, 140, 280, 560, 1120])
def test_budgets(budget: int) -> None:
    assert_matches(media.encode_image(media.picture(300, 500, seed=2), "JPEG", quality=90), budget=budget)


FILES = {
    "png_rgb": lambda a: media.encode_image(a, "PNG"),
    "png_gray": lambda a: media.encode_image(a[:, :, 0], "PNG"),
    "png_rgba": lambda a: media.rgba_png(a),
    "png_gray_alpha": lambda a: media.encode_image(np.dstack([a[:, :, 0], a[:, :, 1]]), "PNG", mode="LA"),
    "png_palette": lambda a: media.palette_png(a),
    "png_palette_transparent": lambda a: media.palette_png(a, transparent_index=3),
    "png_1bit": lambda a: media.encode_image(a, "PNG", mode="1"),
    "jpeg": lambda a: media.encode_image(a, "JPEG", quality=90),
    "jpeg_gray": lambda a: media.encode_image(a[:, :, 0], "JPEG", quality=90),
    "jpeg_cmyk": lambda a: media.cmyk_jpeg(a),
    "webp_lossy": lambda a: media.encode_image(a, "WEBP", quality=80),
    "webp_lossless_rgba": lambda a: media.encode_image(media.with_alpha(a), "WEBP", lossless=True),
    "gif_animated": lambda a: media.gif_animated([a, 255 - a, a // 2]),
    "bmp": lambda a: media.encode_image(a, "BMP"),
    "tiff": lambda a: media.encode_image(a, "TIFF"),
    "tiff_lzw": lambda a: media.encode_image(a, "TIFF", compression="tiff_lzw"),
}


@pytest.mark.parametrize("kind", list(FILES))
def test_formats_and_modes(kind: str) -> None:
    assert_matches(FILES[kind](media.picture(90, 130, seed=5)))


def test_alpha_is_composited_on_white() -> None:
    rgb = media.picture(40, 40)
    transparent = np.dstack([rgb, np.zeros((40, 40), np.uint8)])
    assert (decode_image(media.encode_image(transparent, "PNG"), max_pixels=MAX_PIXELS) == 255).all()


def test_gif_first_frame() -> None:
    a = media.picture(32, 32)
    data = media.gif_animated([np.zeros_like(a), np.full_like(a, 255)])
    assert decode_image(data, max_pixels=MAX_PIXELS).max() == 0


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_is_applied(orientation: int) -> None:
    stored = media.picture(60, 100)  # stored landscape
    data = media.exif_rotated_jpeg(stored, orientation)
    rgb = decode_image(data, max_pixels=MAX_PIXELS)
    assert rgb.shape == ((60, 100, 3) if orientation == 3 else (100, 60, 3))
    upright = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    assert np.array_equal(rgb, upright)
    assert_matches(data)


def test_png16_gray_keeps_the_high_byte() -> None:
    """Pillow opens a 16-bit grayscale PNG as I;16, and its I;16 -> RGB conversion clips: fed the raw
    file, the reference sees a nearly white image. We keep the high byte, i.e. the 8-bit picture; the
    reference given that 8-bit picture agrees with us."""
    gray8 = media.picture(70, 50)[:, :, 0]
    data = media.png16_gray(gray8)
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    rgb = decode_image(data, max_pixels=MAX_PIXELS)
    assert np.array_equal(rgb, np.repeat(gray8[:, :, None], 3, axis=2))
    assert_matches(data, pil=Image.fromarray(gray8))
    clipped = reference(Image.open(io.BytesIO(data)))["pixel_values"][0, :100]  # its own reading
    assert clipped.mean() > 0.95 > 0.7 > ours(data)[0][0, :100].mean()  # the quirk we do not copy


def test_png48_rgb() -> None:
    rgb8 = media.picture(40, 30, seed=9)
    data = media.png16_rgb(rgb8)
    assert np.array_equal(decode_image(data, max_pixels=MAX_PIXELS), rgb8)
    assert_matches(data)


def test_pixel_limit_is_a_parameter() -> None:
    data = media.encode_image(media.picture(100, 100), "PNG")
    assert decode_image(data, max_pixels=10_000).shape == (100, 100, 3)
    from eg2_runtime.errors import InputTooLargeError

    with pytest.raises(InputTooLargeError, match="100x100"):
        decode_image(data, max_pixels=9_999)


def test_padding_and_positions() -> None:
    pixels, positions, n = ours(media.encode_image(media.picture(96, 144), "PNG"), budget=70)
    # 96x144 -> 288x480: 18 x 30 patches, 60 soft tokens, 630 - 540 = 90 padding rows
    real = 18 * 30
    assert n == real // 9 == 60
    assert positions[0, :3].tolist() == [[0, 0], [1, 0], [2, 0]]
    assert positions[0, 30].tolist() == [0, 1] and positions[0, real - 1].tolist() == [29, 17]
    assert (positions[0, real:] == -1).all() and (pixels[0, real:] == 0).all()
    assert pixels.dtype == torch.float32 and pixels.min() >= 0 and pixels.max() <= 1
    levels = pixels[0, :real] * 255
    assert torch.allclose(levels, levels.round(), atol=1e-3)  # uint8 levels / 255: nothing in between


@pytest.mark.parametrize("frames", [1, 3])
def test_the_resize_stays_channels_last_and_patchify_reads_either_layout(frames: int) -> None:
    """The view the resize is given is the caller's memory, and the resize answers channels-last (it
    converts neither way); patchify gives the same patches from NCHW frames."""
    pixels = np.random.default_rng(frames).integers(0, 256, (frames, 100, 130, 3), dtype=np.uint8)
    view = channels_last(pixels[0] if frames == 1 else pixels)  # one image comes as (H, W, 3)
    assert view.shape == (frames, 3, 100, 130) and view.data_ptr() == pixels.ctypes.data
    resized = resize_uint8(view, (96, 144))
    assert resized.is_contiguous(memory_format=torch.channels_last) and not resized.is_contiguous()
    fast = patchify(resized, GEOMETRY.max_patches(70), GEOMETRY)
    slow = patchify(resized.contiguous(), GEOMETRY.max_patches(70), GEOMETRY)
    assert torch.equal(fast.pixel_values, slow.pixel_values) and torch.equal(
        fast.position_ids, slow.position_ids
    )
    assert fast.pixel_values[0, 0].tolist() == resized[0, :, :16, :16].permute(1, 2, 0).flatten().tolist()


def test_prepare_image_resizes_channels_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare_image hands the resize a view it answers channels-last: the fast path above, taken."""
    answers: list[torch.Tensor] = []

    def resize(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        answers.append(out := resize_uint8(frames, size))
        return out

    monkeypatch.setattr(image_module, "resize_uint8", resize)
    prepare_image(
        decode_image(media.encode_image(media.picture(479, 641), "PNG"), max_pixels=MAX_PIXELS), 280, GEOMETRY
    )
    assert len(answers) == 1
    assert answers[0].is_contiguous(memory_format=torch.channels_last) and not answers[0].is_contiguous()


def test_unit_pixels_is_the_float32_rescale() -> None:
    """Codes scaled on any device equal the processor's float32(x) * float32(1/255), every code."""
    codes = np.arange(256, dtype=np.uint8)
    want = torch.from_numpy(codes * np.float32(1 / 255))
    assert want.dtype == torch.float32
    assert torch.equal(unit_pixels(torch.from_numpy(codes)), want)


STRIP_CASES = {
    "rgb-png": lambda rgb: media.encode_image(rgb, "PNG"),
    "rgba-png": media.rgba_png,
    "palette-transparent": lambda rgb: media.palette_png(rgb, transparent_index=3),
    "gray16": lambda rgb: media.png16_gray(rgb[:, :, 0]),
    "cmyk-jpeg": media.cmyk_jpeg,
    "float-tiff": lambda rgb: media.encode_image(rgb[:, :, 0].astype(np.float32) / 255, "TIFF"),
    "float-tiff-255": lambda rgb: media.encode_image(rgb[:, :, 1].astype(np.float32), "TIFF"),
}


@pytest.mark.parametrize("case", list(STRIP_CASES))
def test_rgb_in_strips_equals_rgb_at_once(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Conversion to RGB runs in strips of rows; strips of one row give the pixels of one strip."""
    data = STRIP_CASES[case](media.picture(37, 53))
    whole = decode_image(data, max_pixels=MAX_PIXELS)
    monkeypatch.setattr("eg2_runtime.preprocess.image._STRIP_BYTES", 1)
    np.testing.assert_array_equal(decode_image(data, max_pixels=MAX_PIXELS), whole)


def test_a_large_image_is_not_copied_whole_while_converted() -> None:
    """A 20 MP PNG: numpy and Python hold the RGB result plus a strip (before: Pillow's bytes and a
    numpy copy, two full images, +240 MB for this one)."""
    import tracemalloc

    rgb = np.zeros((4000, 5000, 3), dtype=np.uint8)
    rgb[::3, ::5] = 200
    data = media.encode_image(rgb, "PNG")
    tracemalloc.start()
    try:
        out = decode_image(data, max_pixels=MAX_PIXELS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(out, rgb)
    assert peak < 1.25 * rgb.nbytes, f"peak {peak / 1e6:.0f} MB traced for a {rgb.nbytes / 1e6:.0f} MB image"
