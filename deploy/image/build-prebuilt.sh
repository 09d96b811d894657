#!/usr/bin/env bash
# Builds kvgate's image from a binary built on this machine, with Dockerfile.prebuilt:
#   deploy/image/build-prebuilt.sh [BINARY] [TAG]
# BINARY defaults to target/release/kvgate (`cargo build --release -p kvgate
# --no-default-features`), TAG to kvgate:dev. The builder is $BUILDER, else docker (when its
# daemon answers), podman or buildah, the first found; buildah runs with chroot isolation and,
# unless STORAGE_DRIVER says otherwise, vfs storage, which work inside an unprivileged
# container. The libraries are copied from this machine: the binary must have been built
# against a glibc no newer than its own.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${1:-$root/target/release/kvgate}
tag=${2:-kvgate:dev}
[ -x "$bin" ] || { echo "no kvgate binary at $bin" >&2; exit 2; }

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
rootfs=$ctx/rootfs
mkdir -p "$rootfs/usr/local/bin" "$rootfs/etc/kvgate" "$rootfs/etc/ssl/certs" "$rootfs/tmp"
chmod 1777 "$rootfs/tmp"

# The binary without its debug line tables (symbol names stay, for backtraces).
objcopy --strip-debug "$bin" "$rootfs/usr/local/bin/kvgate"
chmod 0755 "$rootfs/usr/local/bin/kvgate"

# Every shared library the binary loads, and the dynamic loader, at the paths ldd names.
libs=$(ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }')
[ -n "$libs" ] || { echo "ldd lists no libraries for $bin" >&2; exit 2; }
for lib in $libs; do
    cp -L --parents "$lib" "$rootfs/"
done

printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$rootfs/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' >"$rootfs/etc/group"
# Names through /etc/hosts, then DNS (workers and NATS are reached by Service names).
printf 'hosts: files dns\n' >"$rootfs/etc/nsswitch.conf"
# TLS to NATS or the Kubernetes API may verify against the system's roots.
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/"
fi
cp "$root/deploy/image/Dockerfile.prebuilt" "$ctx/Dockerfile"

builder=${BUILDER:-}
if [ -z "$builder" ]; then
    # docker only with a daemon to talk to.
    if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
        builder=docker
    elif command -v podman >/dev/null; then
        builder=podman
    elif command -v buildah >/dev/null; then
        builder=buildah
    fi
fi
case "$builder" in
    buildah) buildah --storage-driver "${STORAGE_DRIVER:-vfs}" bud --isolation chroot -f "$ctx/Dockerfile" -t "$tag" "$ctx" ;;
    docker | podman) "$builder" build -f "$ctx/Dockerfile" -t "$tag" "$ctx" ;;
    *) echo "no image builder: install docker, podman or buildah (apt-get install buildah)" >&2; exit 2 ;;
esac
echo "built $tag from $bin with $builder"
