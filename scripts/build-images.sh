#!/usr/bin/env bash
# Builds the router and engine-cpu images without a container daemon: Debian's buildah, as root,
# with chroot isolation. No registry is needed: the base image is made from Debian's packages
# (mmdebstrap) and Python packages come from the package index pip uses here plus the local
# find-links directory (where the CPU torch wheel lies). The host's CA bundle is mounted
# read-only during the build (HTTPS here goes through an intercepting proxy); it is never
# copied into an image.
#
#   sudo scripts/build-images.sh              # router + engine-cpu
#   sudo scripts/build-images.sh router       # only the router
#
# Environment (all optional):
#   QUIRE_IMAGE_CACHE   where the base tarball is kept (default /var/cache/quire-images)
#   QUIRE_IMAGE_TAG     tag of the images (default: the version in pyproject.toml)
#   DEBIAN_MIRROR       the mirror mmdebstrap uses (default: deb.debian.org)
#   PIP_INDEX_URL       package index (default https://pypi.org/simple)
#   PIP_FIND_LINKS      local wheel directory (default: pip's configured find-links)
#   BUILD_CA_BUNDLE     CA bundle mounted at build time (default /etc/ssl/certs/ca-certificates.crt)
#   STORAGE_DRIVER      overlay (default) or vfs; overlay falls back to vfs if it cannot mount
#
# The CUDA engine (docker/engine.Dockerfile) is not built here: its base (nvidia/cuda) lives on
# Docker Hub, which these machines cannot reach. In a registry pipeline:
#   docker build -f docker/engine.Dockerfile -t REGISTRY/quire/engine:TAG .
set -euo pipefail
cd "$(dirname "$0")/.."

[ "$(id -u)" = 0 ] || { echo "build-images.sh: buildah's chroot isolation needs root" >&2; exit 1; }

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(router engine-cpu)

CACHE=${QUIRE_IMAGE_CACHE:-/var/cache/quire-images}
TAG=${QUIRE_IMAGE_TAG:-$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)}
BASE=localhost/quire-base:bookworm
CA_BUNDLE=${BUILD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
INDEX=${PIP_INDEX_URL:-https://pypi.org/simple}
FIND_LINKS=${PIP_FIND_LINKS:-$(pip config get global.find-links 2>/dev/null || true)}

step_start=0
step() { step_start=$SECONDS; echo "== $*"; }
done_step() { echo "   ($((SECONDS - step_start)) s)"; }

# -- tools ---------------------------------------------------------------------------------
missing=()
for tool in buildah:buildah crun:crun fuse-overlayfs:fuse-overlayfs mmdebstrap:mmdebstrap; do
    command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    step "apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    done_step
fi

# -- storage driver: overlay where the kernel lets us mount it, else vfs (slow, but works) ----
if [ -z "${STORAGE_DRIVER:-}" ]; then
    STORAGE_DRIVER=vfs
    if probe=$(buildah --storage-driver overlay from scratch 2>/dev/null); then
        buildah --storage-driver overlay mount "$probe" >/dev/null 2>&1 && STORAGE_DRIVER=overlay
        buildah --storage-driver overlay rm "$probe" >/dev/null 2>&1 || true
    fi
fi
export STORAGE_DRIVER
bh() { buildah --storage-driver "$STORAGE_DRIVER" "$@"; }
echo "buildah $(buildah version | sed -n 's/^Version: *//p'), storage driver $STORAGE_DRIVER"

# -- the base: Debian bookworm minbase with Python, made from Debian's packages ---------------
if ! bh images --quiet "$BASE" >/dev/null 2>&1; then
    mkdir -p "$CACHE"
    tarball=$CACHE/bookworm-minbase-python3.tar
    if [ ! -f "$tarball" ]; then
        step "mmdebstrap bookworm minbase -> $tarball"
        # No manuals, translations or docs (copyright files stay): as Debian's slim images do.
        # The dpkg settings stay in the base, so packages the Dockerfiles add are trimmed too.
        mmdebstrap --quiet --variant=minbase \
            --include=python3,python3-venv,python-is-python3,ca-certificates \
            --dpkgopt='path-exclude=/usr/share/man/*' \
            --dpkgopt='path-exclude=/usr/share/locale/*' \
            --dpkgopt='path-include=/usr/share/locale/locale.alias' \
            --dpkgopt='path-exclude=/usr/share/doc/*' \
            --dpkgopt='path-include=/usr/share/doc/*/copyright' \
            bookworm "$CACHE/partial.tar" ${DEBIAN_MIRROR:+"$DEBIAN_MIRROR"}
        mv "$CACHE/partial.tar" "$tarball"
        done_step
    fi
    step "import $tarball as $BASE"
    ctr=$(bh from scratch)
    bh add "$ctr" "$tarball" / >/dev/null
    bh config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 --cmd /bin/bash "$ctr"
    bh commit --quiet "$ctr" "$BASE" >/dev/null
    bh rm "$ctr" >/dev/null
    done_step
fi

# -- the images ----------------------------------------------------------------------------
# Build-time only: the CA bundle and the wheel directory are mounted read-only for the RUN
# steps and named to pip through build arguments; neither is copied into an image. They are
# mounted over paths every Debian-family base has (its own CA bundle, the empty /mnt), because
# buildah leaves an empty stub in the image for a mount point it has to create.
volumes=() cert="" wheels=""
if [ -s "$CA_BUNDLE" ]; then
    volumes+=(--volume "$CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro")
    cert=/etc/ssl/certs/ca-certificates.crt
fi
if [ -n "$FIND_LINKS" ] && [ -d "$FIND_LINKS" ]; then
    volumes+=(--volume "$FIND_LINKS:/mnt:ro")
    wheels=/mnt
fi
build_args=(--build-arg "BASE_IMAGE=$BASE" --build-arg "PIP_INDEX_URL=$INDEX"
            --build-arg "PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL:-}"
            --build-arg "PIP_CERT=$cert" --build-arg "PIP_FIND_LINKS=$wheels")

for target in "${targets[@]}"; do
    case $target in
        router) extra=() ;;
        # With find-links, torch comes from there (its +cpu wheel outranks PyPI's 2.13.0).
        engine-cpu) extra=(--build-arg "TORCH_INDEX_URL=$INDEX") ;;
        *) echo "unknown image $target (router, engine-cpu)" >&2; exit 2 ;;
    esac
    [ -n "$wheels" ] || extra=()
    step "build quire/$target:$TAG"
    previous=$(bh images --quiet --no-trunc "localhost/quire/$target:$TAG" 2>/dev/null || true)
    bh bud --quiet --isolation chroot --layers --pull=never \
        "${build_args[@]}" "${extra[@]}" "${volumes[@]}" \
        -f "docker/$target.Dockerfile" -t "localhost/quire/$target:$TAG" .
    # The image this tag named before is now untagged: removed (with the layers only it held),
    # so that repeated builds, as CI makes, do not fill the disk. Unchanged builds keep it.
    current=$(bh images --quiet --no-trunc "localhost/quire/$target:$TAG")
    if [ -n "$previous" ] && [ "$previous" != "$current" ]; then
        bh rmi "$previous" >/dev/null 2>&1 || echo "  (the previous image $previous is in use; kept)"
    fi
    done_step
done

echo "== images"
for target in "${targets[@]}"; do
    bh images --format '{{.Name}}:{{.Tag}}  {{.Size}}' "localhost/quire/$target:$TAG"
done
