{{/* Labels every object of the release carries: the base's part-of, and Helm's own. */}}
{{- define "harvest.labels" -}}
app.kubernetes.io/part-of: harvest
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{/* An image reference: (list . "api"). An empty tag is the chart's appVersion. */}}
{{- define "harvest.image" -}}
{{- $root := index . 0 -}}
{{- $image := index $root.Values.images (index . 1) -}}
{{- printf "%s:%s" $image.repository (toString (default $root.Chart.AppVersion $image.tag)) -}}
{{- end }}

{{/* The catalogue's models as the operator reads them: the Kueue values on every GPU entry
     that names none of its own. */}}
{{- define "harvest.catalogue" -}}
{{- $models := list -}}
{{- range .Values.models -}}
{{- $model := deepCopy . -}}
{{- if gt (int (default 0 $model.gpus)) 0 -}}
{{- if and $.Values.kueue.localQueue (not (hasKey $model "localQueue")) -}}
{{- $_ := set $model "localQueue" $.Values.kueue.localQueue -}}
{{- end -}}
{{- if and $.Values.kueue.workloadPriorityClass (not (hasKey $model "workloadPriorityClass")) -}}
{{- $_ := set $model "workloadPriorityClass" $.Values.kueue.workloadPriorityClass -}}
{{- end -}}
{{- end -}}
{{- $models = append $models $model -}}
{{- end -}}
{{- $config := dict "models" $models "lanes" .Values.lanes -}}
{{- $_ := set $config "apiNamespace" .Release.Namespace -}}
{{- $_ := set $config "workerNamespace" .Release.Namespace -}}
{{- $_ := set $config "workerEnvSecret" "harvest-s3" -}}
{{- $_ := set $config "workerEnvConfigMap" "harvest-s3-endpoint" -}}
{{- with .Values.operator.scratchStorageClass -}}
{{- $_ := set $config "scratchStorageClass" . -}}
{{- end -}}
{{- toYaml $config -}}
{{- end }}

{{/* The API's configuration (api/src/config.rs), its models from the same catalogue. */}}
{{- define "harvest.apiConfig" -}}
{{- $models := list -}}
{{- range .Values.models -}}
{{- $model := dict "name" .name "path" .path "lane" (default "small" .lane) "optional" true -}}
{{- if .gpus -}}
{{- $_ := set $model "devices" (int .gpus) -}}
{{- end -}}
{{- $_ := set $model "max_parallelism" (int (default 1 .maxParallelism)) -}}
{{- $models = append $models $model -}}
{{- end -}}
{{- $storage := dict "kind" "s3" "bucket" .Values.objectStore.bucket "prefix" .Values.objectStore.prefix -}}
{{- $_ := set $storage "access_key_id_env" "HARVEST_S3_ACCESS_KEY_ID" -}}
{{- $_ := set $storage "secret_access_key_env" "HARVEST_S3_SECRET_ACCESS_KEY" -}}
{{- $kubernetes := dict "namespace" .Release.Namespace "keys_namespace" .Values.keysNamespace "storage" $storage -}}
{{- $config := dict "data_dir" "/var/lib/harvest" "public_url" .Values.api.publicUrl -}}
{{- $_ := set $config "url_ttl_seconds" (int .Values.api.urlTtlSeconds) -}}
{{- $_ := set $config "models" $models -}}
{{- $_ := set $config "kubernetes" $kubernetes -}}
{{- toPrettyJson $config -}}
{{- end }}
