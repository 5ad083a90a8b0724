"""What tokenizing costs where the batcher may do it inline (Settings.inline_prepare_chars,
batcher.INLINE_MAX_ITEMS), on the real engine's preprocessor (tiny checkpoint, its stand-in tokenizer):

1. Engine.prepare_many of one text of 30 to 4,000 characters;
2. of 1 to 64 empty or 8-character items (what each item costs apart from its characters);
3. a short call while another thread tokenizes big batches in a loop (does a call made outside the
   tokenizers library's Rayon pool wait behind its work?).

    python docs/results/2026-11-30-cpu/prepare_text_cost.py MODEL_DIR    (from the repository root)
"""

import statistics
import sys
import threading
import time

from eg2_runtime.engine import Engine
from eg2_runtime.inputs import Item, PrepareOptions, TextPart

engine = Engine.from_dir(sys.argv[1], device="cpu")
tokenizer = engine.preprocessor.tokenizer
OPTIONS = PrepareOptions()
WORDS = "embeddings map meaning to vectors and similar texts land close together "


def median_us(fn, rounds: int = 300) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


for chars in (30, 120, 500, 1000, 2000, 4000):
    items = [Item((TextPart((WORDS * 400)[:chars]),))]
    print(f"1 text of {chars:5d} characters: {median_us(lambda: engine.prepare_many(items, OPTIONS)):6.1f} us")
for n in (1, 4, 8, 16, 64):
    empty, short = [Item((TextPart(""),))] * n, [Item((TextPart("abcd efg"),))] * n
    print(
        f"{n:2d} items: empty {median_us(lambda: engine.prepare_many(empty, OPTIONS)):6.1f} us, "
        f"8 characters each {median_us(lambda: engine.prepare_many(short, OPTIONS)):6.1f} us"
    )


def spread(fn, rounds: int = 2000) -> str:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - start))
    times.sort()
    return f"p50 {times[rounds // 2]:.0f} p99 {times[int(rounds * 0.99)]:.0f} max {times[-1]:.0f} us"


def short() -> object:
    return tokenizer.encode_batch(["what is the capital of france"])


print("a short encode_batch alone:", spread(short))
big, stop = [WORDS * 30] * 512, threading.Event()
hog = threading.Thread(target=lambda: [tokenizer.encode_batch(big) for _ in iter(stop.is_set, True)])
hog.start()
time.sleep(0.2)
print("beside a thread tokenizing 512 x ~2,000 characters in a loop:", spread(short))
stop.set()
hog.join()
