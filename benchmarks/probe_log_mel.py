"""Probe (CPU): the audio features' two paths, preprocess/audio.LogMel's fast one (torch's FFT) and its
reference (numpy's, the reference extractor's arithmetic), interleaved round by round so a drift of
the machine's speed lands on both; then a whole clip's Engine.prepare_many each way.

    python -m benchmarks.probe_log_mel MODEL_DIR       (from the repository root)

On one thread, as the service's preprocessing threads and worker processes run torch.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from eg2_runtime import samples
from eg2_runtime.engine import Engine
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions


def median_ms(fn: Callable[[], object], rounds: int = 20) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("model", help="checkpoint directory")
    engine = Engine.from_dir(parser.parse_args().model, device="cpu")
    torch.set_num_threads(1)
    log_mel = engine.preprocessor.log_mel
    for seconds in (9.3, 30.0):
        wave = samples.tone(seconds)
        item = [Item((MediaPart("audio", samples.wav(seconds), "wav"),))]
        rows: dict[str, list[float]] = {k: [] for k in ("fast", "reference", "fast prep", "reference prep")}
        for _ in range(8):
            for fast in (True, False):
                log_mel.fast = fast
                name = "fast" if fast else "reference"
                rows[name].append(median_ms(partial(log_mel, wave)))
                rows[f"{name} prep"].append(median_ms(partial(engine.prepare_many, item, PrepareOptions())))
        log_mel.fast = True
        m = {k: statistics.median(v) for k, v in rows.items()}
        print(
            f"{seconds:4.1f} s clip: features fast {m['fast']:5.2f} ms, reference {m['reference']:5.2f} ms "
            f"({m['fast'] / m['reference']:.2f}x); Engine.prepare_many fast {m['fast prep']:5.2f} ms, "
            f"reference {m['reference prep']:5.2f} ms ({m['fast prep'] / m['reference prep']:.2f}x)"
        )


if __name__ == "__main__":
    main()
