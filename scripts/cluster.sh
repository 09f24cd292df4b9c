#!/usr/bin/env bash
# The local test cluster: the shipped manifests, applied as a platform team applies them, on a
# Kubernetes stand-in that runs each Pod as a local process (harvest-test-cluster, from
# fake-apiserver/; fake-apiserver/DIVERGENCES.md says how it differs from a real cluster).
#
#   eval "$(scripts/cluster.sh up)"     # build, start, kubectl apply -k manifests/crds/ and manifests/, wait
#   eval "$(scripts/cluster.sh up --real)"  # the same on a real control plane (see below)
#   scripts/cluster.sh up --real --images    # its Pods run in the three images (scripts/images.sh)
#   HARVEST_INSTALL=helm scripts/cluster.sh up --real  # helm install charts/harvest instead
#   HARVEST_INSTALL=none scripts/cluster.sh up --real  # nothing installed (docs/install.md's test)
#   scripts/cluster.sh create-key acme  # a new API key for HarvestAccount acme (made if absent)
#   scripts/cluster.sh down             # stop everything `up` started
#
# `up` prints `export KUBECONFIG=…` and `export HARVEST_API=http://127.0.0.1:PORT/v1` (the
# harvest-api Service). Storage is a SeaweedFS S3 server on loopback; the models claim is
# backed by the model cache. What changes from manifests/ for local use: images map to the
# binaries cargo built, the storage Secrets point at the local S3 server, and a HarvestAccount
# for the keys you create. HARVEST_CLUSTER_DIR (default ~/.cache/harvest/cluster) holds its
# state and every Pod's log; HARVEST_BIN_DIR skips the build and takes the binaries there.
#
# `--real` runs the real tier: kube-apiserver, kube-controller-manager, kube-scheduler and etcd
# built from the Kubernetes modules that e2e/controlplane/go.mod pins (scripts/controlplane.sh),
# with RBAC, Node authorization, NodeRestriction and Pod Security admission, and the version's
# own kubectl. Two CPU nodes (cpu-0, cpu-1) and two GPU nodes (gpu-0, gpu-1, two GPUs each, tainted)
# are harvest-node-agent processes that run their Pods as local processes (with --images, in the
# images scripts/images.sh built, through its Docker engine, as read-only, non-root and without
# capabilities as each Pod's securityContext says); one more agent forwards Service ports. The models
# claim is bound to a hostPath PersistentVolume on the model cache.
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${HARVEST_CACHE:-$HOME/.cache/harvest}
dir=${HARVEST_CLUSTER_DIR:-$cache/cluster}
version=0.1.0
next=0.1.1

