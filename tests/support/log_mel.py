"""How close served log-mel features must be to the reference extractor's: the one rule the audio and
layout tests share (preprocess/audio.LogMel's docstring says why the two differ at the floor)."""

from __future__ import annotations

import numpy as np

ENERGETIC = float(np.log(0.1))  # a bin at 100x the mel floor (1e-3) and more has real energy
TOL_ENERGETIC = 1e-4  # there, the two float32 FFTs agree to this
TOL_FLOOR = 0.05  # below, both are rounding noise near log(1e-3); they differ by less than this


def assert_log_mel_close(have: np.ndarray, want: np.ndarray, name: str = "features") -> None:
    assert have.shape == want.shape, (name, have.shape, want.shape)
    if not have.size:
        return
    diff = np.abs(have.astype(np.float64) - want.astype(np.float64))
    energetic = want > ENERGETIC
    worst = float(diff[energetic].max(initial=0.0))
    assert worst <= TOL_ENERGETIC, f"{name}: max |diff| {worst} > {TOL_ENERGETIC} in a bin with energy"
    assert float(diff.max()) < TOL_FLOOR, f"{name}: max |diff| {diff.max()} >= {TOL_FLOOR} at the floor"
