#!/usr/bin/env bash
# Builds the real Kubernetes control plane of the real test tier from the Go modules that
# e2e/controlplane/go.mod pins (kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl, and harvest-controlplane, which embeds etcd), and prints the directory that holds
# them. Cached under ~/.cache/harvest/controlplane by the hash of go.mod, go.sum and the
# launcher's source, so a warm run prints at once. Test tooling only.
set -euo pipefail
cd "$(dirname "$0")/../e2e/controlplane"
cache=${HARVEST_CACHE:-$HOME/.cache/harvest}
export GOMODCACHE=${GOMODCACHE:-$cache/go/mod} GOCACHE=${GOCACHE:-$cache/go/build}
export GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0
key=$(cat go.mod go.sum ./*.go | sha256sum | cut -c1-16)
bin=$cache/controlplane/$key
if [ ! -x "$bin/harvest-controlplane" ]; then
  echo "controlplane: building the control plane into $bin (cold: tens of minutes on 2 cores)" >&2
  start=$SECONDS
  mkdir -p "$bin.tmp"
  go build -trimpath -ldflags=-s -o "$bin.tmp/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl >&2
  go build -trimpath -ldflags=-s -o "$bin.tmp/harvest-controlplane" . >&2
  rm -rf "$bin"
  mv "$bin.tmp" "$bin"
  echo "controlplane: built in $((SECONDS - start)) s" >&2
fi
echo "$bin"
