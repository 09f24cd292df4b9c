#!/usr/bin/env bash
# Builds the real Kubernetes control plane of the real test tier from the Go modules that
# e2e/controlplane/go.mod pins (kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl, and harvest-controlplane, which embeds etcd), and prints the directory that holds
# them. Cached under ~/.cache/harvest/controlplane by the hash of go.mod, go.sum, the
# launcher's source and this script, so a warm run prints at once. Test tooling only.
set -euo pipefail
self=$(realpath "$0")
cd "$(dirname "$0")/../e2e/controlplane"
cache=${HARVEST_CACHE:-$HOME/.cache/harvest}
export GOMODCACHE=${GOMODCACHE:-$cache/go/mod} GOCACHE=${GOCACHE:-$cache/go/build}
export GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0
key=$(cat go.mod go.sum ./*.go "$self" | sha256sum | cut -c1-16)
bin=$cache/controlplane/$key
if [ ! -x "$bin/harvest-controlplane" ]; then
  echo "controlplane: building the control plane into $bin (cold: tens of minutes on 2 cores)" >&2
  start=$SECONDS
  mkdir -p "$bin.tmp"
  # The version a release build stamps (hack/lib/version.sh): clients such as Kueue parse
  # the server's /version, which is v0.0.0-master+$Format:%H$ without it.
  version=$(go list -m -f '{{.Version}}' k8s.io/kubernetes)
  minor=${version#v1.}
  minor=${minor%%.*}
  stamp=""
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    stamp+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    stamp+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  go build -trimpath -ldflags="-s$stamp" -o "$bin.tmp/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl >&2
  go build -trimpath -ldflags=-s -o "$bin.tmp/harvest-controlplane" . >&2
  rm -rf "$bin"
  mv "$bin.tmp" "$bin"
  echo "controlplane: built in $((SECONDS - start)) s" >&2
fi
echo "$bin"
