#!/usr/bin/env bash
# `make image` and `make image-test`: build the image with docker or podman, whichever works here,
# then (test) run it and check it from outside (docker/image_test.py).
#
#   docker/image.sh build | test
#
# Variables (from make or the environment; empty means the public default):
#   VARIANT        cpu (default) or cuda
#   IMAGE          the tag to build and test (default eg2-serve:$VARIANT)
#   ENGINE         docker or podman (default: docker when its daemon answers, else podman)
#   CPU_BASE       the CPU variant's base image; CUDA_BASE the CUDA one's
#   TORCH_INDEX    the index torch comes from
#   TORCH_WHEELS   a folder of torch wheels (mounted read-only into the build); TORCH_VERSION
#                  then defaults to the newest torch wheel there, and torch's own dependencies
#                  come from PyPI unless TORCH_INDEX says otherwise
#   TORCH_VERSION  the torch release to install
#   CA_BUNDLE      a PEM file pip trusts during the build (passed as the build secret ca_bundle)
#   IMAGE_CACHE    where `make image-setup` wrote this host's values (image.env), read first
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE_CACHE=${IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/eg2-image}
VARIANT=${VARIANT:-cpu}
IMAGE=${IMAGE:-eg2-serve:$VARIANT}

say() { printf 'image: %s\n' "$*"; }
die() { printf 'image: %s\n' "$*" >&2; exit 1; }

engine_works() { "$1" info >/dev/null 2>&1; }

# This host's values from the podman route's setup, when it ran.
if [ -f "$IMAGE_CACHE/image.env" ]; then
    # shellcheck disable=SC1091
    . "$IMAGE_CACHE/image.env"
fi
if [ -z "${ENGINE:-}" ]; then
    if command -v docker >/dev/null && engine_works docker; then ENGINE=docker
    elif command -v podman >/dev/null && engine_works podman; then ENGINE=podman
    elif [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        say "no working container engine (docker's daemon does not answer, podman is not installed):"
        say "setting up podman with docker/setup-podman-debian.sh (what each step is for is written there)"
        docker/setup-podman-debian.sh
        # shellcheck disable=SC1091
        . "$IMAGE_CACHE/image.env"
    else
        die "no working container engine: start Docker, install podman, or on Debian run \`sudo make image-setup\`"
    fi
fi
command -v "$ENGINE" >/dev/null || die "ENGINE=$ENGINE is not installed"
# A local base the setup imported is gone (`podman system reset`): import it again.
if [ "$ENGINE" = podman ] && [[ "${CPU_BASE:-}" == localhost/* ]] && ! podman image exists "$CPU_BASE"; then
    say "$CPU_BASE is missing from podman's storage: running docker/setup-podman-debian.sh again"
    docker/setup-podman-debian.sh
fi

build() {
    local args=(build -f docker/Dockerfile --build-arg "VARIANT=$VARIANT" -t "$IMAGE")
    # podman writes OCI images by default, which have no HEALTHCHECK; the Docker format keeps it.
    [ "$ENGINE" = podman ] && args+=(--format docker)
    [ -n "${CPU_BASE:-}" ] && args+=(--build-arg "CPU_BASE=$CPU_BASE")
    [ -n "${CUDA_BASE:-}" ] && args+=(--build-arg "CUDA_BASE=$CUDA_BASE")
    if [ -n "${TORCH_WHEELS:-}" ]; then
        [ -d "$TORCH_WHEELS" ] || die "TORCH_WHEELS=$TORCH_WHEELS is not a folder"
        if [ -z "${TORCH_VERSION:-}" ]; then
            TORCH_VERSION=$(cd "$TORCH_WHEELS" && ls torch-*.whl 2>/dev/null | cut -d- -f2 | sort -V | tail -n1)
            [ -n "$TORCH_VERSION" ] || die "no torch wheel in TORCH_WHEELS=$TORCH_WHEELS"
        fi
        TORCH_INDEX=${TORCH_INDEX:-https://pypi.org/simple}
        args+=(--build-context "torch-wheels=$TORCH_WHEELS")
    fi
    [ -n "${TORCH_VERSION:-}" ] && args+=(--build-arg "TORCH_VERSION=$TORCH_VERSION")
    [ -n "${TORCH_INDEX:-}" ] && args+=(--build-arg "TORCH_INDEX=$TORCH_INDEX")
    if [ -n "${CA_BUNDLE:-}" ]; then
        [ -r "$CA_BUNDLE" ] || die "CA_BUNDLE=$CA_BUNDLE is not readable"
        args+=(--secret "id=ca_bundle,src=$CA_BUNDLE")
    fi
    say "building $IMAGE with $ENGINE: base ${CPU_BASE:-Dockerfile default}, torch ${TORCH_VERSION:-Dockerfile default}" \
        "from ${TORCH_WHEELS:+$TORCH_WHEELS and }${TORCH_INDEX:-the variant default index}${CA_BUNDLE:+, pip trusting $CA_BUNDLE}"
    say "$ENGINE ${args[*]} ."
    local start=$SECONDS
    "$ENGINE" "${args[@]}" .
    local size
    size=$("$ENGINE" image inspect -f '{{.Size}}' "$IMAGE")
    say "built $IMAGE in $((SECONDS - start)) s: $((size / 1000000)) MB ($size bytes, uncompressed)"
}

case "${1:-}" in
    build) build ;;
    test) exec python3 docker/image_test.py --engine "$ENGINE" --image "$IMAGE" --variant "$VARIANT" ;;
    *) die "usage: docker/image.sh build|test" ;;
esac
