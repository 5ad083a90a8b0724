"""Test media synthesised in code: images, audio and video files as bytes, plus hostile variants.

Everything is generated with numpy, Pillow, soundfile and PyAV (nothing downloaded), deterministic from
a seed, and small enough to make per test. Hostile files are built byte by byte where a library would
refuse to write them (a PNG header claiming 100k x 100k, a WAV whose header lies about its length).
"""

from __future__ import annotations

import io
import struct
import zlib
from fractions import Fraction

import av
import numpy as np
import soundfile as sf
from PIL import Image

# ---------------------------------------------------------------------------------------------- images


def picture(height: int, width: int, seed: int = 0, channels: int = 3) -> np.ndarray:
    """(H, W, C) uint8: smooth gradients plus noise, so both resizing and compression have work to do."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :, None]
    phase = rng.uniform(0, 2 * np.pi, size=(1, 1, channels)).astype(np.float32)
    base = 127.5 + 100 * np.sin(6 * x + 4 * y + phase)
    noise = rng.normal(0, 20, size=(height, width, channels)).astype(np.float32)
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def encode_image(array: np.ndarray, fmt: str, mode: str | None = None, **save: object) -> bytes:
    """An array (H, W) or (H, W, C) -> file bytes through Pillow, optionally converted to `mode` first."""
    im = Image.fromarray(array)
    if mode is not None:
        im = im.convert(mode)
    buf = io.BytesIO()
    im.save(buf, format=fmt, **save)
    return buf.getvalue()


def png16_gray(gray8: np.ndarray) -> bytes:
    """A 16-bit grayscale PNG whose high bytes are `gray8` (H, W) uint8 (Pillow opens it as I;16)."""
    return encode_image((gray8.astype(np.uint16) * 257), "PNG")


def png16_rgb(rgb8: np.ndarray) -> bytes:
    """A 48-bit RGB PNG (16 bits per channel) whose high bytes are `rgb8`; Pillow cannot write these."""
    h, w, _ = rgb8.shape
    wide = (rgb8.astype(np.uint16) * 257).astype(">u2")
    raw = b"".join(b"\x00" + wide[y].tobytes() for y in range(h))
    return _png(w, h, bit_depth=16, color_type=2, idat=zlib.compress(raw))


def cmyk_jpeg(rgb: np.ndarray) -> bytes:
    return encode_image(rgb, "JPEG", mode="CMYK", quality=95)


def exif_rotated_jpeg(rgb: np.ndarray, orientation: int) -> bytes:
    """A JPEG of `rgb` as stored, with an EXIF orientation tag (6 = rotate 90 CW to display)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode_image(rgb, "JPEG", quality=95, exif=exif.tobytes())


def palette_png(rgb: np.ndarray, transparent_index: int | None = None) -> bytes:
    im = Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    buf = io.BytesIO()
    if transparent_index is None:
        im.save(buf, format="PNG")
    else:
        im.save(buf, format="PNG", transparency=transparent_index)
    return buf.getvalue()


def with_alpha(rgb: np.ndarray, seed: int = 1) -> np.ndarray:
    """(H, W, 4) uint8: `rgb` with a random alpha channel (fully transparent to opaque)."""
    alpha = np.random.default_rng(seed).integers(0, 256, size=rgb.shape[:2], dtype=np.uint8)
    return np.dstack([rgb, alpha])


def rgba_png(rgb: np.ndarray, seed: int = 1) -> bytes:
    return encode_image(with_alpha(rgb, seed), "PNG")


