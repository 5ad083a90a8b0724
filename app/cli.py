"""The `eg2` command: `serve` here; the runtime's tools wired in, imported only when called.

eg2 serve [--model DIR] [--port 8000] ...     every Settings field is a flag (and an EG2_* variable)
eg2 serve-ray --replicas N [--min-replicas A --max-replicas B] ...   the same app as N Ray Serve replicas
eg2 quantize SRC DST [--group-size 32|64|128]
eg2 demo-model DST --size tiny|full [--seed N] [--dtype bfloat16|float32]
eg2 embed [--model DIR] [--dimensions N] [--json] INPUT...   text, or image/audio/video file paths
eg2 bench ...                                 arguments go to benchmarks.bench (a source checkout only)
"""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from app.settings import Settings, describe_default, env_name, flag_name
from eg2_runtime.errors import EG2Error
from eg2_runtime.inputs import MATRYOSHKA_DIMS, Segments


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    for field, info in Settings.model_fields.items():
        help_text = f"{info.description} [{env_name(field)}; default: {describe_default(field)}]"
        # `%` in a description would be read as an argparse format
        help_text = help_text.replace("%", "%%")
        # bool, or bool | None (unset: decided elsewhere): --flag / --no-flag
        if info.annotation is bool or set(typing.get_args(info.annotation)) == {bool, type(None)}:
            parser.add_argument(
                flag_name(field), dest=field, action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            parser.add_argument(flag_name(field), dest=field, metavar=field.upper(), help=help_text)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Flags given on the command line win over EG2_* variables, which win over defaults."""
    given = {f: getattr(args, f) for f in Settings.model_fields if getattr(args, f, None) is not None}
    return Settings(**given)


def _settings_or_report(args: argparse.Namespace, prog: str) -> Settings | None:
    """The settings, or None after printing each invalid one (no traceback)."""
    try:
        return settings_from_args(args)
    except ValidationError as exc:
        for error in exc.errors(include_url=False, include_input=False):
            where = ".".join(str(p) for p in error["loc"]) or "settings"
            print(f"{prog}: {where}: {error['msg']}", file=sys.stderr)
        return None


def _serve(args: argparse.Namespace) -> int:
    from app.logs import setup_logging
    from app.server import serve

    settings = _settings_or_report(args, "eg2 serve")
    if settings is None:
        return 2
    setup_logging(settings.log_level, settings.log_json)
    return serve(settings)


def _serve_ray(args: argparse.Namespace) -> int:
    from app.logs import setup_logging

    settings = _settings_or_report(args, "eg2 serve-ray")
    if settings is None:
        return 2
    try:
        from app.ray_serve import ScaleOptions, serve_ray
    except ImportError as exc:  # ray is an optional dependency
        print(f"eg2 serve-ray: needs ray[serve] ({exc}); pip install 'eg2-serve[ray]'", file=sys.stderr)
        return 2
    try:
        options = ScaleOptions(
            replicas=args.replicas,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests,
            max_ongoing_requests=args.max_ongoing_requests,
            num_cpus=args.cpus_per_replica,
            num_gpus=args.gpus_per_replica,
            ingress=args.ingress,
        )
    except ValueError as exc:
        print(f"eg2 serve-ray: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_json)
    return serve_ray(settings, options, address=args.ray_address)


def _add_scale_flags(parser: argparse.ArgumentParser) -> None:
    """Deployment knobs of `serve-ray` (app/ray_serve.py ScaleOptions); the service settings follow."""
    group = parser.add_argument_group("replicas (Ray Serve)")
    group.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="replicas to run, one per GPU (initial count when autoscaling)",
    )
    group.add_argument("--min-replicas", type=int, help="autoscale: fewest replicas (with --max-replicas)")
    group.add_argument("--max-replicas", type=int, help="autoscale: most replicas (with --min-replicas)")
    group.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=16.0,
        help="autoscale: ongoing requests per replica Ray aims for; lower scales out sooner, before a "
        "replica's batches are full [default: 16]",
    )
    group.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=128,
        help="requests Ray hands one replica at once (the rest wait in Ray's proxy) [default: 128]",
    )
    group.add_argument(
        "--cpus-per-replica", type=float, default=1.0, help="CPU cores Ray reserves per replica [default: 1]"
    )
    group.add_argument(
        "--gpus-per-replica",
        type=float,
        help="GPUs per replica [default: 1 when the cluster has GPUs and --device is not cpu, else 0]",
    )
    group.add_argument(
        "--ingress",
        choices=("proxy", "haproxy"),
        default="proxy",
        help="what receives HTTP: Ray's Python proxy (a lost replica's requests get the API's 503; one "
        "per node caps it near 300 small requests/s) or HAProxy before each replica's own server "
        "(several times the requests/s; a client's idle connection may drop when replicas change) "
        "[default: proxy]",
    )
    group.add_argument(
        "--ray-address", help="join this Ray cluster (e.g. `auto` or ray://host:10001); default: start one"
    )


def _quantize(args: argparse.Namespace) -> int:
    from eg2_runtime.errors import CheckpointError
    from eg2_runtime.tools.quantize import quantize_checkpoint

    try:
        report = quantize_checkpoint(Path(args.src), Path(args.dst), group_size=args.group_size)
    except (CheckpointError, ValueError, FileNotFoundError) as exc:
        print(f"eg2 quantize: {exc}", file=sys.stderr)
        return 1
    packed = ", ".join(f"{tower} {n}" for tower, n in report.packed.items())
    print(
        f"{sum(report.packed.values())} Linear layers packed ({packed}), {report.copied} tensors copied; "
        f"{report.bytes_in / 2**20:.1f} MiB -> {report.bytes_out / 2**20:.1f} MiB"
    )
    return 0


def _demo_model(args: argparse.Namespace) -> int:
    from eg2_runtime.tools.demo_model import write_demo_model

    kwargs: dict[str, Any] = {"size": args.size, "seed": args.seed}
    if args.dtype is not None:
        kwargs["dtype"] = args.dtype
    write_demo_model(Path(args.dst), **kwargs)
    return 0


def _embed(args: argparse.Namespace) -> int:
    from eg2_runtime.tools.embed import embed_cli

    model_dir = args.model
    if model_dir is None:
        from app.service import DEMO_BANNER, ensure_demo_model

        print(DEMO_BANNER, file=sys.stderr)
        model_dir = ensure_demo_model(Settings().cache_dir)
    kwargs: dict[str, Any] = {"as_json": args.json, "device": args.device}
    if args.dimensions is not None:
        kwargs["dimensions"] = args.dimensions
    if args.segment_seconds is not None or args.segment_tokens is not None:
        try:
            kwargs["segments"] = Segments(
                seconds=args.segment_seconds, tokens=args.segment_tokens, overlap=args.overlap
            )
        except EG2Error as e:
            print(f"eg2 embed: {e.message}", file=sys.stderr)
            return 2
    result = embed_cli(Path(model_dir), list(args.inputs), **kwargs)
    return result if isinstance(result, int) else 0


BENCH_MISSING = (
    "eg2 bench: the benchmark is not part of the installed package; it runs from a source checkout:\n"
    "  git clone <this repository> && cd eg2-serve && pip install -e '.[bench]' && eg2 bench --help"
)


def checkout_root() -> Path | None:
    """The source checkout this `app` package runs from (an editable install), if it holds the
    benchmarks; None for an installed wheel, which ships only app/ and eg2_runtime/."""
    import app

    root = Path(app.__file__).resolve().parents[1]
    ours = (root / "benchmarks" / "bench.py").is_file() and (root / "pyproject.toml").is_file()
    return root if ours else None


def _bench(args: argparse.Namespace) -> int:
    root = checkout_root()
    if root is None:
        print(BENCH_MISSING, file=sys.stderr)
        return 2
    if str(root) not in sys.path:  # the `eg2` script's path holds the installed packages, not the checkout
        sys.path.insert(0, str(root))
    try:
        from benchmarks.bench import main as bench_main
    except ImportError as exc:  # the [bench] extra is missing
        print(f"eg2 bench: {exc}; pip install -e '.[bench]' in the checkout", file=sys.stderr)
        return 2
    return bench_main(list(args.argv))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eg2", description="EmbeddingGemma 2 embedding service and tools")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the HTTP server")
    _add_settings_flags(serve)
    serve.set_defaults(run=_serve)

    serve_ray = sub.add_parser("serve-ray", help="run the HTTP server as Ray Serve replicas (one per GPU)")
    _add_scale_flags(serve_ray)
    _add_settings_flags(serve_ray)
    serve_ray.set_defaults(run=_serve_ray)

    quantize = sub.add_parser("quantize", help="pack a checkpoint's linear weights to 4 bits")
    quantize.add_argument("src")
    quantize.add_argument("dst")
    quantize.add_argument("--group-size", type=int, choices=(32, 64, 128), default=128)
    quantize.set_defaults(run=_quantize)

    demo = sub.add_parser("demo-model", help="write a random-weight checkpoint (for tests and demos)")
    demo.add_argument("dst")
    demo.add_argument("--size", choices=("tiny", "full"), required=True)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--dtype", choices=("bfloat16", "float32"))
    demo.set_defaults(run=_demo_model)

    embed = sub.add_parser("embed", help="embed inputs in-process and print the vectors")
    embed.add_argument("--model", help="checkpoint directory (default: the demo checkpoint)")
    embed.add_argument("--dimensions", type=int, choices=sorted(MATRYOSHKA_DIMS))
    embed.add_argument("--json", action="store_true", help="print every full vector as a JSON line")
    embed.add_argument("--device", default="auto", help="auto, cuda or cpu")
    embed.add_argument(
        "--segment-seconds", type=float, help="also embed spans of this many seconds of each audio or video"
    )
    embed.add_argument("--segment-tokens", type=int, help="also embed spans of this many tokens of each text")
    embed.add_argument("--overlap", type=float, default=0.0, help="share of a span repeated in the next")
    embed.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="text, or a path to an image/audio/video file"
    )
    embed.set_defaults(run=_embed)

    bench = sub.add_parser(
        "bench",
        help="benchmark the engine and the server against the reference (a source checkout)",
        add_help=False,
    )
    bench.add_argument("argv", nargs=argparse.REMAINDER)
    bench.set_defaults(run=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # everything after `bench` belongs to the benchmark's own parser, as is
        return _bench(argparse.Namespace(argv=argv[1:]))
    args = build_parser().parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
