"""Settings (EG2_* variables and `eg2 serve` flags), the `eg2` CLI wiring, and the docs that describe them."""

from __future__ import annotations

import sys
import types
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from app import cli
from app.settings import Settings, env_name, flag_name, markdown_table, settings_page
from eg2_runtime import samples
from eg2_runtime.inputs import MediaLimits

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("EG2_"):
            monkeypatch.delenv(key)


def test_defaults_are_safe() -> None:
    s = Settings()
    assert s.host == "127.0.0.1" and s.port == 8000
    assert s.api_key is None and s.cors_origins == [] and not s.allow_remote_urls and s.media_dir is None
    assert s.model is None and s.max_queue_delay_ms <= 5
    assert s.max_request_items <= s.max_queued_items


def test_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EG2_MODEL", "/models")
    monkeypatch.setenv("EG2_MAX_BATCH_TOKENS", "2048")
    monkeypatch.setenv("EG2_MODALITIES", "text, image")
    monkeypatch.setenv("EG2_CORS_ORIGINS", "https://a.example,https://b.example")
    monkeypatch.setenv("EG2_ALLOW_REMOTE_URLS", "true")
    monkeypatch.setenv("EG2_API_KEY", "k")
    s = Settings()
    assert s.model == Path("/models") and s.max_batch_tokens == 2048
    assert s.modalities == ["image", "text"]
    assert s.cors_origins == ["https://a.example", "https://b.example"]
    assert s.allow_remote_urls and s.api_key is not None and s.api_key.get_secret_value() == "k"


def test_empty_variables_mean_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EG2_API_KEY", "")
    monkeypatch.setenv("EG2_MODEL", "")
    s = Settings()
    assert s.api_key is None and s.model is None


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EG2_PORT", "9000")
    monkeypatch.setenv("EG2_LOG_JSON", "true")
    args = cli.build_parser().parse_args(
        ["serve", "--port", "8123", "--no-log-json", "--aliases", "a,b", "--max-queue-delay-ms", "0.5"]
    )
    s = cli.settings_from_args(args)
    assert s.port == 8123 and s.log_json is False and s.aliases == ["a", "b"] and s.max_queue_delay_ms == 0.5
    assert cli.settings_from_args(cli.build_parser().parse_args(["serve"])).port == 9000


def test_every_setting_is_a_flag() -> None:
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for field in Settings.model_fields:
        assert flag_name(field) in help_text and env_name(field) in help_text, field


@pytest.mark.parametrize(
    "bad",
    [
        {"max_batch_tokens": 0},
        {"modalities": "text,smell"},
        {"max_request_items": 10, "max_queued_items": 5},
        {"port": 70000},
        {"not_a_setting": 1},
        {"log_level": "loud"},
    ],
)
def test_bad_settings_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        Settings(**bad)


def test_serve_reports_bad_settings_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--max-batch-tokens", "lots"]) == 2
    err = capsys.readouterr().err
    assert "max_batch_tokens" in err and "Traceback" not in err


def test_secret_is_not_in_repr_or_dump() -> None:
    s = Settings(api_key="sk-very-secret")
    assert "sk-very-secret" not in repr(s) and "sk-very-secret" not in str(s.model_dump(mode="json"))


def test_media_limits_have_one_source(tiny_bf16: Path) -> None:
    """The engine's decoding limits come from Settings alone: MediaLimits declares no defaults (the video
    length was 300 s in Settings and 120 s in MediaLimits), each of its fields is a setting, and the
    engine the service loads holds exactly those values."""
    from app.service import load_engine

    assert all(f.default is MISSING and f.default_factory is MISSING for f in fields(MediaLimits))
    s = Settings(
        model=tiny_bf16, device="cpu", max_video_seconds=42.0, max_image_pixels=1234, max_audio_channels=3
    )
    limits = s.media_limits()
    assert {f.name: getattr(limits, f.name) for f in fields(MediaLimits)} == {
        f.name: getattr(s, f.name) for f in fields(MediaLimits)
    }
    engine: Any = load_engine(s)
    assert engine.preprocessor.limits == limits


def test_engine_settings_reach_the_engine(tiny_bf16: Path) -> None:
    """engine_cpu_threads and packed_text become the loaded engine's options (the engine reads
    nothing from the environment itself)."""
    from app.service import load_engine

    engine: Any = load_engine(
        Settings(model=tiny_bf16, device="cpu", engine_cpu_threads=1, packed_text=False)
    )
    assert engine.cpu_threads == 1
    assert engine.options.packed_text is False and engine.options.cpu_threads == 1


def test_docs_settings_page_is_current() -> None:
    """docs/SETTINGS.md is the page generated from the field descriptions, verbatim."""
    page = (REPO / "docs" / "SETTINGS.md").read_text()
    assert page == settings_page(), (
        "docs/SETTINGS.md is stale: run `python -m app.settings > docs/SETTINGS.md`"
    )
    assert markdown_table() in page


# --- the runtime tools behind the CLI --------------------------------------------------------------


def fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []
    module = types.ModuleType(name)
    for attr, result in attrs.items():

        def fn(*args: Any, _attr: str = attr, _result: Any = result, **kwargs: Any) -> Any:
            calls.append((_attr, args, kwargs))
            return _result

        setattr(module, attr, fn)
    monkeypatch.setitem(sys.modules, name, module)
    return calls


def test_demo_model_quantize_and_embed_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real tools behind `eg2 demo-model`, `eg2 quantize` and `eg2 embed`, end to end."""
    src, dst = tmp_path / "tiny", tmp_path / "tiny-w4"
    assert cli.main(["demo-model", str(src), "--size", "tiny", "--seed", "3"]) == 0
    assert (src / "model.safetensors").is_file() and (src / "tokenizer.json").is_file()
    assert cli.main(["quantize", str(src), str(dst), "--group-size", "64"]) == 0
    assert "Linear layers packed (vision_tower" in capsys.readouterr().out
    assert cli.main(["quantize", str(dst), str(tmp_path / "again")]) == 1
    assert "already quantized" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["quantize", str(src), str(dst), "--group-size", "48"])
    png = tmp_path / "cat.png"
    png.write_bytes(samples.png(64, 48))
    assert (
        cli.main(["embed", "--model", str(dst), "--device", "cpu", "--dimensions", "256", "hello", str(png)])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["text", "image"] and all(
        "|v|=1.000" in line for line in lines
    )


def test_bench_wiring(monkeypatch: pytest.MonkeyPatch) -> None:
    """`eg2 bench` finds the benchmarks in this source checkout and hands them its arguments untouched."""
    assert cli.checkout_root() == REPO
    calls = fake_module(monkeypatch, "benchmarks.bench", main=3)
    assert cli.main(["bench", "--model", "m", "--batch", "8"]) == 3
    assert calls == [("main", (["--model", "m", "--batch", "8"],), {})]


def test_bench_from_an_installed_wheel_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A wheel ships app/ and eg2_runtime/ only: there `eg2 bench` explains, and runs nothing."""
    import app

    site = tmp_path / "site-packages"
    (site / "app").mkdir(parents=True)
    monkeypatch.setattr(app, "__file__", str(site / "app" / "__init__.py"))
    assert cli.checkout_root() is None
    calls = fake_module(monkeypatch, "benchmarks.bench", main=0)
    assert cli.main(["bench", "--quick"]) == 2
    assert calls == []
    assert "pip install -e '.[bench]'" in capsys.readouterr().err
