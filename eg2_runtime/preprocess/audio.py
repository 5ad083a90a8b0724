"""Audio: bytes -> 16 kHz mono float32 (at most 30 s) -> log-mel features and their frame mask.

Decoding: WAV / FLAC / OGG / AIFF through soundfile (libsndfile), MP3 / M4A / WebM (and what soundfile
cannot read) through PyAV, restricted to those demuxers. Channels are averaged to mono and the result
resampled with soxr (a band-limited polyphase resampler). The reference feature extractor does not
resample (it silently reads 44.1 kHz samples as 16 kHz ones), so the resampling is ours; the features
are then the reference's for that 16 kHz waveform. Only the first 30 s (plus a little filter margin) is
ever decoded, which bounds memory and time whatever a header claims.

Features: transformers' `Gemma4AudioFeatureExtractor` with the checkpoint's config: pad to a multiple
of 128 samples, prepend 160 zeros, 321-sample windows every 160 (first 320 used), periodic Hann in
float32, |rfft(512)|, HTK mel (128 bins, 0-8 kHz, no norm), log(mel + 0.001). A frame is valid when its
whole window lies in real audio; invalid frames are zeroed.
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from threading import Event
from typing import Any

import numpy as np
import soundfile as sf
import soxr
import torch

from eg2_runtime.errors import (
    Cancelled,
    InputTooLargeError,
    InputTooLongError,
    MediaDecodeError,
    check_cancel,
)
from eg2_runtime.inputs import MediaLimits
from eg2_runtime.preprocess import containers, segments
from eg2_runtime.preprocess.limits import reason

SAMPLE_RATE = 16_000
MAX_SAMPLES = 480_000  # 30 s: the feature extractor's max_length
MAX_SECONDS = MAX_SAMPLES / SAMPLE_RATE
# Decoded past 30 s so the resampler's filter has real signal at the cut; 0.25 s >> soxr's filter length.
_MARGIN_SECONDS = 0.25
DECODED_SECONDS = MAX_SECONDS + _MARGIN_SECONDS  # the most `load_audio` decodes of a file, by default
_SOUNDFILE_MAGIC = (b"RIFF", b"RF64", b"fLaC", b"OggS", b"FORM")
# PyAV demuxers we accept; anything else FFmpeg might guess from the bytes is refused.
_AV_FORMATS = {"mp3", containers.MP4, containers.MATROSKA, "ogg", "wav", "flac", "aac"}
_BLOCK = 65_536  # frames per soundfile read: channels are averaged per block to bound memory
# LogMel's fast path takes waves within this peak (integer PCM decodes to [-1, 1]); louder float
# waves take the reference path, where the two float32 FFTs' rounding noise would differ visibly.
FAST_MAX_AMPLITUDE = 1.0
_UNKNOWN_FRAMES = 2**62  # libsndfile reports SF_COUNT_MAX frames when a length is unknown


@dataclass(frozen=True)
class MelConfig:
    """The feature extractor's settings (preprocessor / processor config); defaults are the checkpoint's."""

    feature_size: int = 128
    sampling_rate: int = SAMPLE_RATE
    frame_length: int = 320  # 20 ms
    hop_length: int = 160  # 10 ms
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    mel_floor: float = 1e-3
    pad_to_multiple_of: int = 128
    per_bin_mean: tuple[float, ...] | None = None
    per_bin_stddev: tuple[float, ...] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MelConfig:
        """From a `feature_extractor` config dict; refuses settings this implementation does not do."""
        unsupported = {
            "preemphasis": d.get("preemphasis", 0.0) != 0.0,
            "dither": d.get("dither", 0.0) != 0.0,
            "fft_overdrive": bool(d.get("fft_overdrive", False)),
            "input_scale_factor": d.get("input_scale_factor", 1.0) != 1.0,
        }
        if bad := [k for k, v in unsupported.items() if v]:
            raise ValueError(f"audio feature extractor settings not supported: {bad}")
        rate = int(d.get("sampling_rate", SAMPLE_RATE))
        mean, std = d.get("per_bin_mean"), d.get("per_bin_stddev")
        size = int(d.get("feature_size", 128))
        if any(v is not None and len(v) != size for v in (mean, std)):
            raise ValueError(f"audio feature extractor: per_bin_mean and per_bin_stddev need {size} values")
        return cls(
            feature_size=size,
            sampling_rate=rate,
            frame_length=round(rate * d.get("frame_length_ms", 20.0) / 1000.0),
            hop_length=round(rate * d.get("hop_length_ms", 10.0) / 1000.0),
            min_frequency=float(d.get("min_frequency", 0.0)),
            max_frequency=float(d.get("max_frequency", 8000.0)),
            mel_floor=float(d.get("mel_floor", 1e-3)),
            per_bin_mean=tuple(mean) if mean is not None else None,
            per_bin_stddev=tuple(std) if std is not None else None,
        )

    @property
    def fft_length(self) -> int:
        return int(2 ** math.ceil(math.log2(self.frame_length)))  # 512


class LogMel:
    """Precomputed window and filter bank for one MelConfig; `__call__` is thread-safe (no state).

    `__call__` takes the fast path (`fast`, the default): torch's FFT and the filter bank in float32.
    `reference` is the reference extractor's own arithmetic, bit for bit (numpy's float32 FFT, the
    filter bank in float64). Why: numpy's FFT took most of a clip's preparation (dev machine: 7-10 of
    the 12 ms of a 9.3 s clip, against ~1 ms for torch's; `python -m benchmarks.probe_log_mel`).
    The cost: both FFTs round in float32, differently, so in bins far below a loud pure tone, where
    the spectrum is rounding noise near the mel floor, the log-mels differ by up to ~0.01; in
    broadband audio by ~2e-5. tests/preprocess/test_preprocess_audio.py bounds both and checks the
    clip's vector against the reference path's. That rounding noise grows with the signal, so a wave
    louder than FAST_MAX_AMPLITUDE (a float file holding, say, int16-scale values: at 32768 the bins
    differed by up to 4.5) takes the reference path; every integer PCM decodes within it."""

    fast = True

    def __init__(self, config: MelConfig) -> None:
        self.config = config
        n = config.frame_length
        # Periodic Hann, in float32 as the reference multiplies frames by it in float32.
        self.window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)).astype(np.float32)
        self.filters = mel_filter_bank(config)  # (fft_length // 2 + 1, feature_size) float64
        self._window = torch.from_numpy(self.window)
        self._filters = torch.from_numpy(self.filters).float()
        # float64, as the reference normalizes its float64 log-mels
        self._shift = (
            None if config.per_bin_mean is None else torch.tensor(config.per_bin_mean, dtype=torch.float64)
        )
        self._scale = (
            None
            if config.per_bin_stddev is None
            else torch.tensor(config.per_bin_stddev, dtype=torch.float64)
        )

    def __call__(self, wave: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(n,) float32 at 16 kHz, n <= max_samples -> features (F, 128) float32, mask (F,) bool."""
        loud = wave.size > 0 and float(np.abs(wave).max()) > FAST_MAX_AMPLITUDE
        return self._torch(wave) if self.fast and not loud else self.reference(wave)

    def _torch(self, wave: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        c = self.config
        x, mask = self._framed_signal(wave)
        if not len(mask):  # no whole frame: torch's FFT refuses an empty batch
            return np.zeros((0, c.feature_size), dtype=np.float32), mask
        # (F, frame_length) strided view: frame i starts at i * hop in the left-padded signal.
        frames = torch.from_numpy(x).as_strided((len(mask), c.frame_length), (c.hop_length, 1))
        spectrum = torch.fft.rfft(frames * self._window, n=c.fft_length, dim=-1).abs()  # (F, 257)
        log_mel = torch.log(spectrum @ self._filters + c.mel_floor)  # (F, 128) float32
        if self._shift is not None or self._scale is not None:
            log_mel = log_mel.double()
            if self._shift is not None:
                log_mel -= self._shift
            if self._scale is not None:
                log_mel /= self._scale
            log_mel = log_mel.float()
        features = log_mel.numpy()
        features[~mask] = 0.0
        return features, mask

    def reference(self, wave: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`__call__` with the reference extractor's arithmetic: numpy, the filter bank in float64."""
        c = self.config
        x, mask = self._framed_signal(wave)
        frames = np.lib.stride_tricks.as_strided(
            x, shape=(len(mask), c.frame_length), strides=(x.strides[0] * c.hop_length, x.strides[0])
        )
        spectrum = np.abs(np.fft.rfft(frames * self.window, n=c.fft_length, axis=-1))  # (F, 257)
        log_mel = np.log(spectrum @ self.filters + c.mel_floor)  # (F, 128) float64
        if c.per_bin_mean is not None:
            log_mel = log_mel - np.asarray(c.per_bin_mean)
        if c.per_bin_stddev is not None:
            log_mel = log_mel / np.asarray(c.per_bin_stddev)
        features = log_mel.astype(np.float32)
        features[~mask] = 0.0
        return features, mask

    def _framed_signal(self, wave: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(n,) -> the signal padded to a multiple of pad_to_multiple_of and shifted right by half a
        frame (semicausal: the first window is centred on t = 0), float32; and the frame mask."""
        c = self.config
        n = len(wave)
        padded_len = -(-n // c.pad_to_multiple_of) * c.pad_to_multiple_of
        left = c.frame_length // 2
        x = np.zeros(left + padded_len, dtype=np.float32)
        x[left : left + n] = wave
        return x, self.mask(n)

    def mask(self, n: int) -> np.ndarray:
        """(F,) bool for n samples at 16 kHz: which frames lie wholly in real audio (frame i's window
        ends at original sample i * hop + hop)."""
        c = self.config
        padded_len = -(-n // c.pad_to_multiple_of) * c.pad_to_multiple_of
        left = c.frame_length // 2
        size = c.frame_length + 1  # the reference unfolds 321 samples and drops the last (no preemphasis)
        num_frames = max((left + padded_len - size) // c.hop_length + 1, 0)
        return np.arange(num_frames) * c.hop_length + size - 1 - left < n

    def soft_tokens(self, seconds: float) -> int:
        """Soft tokens of `seconds` of audio (at most 30 s are kept), without the audio itself."""
        n = min(MAX_SAMPLES, round(seconds * self.config.sampling_rate))
        return num_soft_tokens(self.mask(n))


def mel_filter_bank(c: MelConfig) -> np.ndarray:
    """HTK triangular filters without normalization, as transformers' `mel_filter_bank(norm=None)`."""

    def hz_to_mel(f: Any) -> Any:
        return 2595.0 * np.log10(1.0 + f / 700.0)

    mel = np.linspace(hz_to_mel(c.min_frequency), hz_to_mel(c.max_frequency), c.feature_size + 2)
    edges = 700.0 * (np.power(10, mel / 2595.0) - 1.0)  # (feature_size + 2,) Hz
    fft_freqs = np.linspace(0, c.sampling_rate // 2, c.fft_length // 2 + 1)
    diff = np.diff(edges)
    slopes = edges[None, :] - fft_freqs[:, None]  # (bins, feature_size + 2)
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    return np.maximum(0.0, np.minimum(down, up))


def num_soft_tokens(mask: np.ndarray) -> int:
    """Audio soft tokens for one mask: two stride-2 convs (k=3, pad=1) halve it twice, as the reference."""
    for _ in range(2):
        mask = mask[::2][: (len(mask) + 2 - 3) // 2 + 1]
    return int(mask.sum())


def load_audio(
    data: bytes,
    *,
    truncate: bool = True,
    limits: MediaLimits | None = None,
    sample_rate: int = SAMPLE_RATE,
    max_samples: int = MAX_SAMPLES,
    cancel: Event | None = None,
) -> tuple[np.ndarray, bool]:
    """Decode, downmix, resample to `sample_rate` and cut at `max_samples`. `cancel` is checked per
    decoded block (raises Cancelled once set).

    Returns ((n,) float32, cut) where `cut` says the source was longer than the limit. With truncate off
    a longer source raises InputTooLongError instead.
    """
    limits = limits or MediaLimits.unbounded()
    max_seconds = max_samples / sample_rate
    mono, rate = _decode(data, max_seconds + _MARGIN_SECONDS, limits, cancel)
    if not np.isfinite(mono).all():
        raise MediaDecodeError("audio contains NaN or infinite samples", param="input")
    too_long = len(mono) > max_seconds * rate
    if too_long and not truncate:
        raise InputTooLongError(
            f"audio is longer than {max_seconds:g} s; send truncate=true to use its first {max_seconds:g} s",
            param="input",
        )
    if rate != sample_rate:
        mono = soxr.resample(mono, rate, sample_rate, quality="HQ").astype(np.float32, copy=False)
    if len(mono) == 0:
        raise MediaDecodeError("audio has no samples", param="input")
    return np.ascontiguousarray(mono[:max_samples]), too_long


@dataclass
class Clip:
    """A stretch of an item's decoded 16 kHz signal: one of its spans, or the item itself."""

    wave: np.ndarray  # (n,) float32 at 16 kHz
    start: int  # in samples of the whole signal
    end: int
    whole: bool = False  # the item as without segments: its first 30 s
    cut: bool = False  # whole only: the signal runs on past 30 s


def stream_clips(
    data: bytes,
    *,
    seconds: float,
    overlap: float,
    limits: MediaLimits,
    cancel: Event | None = None,
) -> Iterator[Clip]:
    """Decode the whole file once, and give each span of `seconds` (preprocess/segments.py, over the
    16 kHz samples) as soon as it is decoded, then the item itself (its first 30 s, as `load_audio`
    gives it). Memory: one span and the first 30 s, whatever the file's length. Past
    `limits.max_segment_audio_seconds`, or the segment limits' decode cost (MediaLimits.for_segments):
    InputTooLargeError.
    """
    size = round(seconds * SAMPLE_RATE)
    step = segments.step_of(size, overlap)
    head: list[np.ndarray] = []
    head_n = 0
    pending: list[np.ndarray] = []  # samples [kept, received) not yet cut, block by block
    kept = received = start = 0  # `start`: the next span's first sample
    last_end = -1
    for block in _stream_16k(data, limits.for_segments(), cancel):
        if head_n < MAX_SAMPLES:
            head.append(block[: MAX_SAMPLES - head_n])
            head_n += len(head[-1])
        pending.append(block)
        received += len(block)
        while received >= start + size:
            signal = np.concatenate(pending)  # once per span: blocks may be a few hundred samples
            yield Clip(signal[start - kept : start - kept + size].copy(), start, start + size)
            last_end, start = start + size, start + step
            pending, kept = [signal[start - kept :]], start
    if received == 0:
        raise MediaDecodeError("audio has no samples", param="input")
    if last_end < received:  # the shorter last span
        signal = np.concatenate(pending)
        yield Clip(signal[start - kept : received - kept].copy(), start, received)
    whole = np.ascontiguousarray(np.concatenate(head))
    yield Clip(whole, 0, len(whole), whole=True, cut=received > MAX_SAMPLES)


def _stream_16k(data: bytes, limits: MediaLimits, cancel: Event | None) -> Iterator[np.ndarray]:
    """The decoded signal as 16 kHz mono float32 blocks, resampled as it streams (soxr keeps its
    filter state between blocks), at most `max_segment_audio_seconds` of it."""
    limit = limits.max_segment_audio_seconds
    resampler: Any = None
    got = 0
    for rate, block in _blocks(data, limit + 1.0, limits, cancel):
        if not np.isfinite(block).all():
            raise MediaDecodeError("audio contains NaN or infinite samples", param="input")
        got += len(block)
        if got > limit * rate:
            raise InputTooLargeError(
                f"audio is longer than {limit:g} s, this server's limit for audio with segments "
                "(max_segment_audio_seconds)",
                param="input",
            )
        if rate != SAMPLE_RATE:
            if resampler is None:
                resampler = soxr.ResampleStream(rate, SAMPLE_RATE, 1, dtype="float32", quality="HQ")
            block = resampler.resample_chunk(block)
        yield block
    if resampler is not None:
        yield resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True)


@dataclass(frozen=True)
class Header:
    """What an audio file declares before anything is decoded; None where it declares nothing."""

    seconds: float | None = None
    rate: int | None = None  # Hz
    channels: int | None = None


def probe(data: bytes) -> Header:
    """The file's declared duration, rate and channels, from its header alone (nothing decoded); an
    empty Header when the header cannot be read (the decoder then has the last word on the file)."""
    try:
        if data[:4] in _SOUNDFILE_MAGIC:
            with contextlib.suppress(Exception):
                info = sf.info(io.BytesIO(data))
                if 0 < info.frames < _UNKNOWN_FRAMES and info.samplerate > 0:
                    return Header(
                        float(info.frames / info.samplerate), int(info.samplerate), int(info.channels)
                    )
        with containers.open_container(data, _AV_FORMATS, "audio", "audio") as c:
            stream = next((s for s in c.streams if s.type == "audio"), None)
            if stream is None:
                return Header()
            codec = stream.codec_context
            return Header(
                containers.declared_seconds(c, stream),
                int(codec.sample_rate or 0) or None,
                codec.channels or None,
            )
    except Exception:
        return Header()


def check_decode_cost(header: Header, limits: MediaLimits, *, segments: bool = False) -> None:
    """Refuse audio whose header proves that decoding it would produce more samples than the limit:
    channels x rate x the seconds decoded (its first 30 s, under max_audio_decode_samples; with
    `segments` all of it, under max_segment_audio_decode_samples). Decode time follows that product,
    not the duration alone: 30 s of 8 channels at 384 kHz is 192 times the work of 30 s of 16 kHz
    mono. A header that declares no length proves nothing; the decoder counts the samples as it goes
    (`_count_decoded`)."""
    if header.seconds is None or header.rate is None or header.channels is None:
        return
    seconds = header.seconds if segments else min(header.seconds, DECODED_SECONDS)
    setting = "max_segment_audio_decode_samples" if segments else "max_audio_decode_samples"
    most: int = getattr(limits, setting)
    samples = math.ceil(seconds * header.rate) * header.channels
    if samples > most:
        raise InputTooLargeError(
            f"audio is too costly to decode: {seconds:.2f} s of {header.channels} channels at "
            f"{header.rate} Hz = {samples:,} samples, more than this server's limit of {most:,} ({setting})",
            param="input",
        )


def _count_decoded(decoded: int, frames: int, channels: int, limits: MediaLimits) -> int:
    """The samples decoded so far with a block of `frames` x `channels` more, refused past
    `limits.max_audio_decode_samples`: `check_decode_cost` judged the header, which may declare no
    length, or a false one."""
    decoded += frames * channels
    if decoded > limits.max_audio_decode_samples:
        raise InputTooLargeError(
            f"audio is too costly to decode: its samples (channels x frames) exceed "
            f"{limits.max_audio_decode_samples:,}",
            param="input",
        )
    return decoded


def _decode(
    data: bytes, max_seconds: float, limits: MediaLimits, cancel: Event | None
) -> tuple[np.ndarray, int]:
    """Mono float32 samples at the source rate, at most `max_seconds` of them, and that rate."""
    rate, chunks = 0, []
    for block_rate, block in _blocks(data, max_seconds, limits, cancel):
        rate = block_rate
        chunks.append(block)
    if not chunks:
        raise MediaDecodeError("audio has no samples", param="input")
    return np.concatenate(chunks), rate


def _blocks(
    data: bytes, max_seconds: float, limits: MediaLimits, cancel: Event | None
) -> Iterator[tuple[int, np.ndarray]]:
    """(source rate, (n,) float32 mono block), in order, at most `max_seconds` in all (inf: all of it)."""
    if data[:4] in _SOUNDFILE_MAGIC:
        blocks = _blocks_soundfile(data, max_seconds, limits, cancel)
        try:
            first = next(blocks, None)
        except MediaDecodeError:
            if data[:4] != b"OggS":
                raise
            # An Ogg codec libsndfile lacks: PyAV reads Ogg too.
        else:
            if first is not None:
                yield first
                yield from blocks
            return
    yield from _blocks_av(data, max_seconds, limits, cancel)


def _budget(max_seconds: float, rate: int) -> int:
    return math.ceil(max_seconds * rate) if math.isfinite(max_seconds) else sys.maxsize


def _check_format(rate: int, channels: int, limits: MediaLimits) -> None:
    if not limits.min_audio_rate <= rate <= limits.max_audio_rate:
        raise MediaDecodeError(
            f"unsupported audio sample rate {rate} Hz: must be within "
            f"{limits.min_audio_rate}-{limits.max_audio_rate} Hz",
            param="input",
        )
    if not 1 <= channels <= limits.max_audio_channels:
        raise MediaDecodeError(
            f"unsupported audio channel count {channels}: must be within 1-{limits.max_audio_channels}",
            param="input",
        )


def _blocks_soundfile(
    data: bytes, max_seconds: float, limits: MediaLimits, cancel: Event | None
) -> Iterator[tuple[int, np.ndarray]]:
    _check_wav_length(data)
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            rate, channels, declared = int(f.samplerate), int(f.channels), int(f.frames)
            _check_format(rate, channels, limits)
            budget = _budget(max_seconds, rate)
            got = decoded = 0
            # Read in blocks, never `frames` at once: the header's frame count is not trusted.
            while got < budget:
                check_cancel(cancel)
                block = f.read(min(_BLOCK, budget - got), dtype="float32", always_2d=True)  # (n, channels)
                if len(block) == 0:
                    break
                got += len(block)
                decoded = _count_decoded(decoded, len(block), channels, limits)
                yield rate, block.mean(axis=1, dtype=np.float32) if channels > 1 else block[:, 0]
            if got < min(declared, budget) and declared < _UNKNOWN_FRAMES:
                # FLAC's STREAMINFO (and the like) promised more frames than the data holds.
                raise MediaDecodeError(
                    f"audio file is truncated: {declared} frames declared, {got} found", param="input"
                )
    except (MediaDecodeError, InputTooLargeError, Cancelled):
        raise
    except sf.LibsndfileError as e:
        raise MediaDecodeError(f"could not decode audio: {e.error_string}", param="input") from e
    except MemoryError as e:
        raise InputTooLargeError("audio is too large to decode", param="input") from e
    except Exception as e:
        raise MediaDecodeError(f"could not decode audio: {reason(e)}", param="input") from e


# WAV data-chunk sizes that mean "length unknown" (written by streaming encoders), not a promise.
_WAV_UNKNOWN_SIZE = (0, 0xFFFF_FFFF)
_WAV_UNKNOWN_FROM = 0x7FFF_F000  # SoX and others write ~2^31 when they cannot seek back


def _check_wav_length(data: bytes) -> None:
    """Refuse a RIFF/WAVE whose data chunk promises more bytes than the file holds.

    libsndfile silently reads what is there; a size that is neither an "unknown" marker nor true means
    the file was cut (or the header forged), and embedding a fraction of it would be a silent error.
    """
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return
    pos = 12
    while pos + 8 <= len(data):
        chunk, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
        if chunk == b"data":
            held = len(data) - pos - 8
            if size > held and size not in _WAV_UNKNOWN_SIZE and size < _WAV_UNKNOWN_FROM:
                raise MediaDecodeError(
                    f"WAV file is truncated: its header declares {size} bytes of samples, the file holds {held}",
                    param="input",
                )
            return
        pos += 8 + size + (size & 1)  # chunks are word-aligned


# Sample formats PyAV hands out -> scale to [-1, 1] floats.
_AV_SCALE = {"u8": 1 / 128, "s16": 1 / 32768, "s32": 1 / 2**31, "s64": 1 / 2**63, "flt": 1.0, "dbl": 1.0}


def _blocks_av(
    data: bytes, max_seconds: float, limits: MediaLimits, cancel: Event | None
) -> Iterator[tuple[int, np.ndarray]]:
    try:
        with containers.open_container(
            data, _AV_FORMATS, "audio", "a WAV, FLAC, OGG, MP3, M4A or WebM file"
        ) as c:
            stream = next((s for s in c.streams if s.type == "audio"), None)
            if stream is None:
                raise MediaDecodeError("could not decode audio: the file has no audio stream", param="input")
            rate = 0
            got, budget, decoded = 0, 0, 0
            exact = c.format.name in containers.EXACT_DURATION
            declared = containers.declared_seconds(c, stream) if exact else None
            frame: Any
            for frame in c.decode(stream):
                check_cancel(cancel)
                if rate == 0:
                    rate = int(frame.sample_rate)
                    _check_format(rate, frame.layout.nb_channels, limits)
                    budget = _budget(max_seconds, rate)
                elif frame.sample_rate != rate:
                    raise MediaDecodeError(
                        "could not decode audio: the sample rate changes mid-stream", param="input"
                    )
                mono = _av_mono(frame, limits)
                got += len(mono)
                decoded = _count_decoded(decoded, len(mono), frame.layout.nb_channels, limits)
                yield rate, mono
                if got >= budget:
                    break
    except (MediaDecodeError, InputTooLargeError, Cancelled):
        raise
    except MemoryError as e:
        raise InputTooLargeError("audio is too large to decode", param="input") from e
    except Exception as e:  # av.error.* (InvalidDataError, ...), and ValueError for odd layouts
        raise MediaDecodeError(f"could not decode audio: {reason(e)}", param="input") from e
    if rate == 0:
        raise MediaDecodeError("could not decode audio: no audio frames", param="input")
    if declared is not None:
        expected = min(declared, max_seconds)
        if got / rate < 0.9 * expected - 0.1:
            raise MediaDecodeError(
                f"audio file is truncated: {declared:.1f} s declared, {got / rate:.1f} s decoded",
                param="input",
            )


def _av_mono(frame: Any, limits: MediaLimits) -> np.ndarray:
    """One decoded PyAV audio frame -> (samples,) float32 mono."""
    channels = frame.layout.nb_channels
    if not 1 <= channels <= limits.max_audio_channels:
        raise MediaDecodeError(f"unsupported audio channel count {channels}", param="input")
    name = frame.format.name
    base = name.rstrip("p")
    if base not in _AV_SCALE:
        raise MediaDecodeError(f"could not decode audio: sample format {name}", param="input")
    x = frame.to_ndarray()  # planar: (channels, n); packed: (1, n * channels)
    x = x.reshape(channels, -1) if frame.format.is_planar else x.reshape(-1, channels).T
    x = x.astype(np.float32)
    if base == "u8":
        x -= 128.0
    if _AV_SCALE[base] != 1.0:
        x *= _AV_SCALE[base]
    mono: np.ndarray = x.mean(axis=0, dtype=np.float32) if channels > 1 else x[0]
    return mono
