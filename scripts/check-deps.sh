#!/usr/bin/env bash
# The dependency direction of ARCHITECTURE.md, checked with cargo tree: core has no I/O
# dependencies, the harvester never depends on kube or axum, the API never on cudarc or on the
# harvester crate; the operator never on cudarc or axum; the CRD crate does no I/O. Then no
# import cycle between files inside a crate or the Python client, except a parent module and
# its own children (scripts/check-cycles.py).
set -euo pipefail
cd "$(dirname "$0")/.."
fail=0
forbid() { # crate, pattern, why
  if cargo tree -p "$1" -e normal --prefix none 2>/dev/null | grep -E "$2" >/dev/null; then
    echo "dependency direction broken: $1 depends on $(cargo tree -p "$1" -e normal --prefix none | grep -E "$2" | head -1) ($3)" >&2
    fail=1
  fi
}
forbid harvest-core '^(tokio|kube|axum|cudarc|object_store|rusqlite|reqwest) ' "core has no I/O dependencies"
forbid harvester '^(kube|axum) ' "the harvester never depends on kube or axum"
forbid harvest-api '^(cudarc|harvester) ' "the API never depends on cudarc or the harvester crate"
forbid harvest-operator '^(cudarc|axum|harvester) ' "the operator never depends on cudarc, axum or the harvester crate"
forbid harvest-crds '^(tokio|axum|cudarc|object_store|harvester) ' "the CRD types do no I/O"
[ "$fail" = 0 ] && echo "dependency direction: ok"
python3 scripts/check-cycles.py . >&2 || fail=1
exit "$fail"
