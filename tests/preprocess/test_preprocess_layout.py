"""Text and token layout against the reference processor of the same model directory.

The reference is what sentence-transformers runs: `AutoProcessor.from_pretrained(dir)` (an
EmbeddingGemma2Processor) rendering the item through the checkpoint's chat template (the prompt as a
system message first, then the parts in order) and expanding the media placeholders. Media go to the
reference already decoded the way ours are (images opened and EXIF-transposed, audio at 16 kHz since
the reference does not resample, every video frame with its metadata), so these tests isolate the
layout: token ids must be equal, and the tensors too.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from eg2_runtime.config import ModelConfig
from eg2_runtime.errors import CheckpointError, InputError, InputTooLongError, ModalityNotLoadedError
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions, TextPart
from eg2_runtime.preprocess import Prepared, Preprocessor, prepare_item
from eg2_runtime.preprocess.audio import load_audio
from eg2_runtime.preprocess.image import unit_pixels
from eg2_runtime.preprocess.layout import PIXEL_INPUTS
from tests.support import media
from tests.support.log_mel import assert_log_mel_close

PROMPT = "task: search result | query: "


@pytest.fixture(scope="session")
def tiny_dir(tiny_bf16: Path) -> Path:
    """The demo checkpoint (conftest): the real tokenizer layout, chat template and processor configs."""
    return tiny_bf16


@pytest.fixture(scope="session")
def processor(tiny_dir: Path) -> Any:
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_dir, local_files_only=True)
    assert type(proc).__name__ == "EmbeddingGemma2Processor"
    assert type(proc.image_processor).__name__ == "Gemma4ImageProcessor", "the torchvision reference path"
    return proc


@pytest.fixture(scope="session")
def pre(tiny_dir: Path) -> Preprocessor:
    return Preprocessor.from_dir(tiny_dir)


def reference(processor: Any, parts: list[tuple[str, Any]], prompt: str | None = None, **kwargs: Any) -> Any:
    """The reference processor's tensors for one item given as (kind, value) parts."""
    from transformers.video_utils import VideoMetadata

    messages: list[dict[str, Any]] = []
    if prompt is not None:
        messages.append({"role": "system", "content": [{"type": "text", "text": prompt}]})
    content: list[dict[str, Any]] = []
    images, audios, videos, metadata = [], [], [], []
    for kind, value in parts:
        content.append({"type": "text", "text": value} if kind == "text" else {"type": kind})
        if kind == "image":
            images.append(ImageOps.exif_transpose(Image.open(io.BytesIO(value))))
        elif kind == "audio":
            audios.append(load_audio(value)[0])  # our 16 kHz decode: the reference cannot resample
        elif kind == "video":
            frames, fps = media.all_frames(value)
            videos.append(frames)
            metadata.append(VideoMetadata(total_num_frames=len(frames), fps=fps, duration=len(frames) / fps))
    messages.append({"role": "user", "content": content})
    text = processor.apply_chat_template(messages, tokenize=False)
    if videos:
        kwargs.update(videos=videos, video_metadata=metadata)
    return processor(
        text=text, images=[images] if images else None, audio=audios or None, return_tensors="pt", **kwargs
    )


def item_of(parts: list[tuple[str, Any]]) -> Item:
    return Item(tuple(TextPart(v) if k == "text" else MediaPart(k, v) for k, v in parts))


def assert_same(ref: Any, ours: Prepared) -> None:
    assert ours.input_ids.dtype == torch.int64
    assert ours.input_ids.tolist() == ref["input_ids"][0].tolist()
    assert ours.num_tokens == len(ref["input_ids"][0])
    pairs = {
        "pixel_values": 1 / 255,
        "image_position_ids": 0,
        "pixel_values_videos": 1 / 255,
        "video_position_ids": 0,
        "num_frames_per_video": 0,
        "input_features": None,  # tests/support/log_mel.py's rule
        "input_features_mask": 0,
    }
    for name, tol in pairs.items():
        have = getattr(ours, name)
        if name in PIXEL_INPUTS and have is not None:
            have = unit_pixels(have)  # uint8 codes until the model runs
        if name not in ref:
            assert have is None, f"{name}: the reference has none"
            continue
        want = torch.as_tensor(ref[name])
        assert have is not None and have.shape == want.shape, (
            f"{name}: {None if have is None else have.shape}"
        )
        if tol is None:  # the served fast path differs from the reference at the floor
            assert_log_mel_close(have.numpy(), want.numpy(), name)
            continue
        diff = (have.double() - want.double()).abs().max().item()
        assert diff <= tol, f"{name}: max |diff| {diff} > {tol}"


