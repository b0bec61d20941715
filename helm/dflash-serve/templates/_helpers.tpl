{{/*
The RayService's name, which prefixes everything KubeRay derives from it. KubeRay refuses
RayService names over 47 characters (53 for the RayCluster minus its 6-character suffix) and
names that are not DNS-1035 labels.
*/}}
{{- define "dflash-serve.fullname" -}}
{{- $name := .Release.Name -}}
{{- if not (contains .Chart.Name .Release.Name) -}}
{{- $name = printf "%s-%s" .Release.Name .Chart.Name -}}
{{- end -}}
{{- $name | trunc 47 | trimSuffix "-" -}}
{{- end -}}

{{- define "dflash-serve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dflash-serve.labels" -}}
{{ include "dflash-serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "dflash-serve.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/*
The server's config: the user's `dflash` block as given (no defaults added here), plus the ports
this chart owns, and Ray Serve's proxies as the ingress: KubeRay's RayService sends its serve
Service to them and judges the pods' readiness by them.
*/}}
{{- define "dflash-serve.config" -}}
{{- $owned := dict "grpc_port" .Values.ports.grpc "http_port" .Values.ports.http "metrics_port" .Values.ports.metrics "ingress" "serve" -}}
{{- if .Values.apiKeys.secretName -}}
{{- $_ := set $owned "api_keys_file" (include "dflash-serve.apiKeysFile" .) -}}
{{- end -}}
{{- toYaml (merge $owned (deepCopy .Values.dflash)) -}}
{{- end -}}

{{- define "dflash-serve.apiKeysFile" -}}/etc/dflash-keys/keys{{- end -}}

{{- define "dflash-serve.modelsClaim" -}}
{{- .Values.models.pvc.existingClaim | default (printf "%s-models" (include "dflash-serve.fullname" .)) -}}
{{- end -}}

{{/*
Ray Serve's config (RayService serveConfigV2), where the server's config lives (no file, no pod
annotation: a config-only change leaves the pods alone, and KubeRay applies it to the running
cluster). dflash_serve.services.app:app_from_config builds the application from its `args`; Serve rebuilds it,
restarting every replica and reloading the models, when they change. The routers' own settings
(services/config.py:ROUTER_SETTINGS) go to the Router's user_config instead, with the Serve options
build_app derives from max_pending (CONTROL_HEADROOM is services/app.py's), so changing them
restarts nothing. grpc_servicer_functions is services/app.py:GRPC_SERVICER_FUNCTIONS (tests/helm
checks all of these match).
*/}}
{{- define "dflash-serve.serveConfig" -}}
{{- $config := include "dflash-serve.config" . | fromYaml -}}
{{- $router := pick $config "max_pending" "default_max_tokens" "stream_messages_per_s" -}}
{{- $headroom := 32 -}}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: {{ .Values.ports.http }}
grpc_options:
  port: {{ .Values.ports.grpc }}
  enable_reflection: true
  grpc_servicer_functions:
    - dflash_serve.services.api.dflash.v1.generation_pb2_grpc.add_GenerationServicer_to_server
    - grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server
    - dflash_serve.services.app.lost_replicas_are_unavailable
applications:
  - name: dflash
    route_prefix: /
    import_path: dflash_serve.services.app:app_from_config
    args:
      {{- omit $config "max_pending" "default_max_tokens" "stream_messages_per_s" | toYaml | nindent 6 }}
    deployments:
      - name: Router
        user_config: {{ $router | toJson }}
        {{- with $router.max_pending }}
        max_ongoing_requests: {{ add . $headroom }}
        {{- $low := int (dig "router_replicas" 1 $config) }}
        {{- $high := int (dig "router_max_replicas" 0 $config) }}
        {{- if gt $high $low }}
        autoscaling_config:
          min_replicas: {{ $low }}
          initial_replicas: {{ $low }}
          max_replicas: {{ $high }}
          target_ongoing_requests: {{ max 1 (div (int .) 2) }}
        {{- end }}
      - name: Verifier
        max_ongoing_requests: {{ add . $headroom }}
        {{- end }}
{{- end -}}

{{/* Volumes and mounts both Ray containers need: writable scratch space (the root filesystem is
read-only). */}}
{{- define "dflash-serve.commonVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.pods.scratch.tmpSizeLimit }}
- name: home
  emptyDir:
    sizeLimit: {{ .Values.pods.scratch.homeSizeLimit }}
{{- if .Values.apiKeys.secretName }}
- name: api-keys
  secret:
    secretName: {{ .Values.apiKeys.secretName }}
    defaultMode: 0440
    items:
      - key: {{ .Values.apiKeys.key }}
        path: keys
{{- end }}
{{- with .Values.pods.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "dflash-serve.commonMounts" -}}
# Ray's session directory (/tmp/ray), and compiler caches (Triton, torch) under HOME.
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /home/dflash
{{- if .Values.apiKeys.secretName }}
- name: api-keys
  mountPath: /etc/dflash-keys
  readOnly: true
{{- end }}
{{- with .Values.pods.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "dflash-serve.commonEnv" -}}
- name: HOME
  value: /home/dflash
{{- /* Ray Serve's settings for the serving path, in every Ray process: SERVE_ENV in services/app.py says why. */}}
- name: RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD
  value: "0"
- name: RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP
  value: "0"
- name: RAY_SERVE_USE_GRPC_BY_DEFAULT
  value: "1"
{{- with .Values.pods.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}



{{/* The pod-level settings both groups share. */}}
{{- define "dflash-serve.podSpecCommon" -}}
automountServiceAccountToken: false
{{- with .Values.pods.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with .Values.pods.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
