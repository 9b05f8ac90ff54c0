#!/usr/bin/env bash
# Regenerates e2e/tools/kubernetes/go.mod for another k8s.io/kubernetes release:
#   e2e/tools/regen-kubernetes.sh v1.37.2
# Upstream's go.mod maps each staging module (k8s.io/api, k8s.io/client-go, ...) with a relative
# replace that a dependent module ignores; this pins each to the published v0.Y.Z of the same release,
# copies upstream's go/godebug lines (they set GODEBUG defaults), then runs go mod tidy.
set -euo pipefail
version=${1:?usage: $0 v1.Y.Z}
staging=v0.${version#v1.}
dir=$(cd "$(dirname "$0")/kubernetes" && pwd)
export GOTOOLCHAIN=local
upstream=$(go mod download -json "k8s.io/kubernetes@$version" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
{
  echo "// Wrapper module that builds the control-plane and node binaries of k8s.io/kubernetes $version."
  echo "// Upstream maps its staging modules with relative replaces that a dependent module ignores,"
  echo "// so each is pinned here to the matching published v0 release. Regenerate with e2e/tools/regen-kubernetes.sh."
  echo "module vramshare.io/e2e/tools/kubernetes"
  echo
  grep -E '^(go|godebug) ' "$upstream"
  echo
  echo "tool ("
  for c in kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet; do printf '\tk8s.io/kubernetes/cmd/%s\n' "$c"; done
  echo ")"
  echo
  echo "require k8s.io/kubernetes $version"
  echo
  echo "replace ("
  grep '=> ./staging' "$upstream" | awk -v s="$staging" '{printf "\t%s => %s %s\n", $1, $1, s}'
  echo ")"
} > "$dir/go.mod"
rm -f "$dir/go.sum"
(cd "$dir" && go mod tidy)
echo "wrote $dir/go.mod for $version"
