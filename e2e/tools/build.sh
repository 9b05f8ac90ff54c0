#!/usr/bin/env bash
# Builds the local cluster's binaries from their Go modules, pinned by the wrapper modules beside this
# script, into a cache outside the repository keyed by the wrapper's go.mod/go.sum (and own sources)
# and the Go version. A warm cache makes this a no-op; a cold one builds once, printing progress.
#   control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok, helm,
#                  and Kueue's manager (kueue) with its CRDs and webhook manifests (kueue-config/)
#   real nodes:    kubelet (with the control plane), containerd + shim + ctr, runc (cgo, seccomp),
#                  the CNI loopback plugin and ours (cni-loopback), crictl, pause, NVIDIA's container
#                  runtime and nvidia-ctk (nvidia-container-toolkit), and its NRI plugin
#                  (nvidia-cdi-nri), NVIDIA's device plugin (nvidia-device-plugin) and the mock NVML it runs
#                  on (mock-nvml: libnvidia-ml.so.1, C, compiled against go-nvml's nvml.h)
#
# Usage: e2e/tools/build.sh [tool...]
#   (tools: etcd kubernetes kwok kueue helm krew containerd runc cni crictl pause cni-loopback nvidia-toolkit
#    nvidia-cdi-nri nvidia-device-plugin mock-nvml; default: all)
# Prints nothing on stdout but the bin directory on its last line, so callers can capture it.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache_root=${VRAMSHARE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vramshare}
bin_dir="$cache_root/bin"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
go_version=$(go env GOVERSION)

log() { printf '[vramshare build] %s\n' "$*" >&2; }

# The version a wrapper pins, read from its require line.
pinned() { awk -v m="$2" '$1 == m {print $2; exit} $1 == "require" && $2 == m {print $3; exit}' "$here/$1/go.mod"; }

# runc links libseccomp through cgo; Debian's libseccomp-dev provides it (installed here when root).
need_libseccomp() {
  pkg-config --exists libseccomp 2>/dev/null && return 0
  if [[ $(id -u) != 0 ]]; then
    log "runc needs libseccomp: run sudo apt-get install --no-install-recommends libseccomp-dev pkg-config"
    exit 1
  fi
  log "installing libseccomp-dev and pkg-config from Debian's packages (once, for runc)"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libseccomp-dev pkg-config >/dev/null
}

