#!/usr/bin/env bash
# Keeps a reused cargo target directory near the size of one build. Each clone of the
# repository at a new path (as CI makes) builds the workspace's own crates and test binaries
# under new hashes, and cargo never frees the old ones: about 3 GiB a run, which once filled
# the disk until SeaweedFS refused writes. For each unit of the workspace's packages (a
# package's target, built in one mode and profile with one set of features), this keeps the
# newest build and removes the others (cargo rebuilds anything it then misses); it also drops
# the incremental state, which CI does not use (.ci/run sets CARGO_INCREMENTAL=0).
# Third-party builds are kept.
#
#   scripts/sweep-target.sh [TARGET_DIR]   # default $CARGO_TARGET_DIR, else ./target
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:-${CARGO_TARGET_DIR:-$PWD/target}}
[ -d "$target" ] || exit 0
before=$(du -sm "$target" | cut -f1)
packages=$(cargo metadata --no-deps --format-version 1 --offline \
  | python3 -c 'import json, sys; print(" ".join(p["name"] for p in json.load(sys.stdin)["packages"]))')
for profile in debug release; do
  [ -d "$target/$profile/.fingerprint" ] || continue
  rm -rf "$target/$profile/incremental"
  python3 - "$target/$profile" $packages <<'EOF'
import glob, json, os, re, shutil, sys

root, packages = sys.argv[1], set(sys.argv[2:])
unit_dir = re.compile(r"^(.+)-([0-9a-f]{16})$")
newest = {}  # unit -> (mtime, hash)
stale = []
for entry in os.scandir(os.path.join(root, ".fingerprint")):
    match = unit_dir.match(entry.name)
    if not match or match.group(1) not in packages:
        continue
    # The unit's record, e.g. test-integration-test-s3.json or lib-harvester.json; the
    # profile hash tells a check (clippy) from a build.
    records = [f for f in os.listdir(entry.path) if f.endswith(".json")]
    if len(records) != 1:
        continue
    with open(os.path.join(entry.path, records[0])) as f:
        record = json.load(f)
    unit = (match.group(1), records[0], record.get("profile"), str(record.get("features")),
            record.get("target"), str(record.get("compile_kind")))
    built = entry.stat().st_mtime
    stamp = os.path.join(entry.path, "invoked.timestamp")
    if os.path.exists(stamp):
        built = os.stat(stamp).st_mtime
    if unit in newest:
        older, newer = sorted([newest[unit], (built, match.group(2))])
        stale.append(older[1])
        newest[unit] = newer
    else:
        newest[unit] = (built, match.group(2))
for digest in stale:
    for path in glob.glob(os.path.join(root, "*", "*-" + digest + "*")) + glob.glob(
        os.path.join(root, ".fingerprint", "*-" + digest)
    ):
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
EOF
done
after=$(du -sm "$target" | cut -f1)
echo "sweep-target: $target from $before MiB to $after MiB" >&2
