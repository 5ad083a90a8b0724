#!/usr/bin/env bash
# Sets up the podman route for `make image` / `make image-test` on a Debian host (as root), for
# hosts where Docker is not available, and writes down what this host needs in one file,
# $IMAGE_CACHE/image.env, which docker/image.sh reads. Safe to run again: done steps are skipped.
#
#   docker/setup-podman-debian.sh            (or `make image-setup`)
#
# What it does, and why:
#   1. installs podman (a Docker-compatible CLI that builds with its own builder), runc (the OCI
#      runtime it runs containers with) and debootstrap (for step 3), from Debian's packages;
#   2. writes a containers.conf for podman: containers keep the host's rlimits (some sandboxes
#      refuse to raise them: "error setting rlimit"), runc, and cgroupfs where no systemd runs;
#   3. the base image: the Dockerfile's public base (Debian 12 slim, pinned by digest) when a
#      registry answers; otherwise the same release debootstrapped from the Debian mirror that
#      apt's sources name, trimmed as the slim image is, and imported as localhost/debian:bookworm;
#   4. reads pip's own settings on this host: a CA bundle (`cert`, for a TLS-intercepting proxy)
#      becomes the build's ca_bundle secret, and a `find-links` folder holding a torch wheel for the
#      image's Python becomes the build's torch-wheels context;
#   5. checks that a container starts.
# Nothing else on the host changes. To undo: `podman system reset -f` (images and build cache, in
# podman's storage, /var/lib/containers/storage) and `rm -r "$IMAGE_CACHE"`.
set -euo pipefail

IMAGE_CACHE=${IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/eg2-image}
HERE=$(cd "$(dirname "$0")" && pwd)
LOCAL_BASE=localhost/debian:bookworm
SUITE=bookworm                # the public CPU base's release: its Python (3.11) is the image's
IMAGE_PYTHON_TAG=cp311

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (it installs packages and runs rootful podman)"
command -v apt-get >/dev/null || die "not a Debian host (no apt-get)"
mkdir -p "$IMAGE_CACHE"

# 1. the packages ---------------------------------------------------------------------------------
if command -v podman >/dev/null && command -v runc >/dev/null && command -v debootstrap >/dev/null; then
    say "1. podman, runc and debootstrap are installed"
else
    say "1. installing podman, runc and debootstrap"
    start=$SECONDS
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        podman runc debootstrap ca-certificates
    say "   installed in $((SECONDS - start)) s"
fi

# 2. podman's settings for this host ---------------------------------------------------------------
conf=$IMAGE_CACHE/containers.conf
cgroups=cgroupfs
[ -d /run/systemd/system ] && cgroups=systemd
cat > "$conf" <<EOF
# podman settings for eg2-serve's image builds and tests, written by docker/setup-podman-debian.sh.
# Used through CONTAINERS_CONF (docker/image.sh sets it); podman's own defaults apply elsewhere.
[containers]
# Containers inherit podman's rlimits instead of raising them (refused in some sandboxes).
default_ulimits = []

[engine]
runtime = "runc"
cgroup_manager = "$cgroups"
EOF
export CONTAINERS_CONF=$conf
say "2. wrote $conf (cgroup manager: $cgroups)"

# 3. the base image ----------------------------------------------------------------------------------
public_base=$(sed -n 's/^ARG CPU_BASE=//p' "$HERE/Dockerfile")
[ -n "$public_base" ] || die "no CPU_BASE in $HERE/Dockerfile"
base=""
if podman image exists "$public_base" || timeout 300 podman pull -q "$public_base" >/dev/null 2>&1; then
    say "3. base: $public_base (the Dockerfile's default)"
elif podman image exists "$LOCAL_BASE"; then
    base=$LOCAL_BASE
    say "3. base: $LOCAL_BASE (no registry answers; imported earlier)"