say() { echo "cluster: $*" >&2; }
alive() { [ -f "$dir/$1.pid" ] && kill -0 "$(cat "$dir/$1.pid")" 2>/dev/null; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
kubectl_bin() { if [ -f "$dir/state/tier" ] && [ "$(cat "$dir/state/tier")" = real ]; then cat "$dir/state/kubectl"; else echo kubectl; fi; }
kc() { KUBECONFIG=$dir/state/kubeconfig "$(kubectl_bin)" "$@"; }
is_real() { [ "$(cat "$dir/state/tier" 2>/dev/null)" = real ]; }

# Waits until "$@" succeeds, for at most $deadline seconds.
wait_for() {
  local what=$1 deadline=$2
  shift 2
  local until=$((SECONDS + deadline))
  until "$@" >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$until" ]; then
      say "$what did not happen within $deadline s (logs under $dir)"
      return 1
    fi
    sleep 0.5
  done
}

# The harvest-api Service's local port: the fake's load balancer status, or the file the real
# tier's Service agent writes.
api_port() {
  if is_real; then
    cat "$dir/state/agents/services/harvest-system.harvest-api.80"
  else
    kc -n harvest-system get service harvest-api -o jsonpath='{.status.loadBalancer.ingress[0].ports[0].port}'
  fi
}

print_exports() {
  local port
  port=$(api_port)
  echo "export KUBECONFIG=$dir/state/kubeconfig"
  echo "export HARVEST_API=http://127.0.0.1:$port/v1"
}

start_storage() {
  local weed=$1 attempt
  # Ports are picked free and then bound by SeaweedFS, so a cluster starting beside another
  # can lose one to it; a server that exits is started again on fresh ports.
  for attempt in 1 2 3; do
    # The filer can answer after the S3 gateway: its buckets are made once it does.
    if launch_storage "$weed" && wait_for "the filer's buckets" 60 create_buckets; then
      return 0
    fi
    say "the S3 server did not come up (attempt $attempt): $(tail -n 3 "$dir/s3.log" 2>/dev/null | tr '\n' ' ')"
    kill "$(cat "$dir/s3.pid")" 2>/dev/null || true
  done
  say "the S3 server did not start (logs under $dir)"
  return 1
}

# Starts SeaweedFS on fresh ports; succeeds once its S3 gateway answers, fails if the server
# exits first or does not answer within 120 s.
launch_storage() {
  local weed=$1 flag
  # Fresh each time: SeaweedFS keeps its old ports in its data directory.
  rm -rf "$dir/s3"
  mkdir -p "$dir/s3"
  printf '{"identities": [{"name": "harvest", "credentials": [{"accessKey": "harvest-local", "secretKey": "harvest-local-secret"}], "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}' > "$dir/s3.json"
  # `weed server`, not `weed mini`: only it takes a free-space floor, and mini's (1% of the
  # disk) refuses every write on a big disk that is nearly full.
  local args=(server -filer -s3 "-dir=$dir/s3" -ip=127.0.0.1 -ip.bind=127.0.0.1 "-s3.config=$dir/s3.json"
    -volume.minFreeSpace=256MiB -master.volumeSizeLimitMB=64 -s3.port.iceberg=0 -s3.port.lance=0
    # Each bucket grows its own 7 volumes: the default 8 in all leaves the second bucket none.
    -volume.max=200)
  for flag in master.port master.port.grpc volume.port volume.port.grpc filer.port filer.port.grpc \
    s3.port s3.port.grpc; do
    local port
    port=$(free_port)
    args+=("-$flag=$port")
    [ "$flag" = s3.port ] && echo "http://127.0.0.1:$port" > "$dir/s3.endpoint"
    [ "$flag" = filer.port ] && echo "http://127.0.0.1:$port" > "$dir/filer.endpoint"
  done
  setsid "$weed" "${args[@]}" > "$dir/s3.log" 2>&1 < /dev/null &
  echo $! > "$dir/s3.pid"
  local until=$((SECONDS + 120))
  # Any HTTP answer (403 to an unsigned request) means the gateway is up.
  until python3 -c "
import sys, urllib.request, urllib.error
try: urllib.request.urlopen(sys.argv[1], timeout=2)
except urllib.error.HTTPError: pass" "$(cat "$dir/s3.endpoint")/harvest" >/dev/null 2>&1; do
    if ! alive s3 || [ "$SECONDS" -ge "$until" ]; then
      return 1
    fi
    sleep 0.5
  done
}

# The buckets manifests/examples/harvestjob.yaml names, as directories under the filer's
# /buckets (how SeaweedFS keeps buckets). Idempotent, so a retry after one bucket is made
# succeeds: a refused POST passes when the directory is there.
create_buckets() {
  python3 -c "
import sys, urllib.request, urllib.error
for bucket in ('harvest-inputs', 'harvest-outputs'):
    url = sys.argv[1] + '/buckets/' + bucket + '/'
    try:
        urllib.request.urlopen(urllib.request.Request(url, method='POST'), timeout=10)
    except urllib.error.HTTPError:
        urllib.request.urlopen(url, timeout=10)
" "$(cat "$dir/filer.endpoint")"
}

storage_secrets() {
  local endpoint
  endpoint=$(cat "$dir/s3.endpoint")
  # The workers' credentials (the catalogue's workerEnvSecret) and the API's signing key.
  kc -n harvest-system create secret generic harvest-s3 --dry-run=client -o yaml \
    --from-literal=AWS_ENDPOINT_URL="$endpoint" --from-literal=AWS_REGION=us-east-1 \
    --from-literal=AWS_ACCESS_KEY_ID=harvest-local --from-literal=AWS_SECRET_ACCESS_KEY=harvest-local-secret \
    --from-literal=AWS_ALLOW_HTTP=true | kc apply --validate=false -f - >&2
  kc -n harvest-system create secret generic harvest-s3-signing --dry-run=client -o yaml \
    --from-literal=HARVEST_S3_ENDPOINT="$endpoint" --from-literal=HARVEST_S3_ALLOW_HTTP=true \
    --from-literal=HARVEST_S3_ACCESS_KEY_ID=harvest-local \
    --from-literal=HARVEST_S3_SECRET_ACCESS_KEY=harvest-local-secret | kc apply --validate=false -f - >&2
}

up() {
  local tier=fake install=${HARVEST_INSTALL:-kustomize} in_images=""
  while [ $# -gt 0 ]; do
    case $1 in
      --real) tier=real ;;
      --images) in_images=1 ;;
      *) say "up takes --real and --images, not $1"; exit 2 ;;
    esac
    shift
  done
  if [ -n "$in_images" ] && [ "$tier" != real ]; then
    say "--images runs on the real tier only: up --real --images"; exit 2
  fi
  case $tier:$install in
    real:helm | real:kustomize | fake:kustomize | real:none) ;;
    fake:helm) say "HARVEST_INSTALL=helm runs on the real tier only: up --real"; exit 2 ;;
    *) say "HARVEST_INSTALL=$install: use kustomize (the default) or helm"; exit 2 ;;
  esac
  if alive cluster; then
    say "already up"
    print_exports
    return
  fi
  mkdir -p "$dir"
  rm -rf "$dir/state"
  mkdir -p "$dir/state"
  echo "$tier" > "$dir/state/tier"
  local bin=${HARVEST_BIN_DIR:-}
  if [ -z "$bin" ]; then
    say "building"
    cargo build --quiet -p harvester -p harvest-api -p harvest-operator -p harvest-fake-apiserver >&2
    bin=${CARGO_TARGET_DIR:-$PWD/target}/debug
  fi
  # Imported once (scripts/test.sh re-imports it before the tests); never under a running cluster.
  [ -f "$cache/models/smollm2-135m/model.safetensors" ] || HARVESTER=$bin/harvester scripts/fetch-model.sh >/dev/null
  local tools
  tools=$(scripts/test-tools.sh)
  say "starting the S3 server"
  start_storage "$tools/weed"
  local images=() tag image
  if [ -n "$in_images" ]; then
    # The images scripts/images.sh built (HARVEST_IMAGE_TAG; built here from these binaries
    # when unset), run by the node agents through the engine.
    eval "$(scripts/images.sh engine)"
    local built=${HARVEST_IMAGE_TAG:-}
    if [ -z "$built" ]; then
      built=local
      scripts/images.sh base >&2
      scripts/images.sh build --binaries "$bin" --base harvest-base:bookworm --tag "$built" >&2
    fi
    images+=(--engine "$(command -v docker)")
    echo "$DOCKER_HOST" > "$dir/state/docker-host"
  fi
  # $next: the same binaries under the next release's tag, for the upgrade tests.
  for tag in "$version" "$next"; do
    for image in harvest-api harvest-operator harvester; do
      if [ -n "$in_images" ]; then
        images+=(--image "ghcr.io/harvest-dev/$image:$tag=ghcr.io/harvest-dev/$image:$built")
      else
        images+=(--image "ghcr.io/harvest-dev/$image:$tag=$bin/$image")
      fi
    done
  done
  images+=(--claim "*/harvest-models=$cache/models")
  if [ "$tier" = real ]; then
    start_real "$bin" "${images[@]}"
  else
    start_fake "$bin" "${images[@]}"
  fi
  case $tier:$install in
    real:helm)
      install_chart
      bind_models_claim
      ;;
    real:kustomize)
      say "kubectl apply -k manifests/crds/, then -k manifests/"
      kc apply -k manifests/crds/ >&2
      # A new CRD has no conditions for a moment, which kubectl wait refuses as an error.
      wait_for "the CRDs established" 60 kc wait --for=condition=Established crd --all --timeout=5s
      kc apply -k manifests/ >&2
      bind_models_claim
      ;;
    real:none)
      # An empty cluster, its storage ready: what docs/install.md starts from (its test).
      echo "export KUBECONFIG=$dir/state/kubeconfig"
      return
      ;;
    fake:kustomize)
      say "kubectl apply -k manifests/crds/, then -k manifests/"
      # The stand-in serves no OpenAPI document, so kubectl cannot validate client-side; the
      # apiserver validates custom resources against their schemas itself.
      kc apply -k manifests/crds/ --validate=false >&2
      kc apply -k manifests/ --validate=false >&2
      ;;
  esac
  storage_secrets
  say "waiting for the Deployments"
  if ! kc -n harvest-system wait --for=condition=Available deployment --all --timeout=300s >&2; then
    # Say what the cluster shows, so that a run that fails here can be diagnosed from its log.
    say "the Deployments are not available; the cluster shows:"
    kc -n harvest-system get deployments,replicasets,pods -o wide >&2 || true
    kc -n harvest-system get events --sort-by=.lastTimestamp 2>&1 | tail -n 30 >&2 || true
    for log in "$dir"/cluster.log "$dir"/agent-*.log; do
      [ -f "$log" ] && { say "the end of $log:"; tail -n 20 "$log" >&2; }
    done
    return 1
  fi
  wait_for "the harvest-api Service" 30 bash -c "$(declare -f is_real api_port kubectl_bin kc); dir=$dir; api_port | grep -q ."
  print_exports
}

