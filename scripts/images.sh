#!/usr/bin/env bash
# Builds the three images (docker/*.Dockerfile) from the project's own build, with or without a
# container registry, and gives them a Docker engine to build and run in.
#
#   scripts/images.sh engine    a Docker engine that answers: DOCKER_HOST's, the default one, or
#                               (as root) Debian's docker.io started here with the vfs storage
#                               driver and no bridge; prints `export DOCKER_HOST=…` to eval
#   scripts/images.sh stop      stops the engine `engine` started (by its PID), nothing else
#   scripts/images.sh base      a base image made from Debian packages, with no registry: glibc,
#                               libgcc, libstdc++, the CA bundle, the user 65532 and /tmp, no
#                               shell (what gcr.io/distroless/cc-debian12:nonroot holds)
#   scripts/images.sh build [--base IMAGE] [--profile release|dev] [--tag TAG] [--binaries DIR]
#                           [--cuda 12,13|12|13|none]
#                               builds the binaries once (cargo, --profile; or takes them from
#                               --binaries, e.g. a Rust image's build), puts NVIDIA's cuBLAS and
#                               NVRTC wheels (the versions scripts/test-tools.sh pins; of the CUDA
#                               majors --cuda names, both by default) beside the harvester,
#                               strips the binaries' line tables, builds the three images on
#                               BASE (the Dockerfiles' default, distroless, when not given) and
#                               prints each one's size
#
# Images are named as manifests/ names them: ghcr.io/harvest-dev/{harvester,harvest-api,
# harvest-operator}:TAG (the workspace version unless --tag). State lives in
# ${HARVEST_IMAGES_DIR:-~/.cache/harvest/images}: the started engine's store, the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
state=${HARVEST_IMAGES_DIR:-${HARVEST_CACHE:-$HOME/.cache/harvest}/images}
registry=ghcr.io/harvest-dev
base_image=harvest-base:bookworm
# The engine's sockets: exec-root holds unix sockets, whose paths must stay short.
socket=$state/engine/docker.sock
exec_root=/tmp/harvest-dockerd.$(id -u)

say() { echo "images: $*" >&2; }
fail() { echo "images: $*" >&2; exit 1; }

version() { awk -F'"' '/^version = / { print $2; exit }' Cargo.toml; }

engine_answers() { timeout 20 docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

# Starts dockerd here when no engine answers; prints the DOCKER_HOST to use.
engine() {
  command -v docker >/dev/null || fail "no docker command: install Debian's docker.io (apt-get install docker.io) or Docker Engine, or set DOCKER_HOST to a remote engine"
  if engine_answers; then
    echo "export DOCKER_HOST=${DOCKER_HOST:-unix:///var/run/docker.sock}"
    return
  fi
  export DOCKER_HOST=unix://$socket
  if engine_answers; then
    echo "export DOCKER_HOST=$DOCKER_HOST"
    return
  fi
  if ! command -v dockerd >/dev/null; then
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
      || fail "no Docker engine answers and dockerd is not installed: install Debian's docker.io (as root: apt-get install docker.io), or set DOCKER_HOST"
    say "installing Debian's docker.io"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker.io iptables >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker.io iptables >/dev/null; } \
      || fail "apt-get install docker.io failed: install a Docker engine, or set DOCKER_HOST"
  fi
  [ "$(id -u)" = 0 ] || fail "no Docker engine answers, and dockerd must start as root: run this as root, or start one and set DOCKER_HOST"
  mkdir -p "$state/engine" "$exec_root"
  # vfs needs nothing from the kernel's overlay support; no bridge and no iptables rules, so
  # the engine changes nothing on the host's network (containers run --network none or host).
  dockerd --storage-driver=vfs --data-root "$state/engine/root" --exec-root "$exec_root" \
    --pidfile "$state/engine/pid" --host "$DOCKER_HOST" --bridge=none --iptables=false \
    > "$state/engine/log" 2>&1 &
  local deadline=$((SECONDS + 60))
  until engine_answers; do
    if ! kill -0 $! 2>/dev/null; then
      tail -n 5 "$state/engine/log" >&2
      fail "dockerd exited at start (log: $state/engine/log)"
    fi
    [ $SECONDS -lt $deadline ] || fail "dockerd did not answer within 60 s (log: $state/engine/log)"
    sleep 0.5
  done
  say "started dockerd (pid $(cat "$state/engine/pid"), vfs, $state/engine)"
  echo "export DOCKER_HOST=$DOCKER_HOST"
}

