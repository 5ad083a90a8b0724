"""Preprocessor: one Item (text and media parts) -> `Prepared` model inputs, on the CPU.

Built once from a model directory: tokenizer.json, config_sentence_transformers.json (prompts) and
processor_config.json (image / video / audio settings; class defaults when absent). Holds no mutable
state after construction, so `prepare` may run on many threads at once. Decoding is guarded by the
caller's `MediaLimits`; errors are the runtime's InputError family with client-safe messages.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from pathlib import Path
from threading import Event
from typing import Any

import numpy as np
import torch

from eg2_runtime.api import Estimate, Span
from eg2_runtime.config import ModelConfig
from eg2_runtime.errors import (
    CheckpointError,
    EG2Error,
    InputError,
    InputTooLargeError,
    InputTooLongError,
    ModalityNotLoadedError,
    check_cancel,
)
from eg2_runtime.inputs import (
    IMAGE_TOKEN_BUDGETS,
    Item,
    MediaKind,
    MediaLimits,
    MediaPart,
    PrepareOptions,
    TextPart,
)
from eg2_runtime.preprocess import audio, image, segments, text_batch, video
from eg2_runtime.preprocess.layout import Markers, Prepared, check_text, expand
from eg2_runtime.preprocess.text import CUT_WINDOW, MAX_TOKENS, Prompts, TextTokenizer


class Preprocessor:
    def __init__(
        self,
        tokenizer: TextTokenizer,
        config: ModelConfig,
        *,
        prompts: Prompts | None = None,
        processor_config: dict[str, Any] | None = None,
        limits: MediaLimits | None = None,
        modalities: Sequence[MediaKind] | None = None,
        max_tokens: int = MAX_TOKENS,
        bounded_text: bool = True,
        batched_text: bool = True,
    ) -> None:
        pc = processor_config or {}
        self.tokenizer = tokenizer
        self.config = config
        self.prompts = prompts or Prompts({})
        self.limits = limits or MediaLimits.unbounded()
        self.max_tokens = max_tokens
        # The fast path (see `_render`): an item's text cut at a provable cut point past what can reach
        # the model, the prompt's head tokenized once per prompt. False: the reference path, each
        # item's whole string tokenized, as transformers does (tests prove the two equal).
        self.bounded_text = bounded_text
        # n tokens cover at most n * max_token_chars characters: text past this many cannot be kept.
        self.text_bound = max_tokens * tokenizer.max_token_chars
        # (h, ids of prompt[:h]) for the prompt's last cut point h: what every item shares, cached.
        self.prompt_head = functools.lru_cache(maxsize=64)(self._split_prompt)
        # A batch of text alone (with bounded_text) takes text_batch.py's fast path; False: every batch
        # takes `prepare_staged`, its reference (tests prove the two equal).
        self.batched_text = batched_text
        vision = config.vision
        pixels = pc.get("image_processor") or {}  # patch geometry: the processor's, else the tower's
        self.geometry = image.PatchGeometry(
            patch_size=pixels.get("patch_size", vision.patch_size if vision else 16),
            pooling_kernel_size=pixels.get(
                "pooling_kernel_size", vision.pooling_kernel_size if vision else 3
            ),
        )
        self.video_config = video.VideoConfig.from_dict(pc.get("video_processor") or {})
        self.log_mel = audio.LogMel(audio.MelConfig.from_dict(pc.get("feature_extractor") or {}))
        if modalities is None:
            modalities = [*(("image", "video") if vision else ()), *(("audio",) if config.audio else ())]
        self.modalities = frozenset(modalities)
        self.markers = self._markers(tokenizer, config)

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        config: ModelConfig | None = None,
        *,
        limits: MediaLimits | None = None,
        modalities: Sequence[MediaKind] | None = None,
        bounded_text: bool = True,
        batched_text: bool = True,
    ) -> Preprocessor:
        model_dir = Path(model_dir)
        config = config or ModelConfig.from_dir(model_dir)
        pc_path = model_dir / "processor_config.json"
        processor_config = _read_json(pc_path) if pc_path.is_file() else {}
        if "feature_extractor" not in processor_config and (model_dir / "preprocessor_config.json").is_file():
            processor_config["feature_extractor"] = _read_json(model_dir / "preprocessor_config.json")
        try:
            return cls(
                TextTokenizer.from_file(model_dir / "tokenizer.json"),
                config,
                prompts=Prompts.from_dir(model_dir),
                processor_config=processor_config,
                limits=limits,
                modalities=modalities,
                bounded_text=bounded_text,
                batched_text=batched_text,
            )
        except ValueError as e:  # a processor setting this implementation does not reproduce
            raise CheckpointError(f"processor_config.json: {e}") from e

    @staticmethod
    def _markers(tokenizer: TextTokenizer, config: ModelConfig) -> Markers:
        markers = Markers()
        expected = {
            markers.boi: config.boi_token_id,
            markers.eoi: config.eoi_token_id,
            markers.boa: config.boa_token_id,
            markers.eoa: config.eoa_token_id,
            markers.image: config.image_token_id,
            markers.video: config.video_token_id,
            markers.audio: config.audio_token_id,
        }
        for marker, want in expected.items():
            got = tokenizer.token_id(marker)
            if got != want:
                raise CheckpointError(f"tokenizer maps {marker} to {got}, config.json says {want}")
        markers = Markers(ids=expected)
        # Each block must tokenize to exactly its three marker ids, splitting the text around it: the
        # layout renders one block per media part and relies on that.
        e = expected
        blocks = {
            markers.image_block(): [e[markers.boi], e[markers.image], e[markers.eoi]],
            markers.audio_block(): [e[markers.boa], e[markers.audio], e[markers.eoa]],
            markers.video_block(None, 1): [e[markers.boi], e[markers.video], e[markers.eoi]],
        }
        a, b = tokenizer.encode_batch(["a", "b"])
        for block, ids in blocks.items():
            if tokenizer.encode_batch([f"a{block}b"])[0] != [*a, *ids, *b]:
                raise CheckpointError(f"tokenizer.json does not keep {block} as three special tokens")
        return markers

    def resolve_prompt(self, prompt_name: str | None = None, prompt: str | None = None) -> str | None:
        """The literal prefix for a request's prompt / prompt_name (see `Prompts.resolve`)."""
        return self.prompts.resolve(prompt_name, prompt)

    # ----------------------------------------------------------------------------------- estimate

    def estimate(self, item: Item, options: PrepareOptions) -> Estimate:
        """What `prepare` (and `prepare_segments`, for an item with spans) will cost this item in tokens,
        known before anything is decoded or tokenized: text (the prompt included) at one token per
        character, media from their headers (their exact soft tokens and markers), the item itself at
        most `max_tokens` (longer text is cut).

        Raises what the headers alone already prove: media over a `MediaLimits` limit
        (InputTooLargeError), media that alone exceed the model's context (InputTooLongError). Anything
        else (an unreadable header, bad text) is left to `prepare`, which decides.
        """
        unit = item.span_unit
        part = item.parts[0] if item.parts else None
        if unit is None or part is None or (isinstance(part, MediaPart) and part.kind not in self.modalities):
            return Estimate(self._estimate_item(item, options))
        assert item.segments is not None
        overlap = item.segments.overlap
        prompt = len(options.prompt or "")
        fixed = len(self.tokenizer.prefix) + len(self.tokenizer.suffix)
        if isinstance(part, TextPart):
            size = max(1, min(int(unit), self.max_tokens - fixed - prompt))
            n = segments.count(len(part.text), size, overlap)
            span_tokens = segments.covered(len(part.text), size, overlap) + n * (fixed + prompt)
            return Estimate(self._estimate_item(item, options), n, span_tokens)
        if part.kind == "audio":
            header = audio.probe(part.data)
            seconds = header.seconds
            limit = self.limits.max_segment_audio_seconds
            if seconds is not None and seconds > limit:
                raise InputTooLargeError(
                    f"audio is {seconds:.0f} s long, more than this server's limit of {limit:g} s for "
                    "audio with segments (max_segment_audio_seconds)",
                    param="input",
                )
            audio.check_decode_cost(header, self.limits, segments=True)
            # A duration the header does not declare counts as the most the decoder will take.
            most = limit if math.isfinite(limit) else audio.MAX_SECONDS
            length = round(audio.SAMPLE_RATE * (seconds if seconds is not None else most))
            size = round(audio.SAMPLE_RATE * float(unit))
            per_span = [
                self.log_mel.soft_tokens((b - a) / audio.SAMPLE_RATE) + 2 + fixed + prompt
                for a, b in _first_and_last(length, size, overlap)
            ]
            n = segments.count(length, size, overlap)
            span_tokens = per_span[0] * (n - 1) + per_span[-1]
            return Estimate(self._estimate_item(item, options), n, span_tokens)
        whole, spans = video.probe_spans(
            part.data, self.video_config, self.geometry, self.limits, float(unit), overlap
        )
        return Estimate(whole + fixed + prompt, len(spans), sum(spans) + len(spans) * (fixed + prompt))

    def _estimate_item(self, item: Item, options: PrepareOptions) -> int:
        """The item itself (without its spans), as `estimate` describes."""
        text = len(options.prompt or "")
        fixed = len(self.tokenizer.prefix) + len(self.tokenizer.suffix)
        for part in item.parts:
            if isinstance(part, TextPart):
                text += len(part.text)
            elif part.kind not in self.modalities:
                continue  # prepare refuses it
            elif part.kind == "image":
                budget = options.image_tokens if options.image_tokens in IMAGE_TOKEN_BUDGETS else 0
                pixels = self.limits.max_image_pixels
                fixed += image.probe_tokens(part.data, budget, self.geometry, pixels) + 2
            elif part.kind == "audio":
                header = audio.probe(part.data)
                if item.span_unit is None:  # with spans, `estimate` checks the whole decode, as segments
                    audio.check_decode_cost(header, self.limits)
                seconds = audio.MAX_SECONDS if header.seconds is None else header.seconds
                fixed += self.log_mel.soft_tokens(seconds) + 2
            else:
                fixed += video.probe_tokens(part.data, self.video_config, self.geometry, self.limits)
        if fixed > self.max_tokens:
            raise InputTooLongError(
                f"the media of this input alone is {fixed} tokens, more than the model's {self.max_tokens}",
                param="input",
            )
        return min(self.max_tokens, fixed + text)

    # ------------------------------------------------------------------------------------ prepare

    def prepare(self, item: Item, options: PrepareOptions) -> Prepared:
        out = self.prepare_batch([item], options, raise_errors=True)[0]
        assert isinstance(out, Prepared)  # errors were raised
        return out

    def prepare_batch(
        self,
        items: Sequence[Item],
        options: PrepareOptions,
        *,
        raise_errors: bool = False,
        executor: Executor | None = None,
        cancel: Event | None = None,
    ) -> list[Prepared | EG2Error]:
        """Prepare several items, their text tokenized in one call. A failing item gives its error in
        its slot (or raises, with `raise_errors`); the others are unaffected.

        `executor`: decode and featurize the media of the items in parallel (PIL, PyAV, soxr and
        numpy release the GIL for the heavy parts). `cancel`: checked between items and inside the
        decoders (per video frame, per audio block); once set, the call raises Cancelled.

        A batch of text alone takes the fast path (text_batch.py): what `prepare_staged`, the general
        path, gives, its rare items that need cutting at the bound or refusing in a second call."""
        if self.batched_text and self.bounded_text:
            out = text_batch.prepare_texts(self, items, options, raise_errors=raise_errors, cancel=cancel)
            if out is not None:
                return out
        return self.prepare_staged(
            items, options, raise_errors=raise_errors, executor=executor, cancel=cancel
        )

    def prepare_staged(
        self,
        items: Sequence[Item],
        options: PrepareOptions,
        *,
        raise_errors: bool = False,
        executor: Executor | None = None,
        cancel: Event | None = None,
    ) -> list[Prepared | EG2Error]:
        """`prepare_batch` by the general path: each item staged (media decoded, its string rendered
        with one placeholder per block), then all of their strings tokenized in one call."""

        def stage(item: Item) -> _Staged | EG2Error:
            check_cancel(cancel)
            try:
                return self._stage(item, options, cancel)
            except EG2Error as e:
                if raise_errors:
                    raise
                return e

        has_media = any(isinstance(p, MediaPart) for item in items for p in item.parts)
        # Text alone is staged in microseconds: a thread hop per item would cost more than it saves.
        staged = list(executor.map(stage, items) if executor is not None and has_media else map(stage, items))
        check_cancel(cancel)
        texts = [s.text for s in staged if isinstance(s, _Staged)]
        encoded = iter(self.tokenizer.encode_batch(texts) if texts else [])
        out: list[Prepared | EG2Error] = []
        for s in staged:
            if not isinstance(s, _Staged):
                out.append(s)
                continue
            try:
                out.append(self._finish(s, s.head + next(encoded), options))
            except EG2Error as e:
                if raise_errors:
                    raise
                out.append(e)
        return out

    def _stage(self, item: Item, options: PrepareOptions, cancel: Event | None = None) -> _Staged:
        """Decode and featurize the media, and render the item's string with one placeholder per block."""
        s = self._begin(item, options)
        for part in item.parts:
            if isinstance(part, TextPart):
                check_text(part.text, self.markers)
                s.pieces.append((True, part.text))
            elif part.kind == "image":
                rgb = image.decode_image(part.data, max_pixels=self.limits.max_image_pixels)
                check_cancel(cancel)
                self._add_image(s, rgb, options)
            elif part.kind == "audio":
                wave, cut = audio.load_audio(
                    part.data, truncate=options.truncate, limits=self.limits, cancel=cancel
                )
                self._add_audio(s, wave, cut)
            else:
                sampled = video.decode_video(
                    part.data, self.video_config, self.limits, geometry=self.geometry, cancel=cancel
                )
                self._add_video(s, sampled)
        self._render(s, options)
        return s

    def _begin(self, item: Item, options: PrepareOptions) -> _Staged:
        """The checks every item passes before its parts are decoded, and its prompt piece."""
        if not item.parts:
            raise InputError("an input item has no parts", param="input")
        if options.image_tokens not in IMAGE_TOKEN_BUDGETS:
            raise InputError(f"image_tokens must be one of {IMAGE_TOKEN_BUDGETS}", param="image_tokens")
        for part in item.parts:
            if isinstance(part, MediaPart) and part.kind not in self.modalities:
                raise ModalityNotLoadedError(f"this server does not embed {part.kind}", param="input")
        prompt = options.prompt or ""
        check_text(prompt, self.markers, param="prompt")
        return _Staged(item=item, pieces=[(True, prompt)])

    def _add_image(self, s: _Staged, rgb: np.ndarray, options: PrepareOptions) -> None:
        m = self.markers
        patched = image.prepare_image(rgb, options.image_tokens, self.geometry)
        s.images.append(patched)
        s.soft[m.ids[m.image]].append(patched.num_soft_tokens)
        s.pieces.append((False, m.image_block()))
        s.media_tokens.append(("image", patched.num_soft_tokens + 2))

    def _add_audio(self, s: _Staged, wave: np.ndarray, cut: bool) -> None:
        """(n,) float32 at 16 kHz, at most 30 s, and whether the source was longer."""
        m = self.markers
        features, mask = self.log_mel(wave)
        if not np.isfinite(features).all():  # finite samples so large the spectrum overflows
            raise InputError("audio sample values are out of range", param="input")
        n = audio.num_soft_tokens(mask)
        if n == 0:
            raise InputError("audio is too short: it needs at least 10 ms of sound", param="input")
        s.audio.append((features, mask))
        s.audio_truncated |= cut
        s.soft[m.ids[m.audio]].append(n)
        s.pieces.append((False, m.audio_block()))
        s.media_tokens.append(("audio", n + 2))

    def _add_video(self, s: _Staged, sampled: video.SampledVideo) -> None:
        m, vc = self.markers, self.video_config
        patched = video.prepare_frames(sampled.frames, vc.budget, self.geometry)
        frames = len(sampled.indices)
        s.videos.append(patched)
        s.frame_counts.append(frames)
        s.timestamps.append(sampled.timestamps)
        s.soft[m.ids[m.video]].extend([patched.num_soft_tokens] * frames)
        block = m.video_block(sampled.timestamps if vc.add_timestamps else None, frames)
        s.pieces.append((False, block))
        s.media_tokens.append(("video", frames * (patched.num_soft_tokens + 2)))

    # ----------------------------------------------------------------------------------- segments

    def prepare_segments(
        self, item: Item, options: PrepareOptions, cancel: Event | None = None
    ) -> Iterator[list[tuple[Span | None, Prepared]]]:
        """An item with spans (`Item.span_unit`), step by step: each step the spans decoded since the
        last one, and the item itself (None) with the step that completes it. Each span is prepared as
        the same request's item of just that span would be; the item itself as without segments, its
        media past the single-item limits cut where the model must cut them (truncate on).

        Text: every span in one step (spans of at most `tokens` text tokens, `_text_spans`). Audio and
        video: the file is decoded once, front to back, and each span comes as soon as it is decoded
        (`audio.stream_clips`, `video.decode_spans`), so memory holds one span, not the file.
        """
        unit, part, spec = item.span_unit, item.parts[0], item.segments
        if unit is None or spec is None:
            raise InputError("this item has no segments to prepare", param="segments")
        whole_options = replace(options, truncate=True)
        self._begin(item, options)
        if isinstance(part, TextPart):
            yield self._text_segments(item, part.text, int(unit), spec.overlap, options)
            return
        index = 0
        if part.kind == "audio":
            size = round(float(unit) * audio.SAMPLE_RATE)
            for clip in audio.stream_clips(
                part.data, seconds=float(unit), overlap=spec.overlap, limits=self.limits, cancel=cancel
            ):
                check_cancel(cancel)
                s = self._begin(item, whole_options)
                if clip.whole:
                    self._add_audio(s, clip.wave, clip.cut)
                    yield [(None, self._finish_one(s, whole_options))]
                    continue
                wave = clip.wave[: audio.MAX_SAMPLES]  # a span over 30 s: cut as it would be alone
                if len(wave) < size and audio.num_soft_tokens(self.log_mel.mask(len(wave))) == 0:
                    continue  # a last sliver too short to embed (under 10 ms of sound)
                self._add_audio(s, wave, len(clip.wave) > len(wave))
                rate = audio.SAMPLE_RATE
                yield [(Span(index, clip.start / rate, clip.end / rate), self._finish_one(s, whole_options))]
                index += 1
            return
        for plan, sampled in video.decode_spans(
            part.data,
            self.video_config,
            self.limits,
            seconds=float(unit),
            overlap=spec.overlap,
            geometry=self.geometry,
            cancel=cancel,
        ):
            check_cancel(cancel)
            s = self._begin(item, whole_options)
            self._add_video(s, sampled)
            span = None if plan is None else Span(index, plan.start, plan.end)
            yield [(span, self._finish_one(s, whole_options))]
            index += plan is not None

    def _finish_one(self, s: _Staged, options: PrepareOptions) -> Prepared:
        self._render(s, options)
        return self._finish(s, s.head + self.tokenizer.encode_batch([s.text])[0], options)

    def _text_segments(
        self, item: Item, text: str, tokens: int, overlap: float, options: PrepareOptions
    ) -> list[tuple[Span | None, Prepared]]:
        """The text item itself and its spans, prepared in one batch (one tokenizer call)."""
        check_text(text, self.markers)
        prompt_tokens = len(self.tokenizer.encode_batch([options.prompt])[0]) if options.prompt else 0
        room = self.max_tokens - len(self.tokenizer.prefix) - len(self.tokenizer.suffix) - prompt_tokens
        if room < 1:
            raise InputTooLongError("the prompt leaves no room for text in a segment", param="prompt")
        bounds = self._text_spans(text, min(tokens, room), overlap)
        items = [item, *(Item((TextPart(text[a:b]),)) for a, b in bounds)]
        prepared = self.prepare_batch(items, replace(options, truncate=True), raise_errors=True)
        spans = [None, *(Span(i, a, b) for i, (a, b) in enumerate(bounds))]
        return [(span, p) for span, p in zip(spans, prepared, strict=True) if isinstance(p, Prepared)]

    def _text_spans(self, text: str, size: int, overlap: float) -> list[tuple[int, int]]:
        """[start, end) character spans of `text`, each of at most `size` tokens of its tokenization,
        cut at token boundaries, the next starting `size * (1 - overlap)` tokens after the last
        (preprocess/segments.py). Each cut is moved back to the last provable cut point before it
        (TextTokenizer.cut_point), where the text on either side tokenizes as it does in the whole:
        then a span alone has exactly the tokens it had in the whole. (Where the tokenizer proves no
        cut point, the cut stays at the token boundary, and a span alone may tokenize a token or
        two differently at its edges.) Each span is embedded alone in any case."""
        starts = [a for a, _ in self.tokenizer.tokenizer.encode(text, add_special_tokens=False).offsets]
        n, step = len(starts), segments.step_of(size, overlap)
        out: list[tuple[int, int]] = []
        first, lo = 0, 0  # the span's first token and its first character
        while True:
            # Tokens of one character (byte fallback) share its offsets: cut after `lo` at the least.
            at = starts[first + size] if first + size < n else len(text)
            if at <= lo:
                after = bisect.bisect_right(starts, lo)
                at = starts[after] if after < n else len(text)
            if at >= len(text):
                out.append((lo, len(text)))
                return out
            end = self._cut_before(text, lo, at)
            out.append((lo, end))
            nxt = end if step >= size else self._cut_before(text, lo, starts[first + step])
            lo = nxt if lo < nxt <= end else end
            first = bisect.bisect_left(starts, lo)

    def _cut_before(self, text: str, lo: int, at: int) -> int:
        """The last provable cut point p with lo < p <= at; `at` itself (a token boundary) if none."""
        p = self.tokenizer.last_cut_point(text[lo : at + 1])
        return lo + p if p > 0 else at

    def _render(self, s: _Staged, options: PrepareOptions) -> None:
        """Set `s.text`, the string left to tokenize, and `s.head`, the ids of its start known in advance.

        Reference path: the whole rendered string. Fast path, the same ids: (1) text past `text_bound`
        characters (the prompt included) cannot reach the model, whose text tokens are cut at
        max_tokens: the piece that crosses the bound is cut at the first provable cut point past it
        (TextTokenizer.cut_point) and later text is dropped (its tokens would be dropped after the
        first max_tokens ones); media blocks all stay. With truncate off, such an item is refused here:
        it has more than text_bound / max_token_chars = max_tokens text tokens. (2) The prompt up to its
        last cut point is tokenized once per prompt (cached) rather than once per item.
        """
        if not self.bounded_text:
            s.text = "".join(piece for _, piece in s.pieces)
            return
        budget = self.text_bound
        kept: list[str] = []
        cut = False
        after_text = False  # the last kept piece is text: a cut at 0 would split a run
        for is_text, piece in s.pieces:
            if not is_text:
                kept.append(piece)
                after_text = False
                continue
            if cut or not piece:
                continue
            if len(piece) <= budget:
                kept.append(piece)
                budget -= len(piece)
                after_text = True
                continue
            if not options.truncate:
                raise InputTooLongError(
                    f"input is more than {self.max_tokens} tokens (over {self.text_bound} characters of text); "
                    "send truncate=true to cut the text",
                    param="input",
                )
            at = 0 if budget == 0 and not after_text else max(budget, 1)
            if at:
                at = self.tokenizer.cut_point(piece, at) or min(len(piece), at + CUT_WINDOW)
            kept.append(piece[:at])
            cut = True
        prompt = s.pieces[0][1]
        if prompt and kept[0] == prompt:  # not cut: its head is every item's
            head, head_ids = self.prompt_head(prompt)
            kept[0] = prompt[head:]
            s.head = list(head_ids)
        s.text = "".join(kept)

    def _split_prompt(self, prompt: str) -> tuple[int, tuple[int, ...]]:
        """(h, ids of prompt[:h]) for the prompt's last cut point h: what every item shares."""
        head = self.tokenizer.last_cut_point(prompt)
        return head, tuple(self.tokenizer.encode_batch([prompt[:head]])[0]) if head else ()

    def expand_ids(
        self, ids: list[int], soft: dict[int, Iterator[int]], options: PrepareOptions
    ) -> tuple[torch.Tensor, bool]:
        """An item's token ids -> (input_ids with <bos>, <eos> and its soft tokens, truncated?), cut to
        the context or refused as `options.truncate` says (layout.expand)."""
        return expand(
            ids,
            soft,
            prefix=self.tokenizer.prefix,
            suffix=self.tokenizer.suffix,
            max_tokens=self.max_tokens,
            truncate=options.truncate,
            marker_ids=set(self.markers.ids.values()),
        )

    def _finish(self, s: _Staged, ids: list[int], options: PrepareOptions) -> Prepared:
        input_ids, truncated = self.expand_ids(ids, {k: iter(v) for k, v in s.soft.items()}, options)
        p = Prepared(
            input_ids=input_ids,
            modality=s.item.modality,
            text_truncated=truncated,
            audio_truncated=s.audio_truncated,
            frame_timestamps=s.timestamps,
            media_tokens=s.media_tokens,
        )
        if s.images:
            p.pixel_values = _cat([x.pixel_values for x in s.images])
            p.image_position_ids = _cat([x.position_ids for x in s.images])
        if s.videos:
            p.pixel_values_videos = _cat([x.pixel_values for x in s.videos])
            p.video_position_ids = _cat([x.position_ids for x in s.videos])
            p.num_frames_per_video = torch.tensor(s.frame_counts, dtype=torch.int64)
        if s.audio:
            # Pad every audio's frames to the longest, as the reference's batch padding does.
            frames = max(f.shape[0] for f, _ in s.audio)
            feats = np.zeros((len(s.audio), frames, self.log_mel.config.feature_size), dtype=np.float32)
            masks = np.zeros((len(s.audio), frames), dtype=bool)
            for i, (f, mask) in enumerate(s.audio):
                feats[i, : len(f)], masks[i, : len(mask)] = f, mask
            p.input_features, p.input_features_mask = torch.from_numpy(feats), torch.from_numpy(masks)
        return p


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat, without its copy for the usual single part (one image's patches are 7.7 MB)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass
class _Staged:
    """An item between decoding and tokenization."""

    item: Item
    # The rendered string, piece by piece: (True, prompt), (True, text) per text part, (False, block) per media
    # part (one placeholder per block; the blocks are special tokens).
    pieces: list[tuple[bool, str]]
    text: str = ""  # what is left to tokenize (see Preprocessor._render)
    head: list[int] = field(default_factory=list)  # ids of the text before `text`, tokenized in advance
    images: list[image.PatchedImages] = field(default_factory=list)
    videos: list[image.PatchedImages] = field(default_factory=list)
    frame_counts: list[int] = field(default_factory=list)
    timestamps: list[list[float]] = field(default_factory=list)
    audio: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (F, 128) features, (F,) mask
    audio_truncated: bool = False
    soft: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))  # placeholder id -> counts
    media_tokens: list[tuple[MediaKind, int]] = field(default_factory=list)  # per media part


def _first_and_last(length: int, size: int, overlap: float) -> list[tuple[int, int]]:
    """The first and the last of `segments.spans(length, size, overlap)` (every other is as the first)."""
    n = segments.count(length, size, overlap)
    start = (n - 1) * segments.step_of(size, overlap)
    return [(0, min(size, length)), (start, length)]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path.name} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{path.name} must hold a JSON object")
    return d


def prepare_item(item: Item, options: PrepareOptions, ctx: Preprocessor) -> Prepared:
    """Preprocess one item with the tokenizer, prompts and settings held by `ctx`."""
    return ctx.prepare(item, options)