# -------------------------------------------------------------------------------------------- text

TEXTS = {
    "ascii": "hello world",
    "empty": "",
    "spaces": "  two  spaces \n and a newline\t",
    "non_latin": "Привет, мир! 你好，世界。 مرحبا بالعالم नमस्ते 안녕하세요 ゆっくり",
    "emoji": "👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 rare 🫠 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "special_words": "<bos> is the start and <eos> the end; <pad> too",
}


@pytest.mark.parametrize("prompt", [None, PROMPT])
@pytest.mark.parametrize("name", list(TEXTS))
def test_text_ids_equal_reference(processor: Any, pre: Preprocessor, name: str, prompt: str | None) -> None:
    parts = [("text", TEXTS[name])]
    assert_same(
        reference(processor, parts, prompt), pre.prepare(item_of(parts), PrepareOptions(prompt=prompt))
    )


def test_empty_text_is_bos_eos(processor: Any, pre: Preprocessor) -> None:
    """The reference embeds "" as <bos><eos>; so do we (no error)."""
    ours = pre.prepare(item_of([("text", "")]), PrepareOptions())
    assert ours.input_ids.tolist() == [2, 1]


def test_adjacent_text_parts_are_concatenated(processor: Any, pre: Preprocessor) -> None:
    parts = [("text", "multi "), ("text", "part"), ("text", " text")]
    assert_same(
        reference(processor, parts, PROMPT), pre.prepare(item_of(parts), PrepareOptions(prompt=PROMPT))
    )


def test_long_text_truncates_keeping_eos(processor: Any, pre: Preprocessor) -> None:
    text = "0123456789 abcdefghij " * 500  # 11000 characters = 11000 tokens with the stand-in tokenizer
    ours = pre.prepare(item_of([("text", text)]), PrepareOptions(prompt=PROMPT))
    want = processor.tokenizer(PROMPT + text, truncation=True, max_length=8192)["input_ids"]
    assert ours.input_ids.tolist() == want
    assert ours.num_tokens == 8192 and ours.input_ids[-1].item() == 1 and ours.text_truncated


def test_long_text_refused_without_truncation(pre: Preprocessor) -> None:
    with pytest.raises(InputTooLongError) as e:
        pre.prepare(item_of([("text", "x" * 9000)]), PrepareOptions(truncate=False))
    assert "8192" in e.value.message and e.value.param == "input"
    exact = pre.prepare(item_of([("text", "x" * 8190)]), PrepareOptions(truncate=False))
    assert exact.num_tokens == 8192 and not exact.text_truncated


def test_prompts_by_name(pre: Preprocessor) -> None:
    assert pre.resolve_prompt(prompt_name="SearchQuery") == PROMPT
    assert pre.resolve_prompt(prompt="literal: ") == "literal: "
    assert pre.resolve_prompt() is None  # the demo checkpoint has no default_prompt_name
    with pytest.raises(InputError) as e:
        pre.resolve_prompt(prompt_name="Nope")
    assert e.value.param == "prompt_name" and "SearchQuery" in e.value.message
    with pytest.raises(InputError):
        pre.resolve_prompt(prompt_name="SearchQuery", prompt="x")


@pytest.mark.parametrize("marker", ["<|image|>", "<|video|>", "<|audio|>", "<|image>", "<audio|>"])
def test_media_markers_in_text_are_refused(pre: Preprocessor, marker: str) -> None:
    """Client text holding a marker would shift every placeholder (the reference misplaces media)."""
    with pytest.raises(InputError, match="reserved media marker"):
        pre.prepare(item_of([("text", f"look {marker} here")]), PrepareOptions())
    with pytest.raises(InputError) as e:
        pre.prepare(item_of([("text", "x")]), PrepareOptions(prompt=marker))
    assert e.value.param == "prompt"


def test_batch_encoding_matches_single(pre: Preprocessor) -> None:
    items = [item_of([("text", t)]) for t in TEXTS.values()]
    batch = pre.prepare_batch(items, PrepareOptions(prompt=PROMPT))
    for item, got in zip(items, batch, strict=True):
        assert isinstance(got, Prepared)
        assert torch.equal(got.input_ids, pre.prepare(item, PrepareOptions(prompt=PROMPT)).input_ids)


