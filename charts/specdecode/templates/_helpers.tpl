{{/*
One helper per name the templates spell more than once.
*/}}

{{/* The app name on the operator's labels. Never the runtime's `specdecode`: the Services the
operator renders select pods by app.kubernetes.io/name=specdecode plus instance. */}}
{{- define "specdecode.name" -}}
{{- default (printf "%s-operator" .Chart.Name) .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The name of the operator's namespaced objects and of its cluster-wide RBAC and webhook. */}}
{{- define "specdecode.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains .Chart.Name .Release.Name }}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s-operator" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* The Lease the operator's replicas compete for (operator/leadership.py): one per release. */}}
{{- define "specdecode.leaseName" -}}
{{- include "specdecode.fullname" . }}
{{- end }}

{{- define "specdecode.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specdecode.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specdecode.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "specdecode.labels" -}}
{{ include "specdecode.selectorLabels" . }}
app.kubernetes.io/component: operator
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ include "specdecode.chart" . }}
{{- end }}

{{- define "specdecode.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specdecode.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "specdecode.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The DNS name the API server calls the webhook at, and the certificate is issued for. */}}
{{- define "specdecode.serviceHost" -}}
{{- printf "%s.%s.svc" (include "specdecode.fullname" .) .Release.Namespace }}
{{- end }}

{{/* Where the operator serves admission reviews: kopf serves a validating handler at /<handler id>. */}}
{{- define "specdecode.webhookPath" -}}
/validate-specdecodedeployment
{{- end }}

{{/* The Service port the API server calls; it forwards to webhook.port on the pod. */}}
{{- define "specdecode.webhookServicePort" -}}
443
{{- end }}

{{- define "specdecode.webhookSecretName" -}}
{{- printf "%s-webhook-tls" (include "specdecode.fullname" .) }}
{{- end }}

{{/* Where the serving certificate (tls.crt, tls.key) is mounted; SPECDECODE_WEBHOOK_CERT_DIR. */}}
{{- define "specdecode.webhookCertDir" -}}
/etc/specdecode/webhook-tls
{{- end }}

{{- define "specdecode.webhookCertificateName" -}}
{{- printf "%s-webhook" (include "specdecode.fullname" .) }}
{{- end }}