start_fake() {
  local bin=$1
  shift
  say "starting the cluster"
  setsid "$bin/harvest-test-cluster" --dir "$dir/state" "$@" > "$dir/cluster.log" 2>&1 < /dev/null &
  echo $! > "$dir/cluster.pid"
  if ! wait_for "the apiserver writing its kubeconfig" 60 test -f "$dir/state/kubeconfig"; then
    alive cluster || say "harvest-test-cluster has exited"
    say "the end of $dir/cluster.log:"
    tail -n 40 "$dir/cluster.log" >&2 || true
    return 1
  fi
}

# The real control plane, then a node agent per node and one for Services.
start_real() {
  local bin=$1 cp
  shift
  cp=$(scripts/controlplane.sh)
  echo "$cp/kubectl" > "$dir/state/kubectl"
  echo "$cp" > "$dir/state/controlplane"
  say "starting the control plane (kube-apiserver, controller-manager, scheduler, etcd)"
  setsid "$cp/harvest-controlplane" up --dir "$dir/state" --bin "$cp" --node cpu-0 --node cpu-1 --node gpu-0 --node gpu-1 \
    > "$dir/cluster.log" 2>&1 < /dev/null &
  echo $! > "$dir/cluster.pid"
  if ! wait_for "the control plane becoming ready" 240 test -f "$dir/state/ready"; then
    alive cluster || say "harvest-controlplane has exited"
    tail -n 40 "$dir/cluster.log" >&2 || true
    return 1
  fi
  local node gpus
  for node in cpu-0 cpu-1 gpu-0 gpu-1; do
    gpus=2
    case $node in cpu-*) gpus=0 ;; esac
    setsid "$bin/harvest-node-agent" --kubeconfig "$dir/state/nodes/$node.kubeconfig" --node "$node" \
      --gpus "$gpus" --dir "$dir/state/agents/$node" "$@" \
      --serving-cert "$dir/state/pki/node-$node-serving.crt" --serving-key "$dir/state/pki/node-$node-serving.key" \
      > "$dir/agent-$node.log" 2>&1 < /dev/null &
    echo $! > "$dir/agent-$node.pid"
  done
  setsid "$bin/harvest-node-agent" --services-kubeconfig "$dir/state/kubeconfig" \
    --dir "$dir/state/agents" > "$dir/agent-services.log" 2>&1 < /dev/null &
  echo $! > "$dir/agent-services.pid"
  wait_for "the nodes becoming Ready" 60 kc wait --for=condition=Ready node/cpu-0 node/cpu-1 node/gpu-0 node/gpu-1 --timeout=5s
}

