#!/usr/bin/env bash
# End to end on a real cluster: kind + a MinIO in the cluster + the three images + SmolLM2.
# NOT RUN IN CI: it needs Docker, kind and network access. Run it on a workstation:
#   e2e/kind.sh            # creates cluster "harvest-e2e", runs one job, prints the manifest
#   KEEP=1 e2e/kind.sh     # leaves the cluster up afterwards
# Needs: docker, kind, kubectl, python3 with boto3 (for the upload), and the model imported by
# scripts/fetch-model.sh (it is baked into a test image so no hub is reached).
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
# The worker image with the model inside, at the catalogue's path.
ctx=$(mktemp -d); cp -r "$model" "$ctx/smollm2-135m"
printf 'FROM harvest-harvester:%s\nCOPY smollm2-135m /models/smollm2-135m\n' "$tag" > "$ctx/Dockerfile"
docker build -t "harvest-harvester-smollm2:$tag" "$ctx"
for image in harvest-harvester-smollm2 harvest-operator harvest-api; do
  kind load docker-image --name "$cluster" "$image:$tag"
done

kubectl apply -k manifests/
kubectl -n harvest-system create secret generic harvest-s3 --dry-run=client -o yaml \
  --from-literal=AWS_ACCESS_KEY_ID=harvest --from-literal=AWS_SECRET_ACCESS_KEY=harvest-secret \
  --from-literal=AWS_ENDPOINT=http://minio.harvest-system:9000 --from-literal=AWS_ALLOW_HTTP=true \
  --from-literal=AWS_REGION=us-east-1 | kubectl apply -f -
kubectl -n harvest-system apply -f - <<YAML
apiVersion: v1
kind: Pod
metadata: {name: minio, labels: {app: minio}}
spec:
  containers:
    - name: minio
      image: minio/minio:latest
      args: [server, /data]
      env: [{name: MINIO_ROOT_USER, value: harvest}, {name: MINIO_ROOT_PASSWORD, value: harvest-secret}]
---
apiVersion: v1
kind: Service
metadata: {name: minio}
spec: {selector: {app: minio}, ports: [{port: 9000}]}
YAML
# Point the catalogue and Deployments at the local images; CPU only in kind.
kubectl -n harvest-system create configmap harvest-operator --dry-run=client -o yaml --from-literal=config.yaml="
models:
  - {name: smollm2-135m, path: /models/smollm2-135m, numLayers: 30, hiddenSize: 576, lane: small, image: harvest-harvester-smollm2:$tag}
lanes: {small: 2, large: 1}
workerEnvSecret: harvest-s3
workerServiceAccount: default" | kubectl apply -f -
kubectl -n harvest-system set image deploy/harvest-operator operator="harvest-operator:$tag"
kubectl -n harvest-system rollout status deploy/harvest-operator --timeout=180s
kubectl -n harvest-system wait --for=condition=Ready pod/minio --timeout=180s

kubectl -n harvest-system port-forward svc/minio 19000:9000 >/dev/null & pf=$!
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
# The account that pays for jobs applied in harvest-system.
kubectl apply -f - <<YAML
apiVersion: harvest.dev/v1alpha1
kind: HarvestAccount
metadata: {name: e2e}
spec: {namespaces: [harvest-system], dailyTokens: 100000}
YAML
kubectl -n harvest-system apply -f - <<YAML
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
kubectl -n harvest-system wait --for=condition=Finished hj/e2e --timeout=900s
kubectl -n harvest-system get hj e2e
test "$(kubectl -n harvest-system get hj e2e -o jsonpath='{.status.phase}')" = Succeeded
charged="$(kubectl -n harvest-system get hj e2e -o jsonpath='{.status.tokens.charged}')"
sleep 2 # the account controller settles the hold just after the job finishes
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
