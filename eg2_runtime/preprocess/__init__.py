"""Preprocessing: what a client sent (an `Item`) -> the model inputs the reference processor would build.

text.py          tokenizer.json (tokenizers library), task prompts
image.py         decode, EXIF, RGB, resize to the soft-token budget, patches and positions
audio.py         decode, downmix, resample to 16 kHz, log-mel features and mask
video.py         decode, 1 fps sampling (<= 32 frames), per-frame patches
layout.py        the token sequence: markers, placeholders, truncation; `Prepared`
segments.py      where the spans of an item with segments lie (audio, video and text alike)
preprocessor.py  `Preprocessor`: all of the above for one model directory
text_batch.py    its fast path for a batch of text alone
limits.py        decoder errors as client-safe reasons (the limits: eg2_runtime.inputs.MediaLimits)
"""

from eg2_runtime.inputs import MediaLimits
from eg2_runtime.preprocess.layout import Prepared
from eg2_runtime.preprocess.preprocessor import Preprocessor, prepare_item

__all__ = ["MediaLimits", "Prepared", "Preprocessor", "prepare_item"]