# docs/install.md's Helm install: the release's namespace with its Pod Security level, then
# the chart (its crds/ first). Helm keeps its own state under the cluster's directory.
install_chart() {
  local helm
  helm=$(scripts/helm.sh)
  echo "$helm" > "$dir/state/helm"
  say "helm install harvest charts/harvest -n harvest-system"
  kc create namespace harvest-system --dry-run=client -o yaml | kc apply -f - >&2
  kc label namespace harvest-system --overwrite app.kubernetes.io/part-of=harvest \
    pod-security.kubernetes.io/enforce=restricted pod-security.kubernetes.io/warn=restricted >&2
  hc install harvest charts/harvest -n harvest-system >&2
}

# Helm against this cluster, its caches and repositories under the cluster's directory.
hc() {
  KUBECONFIG=$dir/state/kubeconfig HELM_CACHE_HOME=$dir/state/helm-home/cache \
    HELM_CONFIG_HOME=$dir/state/helm-home/config HELM_DATA_HOME=$dir/state/helm-home/data \
    "$(cat "$dir/state/helm")" "$@"
}

# Binds the models claim to the model cache, as a platform team's storage would.
bind_models_claim() {
  local class
  class=$(kc -n harvest-system get pvc harvest-models -o jsonpath='{.spec.storageClassName}')
  printf '%s\n' "apiVersion: v1" "kind: PersistentVolume" "metadata: {name: harvest-models-local}" \
    "spec:" "  capacity: {storage: 2Ti}" "  accessModes: [ReadWriteMany, ReadWriteOnce, ReadOnlyMany]" \
    "  persistentVolumeReclaimPolicy: Retain" "  storageClassName: \"$class\"" \
    "  claimRef: {namespace: harvest-system, name: harvest-models}" \
    "  hostPath: {path: $cache/models}" | kc apply -f - >&2
}

