"""Host-side timings of the engine's CPU paths, on the tiny checkpoint: run it at two commits on the
same machine to compare them.

    python docs/results/2026-11-30-cpu/host_paths.py    (from the repository root)

Prints median ms over 5 rounds: one image, one 8-frame video and one 9.3 s audio clip prepared
(Engine.prepare), collating 16 prepared images and 64 prepared short texts (engine.collate), and 16
audio clips through prepare_many on 1 and 2 threads where the commit has it.
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

from eg2_runtime.engine import Engine, collate  # noqa: E402
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions, TextPart  # noqa: E402
from eg2_runtime.tools import samples  # noqa: E402
from eg2_runtime.tools.demo_model import write_demo_model  # noqa: E402


def median_ms(fn, calls=10, rounds=5):
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e3)
    return statistics.median(times)


model = write_demo_model(Path(tempfile.mkdtemp()), size="tiny", seed=0, dtype="float32")
opts = PrepareOptions()
image = Item((MediaPart("image", samples.png(640, 480, 1)),))
video = Item((MediaPart("video", samples.mp4(8)),))
audio = Item((MediaPart("audio", samples.wav(9.3)),))
words = "search results rank documents by meaning and queries find images audio video and text alike".split()
texts = [Item((TextPart(" ".join(words[(i + j) % len(words)] for j in range(3 + i % 7))),)) for i in range(64)]
engine = Engine.from_dir(model, device="cpu")
print(f"prepare 1 image 640x480: {median_ms(lambda: engine.prepare(image, opts)):.2f} ms")
print(f"prepare 1 video of 8 frames: {median_ms(lambda: engine.prepare(video, opts)):.2f} ms")
print(f"prepare 1 audio clip of 9.3 s: {median_ms(lambda: engine.prepare(audio, opts)):.2f} ms")
images = [engine.prepare(Item((MediaPart("image", samples.png(640, 480, i)),)), opts).inputs for i in range(16)]
print(f"collate 16 images: {median_ms(lambda: collate(images, 0), calls=2):.2f} ms")
short = [engine.prepare(t, opts).inputs for t in texts]
print(f"collate 64 short texts: {median_ms(lambda: collate(short, 0)):.3f} ms")
if hasattr(Engine, "prepare_many"):
    from eg2_runtime.engine import EngineOptions

    for threads in (1, 2):
        e = Engine.from_dir(model, device="cpu", options=EngineOptions(prepare_threads=threads))
        ms = median_ms(lambda e=e: e.prepare_many([audio] * 16, opts), calls=2) / 16
        print(f"prepare_many 16 audio clips on {threads} thread(s): {ms:.2f} ms per clip")
