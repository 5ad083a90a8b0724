"""What tokenizing costs where the batcher may do it inline (Settings.inline_prepare_chars,
batcher.INLINE_MAX_ITEMS), on the real engine's preprocessor:

1. Engine.prepare_many of one text of 30 to 4,000 characters;
2. of 1 to 64 empty or 8-character items (what each item costs apart from its characters);
3. a short call while another thread tokenizes big batches in a loop (does a call made outside the
   tokenizers library's Rayon pool wait behind its work?);
4. 64 docs of 120-360 characters and one short query by the text fast path (preprocess/text_batch.py) and
   by its reference (`batched_text` off), the two interleaved round by round.

    python -m benchmarks.prepare_text_cost MODEL_DIR       (from the repository root)
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from functools import partial

from eg2_runtime.engine import Engine
from eg2_runtime.inputs import Item, PrepareOptions, TextPart

OPTIONS = PrepareOptions()
WORDS = "embeddings map meaning to vectors and similar texts land close together "


def median_us(fn: Callable[[], object], rounds: int = 300) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def spread(fn: Callable[[], object], rounds: int = 2000) -> str:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - start))
    times.sort()
    return f"p50 {times[rounds // 2]:.0f} p99 {times[int(rounds * 0.99)]:.0f} max {times[-1]:.0f} us"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("model", help="checkpoint directory")
    engine = Engine.from_dir(parser.parse_args().model, device="cpu")
    tokenizer = engine.preprocessor.tokenizer

    for chars in (30, 120, 500, 1000, 2000, 4000):
        items = [Item((TextPart((WORDS * 400)[:chars]),))]
        cost = median_us(partial(engine.prepare_many, items, OPTIONS))
        print(f"1 text of {chars:5d} characters: {cost:6.1f} us")
    for n in (1, 4, 8, 16, 64):
        empty, short = [Item((TextPart(""),))] * n, [Item((TextPart("abcd efg"),))] * n
        print(
            f"{n:2d} items: empty {median_us(partial(engine.prepare_many, empty, OPTIONS)):6.1f} us, "
            f"8 characters each {median_us(partial(engine.prepare_many, short, OPTIONS)):6.1f} us"
        )

    pre = engine.preprocessor
    docs = [Item((TextPart(" ".join(WORDS.split() * 6)[: 6 * (20 + 40 * i // 63)]),)) for i in range(64)]
    for name, items in (("64 docs", docs), ("1 query", [Item((TextPart("what is the capital of france"),))])):
        fast, reference = [], []
        for _ in range(8):  # interleaved: a drift of the machine's speed lands on both
            pre.batched_text = True
            fast.append(median_us(partial(engine.prepare_many, items, OPTIONS), rounds=100))
            pre.batched_text = False
            reference.append(median_us(partial(engine.prepare_many, items, OPTIONS), rounds=100))
        pre.batched_text = True
        f, r = statistics.median(fast), statistics.median(reference)
        print(f"{name}: fast path {f:7.1f} us, reference {r:7.1f} us ({f / r:.2f}x)")

    def one_short() -> object:
        return tokenizer.encode_batch(["what is the capital of france"])

    print("a short encode_batch alone:", spread(one_short))
    big, stop = [WORDS * 30] * 512, threading.Event()

    def hog() -> None:
        while not stop.is_set():
            tokenizer.encode_batch(big)

    thread = threading.Thread(target=hog)
    thread.start()
    time.sleep(0.2)
    print("beside a thread tokenizing 512 x ~2,000 characters in a loop:", spread(one_short))
    stop.set()
    thread.join()


if __name__ == "__main__":
    main()