create_key() {
  local account=${1:?usage: scripts/cluster.sh create-key ACCOUNT}
  alive cluster || { say "not up: run scripts/cluster.sh up"; exit 1; }
  if ! kc get harvestaccount "$account" >/dev/null 2>&1; then
    say "creating HarvestAccount $account (REST jobs only; edit its lanes and budgets with kubectl)"
    printf 'apiVersion: harvest.dev/v1alpha1\nkind: HarvestAccount\nmetadata: {name: %s}\nspec: {namespaces: [], lanes: {small: 2, large: 1}}\n' "$account" \
      | kc apply --validate=false -f - >&2
  fi
  kc -n harvest-system get configmap harvest-api -o jsonpath='{.data.api\.json}' > "$dir/api.json"
  local bin=${HARVEST_BIN_DIR:-${CARGO_TARGET_DIR:-$PWD/target}/debug}
  KUBECONFIG=$dir/state/kubeconfig "$bin/harvest-api" --config "$dir/api.json" create-key --account "$account"
}

down() {
  local what
  for what in agent-cpu-0 agent-cpu-1 agent-gpu-0 agent-gpu-1 agent-services cluster s3; do
    if alive "$what"; then
      local pid
      pid=$(cat "$dir/$what.pid")
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
      # A node a test stopped (SIGSTOP) handles its SIGTERM once continued.
      kill -CONT -- "-$pid" 2>/dev/null || true
      local until=$((SECONDS + 20))
      while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$until" ]; do sleep 0.2; done
      kill -KILL -- "-$pid" 2>/dev/null || true
    fi
    rm -f "$dir/$what.pid"
  done
  # Containers a killed node agent left running (up --images).
  if [ -f "$dir/state/docker-host" ]; then
    local node left
    for node in cpu-0 cpu-1 gpu-0 gpu-1; do
      left=$(DOCKER_HOST=$(cat "$dir/state/docker-host") docker ps -aq --filter "label=harvest.dev/kubelet-dir=$dir/state/agents/$node" 2>/dev/null || true)
      # shellcheck disable=SC2086
      [ -z "$left" ] || DOCKER_HOST=$(cat "$dir/state/docker-host") docker rm -f $left >/dev/null 2>&1 || true
    done
  fi
  say "down"
}

# Writes stdin to BUCKET/KEY of the local S3 server (through its filer).
put_object() {
  local bucket=${1:?usage: scripts/cluster.sh put BUCKET KEY < FILE} key=${2:?usage: scripts/cluster.sh put BUCKET KEY < FILE}
  alive cluster || { say "not up: run scripts/cluster.sh up"; exit 1; }
  curl -fsS -X PUT --data-binary @- "$(cat "$dir/filer.endpoint")/buckets/$bucket/$key" >/dev/null
}

# The local stand-ins for what docs/install.md does with a cloud or a registry (its test marks
# each such command and runs one of these instead): the storage Secrets of the local S3 server,
# the models claim bound to the model cache, an object put in a bucket.
local_step() {
  alive cluster || { say "not up: run scripts/cluster.sh up"; exit 1; }
  case ${1:-} in
    storage-secrets) storage_secrets ;;
    bind-models) bind_models_claim ;;
    put) shift; put_object "$@" ;;
    *) echo "usage: scripts/cluster.sh local storage-secrets | bind-models | put BUCKET KEY" >&2; exit 2 ;;
  esac
}

case ${1:-} in
  up) shift; up "$@" ;;
  create-key) shift; create_key "$@" ;;
  local) shift; local_step "$@" ;;
  down) down ;;
  *) echo "usage: scripts/cluster.sh up [--real] | create-key ACCOUNT | local STEP | down" >&2; exit 2 ;;
esac
