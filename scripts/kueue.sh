#!/usr/bin/env bash
# Builds the Kueue controller of the real tier's Kueue test from the module e2e/kueue/go.mod
# pins (sigs.k8s.io/kueue), beside that module's own install (config/) and the test's overlay
# of it (install/, from e2e/kueue/install), and prints the directory that holds them: `kubectl
# apply --server-side -k DIR/install` installs Kueue less its Deployment, and DIR/kueue is
# the controller. Cached under ~/.cache/harvest/kueue by the hash of go.mod, go.sum, the
# overlay and this script, so a warm run prints at once. Test tooling only.
set -euo pipefail
self=$(realpath "$0")
cd "$(dirname "$0")/../e2e/kueue"
cache=${HARVEST_CACHE:-$HOME/.cache/harvest}
export GOMODCACHE=${GOMODCACHE:-$cache/go/mod} GOCACHE=${GOCACHE:-$cache/go/build}
export GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0
key=$(cat go.mod go.sum install/* "$self" | sha256sum | cut -c1-16)
out=$cache/kueue/$key
if [ ! -x "$out/kueue" ]; then
  echo "kueue: building the Kueue controller into $out (cold: several minutes on 2 cores)" >&2
  start=$SECONDS
  rm -rf "$out.tmp"
  mkdir -p "$out.tmp"
  go build -trimpath -ldflags=-s -o "$out.tmp/kueue" sigs.k8s.io/kueue/cmd/kueue >&2
  module=$(go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)
  cp -r "$module/config" "$out.tmp/config"
  cp -r install "$out.tmp/install"
  chmod -R u+w "$out.tmp"
  rm -rf "$out"
  mv "$out.tmp" "$out"
  echo "kueue: built in $((SECONDS - start)) s" >&2
fi
echo "$out"