else
    base=$LOCAL_BASE
    # The mirror apt already uses: the only one known to be reachable from here.
    mirror=$(grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ \
                 2>/dev/null | grep -oE 'https?://[^ ]+' | head -n1 || true)
    mirror=${mirror:-http://deb.debian.org/debian}
    security=${mirror%/debian*}/debian-security
    say "3. base: no registry answers; debootstrapping Debian $SUITE from $mirror as $LOCAL_BASE"
    rootfs=$IMAGE_CACHE/rootfs.partial
    rm -rf "$rootfs"
    start=$SECONDS
    debootstrap --variant=minbase "$SUITE" "$rootfs" "$mirror" > "$IMAGE_CACHE/debootstrap.log" 2>&1 \
        || die "debootstrap failed; see $IMAGE_CACHE/debootstrap.log"
    # The same sources as the public image (updates and security included) ...
    rm -f "$rootfs/etc/apt/sources.list"
    cat > "$rootfs/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security
Suites: $SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    # ... and trimmed as the slim image is: no package caches or lists, and no documentation,
    # manual pages or translations, now or from later installs (copyright files stay).
    cat > "$rootfs/etc/dpkg/dpkg.cfg.d/slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
EOF
    cat > "$rootfs/etc/apt/apt.conf.d/slim" <<'EOF'
APT::Install-Recommends "false";
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/* \
           "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/*
    find "$rootfs/usr/share/doc" -mindepth 2 ! -name copyright ! -type d -delete
    tar -C "$rootfs" -c . | podman import -q --change 'CMD ["bash"]' - "$LOCAL_BASE" >/dev/null
    rm -rf "$rootfs"
    say "   imported $LOCAL_BASE in $((SECONDS - start)) s ($(podman image inspect -f '{{.Size}}' "$LOCAL_BASE") bytes)"
fi

# 4. pip's settings on this host ---------------------------------------------------------------------
pip_setting() {  # the first value of a pip option in any scope (`pip config list`: scope.key='value')
    python3 -m pip config list 2>/dev/null | sed -n "s/^[^=]*\.$1='\(.*\)'\$/\1/p" | head -n1
}
ca_bundle=$(pip_setting cert || true)
if [ -n "$ca_bundle" ] && [ -r "$ca_bundle" ]; then
    say "4. CA bundle: $ca_bundle (pip's cert)"
else
    ca_bundle=""
    say "4. CA bundle: none (pip has no cert setting)"
fi
torch_wheels=""
for dir in $(pip_setting find-links || true); do
    if compgen -G "$dir/torch-*-$IMAGE_PYTHON_TAG-*linux*.whl" >/dev/null; then torch_wheels=$dir; break; fi
done
if [ -n "$torch_wheels" ]; then
    say "   torch wheels: $torch_wheels (pip's find-links; $(cd "$torch_wheels" && ls torch-*-$IMAGE_PYTHON_TAG-*linux*.whl | tr '\n' ' '))"
else
    say "   torch wheels: none ($IMAGE_PYTHON_TAG torch wheels are not in pip's find-links); torch comes from its index"
fi

# What docker/image.sh reads. A variable given to make (`make image CA_BUNDLE=`) wins over these.
cat > "$IMAGE_CACHE/image.env" <<EOF
# Written by docker/setup-podman-debian.sh on $(date -u +%Y-%m-%dT%H:%MZ): how this host builds and
# runs eg2-serve's image. A value given to make or in the environment wins over these.
export CONTAINERS_CONF=\${CONTAINERS_CONF-$conf}
ENGINE=\${ENGINE-podman}
CPU_BASE=\${CPU_BASE-$base}
TORCH_WHEELS=\${TORCH_WHEELS-$torch_wheels}
CA_BUNDLE=\${CA_BUNDLE-$ca_bundle}
EOF
say "   wrote $IMAGE_CACHE/image.env"

# 5. a container starts ----------------------------------------------------------------------------
podman run --rm "${base:-$public_base}" true || die "a container does not start; see the error above"
say "5. a container starts: done. Next: make image-test"