stop() {
  local pidfile=$state/engine/pid
  [ -f "$pidfile" ] || return 0
  local pid
  pid=$(cat "$pidfile")
  if kill "$pid" 2>/dev/null; then
    local deadline=$((SECONDS + 30))
    while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    say "stopped dockerd (pid $pid)"
  fi
  rm -f "$pidfile"
}

# The base image, from Debian's packages: what a dynamically linked Rust binary and NVIDIA's
# libraries load, the CA bundle for S3 over TLS, a passwd naming 65532, and nothing else.
base() {
  docker image inspect "$base_image" >/dev/null 2>&1 && { say "$base_image is there"; return; }
  # Global, for the EXIT trap.
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && apt-get download libc6 libgcc-s1 libstdc++6 ca-certificates >/dev/null 2>&1) \
    || { [ "$(id -u)" = 0 ] && apt-get update -q >/dev/null \
      && (cd "$work" && apt-get download libc6 libgcc-s1 libstdc++6 ca-certificates >/dev/null); } \
    || fail "apt-get download of libc6, libgcc-s1, libstdc++6 and ca-certificates failed: the base needs Debian's package mirror, or pass --base to build on another image"
  local root=$work/root
  mkdir -p "$root"
  for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$root"; done
  mkdir -p "$root/etc/ssl/certs" "$root/tmp" "$root/home/nonroot"
  cat "$root"/usr/share/ca-certificates/mozilla/*.crt > "$root/etc/ssl/certs/ca-certificates.crt"
  rm -rf "$root/usr/share/doc" "$root/usr/share/lintian" "$root/usr/share/man" "$root/usr/share/gcc" \
    "$root/usr/share/ca-certificates" "$root/usr/sbin" "$root/usr/share/gdb" "$root/etc/ca-certificates" \
    "$root"/usr/lib/x86_64-linux-gnu/gconv "$root"/lib/x86_64-linux-gnu/gconv
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' > "$root/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' > "$root/etc/group"
  chmod 1777 "$root/tmp"
  chown 65532:65532 "$root/home/nonroot" 2>/dev/null || true
  tar --numeric-owner -C "$root" -c . \
    | docker import --change 'USER 65532:65532' --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' - "$base_image" >/dev/null
  say "made $base_image from Debian's libc6, libgcc-s1, libstdc++6 and ca-certificates ($(size "$base_image"))"
}

size() { docker image inspect -f '{{.Size}}' "$1" | awk '{ printf "%.1f MB", $1 / 1e6 }'; }

# NVIDIA's wheels at the versions CI tests (scripts/test-tools.sh), unpacked into $1/nvidia
# without headers, as pip would install them into a site-packages.
# $2 names the CUDA majors: 12, 13 or 12,13.
cuda_libraries() {
  local into=$1 majors=$2 wheels=$state/wheels
  local pins="" all
  all=$(grep -o 'nvidia-[a-z0-9-]*==[0-9.]*' scripts/test-tools.sh | grep -E 'nvidia-(cublas|cuda-nvrtc)' | sort -u)
  case ,$majors, in *,12,*) pins+=" $(grep -e '-cu12==' <<<"$all" | tr '\n' ' ')" ;; esac
  case ,$majors, in *,13,*) pins+=" $(grep -v -e '-cu12==' <<<"$all" | tr '\n' ' ')" ;; esac
  [ -n "${pins// /}" ] || fail "scripts/test-tools.sh pins no nvidia-cublas or nvidia-cuda-nvrtc wheel of CUDA $majors"
  mkdir -p "$into"
  mkdir -p "$wheels"
  local pin missing=""
  for pin in $pins; do
    compgen -G "$wheels/$(tr - _ <<<"${pin%%==*}")-${pin##*==}-*.whl" >/dev/null || missing+=" $pin"
  done
  # shellcheck disable=SC2086
  [ -z "$missing" ] || python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --dest "$wheels" $missing >&2 || fail "pip download of$missing failed: the worker image needs PyPI, or its wheels in $wheels"
  # Unpacked once per set of pins, then linked into each build's context.
  local unpacked=$state/cuda/${majors/,/-}
  if [ "$(cat "$unpacked/.pins" 2>/dev/null)" != "$pins" ]; then
    rm -rf "$unpacked"
    mkdir -p "$unpacked"
    python3 - "$unpacked" "$wheels" $pins <<'PY' || fail "unpacking the CUDA wheels into $unpacked failed"
import sys, zipfile, pathlib
into, wheels, pins = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3:]
for pin in pins:
    name, version = pin.split("==")
    stem = name.replace("-", "_") + "-" + version + "-"
    found = sorted(wheels.glob(stem + "*.whl"))
    if not found:
        sys.exit(f"images: no wheel {stem}*.whl in {wheels}")
    with zipfile.ZipFile(found[-1]) as wheel:
        for member in wheel.infolist():
            parts = member.filename.split("/")
            if parts[0] != "nvidia" or "include" in parts or member.is_dir():
                continue
            target = into / member.filename
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(wheel.read(member))
            target.chmod(0o755 if ".so" in target.name else 0o644)
PY
    echo "$pins" > "$unpacked/.pins"
  fi
  rmdir "$into" 2>/dev/null || true
  cp -al "$unpacked" "$into" 2>/dev/null || cp -a "$unpacked" "$into"
  rm -f "$into/.pins"
}

build() {
  local base="" profile=release tag binaries="" cuda=12,13
  tag=$(version)
  while [ $# -gt 0 ]; do
    case $1 in
      --base) base=$2; shift 2 ;;
      --profile) profile=$2; shift 2 ;;
      --tag) tag=$2; shift 2 ;;
      --binaries) binaries=$2; shift 2 ;;
      --cuda) cuda=$2; shift 2 ;;
      *) fail "unknown argument $1: use --base IMAGE, --profile release|dev, --tag TAG, --binaries DIR or --cuda 12,13|12|13|none" ;;
    esac
  done
  engine_answers || fail "no Docker engine answers at ${DOCKER_HOST:-the default socket}: run eval \"\$(scripts/images.sh engine)\" first"
  local wanted=${base:-$(awk -F= '/^ARG BASE=/ { print $2; exit }' docker/harvester.Dockerfile)}
  if ! docker image inspect "$wanted" >/dev/null 2>&1 && ! docker pull -q "$wanted" >/dev/null 2>&1; then
    fail "base image $wanted is neither local nor pullable (no registry?): make one with scripts/images.sh base, then pass --base $base_image"
  fi
  if [ -z "$binaries" ]; then
    case $profile in
      release) binaries=${CARGO_TARGET_DIR:-$PWD/target}/release ;;
      dev) binaries=${CARGO_TARGET_DIR:-$PWD/target}/debug ;;
      *) fail "--profile $profile: use release or dev" ;;
    esac
    cargo build --locked --quiet --profile "$profile" -p harvester -p harvest-api -p harvest-operator >&2
  fi
  # Global, for the EXIT trap.
  contexts=$(mktemp -d)
  trap 'rm -rf "$contexts"' EXIT
  local -A binary=([harvester]=harvester [api]=harvest-api [operator]=harvest-operator)
  local -A image=([harvester]=harvester [api]=harvest-api [operator]=harvest-operator)
  local builder=()
  docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0
  for name in harvester api operator; do
    [ -x "$binaries/${binary[$name]}" ] || fail "no ${binary[$name]} in $binaries: build it (cargo build -p ${binary[$name]}) or pass --binaries"
    mkdir -p "$contexts/$name/bin"
    # Without the line tables (four fifths of a binary's size); symbols stay, so a backtrace
    # still names its functions.
    objcopy --strip-debug "$binaries/${binary[$name]}" "$contexts/$name/bin/${binary[$name]}" 2>/dev/null \
      || cp "$binaries/${binary[$name]}" "$contexts/$name/bin/"
    if [ "$name" = harvester ]; then
      case $cuda in
        none) mkdir -p "$contexts/$name/cuda" ;;
        12 | 13 | 12,13 | 13,12) cuda_libraries "$contexts/$name/cuda" "$cuda" ;;
        *) fail "--cuda $cuda: use 12,13 (both, the default), 12, 13, or none (a CPU-only worker)" ;;
      esac
    fi
    builder=(docker build --quiet -f "docker/$name.Dockerfile" -t "$registry/${image[$name]}:$tag")
    [ -n "$base" ] && builder+=(--build-arg "BASE=$base")
    local said
    said=$("${builder[@]}" "$contexts/$name" 2>&1 >/dev/null) \
      || { echo "$said" >&2; fail "docker build of docker/$name.Dockerfile failed"; }
    say "$registry/${image[$name]}:$tag on ${base:-the default base}: $(size "$registry/${image[$name]}:$tag")"
  done
  # A rebuild leaves the previous images' layers behind; vfs stores each one whole.
  docker image prune -f >/dev/null
}

case ${1:-} in
  engine) engine ;;
  stop) stop ;;
  base) base ;;
  build) shift; build "$@" ;;
  *) fail "usage: scripts/images.sh engine|stop|base|build [--base IMAGE] [--profile release|dev] [--tag TAG] [--binaries DIR] [--cuda 12,13|12|13|none]" ;;
esac
