"""The wheels a GPU host without internet needs to run the service, its GPU tests and the benchmark.

`make wheelhouse` runs `python scripts/wheelhouse.py` (defaults: Python 3.12, manylinux x86_64 up to
glibc 2.39, the H200 image's package list, into .whl/). With pip, for the target interpreter and
platform, it downloads
  1. the project's pinned dependencies (pyproject.toml) and the reference packages the GPU tests pin
     (transformers, sentence-transformers, compressed-tensors from the `test` extra) that the host
     lacks or holds at another version;
  2. then, round by round, their own requirements that the host cannot serve;
one version of each, never torch, torchvision, torchaudio, triton, nvidia-* or cuda-*: the host has
them, and torch alone is far over the 64 MiB a device call may carry.

The host's packages come from a `pip list --format=freeze` taken there (a bare name where only the
name was recorded: such a package is taken to serve any requirement but an exact pin). On the host:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD

(docs/GPU.md). `--no-deps` because the set is already closed over what the host lacks.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

# packaging comes with pip's toolchain in every venv of this project (pytest requires it).
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent

# The GPU tests compare with these; the host's own versions are older (transformers 5.17 has no
# EmbeddingGemma 2).
REFERENCE = ("transformers", "sentence-transformers", "compressed-tensors")

# The host's: never carried.
NEVER = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*)$")

# Pins the host's own version serves, though it differs: the set must stay well under the 64 MiB a
# device call carries (PyAV is 34 MiB and transformers 13 MiB of it). Each is printed with its reason.
HOST_SERVES = {
    "numpy": "16 MiB; the host's torch and scientific stack are built against the host's numpy",
    "pillow": "7 MiB; it only decodes images, the resize is torch's (eg2_runtime/preprocess/image.py)",
    "uvloop": "4 MiB; the event loop only",
}

# manylinux_2_N for every glibc up to the target's, plus the legacy aliases pip matches literally.
LEGACY = {"manylinux1": 5, "manylinux2010": 12, "manylinux2014": 17}


def platform_tags(platform: str) -> list[str]:
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if m is None:
        return [platform]
    glibc, arch = int(m.group(1)), m.group(2)
    tags = [f"manylinux_2_{n}_{arch}" for n in range(glibc, 4, -1)]
    return tags + [f"{alias}_{arch}" for alias, n in LEGACY.items() if n <= glibc]


def read_host(path: Path) -> dict[str, Version | None]:
    """`name==version` lines (a `pip list --format=freeze`), or a bare name: version not recorded."""
    host: dict[str, Version | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        host[canonicalize_name(name)] = Version(version) if version else None
    return host


def project_pins() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # The reference packages are pinned in the [bench] extra (the test extra includes it).
    bench = {canonicalize_name(Requirement(r).name): r for r in project["optional-dependencies"]["bench"]}
    pins = [Requirement(r) for r in project["dependencies"]]
    return pins + [Requirement(bench[canonicalize_name(name)]) for name in REFERENCE]


def pinned_version(req: Requirement) -> Version | None:
    specs = list(req.specifier)
    if len(specs) == 1 and specs[0].operator == "==":
        return Version(specs[0].version)
    return None


class Wheelhouse:
    def __init__(self, python: str, platform: str, host: dict[str, Version | None], dest: Path):
        self.python, self.platforms, self.host, self.dest = python, platform_tags(platform), host, dest
        arch = platform.rsplit("_", 1)[-1] if platform.startswith("manylinux") else "x86_64"
        self.env = {
            "python_version": python,
            "python_full_version": f"{python}.0",
            "implementation_name": "cpython",
            "platform_python_implementation": "CPython",
            "sys_platform": "linux",
            "platform_system": "Linux",
            "os_name": "posix",
            "platform_machine": arch,
            "extra": "",
        }
        self.carried: dict[str, tuple[Version, Path]] = {}
        self.specs: dict[str, SpecifierSet] = {}
        self.assumed: set[str] = set()
        self.kept: list[str] = []
        self.unmet: list[str] = []

    def host_serves(self, name: str, spec: SpecifierSet, exact: bool) -> bool:
        if name not in self.host:
            return False
        have = self.host[name]
        if have is None:  # name recorded without its version
            if exact and name not in HOST_SERVES:
                return False
            self.assumed.add(name)
            return True
        return spec.contains(have, prereleases=True)

    def wanted(self, reqs: list[Requirement], top: bool) -> list[str]:
        """The names among reqs to fetch this round, as `name<spec>` for pip."""
        fetch: dict[str, SpecifierSet] = {}
        for req in reqs:
            name = canonicalize_name(req.name)
            if top and name in HOST_SERVES and name in self.host:
                self.kept.append(
                    f"{name}: the host's {self.host[name] or '(version not recorded)'} "
                    f"for the pinned {pinned_version(req)} ({HOST_SERVES[name]})"
                )
                continue
            spec = self.specs.get(name, SpecifierSet()) & req.specifier
            self.specs[name] = spec
            if NEVER.match(name):
                have = self.host.get(name)
                if have is not None and not spec.contains(have, prereleases=True):
                    self.unmet.append(f"{name}{spec} (host: {have})")
                continue
            if name in self.carried:
                version = self.carried[name][0]
                if not spec.contains(version, prereleases=True):
                    raise SystemExit(f"conflict: {name} {version} carried, but {req} needs {spec}")
                continue
            if self.host_serves(name, spec, exact=top and pinned_version(req) is not None):
                continue
            fetch[name] = spec
        return [f"{name}{spec}" for name, spec in fetch.items()]

    def download(self, reqs: list[str]) -> list[Path]:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                self.python,
                "--implementation",
                "cp",
                "-d",
                tmp,
            ]
            cmd += [arg for tag in self.platforms for arg in ("--platform", tag)]
            subprocess.run(cmd + reqs, check=True)
            paths = []
            for wheel in sorted(Path(tmp).glob("*.whl")):
                paths.append(self.dest / wheel.name)
                shutil.move(wheel, paths[-1])
            return paths

    def requirements(self, wheel: Path) -> list[Requirement]:
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            headers = Parser().parsestr(z.read(meta).decode())
        reqs = [Requirement(r) for r in headers.get_all("Requires-Dist") or []]
        return [r for r in reqs if r.marker is None or Marker(str(r.marker)).evaluate(self.env)]

    def build(self, pins: list[Requirement]) -> None:
        self.dest.mkdir(parents=True, exist_ok=True)
        for old in self.dest.glob("*.whl"):  # one version of each: no leftovers of an earlier set
            old.unlink()
        reqs, top = pins, True
        while True:
            names = self.wanted(reqs, top)
            if not names:
                return
            reqs, top = [], False
            for wheel in self.download(names):
                name, version, _, _ = parse_wheel_filename(wheel.name)
                self.carried[canonicalize_name(name)] = (version, wheel)
                reqs += self.requirements(wheel)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default="3.12", help="target interpreter, major.minor")
    p.add_argument(
        "--platform",
        default="manylinux_2_39_x86_64",
        help="target platform; manylinux_2_N_ARCH also takes every older glibc's wheels",
    )
    p.add_argument(
        "--host",
        type=Path,
        default=ROOT / "scripts" / "h200-packages.txt",
        help="the host's packages: a `pip list --format=freeze` taken there",
    )
    p.add_argument(
        "--dest", type=Path, default=ROOT / ".whl", help="where the wheels go (emptied of *.whl first)"
    )
    p.add_argument(
        "--max-mib",
        type=float,
        default=60.0,
        help="fail above this total: a device call carries 64 MiB, the repository included",
    )
    args = p.parse_args()

    house = Wheelhouse(args.python, args.platform, read_host(args.host), args.dest)
    house.build(project_pins())
    total = 0
    for name, (version, wheel) in sorted(house.carried.items()):
        size = wheel.stat().st_size
        total += size
        print(f"{size / 2**20:7.2f} MiB  {name}=={version}")
    for line in house.kept:
        print(f"kept from the host: {line}")
    if house.assumed:
        print(f"taken from the host (version not recorded): {', '.join(sorted(house.assumed))}")
    for line in house.unmet:
        print(f"WARNING: the host's version does not meet {line}")
    print(f"{len(house.carried)} wheels, {total / 2**20:.1f} MiB in {args.dest}")
    if total > args.max_mib * 2**20:
        raise SystemExit(f"over --max-mib {args.max_mib}")


if __name__ == "__main__":
    main()
