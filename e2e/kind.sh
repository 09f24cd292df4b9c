#!/usr/bin/env bash
# End to end on a real cluster: kind + a MinIO in the cluster + the three images + SmolLM2.
# NOT RUN IN CI: it needs Docker, kind and network access. Run it on a workstation:
#   e2e/kind.sh            # creates cluster "harvest-e2e", runs one job, prints the manifest
#   KEEP=1 e2e/kind.sh     # leaves the cluster up afterwards
# Needs: docker, kind, kubectl, python3 with boto3 (for the upload), and the model imported by
# scripts/fetch-model.sh (copied onto the kind node as the harvest-models volume, so no hub is
# reached).
set -euo pipefail
cd "$(dirname "$0")/.."
cluster=harvest-e2e
tag=e2e
model=${HARVEST_MODEL:-$HOME/.cache/harvest/models/smollm2-135m}
[ -f "$model/model.safetensors" ] || scripts/fetch-model.sh

kind get clusters | grep -qx "$cluster" || kind create cluster --name "$cluster"
trap '[ "${KEEP:-0}" = 1 ] || kind delete cluster --name "$cluster"' EXIT

for image in harvester operator api; do
  docker build -f "docker/$image.Dockerfile" -t "harvest-$image:$tag" .
done
for image in harvest-harvester harvest-operator harvest-api; do
  kind load docker-image --name "$cluster" "$image:$tag"
done

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
  - {name: ghcr.io/harvest-dev/harvest-api, newName: harvest-api, newTag: $tag}
  - {name: ghcr.io/harvest-dev/harvest-operator, newName: harvest-operator, newTag: $tag}
  - {name: ghcr.io/harvest-dev/harvester, newName: harvest-harvester, newTag: $tag}
YAML
kubectl apply -k manifests/crds/
kubectl wait --for=condition=Established crd/harvestjobs.harvest.dev crd/harvestaccounts.harvest.dev --timeout=60s
kubectl apply -k "$overlay"
# S3 in its own namespace (the harvest namespaces enforce the restricted Pod Security level).
kubectl apply -f - <<YAML
apiVersion: v1
kind: Namespace
metadata: {name: minio}
---
apiVersion: v1
kind: Pod
metadata: {name: minio, namespace: minio, labels: {app: minio}}
spec:
  containers:
    - name: minio
      image: minio/minio:latest
      args: [server, /data]
      env: [{name: MINIO_ROOT_USER, value: harvest}, {name: MINIO_ROOT_PASSWORD, value: harvest-secret}]
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
