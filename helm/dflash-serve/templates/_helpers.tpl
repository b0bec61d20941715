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
The server's config file: the user's `dflash` block as given (no defaults added here), plus the
ports this chart owns.
*/}}
{{- define "dflash-serve.config" -}}
{{- $owned := dict "grpc_port" .Values.ports.grpc "http_port" .Values.ports.http "metrics_port" .Values.ports.metrics -}}
{{- if .Values.apiKeys.secretName -}}
{{- $_ := set $owned "api_keys_file" (include "dflash-serve.apiKeysFile" .) -}}
{{- end -}}
{{- toYaml (merge $owned (deepCopy .Values.dflash)) -}}
{{- end -}}

{{- define "dflash-serve.apiKeysFile" -}}/etc/dflash-keys/keys{{- end -}}

{{- define "dflash-serve.configPath" -}}/etc/dflash/config.yaml{{- end -}}

{{- define "dflash-serve.modelsClaim" -}}
{{- .Values.models.pvc.existingClaim | default (printf "%s-models" (include "dflash-serve.fullname" .)) -}}
{{- end -}}

{{/*
Ray Serve's config (RayService serveConfigV2). The application is built by
services.app:app_from_env from the file DFLASH_CONFIG names; grpc_servicer_functions is
services/app.py:GRPC_SERVICER_FUNCTIONS (tests/helm checks they match).
*/}}
{{- define "dflash-serve.serveConfig" -}}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: {{ .Values.ports.http }}
grpc_options:
  port: {{ .Values.ports.grpc }}
  enable_reflection: true
  grpc_servicer_functions:
    - services.api.dflash.v1.generation_pb2_grpc.add_GenerationServicer_to_server
    - grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server
applications:
  - name: dflash
    route_prefix: /
    import_path: services.app:app_from_env
{{- end -}}

{{/* Volumes and mounts both Ray containers need: the config file and writable scratch space
(the root filesystem is read-only). */}}
{{- define "dflash-serve.commonVolumes" -}}
- name: dflash-config
  configMap:
    name: {{ include "dflash-serve.fullname" . }}-config
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
- name: dflash-config
  mountPath: /etc/dflash
  readOnly: true
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
- name: DFLASH_CONFIG
  value: {{ include "dflash-serve.configPath" . }}
- name: HOME
  value: /home/dflash
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