def test_batch_isolates_a_bad_item(pre: Preprocessor) -> None:
    items = [item_of([("text", "fine")]), item_of([("image", b"not an image")]), item_of([("text", "also")])]
    out = pre.prepare_batch(items, PrepareOptions())
    assert isinstance(out[0], Prepared) and isinstance(out[2], Prepared)
    assert isinstance(out[1], InputError)


# ------------------------------------------------------------------------------------------- media

PNG = media.encode_image(media.picture(120, 90), "PNG")
JPEG = media.encode_image(media.picture(64, 200, seed=3), "JPEG", quality=90)
WAV_2S = media.encode_audio(media.noise(2.0, 16_000), 16_000, "wav")
WAV_07S = media.encode_audio(media.sine(0.7, 16_000), 16_000, "wav")
MP4_3S = media.encode_video(3, 10)

LAYOUTS = {
    "image": [("image", PNG)],
    "text_image_text": [("text", "a photo of "), ("image", PNG), ("text", " in the rain")],
    "two_images": [("image", PNG), ("text", " vs "), ("image", JPEG)],
    "audio": [("audio", WAV_2S)],
    "two_audio_padded": [("audio", WAV_2S), ("text", "then"), ("audio", WAV_07S)],
    "video": [("video", MP4_3S)],
    "everything": [("text", "x"), ("audio", WAV_07S), ("image", JPEG), ("video", MP4_3S), ("text", "y")],
}


@pytest.mark.parametrize("prompt", [None, PROMPT])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_media_layout_equals_reference(
    processor: Any, pre: Preprocessor, name: str, prompt: str | None
) -> None:
    parts = LAYOUTS[name]
    ours = pre.prepare(item_of(parts), PrepareOptions(prompt=prompt))
    assert_same(reference(processor, parts, prompt), ours)


def test_video_frames_are_image_blocks_back_to_back(pre: Preprocessor) -> None:
    """Per frame <|image> 70-budget x <|video|> <image|>, no separator and no timestamp text."""
    ours = pre.prepare(item_of([("video", MP4_3S)]), PrepareOptions())
    m = pre.markers.ids
    n = 336 * 432 // (16 * 16 * 9)  # 96x128 frames are upscaled to 336x432 at the 70 budget: 63 tokens
    frame = [m["<|image>"], *[m["<|video|>"]] * n, m["<image|>"]]
    assert ours.input_ids.tolist() == [2, *frame * 3, 1]
    assert ours.frame_timestamps == [[0.0, 1.0, 2.0]]


@pytest.mark.parametrize("budget", [70, 140, 280, 560, 1120])
def test_image_budgets(processor: Any, pre: Preprocessor, budget: int) -> None:
    parts = [("text", "budget "), ("image", JPEG)]
    ours = pre.prepare(item_of(parts), PrepareOptions(image_tokens=budget))
    assert_same(reference(processor, parts, None, images_kwargs={"max_soft_tokens": budget}), ours)
    assert ours.pixel_values is not None and ours.pixel_values.shape == (1, budget * 9, 768)