build_one() {
  # cgo: "" keeps the environment's CGO_ENABLED (the control plane's builds); tags: Go build tags.
  local tool=$1 ldflags="" packages=() outputs=() cgo="" tags="" dest="$bin_dir"
  case $tool in
    kubernetes)
      local v; v=$(pinned kubernetes k8s.io/kubernetes)
      local minor; minor=$(echo "$v" | cut -d. -f2)
      # Version stamps so `kubectl version` and discovery report the real release.
      for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ldflags+=" -X $pkg.gitVersion=$v -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
      done
      packages=(k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager
                k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl k8s.io/kubernetes/cmd/kubelet)
      outputs=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet);;
    containerd)
      local cv; cv=$(pinned containerd github.com/containerd/containerd/v2)
      ldflags="-X github.com/containerd/containerd/v2/version.Version=$cv"
      packages=(github.com/containerd/containerd/v2/cmd/containerd
                github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2
                github.com/containerd/containerd/v2/cmd/ctr)
      outputs=(containerd containerd-shim-runc-v2 ctr); cgo=0;;
    runc)
      need_libseccomp
      ldflags="-X main.version=$(pinned runc github.com/opencontainers/runc | sed 's/^v//')"
      packages=(github.com/opencontainers/runc); outputs=(runc); cgo=1; tags=seccomp;;
    cni)
      packages=(github.com/containernetworking/plugins/plugins/main/loopback); outputs=(loopback)
      dest="$bin_dir/cni"; cgo=0;;
    crictl)
      packages=(sigs.k8s.io/cri-tools/cmd/crictl); outputs=(crictl); cgo=0;;
    nvidia-toolkit)
      # cgo: the toolkit dlopens NVIDIA's libraries when there is a driver (never here: CDI mode).
      ldflags="-X github.com/NVIDIA/nvidia-container-toolkit/internal/info.version=$(pinned nvidia-toolkit github.com/NVIDIA/nvidia-container-toolkit | sed 's/^v//')"
      packages=(github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-container-runtime
                github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-ctk)
      outputs=(nvidia-container-runtime nvidia-ctk); cgo=1;;
    nvidia-cdi-nri)
      # NVIDIA's NRI plugin (the toolkit's nri package), the GPU Operator's cdi.nriPluginEnabled.
      packages=(vramshare.io/e2e/tools/nvidia-cdi-nri); outputs=(nvidia-cdi-nri); cgo=0;;
    nvidia-device-plugin)
      # cgo: it dlopens libnvidia-ml.so.1 (the mock NVML on the real nodes).
      ldflags="-X github.com/NVIDIA/k8s-device-plugin/internal/info.version=$(pinned nvidia-device-plugin github.com/NVIDIA/k8s-device-plugin)"
      packages=(github.com/NVIDIA/k8s-device-plugin/cmd/nvidia-device-plugin); outputs=(nvidia-device-plugin)
      cgo=1;;
    mock-nvml)
      build_mock_nvml; return 0;;
    pause)
      packages=(vramshare.io/e2e/tools/pause); outputs=(pause); cgo=0;;  # static: the image has no libc
    cni-loopback)
      packages=(vramshare.io/e2e/tools/cni-loopback); outputs=(cni-loopback); dest="$bin_dir/cni"; cgo=0;;
    etcd)
      packages=(go.etcd.io/etcd/server/v3); outputs=(etcd);;
    kwok)
      packages=(sigs.k8s.io/kwok/cmd/kwok); outputs=(kwok);;
    kueue)
      packages=(sigs.k8s.io/kueue/cmd/kueue); outputs=(kueue); cgo=0;;
    helm)
      local kv; kv=$(pinned kubernetes k8s.io/kubernetes)
      # helm defaults its capabilities to an old Kubernetes; report the one we run.
      ldflags="-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$(echo "$kv" | cut -d. -f2)"
      ldflags+=" -X helm.sh/helm/v3/internal/version.version=$(pinned helm helm.sh/helm/v3)"
      packages=(helm.sh/helm/v3/cmd/helm); outputs=(helm);;
    krew)
      packages=(sigs.k8s.io/krew/cmd/krew sigs.k8s.io/krew/cmd/validate-krew-manifest)
      outputs=(krew validate-krew-manifest);;
    *) log "unknown tool: $tool"; exit 2;;
  esac
  # Keyed by what decides the binaries: the pinned modules, the packages and the flags (not the rest
  # of this script, so adding a tool rebuilds no other).
  local key
  local build_env=""
  [[ -z $cgo && -z $tags ]] || build_env=" cgo=$cgo tags=$tags"
  key=$( (cat "$here/$tool/go.mod" "$here/$tool/go.sum" "$here/$tool"/*.go 2>/dev/null || true
          echo "${packages[*]} ${outputs[*]} $ldflags$build_env") | sha256sum | cut -c1-12)
  local stamp="$bin_dir/.$tool-$go_version-$key"
  local all_there=1
  for o in "${outputs[@]}"; do [[ -x "$dest/$o" ]] || all_there=0; done
  [[ $tool != kueue || -d "$dest/kueue-config/crd" ]] || all_there=0
  if [[ -f "$stamp" && $all_there == 1 ]]; then
    return 0
  fi
  log "building $tool (${outputs[*]}) with $go_version; the first build takes minutes, later runs reuse $bin_dir"
  local start=$SECONDS tmp
  tmp=$(mktemp -d "$cache_root/.build-$tool.XXXX")
  # -v names every package as it is compiled: count them for a progress line.
  (cd "$here/$tool" && CGO_ENABLED=${cgo:-$(go env CGO_ENABLED)} go build -v -trimpath -tags "$tags" \
    -ldflags "-s -w $ldflags" -o "$tmp/" "${packages[@]}") 2>&1 |
    awk -v t="$tool" '/^(go: |# )|\.go:[0-9]+/ {print > "/dev/stderr"; next}
                      {n++; if (n % 200 == 0) printf "[vramshare build] %s: %d packages compiled\n", t, n > "/dev/stderr"}'
  if [[ ${PIPESTATUS[0]} != 0 ]]; then log "building $tool failed"; exit 1; fi
  if [[ $tool == etcd ]]; then mv "$tmp/server" "$tmp/etcd"; fi
  if [[ $tool == kueue ]]; then  # the manifests the harness applies, from the same module version
    local kdir; kdir=$(cd "$here/kueue" && go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)
    rm -rf "$dest/kueue-config"; mkdir -p "$dest/kueue-config"
    cp -r "$kdir/config/components/crd/bases" "$dest/kueue-config/crd"
    cp "$kdir/config/components/webhook/manifests.yaml" "$dest/kueue-config/webhooks.yaml"
    chmod -R u+w "$dest/kueue-config"
  fi
  mkdir -p "$dest"
  for o in "${outputs[@]}"; do mv -f "$tmp/$o" "$dest/$o"; done
  rm -rf "$tmp"
  rm -f "$bin_dir/.$tool-"*
  touch "$stamp"
  log "built $tool in $((SECONDS - start)) s"
}

# The mock NVML: a C library, compiled against NVIDIA's nvml.h as go-nvml ships it (the version the
# wrapper pins), keyed by that version and the source.
build_mock_nvml() {
  local dest="$bin_dir/mock-nvml" header_dir key
  header_dir=$(cd "$here/mock-nvml" && go mod download -json github.com/NVIDIA/go-nvml | awk -F'"' '/"Dir"/ {print $4}')/pkg/nvml
  key=$( (cat "$here/mock-nvml/go.mod" "$here/mock-nvml/mock_nvml.c"; gcc --version | head -1) | sha256sum | cut -c1-12)
  local stamp="$bin_dir/.mock-nvml-$key"
  [[ -f "$stamp" && -f "$dest/libnvidia-ml.so.1" ]] && return 0
  log "building mock-nvml (libnvidia-ml.so.1) against $header_dir/nvml.h"
  mkdir -p "$dest"
  gcc -shared -fPIC -O2 -Wall -Wextra -Werror -fvisibility=hidden -I"$header_dir" \
    -Wl,-soname,libnvidia-ml.so.1 -o "$dest/libnvidia-ml.so.1.tmp" "$here/mock-nvml/mock_nvml.c"
  mv -f "$dest/libnvidia-ml.so.1.tmp" "$dest/libnvidia-ml.so.1"
  rm -f "$bin_dir/.mock-nvml-"*
  touch "$stamp"
  log "built mock-nvml"
}

mkdir -p "$bin_dir"
tools=("$@")
[[ ${#tools[@]} -gt 0 ]] || tools=(etcd kubernetes kwok helm krew containerd runc cni crictl pause cni-loopback nvidia-toolkit
                                   nvidia-cdi-nri nvidia-device-plugin mock-nvml kueue)
for t in "${tools[@]}"; do build_one "$t"; done
echo "$bin_dir"
