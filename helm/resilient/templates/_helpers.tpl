{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "resilient.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: <release>-<chart> (or the release name alone when it already contains the chart
name). Truncated to 40 characters so that suffixes like "-etcd-headless" stay in 63.
*/}}
{{- define "resilient.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "resilient.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels; call with (dict "ctx" $ "component" "worker"). */}}
{{- define "resilient.selectorLabels" -}}
app.kubernetes.io/name: {{ include "resilient.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Common labels (helm.sh conventions); call with (dict "ctx" $ "component" "..."). */}}
{{- define "resilient.labels" -}}
helm.sh/chart: {{ include "resilient.chart" .ctx }}
{{ include "resilient.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: resilient
{{- end }}

{{- define "resilient.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "resilient.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "resilient.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The job id: etcd prefix /resilient/<job>/ and PET_RDZV_ID. */}}
{{- define "resilient.jobId" -}}
{{- default .Release.Name .Values.job.id }}
{{- end }}

{{- define "resilient.etcd.fullname" -}}
{{- printf "%s-etcd" (include "resilient.fullname" .) }}
{{- end }}

{{- define "resilient.etcd.headless" -}}
{{- printf "%s-etcd-headless" (include "resilient.fullname" .) }}
{{- end }}

{{- define "resilient.etcd.scheme" -}}
{{- if .Values.etcd.tls.enabled }}https{{ else }}http{{ end }}
{{- end }}

{{/* DNS name of etcd member $i: <sts>-<i>.<headless>.<ns>.svc.<domain>. Call with (list $ i). */}}
{{- define "resilient.etcd.memberHost" -}}
{{- $ctx := index . 0 }}
{{- printf "%s-%d.%s.%s.svc.%s" (include "resilient.etcd.fullname" $ctx) (index . 1) (include "resilient.etcd.headless" $ctx) $ctx.Release.Namespace $ctx.Values.clusterDomain }}
{{- end }}

{{/*
etcd client endpoints as host:port,host:port (every member, for client-side failover), or
etcd.endpoints when the chart does not deploy etcd.
*/}}
{{- define "resilient.etcd.endpoints" -}}
{{- if .Values.etcd.enabled }}
{{- $eps := list }}
{{- range $i := until (int .Values.etcd.replicas) }}
{{- $eps = append $eps (printf "%s:%d" (include "resilient.etcd.memberHost" (list $ $i)) (int $.Values.etcd.clientPort)) }}
{{- end }}
{{- join "," $eps }}
{{- else }}
{{- required "etcd.endpoints must list your etcd's client endpoints (host:port) when etcd.enabled is false" (join "," .Values.etcd.endpoints) }}
{{- end }}
{{- end }}

{{- define "resilient.etcd.proxyName" -}}
{{- printf "%s-etcd-proxy" (include "resilient.fullname" .) }}
{{- end }}

{{/* The endpoints the node agents use: the grpc-proxy Service when enabled, else etcd's. */}}
{{- define "resilient.etcd.agentEndpoints" -}}
{{- if .Values.etcdGrpcProxy.enabled }}
{{- if .Values.etcd.tls.enabled }}
{{- fail "etcdGrpcProxy.enabled needs a plain-HTTP etcd: turn etcd.tls.enabled off or the proxies off" }}
{{- end }}
{{- printf "%s.%s.svc.%s:%d" (include "resilient.etcd.proxyName" .) .Release.Namespace .Values.clusterDomain (int .Values.etcdGrpcProxy.port) }}
{{- else }}
{{- include "resilient.etcd.endpoints" . }}
{{- end }}
{{- end }}

{{/* ETCD_INITIAL_CLUSTER: name=peerURL for every member. */}}
{{- define "resilient.etcd.initialCluster" -}}
{{- $members := list }}
{{- range $i := until (int .Values.etcd.replicas) }}
{{- $members = append $members (printf "%s-%d=%s://%s:%d" (include "resilient.etcd.fullname" $) $i (include "resilient.etcd.scheme" $) (include "resilient.etcd.memberHost" (list $ $i)) (int $.Values.etcd.peerPort)) }}
{{- end }}
{{- join "," $members }}
{{- end }}

{{/* Client TLS and credential environment for resilient processes (RESILIENT_ETCD_*,
read by every process that opens an etcd Store: coordinator, resilient-run, workers,
resilient status; see docs/security.md). */}}
{{- define "resilient.etcd.clientTlsEnv" -}}
{{- if and .Values.etcd.enabled .Values.etcd.tls.enabled }}
- name: RESILIENT_ETCD_CA_CERT
  value: /etc/resilient/etcd-tls/ca.crt
- name: RESILIENT_ETCD_CERT
  value: /etc/resilient/etcd-tls/tls.crt
- name: RESILIENT_ETCD_KEY
  value: /etc/resilient/etcd-tls/tls.key
{{- end }}
{{- with .Values.etcd.clientAuth.existingSecret }}
- name: RESILIENT_ETCD_USER
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: username
- name: RESILIENT_ETCD_PASSWORD_FILE
  value: /etc/resilient/etcd-auth/password
{{- end }}
{{- end }}

{{- define "resilient.etcd.clientTlsVolumeMount" -}}
{{- if and .Values.etcd.enabled .Values.etcd.tls.enabled }}
- name: etcd-tls
  mountPath: /etc/resilient/etcd-tls
  readOnly: true
{{- end }}
{{- if .Values.etcd.clientAuth.existingSecret }}
- name: etcd-auth
  mountPath: /etc/resilient/etcd-auth
  readOnly: true
{{- end }}
{{- end }}

{{/* Volumes of a resilient client pod: the TLS Secret and the credentials Secret. */}}
{{- define "resilient.etcd.clientVolumes" -}}
{{- include "resilient.etcd.clientTlsVolume" . }}
{{- with .Values.etcd.clientAuth.existingSecret }}
- name: etcd-auth
  secret:
    secretName: {{ . }}
    defaultMode: 288  # 0440: the pod's fsGroup may read it, other users not
    items:
      - key: password
        path: password
{{- end }}
{{- end }}

{{- define "resilient.etcd.clientTlsVolume" -}}
{{- if and .Values.etcd.enabled .Values.etcd.tls.enabled }}
- name: etcd-tls
  secret:
    secretName: {{ required "etcd.tls.existingSecret must name a Secret with ca.crt, tls.crt and tls.key when etcd.tls.enabled is true" .Values.etcd.tls.existingSecret }}
{{- end }}
{{- end }}

{{/* PET_NNODES: "nodes" or "minNodes:nodes". */}}
{{- define "resilient.workers.nnodes" -}}
{{- if gt (int .Values.workers.minNodes) (int .Values.workers.nodes) }}
{{- fail (printf "workers.minNodes (%d) is larger than workers.nodes (%d): set minNodes <= nodes, or 0 for a fixed size" (int .Values.workers.minNodes) (int .Values.workers.nodes)) }}
{{- end }}
{{- if gt (int .Values.workers.minNodes) 0 }}
{{- printf "%d:%d" (int .Values.workers.minNodes) (int .Values.workers.nodes) }}
{{- else }}
{{- printf "%d" (int .Values.workers.nodes) }}
{{- end }}
{{- end }}

{{/* Members the coordinator must see for the job to be complete (min nodes x procs). */}}
{{- define "resilient.workers.expectedMembers" -}}
{{- $nodes := int .Values.workers.nodes }}
{{- if gt (int .Values.workers.minNodes) 0 }}{{ $nodes = int .Values.workers.minNodes }}{{ end }}
{{- mul $nodes (int .Values.workers.nprocPerNode) }}
{{- end }}

{{- define "resilient.workers.fullname" -}}
{{- printf "%s-workers" (include "resilient.fullname" .) }}
{{- end }}