def gif_animated(frames: list[np.ndarray]) -> bytes:
    ims = [Image.fromarray(f).convert("P", palette=Image.Palette.ADAPTIVE) for f in frames]
    buf = io.BytesIO()
    ims[0].save(buf, format="GIF", save_all=True, append_images=ims[1:], duration=100, loop=0)
    return buf.getvalue()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png(width: int, height: int, *, bit_depth: int, color_type: int, idat: bytes) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims width x height RGB pixels and holds a few bytes of pixel data."""
    return _png(width, height, bit_depth=8, color_type=2, idat=zlib.compress(b"\x00" * 64))


def png_bomb(width: int = 20_000, height: int = 20_000) -> bytes:
    """A small 1-bit PNG (~50 KB for 20k x 20k) that inflates to width x height pixels of zeros."""
    row = b"\x00" * (1 + (width + 7) // 8)  # filter byte + packed bits
    z = zlib.compressobj(9)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    return _png(width, height, bit_depth=1, color_type=0, idat=idat)


# ----------------------------------------------------------------------------------------------- audio


def sine(seconds: float, rate: int, freq: float = 440.0, channels: int = 1, amp: float = 0.5) -> np.ndarray:
    """(n, channels) float32; channel c is `freq * (c + 1)` Hz so a downmix is not a plain copy."""
    t = np.arange(round(seconds * rate), dtype=np.float64) / rate
    cols = [amp * np.sin(2 * np.pi * freq * (c + 1) * t) for c in range(channels)]
    return np.stack(cols, axis=1).astype(np.float32)


def noise(seconds: float, rate: int, channels: int = 1, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.2 * rng.standard_normal((round(seconds * rate), channels))).astype(np.float32)


def encode_audio(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    """(n, channels) float32 -> wav / flac / ogg (soundfile) or mp3 / m4a / webm (PyAV) bytes."""
    if fmt in ("wav", "flac", "ogg"):
        buf = io.BytesIO()
        subtype = {"wav": "PCM_16", "flac": "PCM_16", "ogg": "VORBIS"}[fmt]
        sf.write(buf, samples, rate, format=fmt.upper(), subtype=subtype)
        return _ogg_fixed_serial(buf.getvalue()) if fmt == "ogg" else buf.getvalue()
    container, codec = {"mp3": ("mp3", "libmp3lame"), "m4a": ("ipod", "aac"), "webm": ("webm", "libopus")}[
        fmt
    ]
    if codec == "libopus" and rate not in (8000, 12000, 16000, 24000, 48000):
        raise ValueError("opus needs 8/12/16/24/48 kHz")
    channels = samples.shape[1]
    layout = "mono" if channels == 1 else "stereo"
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        planar = np.ascontiguousarray(samples.T)  # (channels, n)
        step = 1152
        for i in range(0, planar.shape[1], step):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(planar[:, i : i + step]), "fltp", layout)
            frame.sample_rate = rate
            frame.pts = i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def _ogg_crc(page: bytes) -> int:
    crc = 0
    for byte in page:  # CRC-32, polynomial 0x04C11DB7, unreflected, initial 0 (the Ogg spec's)
        crc ^= byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7 if crc & 0x8000_0000 else crc << 1) & 0xFFFF_FFFF
    return crc


def _ogg_fixed_serial(data: bytes, serial: int = 0x5EED) -> bytes:
    """libsndfile picks a random Ogg stream serial: pin it (and redo each page's CRC) so that the same
    samples always give the same bytes (the fuzz test wants reproducible seeds)."""
    out, pos = bytearray(), 0
    while pos + 27 <= len(data) and data[pos : pos + 4] == b"OggS":
        segments = data[pos + 26]
        size = 27 + segments + sum(data[pos + 27 : pos + 27 + segments])
        page = bytearray(data[pos : pos + size])
        page[14:18] = struct.pack("<I", serial)
        page[22:26] = b"\x00\x00\x00\x00"
        page[22:26] = struct.pack("<I", _ogg_crc(bytes(page)))
        out += page
        pos += size
    return bytes(out + data[pos:])


def wav_float(samples: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def wav_lying_length(samples: np.ndarray, rate: int, claimed_bytes: int = 0x7FFF_FF00) -> bytes:
    """A 16-bit WAV whose RIFF and data chunk sizes claim ~2 GB while the file holds `samples`."""
    data = encode_audio(samples, rate, "wav")
    i = data.find(b"data")
    data = data[: i + 4] + struct.pack("<I", claimed_bytes) + data[i + 8 :]
    return data[:4] + struct.pack("<I", claimed_bytes) + data[8:]


def silent_flac(seconds: int, rate: int, channels: int) -> bytes:
    """`seconds` of 16-bit silence as FLAC, written a second at a time: 31 s of 8 channels at 384 kHz is
    ~100 KB of file and 93 million samples to decode (as one float32 array it would take 381 MB here)."""
    buf = io.BytesIO()
    second = np.zeros((rate, channels), dtype=np.int16)
    with sf.SoundFile(buf, "w", samplerate=rate, channels=channels, format="FLAC", subtype="PCM_16") as f:
        for _ in range(seconds):
            f.write(second)
    return buf.getvalue()


def wav_header(rate: int, channels: int, bits: int = 16, data_bytes: int = 1024) -> bytes:
    """A plain PCM WAV header with arbitrary (possibly absurd) rate / channel fields, zeros after."""
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * block, block, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", data_bytes)
    return b"RIFF" + struct.pack("<I", len(body) + data_bytes) + body + b"\x00" * data_bytes


# ----------------------------------------------------------------------------------------------- video

VIDEO_CODECS = {"mp4": ("mp4", "libx264"), "mov": ("mov", "libx264"), "mkv": ("matroska", "libx264")}
VIDEO_CODECS["webm"] = ("webm", "libvpx")


def video_frame(index: int, height: int, width: int) -> np.ndarray:
    """(H, W, 3) uint8 frame whose content says its index: a moving bar over a per-index flat colour."""
    frame = np.empty((height, width, 3), dtype=np.uint8)
    frame[:] = ((index * 37) % 256, (index * 91) % 256, (index * 13) % 256)
    x = (index * 4) % max(width - 8, 1)
    frame[:, x : x + 8] = 255
    return frame


def encode_video(
    seconds: float, fps: int | Fraction = 10, size: tuple[int, int] = (96, 128), fmt: str = "mp4"
) -> bytes:
    """A `seconds` long clip at `fps`, (height, width) = size, as mp4 / mov / mkv (H.264) or webm (VP8)."""
    container, codec = VIDEO_CODECS[fmt]
    height, width = size
    rate = Fraction(fps)
    n = round(seconds * rate)
    buf = io.BytesIO()
    with av.open(buf, "w", format=container, options={"fflags": "+bitexact"}) as out:  # no random UIDs
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if codec == "libx264":
            stream.options = {"preset": "ultrafast", "crf": "18"}
        for i in range(n):
            frame = av.VideoFrame.from_ndarray(video_frame(i, height, width), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def growing_video(
    frames: int, declared: tuple[int, int] = (16, 16), size: tuple[int, int] = (240, 320)
) -> bytes:
    """An H.264 MP4 at 1 fps whose header declares (height, width) = `declared` and whose frames
    after the first are `size`: each IDR carries its own parameters (x264's repeat-headers), so a
    decoder follows the stream, not the header."""
    rate = Fraction(1)

    def packets(shape: tuple[int, int], n: int, first: int) -> list[av.Packet]:
        encoder = av.CodecContext.create("libx264", "w")
        encoder.height, encoder.width = shape
        encoder.pix_fmt, encoder.time_base = "yuv420p", 1 / rate
        encoder.options = {"x264-params": "repeat-headers=1", "bf": "0"}
        out: list[av.Packet] = []
        for i in range(first, first + n):
            frame = av.VideoFrame.from_ndarray(video_frame(i, *shape), format="rgb24")
            frame.pts, frame.time_base = i, 1 / rate
            out += encoder.encode(frame)
        return out + encoder.encode(None)

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4", options={"fflags": "+bitexact"}) as out:
        stream = out.add_stream("h264", rate=rate)
        stream.height, stream.width = declared
        stream.pix_fmt, stream.time_base = "yuv420p", 1 / rate
        for k, packet in enumerate(packets(declared, 1, 0) + packets(size, frames - 1, 1)):
            packet.stream, packet.pts, packet.dts, packet.time_base = stream, k, k, 1 / rate
            out.mux(packet)
    return buf.getvalue()


def all_frames(data: bytes) -> tuple[np.ndarray, float]:
    """Every frame of a clip as (T, H, W, 3) uint8 RGB in decode order, and its average frame rate."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        return np.stack(frames), float(stream.average_rate)


def jpeg_scan_bomb(rgb: np.ndarray, repeats: int) -> bytes:
    """A progressive JPEG whose last scan is repeated `repeats` more times: each pass over the whole
    image again, with nothing in the format to bound how many there are."""
    data = encode_image(rgb, "JPEG", progressive=True)
    last, end = data.rfind(b"\xff\xda"), data.rfind(b"\xff\xd9")
    return data[:end] + data[last:end] * repeats + data[end:]


def png_text_bomb(rgb: np.ndarray, inflated_bytes: int = 20 << 20) -> bytes:
    """A valid PNG carrying a zTXt chunk that inflates to `inflated_bytes` (~20 KB on disk)."""
    png = encode_image(rgb, "PNG")
    z = b"Comment\x00\x00" + zlib.compress(b"\x00" * inflated_bytes, 9)
    end = png.rfind(b"IEND") - 4  # before the IEND chunk's length field
    return png[:end] + _chunk(b"zTXt", z) + png[end:]


def mp4_declaring_frames(data: bytes, frames: int) -> bytes:
    """An MP4 whose time-to-sample table (stts, one entry) claims `frames` samples."""
    at = data.find(b"stts")
    if at < 0 or struct.unpack(">I", data[at + 8 : at + 12])[0] != 1:
        raise ValueError("expected a one-entry stts box")
    return data[: at + 12] + struct.pack(">I", frames) + data[at + 16 :]


def mkv_declaring_seconds(data: bytes, seconds: float) -> bytes:
    """A Matroska file whose Segment Info Duration (8-byte float, in ms) claims `seconds`."""
    at = data.find(b"\x44\x89\x88")
    if at < 0:
        raise ValueError("no 8-byte Duration element")
    return data[: at + 3] + struct.pack(">d", seconds * 1000) + data[at + 11 :]


def garbage_after_magic(data: bytes, keep: int = 16, seed: int = 0) -> bytes:
    """The first `keep` bytes (the magic, so the right decoder is picked), then random bytes."""
    return data[:keep] + np.random.default_rng(seed).bytes(max(len(data) - keep, 64))


def moving_texture_clip(frames: int, size: tuple[int, int], fps: int = 30, seed: int = 0) -> bytes:
    """An H.264 MP4 of a blocky texture sliding 4 px per frame, one keyframe: cheap to encode and small,
    while every frame still costs the decoder motion compensation over the whole picture."""
    height, width = size
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 4, (height // 120 + 1, width // 120 + 1), dtype=np.uint8) * 60
    texture = np.repeat(blocks.repeat(120, 0).repeat(120, 1)[:height, :width, None], 3, axis=2)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4", options={"fflags": "+bitexact"}) as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "45", "g": str(frames)}
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.roll(texture, 4 * i, axis=1), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def repeated_clip(data: bytes, times: int) -> bytes:
    """The clip's packets muxed `times` times in a row (timestamps shifted, nothing re-encoded): a long
    clip for the price of encoding a short one. Each copy starts on a keyframe, so it decodes."""
    with av.open(io.BytesIO(data)) as src:
        stream = src.streams.video[0]
        packets = [p for p in src.demux(stream) if p.size]
        span = max(p.pts + p.duration for p in packets) - min(p.pts for p in packets)
        buf = io.BytesIO()
        with av.open(buf, "w", format="mp4", options={"fflags": "+bitexact"}) as out:
            copy = out.add_stream_from_template(stream)
            for k in range(times):
                for p in packets:
                    q = av.Packet(bytes(p))
                    q.pts, q.dts, q.duration = p.pts + k * span, p.dts + k * span, p.duration
                    q.is_keyframe, q.time_base, q.stream = p.is_keyframe, p.time_base, copy
                    out.mux(q)
    return buf.getvalue()
