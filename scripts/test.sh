#!/usr/bin/env bash
# The project's test command: fetches and imports the real test model, installs the
# test-only tools, builds the three images (scripts/images.sh, a Docker engine started when none
# answers) and builds the real tier's Kubernetes control plane and Kueue from their Go
# modules, and Helm from its (all cached in ~/.cache/harvest), runs every test of the workspace, runs the e2e suite once more
# on the real control plane (the first run is on the fake apiserver), runs
# schemathesis on the OpenAPI document against the embedded server, then installs the Python
# client (clients/python) and runs its pytest suite against the binaries cargo just built (the
# status page's browser test included), and closes with one line that adds up the Rust and
# Python tests. The harvester's CPU kernel tests run once more at each other kernel level.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh >/dev/null
tools=$(scripts/test-tools.sh)
# kube-apiserver, controller-manager, scheduler, kubectl and etcd for e2e/tests/real.rs and
# the second e2e run (cold: about four minutes on two cores; then cached).
scripts/controlplane.sh >/dev/null
# Kueue's controller and install, for the real tier's Kueue test (cold: a few minutes).
scripts/kueue.sh >/dev/null
# Helm, for the chart's tests (operator/tests/chart.rs) and its install on the real tier.
scripts/helm.sh >/dev/null
export HARVEST_WEED=$tools/weed HARVEST_PYTHON=$tools/python
# NVIDIA's CUDA 12 and 13 wheels (the harvester looks in a site-packages named here) and driver
# 535's library: the CUDA tests must compile every kernel and resolve every entry point, not skip.
site_packages=$(echo "$tools"/../lib/python3*/site-packages)
export HARVEST_CUDA_LIBRARY_PATH=$site_packages HARVEST_TEST_LIBCUDA=$tools/../libcuda-535 \
  HARVEST_REQUIRE_NVRTC=1
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
# The e2e tests run the workspace's binaries from target/debug (scripts/cluster.sh with
# HARVEST_BIN_DIR), and `cargo test` builds a package's plain binaries only for that package's
# own integration tests: harvest-test-cluster (fake-apiserver has none) would be missing on a
# new machine.
cargo build --workspace --bins --quiet
# The three images, from the binaries just built (the ones every test runs; users' builds take
# the release profile), on a base made from Debian's packages with no registry, in a Docker
# engine started here when none answers and stopped at the end: the image tests
# (api/tests/images.rs, e2e/tests/images.rs) run them as the cluster would.
eval "$(scripts/images.sh engine)"
trap 'rm -f "$log"; scripts/images.sh stop' EXIT
scripts/images.sh base
scripts/images.sh build --profile dev --base harvest-base:bookworm --tag test
export HARVEST_IMAGE_TAG=test
# --no-fail-fast: one failing test binary must not hide the results of the others.
cargo test --workspace --all-targets --no-fail-fast "$@" 2>&1 | tee "$log" || status=$?
# The shared e2e suite again, on the real control plane (scripts/cluster.sh up --real).
HARVEST_E2E_TIER=real cargo test -p harvest-e2e --test cluster --no-fail-fast 2>&1 | tee -a "$log" || status=$?
# The OpenAPI document against the server it describes: schemathesis, every check.
scripts/schemathesis.sh 2>&1 | tee -a "$log" || status=$?
# The CPU kernels again at every other kernel level this CPU runs (HARVEST_CPU_LEVEL), so a
# machine with AVX-512 tests what an AVX2 laptop or any x86-64 CPU runs: the kernel and
# attention unit tests, and the parity and forward-pass tests. A level the CPU lacks is named
# as skipped, with what it lacks, and counts as nothing. (The run above was at the running
# level: the CPU's, or the one HARVEST_CPU_LEVEL names.)
levels=$("${CARGO_TARGET_DIR:-$PWD/target}/debug/harvester" cpu-info | "$tools/python" -c '
import json, sys
report = json.load(sys.stdin)
for level in report["levels"]:
    if level["level"] != report["running"]:
        print(level["level"], ",".join(level["lacks"]) or "-")')
while read -r level lacks; do
  [ -n "$level" ] || continue
  if [ "$lacks" != - ]; then
    echo "level $level: skipped, this CPU lacks $lacks" | tee -a "$log"
    continue
  fi
  echo "level $level: the CPU kernel, attention, parity and forward-pass tests"
  HARVEST_CPU_LEVEL=$level cargo test -p harvester --lib --no-fail-fast -- backend::cpu 2>&1 | tee -a "$log" || status=$?
  HARVEST_CPU_LEVEL=$level cargo test -p harvester --test parity --test cpu_forward --no-fail-fast 2>&1 \
    | tee -a "$log" || status=$?
done <<<"$levels"
# The client as a user installs it (its `harvest` command included), against the debug binaries.
"$tools/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation \
  --force-reinstall ./clients/python >&2
PATH=$tools:$PATH HARVEST_BIN_DIR=${CARGO_TARGET_DIR:-$PWD/target}/debug \
  "$tools/python" -m pytest -q -p no:cacheprovider clients/python/tests 2>&1 | tee -a "$log" || status=$?
# Each failing Rust test's captured output again, at the end where a short tail of this output
# still shows it: its first lines, up to the backtrace.
if [ "$status" != 0 ]; then
  awk '/^---- .* stdout ----$/ { n = 14 } /^stack backtrace:/ { n = 0 } n > 0 { print; n-- }' "$log" \
    | head -n 240
fi
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     /^[0-9]+ (passed|failed)|^=+ .*(passed|failed)/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "harvest: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
