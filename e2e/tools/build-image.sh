#!/usr/bin/env bash
# Build the Dockerfile without a Docker engine or a registry: buildah (daemonless, vfs storage, chroot
# isolation) on a base image made here from Debian's own packages (debootstrap), since no registry
# is reachable. Then run each entry point inside the image and report its size.
#
#   sudo bash e2e/tools/build-image.sh            (needs: apt-get install buildah debootstrap)
#
# The base is cached under ~/.cache/vramshare/image (keyed by the Debian release).
set -euo pipefail
cd "$(dirname "$0")/../.."
RELEASE=bookworm
CACHE="${HOME}/.cache/vramshare/image"
BASE="localhost/vramshare-base:${RELEASE}"
TAG="localhost/vramshare:$(python3 -c 'import tomllib;print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')"
B=(buildah --storage-driver vfs)
for tool in buildah debootstrap; do
  command -v "$tool" >/dev/null || { echo "build-image: $tool is missing (apt-get install buildah debootstrap)" >&2; exit 2; }
done

if ! "${B[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
  if [ ! -x "$CACHE/rootfs-$RELEASE/usr/bin/python3" ]; then
    echo "[image] debootstrap $RELEASE with python3 (a few minutes, cached)"
    rm -rf "$CACHE/rootfs-$RELEASE"; mkdir -p "$CACHE"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates \
      "$RELEASE" "$CACHE/rootfs-$RELEASE" >"$CACHE/debootstrap.log"
    rm -rf "$CACHE/rootfs-$RELEASE"/var/cache/apt/archives/*.deb "$CACHE/rootfs-$RELEASE"/var/lib/apt/lists/*
  fi
  echo "[image] base image $BASE from that root filesystem"
  ctr=$("${B[@]}" from scratch)
  mnt=$("${B[@]}" mount "$ctr")
  cp -a "$CACHE/rootfs-$RELEASE"/. "$mnt"/
  "${B[@]}" umount "$ctr"
  "${B[@]}" config --env PATH=/usr/local/bin:/usr/bin:/bin --cmd /bin/sh "$ctr"
  "${B[@]}" commit --quiet "$ctr" "$BASE" >/dev/null
  "${B[@]}" rm "$ctr" >/dev/null
fi

# What the Dockerfile copies, hashed: buildah would otherwise reuse the final stage's cached install
# step after a code change (its cache key ignores what a --mount=from brings).
DIGEST=$(find Dockerfile pyproject.toml README.md operator webhook -type f \
  ! -path '*/__pycache__/*' ! -name '*.pyc' ! -path '*.egg-info/*' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
echo "[image] building $TAG from the Dockerfile (sources $DIGEST)"
# The build stage fetches wheels from the package index; the host's CA bundle is mounted for the RUN
# steps (never committed to a layer), for networks that reach it through a TLS-inspecting proxy.
"${B[@]}" bud --quiet --isolation chroot --layers \
  --volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro \
  --build-arg PYTHON_IMAGE="$BASE" --build-arg SOURCE_DIGEST="$DIGEST" -t "$TAG" -f Dockerfile . >/dev/null

echo "[image] running each entry point inside it"
ctr=$("${B[@]}" from "$TAG")
trap '"${B[@]}" rm "$ctr" >/dev/null 2>&1 || true' EXIT
run() { "${B[@]}" run --isolation chroot --user 65532:65532 "$ctr" -- "$@"; }
out=$(run vramshare-webhook 2>&1 || true)
grep -q "VRAMSHARE_TLS_CERT_FILE" <<<"$out" && echo "  vramshare-webhook: starts, refuses missing TLS files: ${out%%$'\n'*}"
out=$(VRAMSHARE_PROMETHEUS_URL=bad run env VRAMSHARE_PROMETHEUS_URL=bad vramshare-controller 2>&1 || true)
grep -q "VRAMSHARE_PROMETHEUS_URL" <<<"$out" && echo "  vramshare-controller: starts, refuses a bad setting: ${out%%$'\n'*}"
out=$(run kubectl-vramshare status --kubeconfig /nonexistent 2>&1 || true)
grep -q "cannot read the cluster" <<<"$out" && echo "  kubectl-vramshare: ${out%%$'\n'*}"
run python -c "import vramshare_webhook.__main__, vramshare.controller.__main__, kopf; print('  imports: ok')"
whoami_out=$(run id -u); echo "  runs as uid $whoami_out ($(run id -un))"
built=$(run cat /opt/vramshare/SOURCE_DIGEST)
[ "$built" = "sources $DIGEST" ] || { echo "the image holds $built, not the sources $DIGEST (a stale cached layer)" >&2; exit 1; }
echo "  built from the sources $DIGEST"
if run sh -c 'ls /wheels' >/dev/null 2>&1; then echo "wheels left in the image" >&2; exit 1; fi
echo "  no /wheels in the image"
echo "[image] $TAG: $("${B[@]}" images --format '{{.Size}}' "$TAG") (base $("${B[@]}" images --format '{{.Size}}' "$BASE"))"
echo "[image] layers: $("${B[@]}" inspect --type image --format '{{len .OCIv1.RootFS.DiffIDs}}' "$TAG")"