def test_apply_chat_template_tokenize_path_agrees(processor: Any, pre: Preprocessor) -> None:
    """`reference` renders then calls the processor; apply_chat_template(tokenize=True) (what
    sentence-transformers calls) must give the same ids, BOS/EOS included."""
    image = Image.open(io.BytesIO(PNG))
    wave = load_audio(WAV_07S)[0]
    messages = [
        {"role": "system", "content": [{"type": "text", "text": PROMPT}]},
        {"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "image", "image": image}]},
        {"role": "user", "content": [{"type": "audio", "audio": wave}, {"type": "text", "text": " b"}]},
    ]
    ref = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    parts = [("text", "a "), ("image", PNG), ("audio", WAV_07S), ("text", " b")]
    assert_same(ref, pre.prepare(item_of(parts), PrepareOptions(prompt=PROMPT)))


def test_long_text_beside_media_keeps_the_media(pre: Preprocessor) -> None:
    parts = [("text", "t" * 9000), ("image", PNG), ("text", "tail")]  # PNG: 120x90 -> 912x672, 266 tokens
    ours = pre.prepare(item_of(parts), PrepareOptions(image_tokens=280))
    ids = ours.input_ids.tolist()
    m = pre.markers.ids
    assert len(ids) == 8192 and ids[0] == 2 and ids[-1] == 1 and ours.text_truncated
    assert (
        ids.count(m["<|image|>"]) == 19 * 14
        and ids.count(m["<|image>"]) == 1
        and ids.count(m["<image|>"]) == 1
    )
    assert ids[-2] == m["<image|>"]  # the trailing text went first, the image block stayed whole
    with pytest.raises(InputTooLongError):
        pre.prepare(item_of(parts), PrepareOptions(truncate=False))


def test_media_alone_over_the_limit_is_refused(pre: Preprocessor) -> None:
    big = media.encode_image(media.picture(48, 48), "PNG")  # 1089 soft tokens at the 1120 budget
    item = item_of([("image", big)] * 8)  # 8 x 1091 tokens > 8192: media cannot be cut
    with pytest.raises(InputTooLongError, match="media of this input alone"):
        pre.prepare(item, PrepareOptions(image_tokens=1120))


def test_usage_counts_every_token(pre: Preprocessor) -> None:
    ours = prepare_item(item_of([("text", "ab"), ("audio", WAV_2S)]), PrepareOptions(), pre)
    # <bos> a b <|audio> 50 x <|audio|> <audio|> <eos>: 2 s = 199 mel frames -> 50 soft tokens
    assert ours.num_tokens == 1 + 2 + 1 + 50 + 1 + 1
    assert ours.modality == "audio"


def test_options_and_modalities_are_checked(tiny_dir: Path, pre: Preprocessor) -> None:
    with pytest.raises(InputError) as e:
        pre.prepare(item_of([("image", PNG)]), PrepareOptions(image_tokens=100))
    assert e.value.param == "image_tokens"
    text_only = Preprocessor.from_dir(tiny_dir, modalities=())
    with pytest.raises(ModalityNotLoadedError):
        text_only.prepare(item_of([("image", PNG)]), PrepareOptions())
    with pytest.raises(InputError):
        pre.prepare(Item(()), PrepareOptions())


def test_tokenizer_and_config_must_agree(tiny_dir: Path) -> None:
    config = ModelConfig.from_dir(tiny_dir)
    wrong = ModelConfig(text=config.text, vision=config.vision, audio=config.audio, image_token_id=7)
    with pytest.raises(CheckpointError, match="<\\|image\\|>"):
        Preprocessor.from_dir(tiny_dir, wrong)


def test_audio_features_are_padded_per_item(pre: Preprocessor) -> None:
    ours = pre.prepare(item_of([("audio", WAV_2S), ("audio", WAV_07S)]), PrepareOptions())
    assert ours.input_features is not None and ours.input_features_mask is not None
    assert ours.input_features.shape == (2, 199, 128) and ours.input_features.dtype == torch.float32
    short = ours.input_features_mask[1]
    assert short.sum().item() == (11_200 - 161) // 160 + 1 and not short[-1]
    assert np.all(ours.input_features[1, ~short].numpy() == 0)


def test_audio_flags_and_limits(pre: Preprocessor) -> None:
    long = media.encode_audio(media.noise(31.0, 16_000), 16_000, "flac")
    cut = pre.prepare(item_of([("audio", long)]), PrepareOptions())
    assert cut.audio_truncated and cut.num_tokens == 1 + 1 + 750 + 1 + 1
    with pytest.raises(InputTooLongError):
        pre.prepare(item_of([("audio", long)]), PrepareOptions(truncate=False))
    blip = media.encode_audio(media.sine(0.005, 16_000), 16_000, "wav")  # 80 samples: no whole frame
    with pytest.raises(InputError, match="too short"):
        pre.prepare(item_of([("audio", blip)]), PrepareOptions())


def test_prepare_is_thread_safe(pre: Preprocessor) -> None:
    """The engine prepares items on many threads at once: results must not depend on it."""
    import concurrent.futures

    items = [item_of(parts) for parts in LAYOUTS.values()] * 3
    alone = [pre.prepare(item, PrepareOptions()) for item in items]
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        together = list(pool.map(lambda item: pre.prepare(item, PrepareOptions()), items))
    for a, b in zip(alone, together, strict=True):
        for name, tensor in a.model_inputs().items():
            assert torch.equal(tensor, b.model_inputs()[name]), name


def test_model_inputs_names(pre: Preprocessor) -> None:
    ours = pre.prepare(item_of(LAYOUTS["everything"]), PrepareOptions())
    assert set(ours.model_inputs()) == {
        "input_ids",
        "pixel_values",
        "image_position_ids",
        "pixel_values_videos",
        "video_position_ids",
        "num_frames_per_video",
        "input_features",
        "input_features_mask",
    }
    assert set(pre.prepare(item_of([("text", "t")]), PrepareOptions()).model_inputs()) == {"input_ids"}
