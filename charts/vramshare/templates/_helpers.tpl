{{/* The chart's name, or nameOverride. */}}
{{- define "vramshare.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{/* Object names: fullnameOverride, else <release>-<name> (just <release> when it holds the name).
     50 characters leave room for the -webhook/-controller/-tls suffixes within 63. */}}
{{- define "vramshare.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "vramshare.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "vramshare.labels" -}}
app.kubernetes.io/name: {{ include "vramshare.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- with .Values.global.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "vramshare.selector" -}}
app.kubernetes.io/name: {{ include "vramshare.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "vramshare.image" -}}
{{ .Values.global.image.repository }}:{{ .Values.global.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* Every setting becomes VRAMSHARE_<NAME>: the same names in values, environment and docs. */}}
{{- define "vramshare.settingsEnv" -}}
{{- range $key, $value := . }}
- name: VRAMSHARE_{{ upper $key }}
  {{- /* Helm reads YAML numbers as floats: print whole ones as integers, not 1.048576e+06. */}}
  {{- if and (kindIs "float64" $value) (eq $value (float64 (int64 $value))) }}
  value: {{ int64 $value | toString | quote }}
  {{- else }}
  value: {{ $value | toString | quote }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* The containers' security context: values securityContext (set a key to null to drop it, e.g.
     runAsUser on OpenShift, which assigns one from the namespace's range). */}}
{{- define "vramshare.securityContext" -}}
{{- toYaml .Values.securityContext }}
{{- end -}}

{{- define "vramshare.webhookName" -}}{{ include "vramshare.fullname" . }}-webhook{{- end -}}
{{- define "vramshare.controllerName" -}}{{ include "vramshare.fullname" . }}-controller{{- end -}}
{{- define "vramshare.holderName" -}}{{ include "vramshare.fullname" . }}-gpu-holder{{- end -}}
{{- define "vramshare.tlsSecret" -}}
{{- if eq .Values.webhook.tls.mode "secret" -}}{{ required "webhook.tls.existingSecret is required in the secret TLS mode" .Values.webhook.tls.existingSecret }}{{- else -}}{{ include "vramshare.webhookName" . }}-tls{{- end -}}
{{- end -}}

{{/* The API server's address for every vramshare container, where set: overrides what the kubelet
     derives from the kubernetes Service, for clusters where pods cannot reach Service IPs (no
     kube-proxy yet, or hostNetwork pods on a kube-proxy replacement that serves only pod traffic). */}}
{{- define "vramshare.apiServerEnv" -}}
{{- with .Values.global.apiServer.host -}}
- name: KUBERNETES_SERVICE_HOST
  value: {{ . | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ required "global.apiServer.port is required with global.apiServer.host" $.Values.global.apiServer.port | toString | quote }}
{{- end }}
{{- end -}}

{{/* On the node's network several components share the node's addresses: each listens on its
     pod's IP (the node's), not on all of them. */}}
{{- define "vramshare.podIPEnv" -}}
- name: {{ .name }}
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end -}}

{{/*
"true" when pods asking for no GPU are hidden in the API server (a MutatingAdmissionPolicy) rather
than by the webhook: see files/hide-gpus-in-process.yaml.
*/}}
{{- define "vramshare.hideInProcess" -}}
{{- $mode := .Values.webhook.hideGpus.inProcess -}}
{{- $served := .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy" -}}
{{- if and .Values.webhook.hideGpus.enabled (or (eq $mode "always") (and (eq $mode "auto") $served)) -}}
true
{{- end -}}
{{- end }}

{{/* The namespaces whose pods without a GPU request get their GPUs hidden. */}}
{{- define "vramshare.hideNamespaceSelector" -}}
{{- with .Values.webhook.hideGpus.namespaceSelector.matchLabels }}
matchLabels:
  {{- toYaml . | nindent 2 }}
{{- end }}
matchExpressions:
  - key: kubernetes.io/metadata.name
    operator: NotIn
    values: {{ toJson (list .Release.Namespace "kube-system") }}
  {{- with .Values.webhook.hideGpus.namespaceSelector.matchExpressions }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
