"""Audio: decoding, resampling and log-mel features against transformers' Gemma4AudioFeatureExtractor.

The reference feature extractor takes 16 kHz samples and never resamples, so it is fed the waveform we
decoded and resampled: LogMel's reference path must equal it bit for bit, its fast path within 1e-4
wherever the spectrum has energy, with the same mask. The resampling itself is
proved separately against the analytic signal (a sine keeps its frequency and its samples).
"""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest

from eg2_runtime import samples
from eg2_runtime.errors import Cancelled, InputTooLongError, MediaDecodeError
from eg2_runtime.preprocess.audio import (
    FAST_MAX_AMPLITUDE,
    MAX_SAMPLES,
    LogMel,
    MelConfig,
    load_audio,
    num_soft_tokens,
)
from tests.support import media
from tests.support.log_mel import ENERGETIC, assert_log_mel_close

LOG_MEL = LogMel(MelConfig())


def reference(wave: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Features and mask of the reference extractor (default args) for one 16 kHz waveform."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    out = Gemma4AudioFeatureExtractor()([wave], return_tensors="np")  # a list: a bare 1-D array breaks it
    return out["input_features"][0], out["input_features_mask"][0]


def assert_features_match(wave: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The reference path equals the extractor bit for bit; the fast path (what serves) equals it
    within 1e-4 in every bin with energy, and within 0.05 where the spectrum is float32 rounding
    noise near the mel floor (LogMel's docstring)."""
    features, mask = LOG_MEL(wave)
    ref_features, ref_mask = reference(wave)
    assert features.shape == ref_features.shape and features.dtype == np.float32
    assert np.array_equal(mask, ref_mask)
    assert np.array_equal(LOG_MEL.reference(wave)[0], ref_features)
    assert_log_mel_close(features, ref_features)
    return features, mask


def test_filter_bank_and_window_equal_reference() -> None:
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    ref = Gemma4AudioFeatureExtractor()
    assert np.array_equal(LOG_MEL.filters, ref.mel_filters)
    assert np.array_equal(LOG_MEL.window, ref.window)


@pytest.mark.parametrize("n", [160, 161, 1600, 8000, 12_345, 16_000, 16_001, 480_000])
def test_features_equal_reference(n: int) -> None:
    wave = media.noise(n / 16_000, 16_000)[:, 0]
    features, mask = assert_features_match(wave)
    assert mask.sum() == max((n - 161) // 160 + 1, 0)  # frames whose whole window is real audio
    assert (features[~mask] == 0).all()


def _chirp(seconds: float, amplitude: float = 0.9) -> np.ndarray:
    t = np.arange(int(seconds * 16_000)) / 16_000
    return (amplitude * np.sin(2 * np.pi * (100 + 2000 * t) * t)).astype(np.float32)


def test_the_reference_path_is_the_reference_extractor_bit_for_bit() -> None:
    for wave in (media.noise(2.0, 16_000)[:, 0], _chirp(3.0)):
        features, mask = LOG_MEL.reference(wave)
        ref_features, ref_mask = reference(wave)
        assert np.array_equal(mask, ref_mask) and np.array_equal(features, ref_features)


@pytest.mark.parametrize("n", [0, 100, 160, 161, 1600, 12_345, 148_800, 480_000])
def test_the_fast_path_equals_the_reference_path_on_broadband_audio(n: int) -> None:
    wave = media.noise(n / 16_000, 16_000)[:, 0]
    features, mask = LOG_MEL(wave)
    ref_features, ref_mask = LOG_MEL.reference(wave)
    assert features.shape == ref_features.shape and features.dtype == np.float32
    assert np.array_equal(mask, ref_mask) and (features[~mask] == 0).all()
    if features.size:
        assert np.abs(features - ref_features).max() <= 1e-4


@pytest.mark.parametrize(
    "wave", [_chirp(9.3), _chirp(9.3, 1e-3), samples.tone(9.3)], ids=["loud", "quiet", "tone"]
)
def test_the_fast_path_differs_only_where_the_spectrum_is_rounding_noise(wave: np.ndarray) -> None:
    """A pure tone leaves most bins near the mel floor, where both paths' float32 FFTs give rounding
    noise: there they may differ (by < 0.05 in log units); in every bin with energy they agree."""
    features, _ = LOG_MEL(wave)
    ref_features, _ = LOG_MEL.reference(wave)
    assert (ref_features > ENERGETIC).any()
    assert_log_mel_close(features, ref_features)


def test_a_wave_louder_than_pcm_takes_the_reference_path() -> None:
    """A float file may hold int16-scale values; there the two FFTs' rounding noise differs by whole
    log units, so such a wave is featurized by the reference arithmetic itself."""
    loud = _chirp(3.0, 32768.0)
    assert np.array_equal(LOG_MEL(loud)[0], LOG_MEL.reference(loud)[0])
    at_full_scale = _chirp(3.0, FAST_MAX_AMPLITUDE)
    assert not np.array_equal(LOG_MEL(at_full_scale)[0], LOG_MEL.reference(at_full_scale)[0])


def test_per_bin_normalization_matches_the_reference_path() -> None:
    rng = np.random.default_rng(0)
    mean, std = rng.normal(-4, 1, 128), rng.uniform(0.5, 2.0, 128)
    log_mel = LogMel(MelConfig.from_dict({"per_bin_mean": list(mean), "per_bin_stddev": list(std)}))
    wave = media.noise(2.0, 16_000)[:, 0]
    features, _ = log_mel(wave)
    ref_features, _ = log_mel.reference(wave)
    assert not np.array_equal(features, LOG_MEL(wave)[0])  # normalized
    assert np.abs(features - ref_features).max() <= 1e-4
    with pytest.raises(ValueError, match="128 values"):
        MelConfig.from_dict({"per_bin_mean": [0.0] * 127})


@pytest.mark.parametrize("n", [1600, 16_000, 160_000, 480_000])
def test_soft_token_count_equals_reference(n: int) -> None:
    """25 per second: what the processor puts between <|audio> and <audio|>."""
    from transformers.models.embedding_gemma2.processing_embedding_gemma2 import EmbeddingGemma2Processor

    _, mask = LOG_MEL(np.zeros(n, np.float32))
    assert num_soft_tokens(mask) == EmbeddingGemma2Processor.compute_sscp(mask)
    assert num_soft_tokens(mask) == {1600: 3, 16_000: 25, 160_000: 250, 480_000: 750}[n]


def dominant_frequency(wave: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(wave * np.hanning(len(wave))))
    return float(np.argmax(spectrum) * rate / len(wave))


def test_stereo_44k_is_downmixed_and_resampled() -> None:
    """Channels 1 kHz and 2 kHz at 44.1 kHz -> their mean at 16 kHz, sample for sample."""
    source = media.sine(2.0, 44_100, freq=1000.0, channels=2)
    wave, cut = load_audio(media.encode_audio(source, 44_100, "wav"))
    assert not cut and wave.dtype == np.float32 and len(wave) == 32_000
    t = np.arange(len(wave)) / 16_000
    truth = 0.25 * (np.sin(2 * np.pi * 1000 * t) + np.sin(2 * np.pi * 2000 * t))
    inner = slice(800, -800)  # away from the edges, where the resampler's filter sees silence
    assert np.abs(wave[inner] - truth[inner]).max() < 2e-3  # PCM16 quantization + filter ripple
    assert_features_match(wave)
    # Misreading 44.1 kHz samples as 16 kHz (what the reference alone would do) moves the tone.
    assert abs(dominant_frequency(source[:16_000, 0], 16_000) - 1000 * 16_000 / 44_100) < 5


def test_8k_mono_is_upsampled() -> None:
    wave, _ = load_audio(media.encode_audio(media.sine(1.0, 8_000, freq=440.0), 8_000, "flac"))
    assert len(wave) == 16_000
    assert abs(dominant_frequency(wave, 16_000) - 440) < 2
    spectrum = np.abs(np.fft.rfft(wave))
    assert spectrum[4100:].max() < 1e-3 * spectrum.max()  # nothing imaged above the old Nyquist
    assert_features_match(wave)


def test_31s_is_cut_to_30s() -> None:
    data = media.encode_audio(media.noise(31.0, 16_000), 16_000, "flac")
    wave, cut = load_audio(data)
    assert cut and len(wave) == MAX_SAMPLES
    features, mask = assert_features_match(wave)
    assert features.shape == (2999, 128) and num_soft_tokens(mask) == 750
    with pytest.raises(InputTooLongError) as e:
        load_audio(data, truncate=False)
    assert "30 s" in e.value.message


def test_31s_at_44k_cut_after_resampling_matches_full() -> None:
    """The first 30 s decode (with a margin) resamples like the whole file would."""
    import soundfile as sf
    import soxr

    data = media.encode_audio(media.noise(31.0, 44_100), 44_100, "wav")
    wave, cut = load_audio(data)
    full = soxr.resample(sf.read(io.BytesIO(data), dtype="float32")[0], 44_100, 16_000)[:MAX_SAMPLES]
    assert cut and np.abs(wave - full).max() < 1e-5


def test_exactly_30s_is_not_too_long() -> None:
    wave, cut = load_audio(media.encode_audio(media.noise(30.0, 16_000), 16_000, "wav"), truncate=False)
    assert not cut and len(wave) == MAX_SAMPLES


def test_100ms() -> None:
    wave, _ = load_audio(media.encode_audio(media.sine(0.1, 16_000), 16_000, "wav"))
    assert len(wave) == 1600
    _, mask = assert_features_match(wave)
    assert num_soft_tokens(mask) == 3


@pytest.mark.parametrize("fmt", ["wav", "flac", "ogg", "mp3", "m4a", "webm"])
def test_formats_decode_to_the_signal(fmt: str) -> None:
    rate = 48_000 if fmt == "webm" else 44_100
    source = np.repeat(media.sine(1.5, rate, freq=440.0), 2, axis=1)  # stereo, both channels alike
    wave, _ = load_audio(media.encode_audio(source, rate, fmt))
    # Lossy codecs add encoder delay and padding (tens of ms); lossless ones are exact.
    assert abs(len(wave) - 24_000) <= (0 if fmt in ("wav", "flac") else 2_400)
    assert abs(dominant_frequency(wave, 16_000) - 440) < 3
    rms = float(np.sqrt(np.mean(wave[2000:-2000] ** 2)))
    assert abs(rms - 0.5 / np.sqrt(2)) < 0.03  # a 0.5-amplitude sine
    assert_features_match(wave)


def test_float_wav_with_nan_or_inf_is_refused() -> None:
    for bad in (np.nan, np.inf, -np.inf):
        samples = media.sine(0.5, 16_000)
        samples[100] = bad
        with pytest.raises(MediaDecodeError, match="NaN or infinite"):
            load_audio(media.wav_float(samples, 16_000))


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "m4a"])
def test_decoding_stops_once_cancelled(fmt: str) -> None:
    """The decode loops (soundfile blocks, PyAV frames) check the cancel flag: set, nothing is decoded."""
    data = media.encode_audio(media.sine(20.0, 44_100, channels=2), 44_100, fmt)
    cancel = threading.Event()
    assert len(load_audio(data, cancel=cancel)[0]) > 0
    cancel.set()
    with pytest.raises(Cancelled):
        load_audio(data, cancel=cancel)
