#!/usr/bin/env bash
# Builds the Helm CLI the chart's tests run (charts/harvest: lint, template, install, upgrade,
# uninstall) from the module e2e/helm/go.mod pins (helm.sh/helm/v4), and prints the path of the
# binary. Cached under ~/.cache/harvest/helm by the hash of go.mod, go.sum and this script, so a
# warm run prints at once. Test tooling only: users bring their own Helm.
set -euo pipefail
self=$(realpath "$0")
cd "$(dirname "$0")/../e2e/helm"
cache=${HARVEST_CACHE:-$HOME/.cache/harvest}
export GOMODCACHE=${GOMODCACHE:-$cache/go/mod} GOCACHE=${GOCACHE:-$cache/go/build}
export GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0
key=$(cat go.mod go.sum "$self" | sha256sum | cut -c1-16)
out=$cache/helm/$key
if [ ! -x "$out/helm" ]; then
  echo "helm: building the Helm CLI into $out (cold: a few minutes on 2 cores)" >&2
  start=$SECONDS
  rm -rf "$out.tmp"
  mkdir -p "$out.tmp"
  # The version Helm's own release build stamps, so `helm version` and the chart's
  # kubeVersion checks see a real one.
  version=$(go list -m -f '{{.Version}}' helm.sh/helm/v4)
  go build -trimpath -ldflags="-s -X helm.sh/helm/v4/internal/version.version=$version" \
    -o "$out.tmp/helm" helm.sh/helm/v4/cmd/helm >&2
  rm -rf "$out"
  mv "$out.tmp" "$out"
  echo "helm: built in $((SECONDS - start)) s" >&2
fi
echo "$out/helm"
