{{/* Names, labels and the small pieces both components share. */}}

{{- define "quire.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<chart>, shortened to leave room for "-router" / "-engine" suffixes. */}}
{{- define "quire.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "quire.routerName" -}}{{ include "quire.fullname" . }}-router{{- end }}
{{- define "quire.engineName" -}}{{ include "quire.fullname" . }}-engine{{- end }}

{{- define "quire.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "router"). */}}
{{- define "quire.selectorLabels" -}}
app.kubernetes.io/name: {{ include "quire.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Standard labels of one component's objects. */}}
{{- define "quire.labels" -}}
{{ include "quire.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: quire
helm.sh/chart: {{ include "quire.chart" .root }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* repository:tag or repository@digest; the tag defaults to the appVersion. */}}
{{- define "quire.image" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) }}
{{- end }}
{{- end }}

{{/* One scalar as an environment value; whole numbers never in exponent form. */}}
{{- define "quire.scalar" -}}
{{- if and (kindIs "float64" .) (eq (float64 (int64 .)) .) }}
{{- int64 . }}
{{- else }}
{{- . }}
{{- end }}
{{- end }}

{{/* A `config` block as QUIRE_<SNAKE_CASE> variables; null values are left out. */}}
{{- define "quire.configEnv" -}}
{{- range $key, $value := . }}
{{- if not (kindIs "invalid" $value) }}
- name: {{ printf "QUIRE_%s" (snakecase $key | upper) }}
  value: {{ include "quire.scalar" $value | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The grace period: explicit (checked) or preStop + drain + margin.
     (dict "name" "engine" "values" .Values.engine "margin" 10) */}}
{{- define "quire.gracePeriod" -}}
{{- $floor := add (int .values.preStopSleepSeconds) (int (ceil .values.config.drainTimeoutS)) }}
{{- if kindIs "invalid" .values.terminationGracePeriodSeconds }}
{{- add $floor .margin }}
{{- else if lt (int .values.terminationGracePeriodSeconds) $floor }}
{{- fail (printf "%s.terminationGracePeriodSeconds: must be at least %s.preStopSleepSeconds + %s.config.drainTimeoutS = %d, got %d" .name .name .name $floor (int .values.terminationGracePeriodSeconds)) }}
{{- else }}
{{- int .values.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/* OTEL_* variables of one component: (dict "root" $ "component" "router"). */}}
{{- define "quire.tracingEnv" -}}
{{- $t := .root.Values.tracing }}
{{- if $t.enabled }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: OTEL_SERVICE_NAME
  value: {{ printf "quire-%s" .component | quote }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ required "tracing.endpoint: required when tracing.enabled is true" $t.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $t.protocol | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $t.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $t.samplerArg | quote }}
{{- with $t.headersSecretName }}
- name: OTEL_EXPORTER_OTLP_HEADERS
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $t.headersSecretKey }}
{{- end }}
{{- $attrs := list "k8s.pod.name=$(POD_NAME)" "k8s.namespace.name=$(POD_NAMESPACE)" (printf "service.instance.id=$(POD_NAME)") (printf "service.namespace=%s" .root.Release.Name) }}
{{- range $k, $v := $t.resourceAttributes }}
{{- $attrs = append $attrs (printf "%s=%s" $k (toString $v)) }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attrs | quote }}
{{- end }}
{{- end }}

{{/* The writable volumes a read-only root filesystem needs. */}}
{{- define "quire.writableMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /cache
{{- end }}

{{- define "quire.cacheEnv" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /cache
- name: QUIRE_CACHE_DIR
  value: /cache/quire
- name: HF_HOME
  value: /cache/huggingface
{{- end }}

{{- define "quire.routerServiceAccountName" -}}
{{- if .Values.router.serviceAccount.enabled }}
{{- default (include "quire.routerName" .) .Values.router.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.router.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "quire.engineServiceAccountName" -}}
{{- if .Values.engine.serviceAccount.enabled }}
{{- default (include "quire.engineName" .) .Values.engine.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.engine.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The engine Service the router discovers: this release's, or the one router.discovery names
     (engines deployed elsewhere, engine.enabled=false). */}}
{{- define "quire.discoveryService" -}}
{{- default (include "quire.engineName" .) .Values.router.discovery.service }}
{{- end }}
{{- define "quire.discoveryNamespace" -}}
{{- default .Release.Namespace .Values.router.discovery.namespace }}
{{- end }}

{{/* The name the router checks in engine certificates. */}}
{{- define "quire.tlsServerName" -}}
{{- default (printf "%s.%s.svc" (include "quire.discoveryService" .) (include "quire.discoveryNamespace" .)) .Values.tls.serverName }}
{{- end }}

{{/* Flow control's tenants table as the router reads it (QUIRE_TENANTS): the chart's camelCase
     setting names in snake_case; tenant names as written. Empty when nothing is set. */}}
{{- define "quire.tenantsJson" -}}
{{- $table := dict }}
{{- with include "quire.snakeKeys" (.default | default dict) | fromJson }}
{{- $_ := set $table "default" . }}
{{- end }}
{{- $tenants := dict }}
{{- range $name, $settings := .tenants }}
{{- $_ := set $tenants $name (include "quire.snakeKeys" $settings | fromJson) }}
{{- end }}
{{- if $tenants }}
{{- $_ := set $table "tenants" $tenants }}
{{- end }}
{{- if $table }}{{ toJson $table }}{{ end }}
{{- end }}

{{- define "quire.snakeKeys" -}}
{{- $out := dict }}
{{- range $key, $value := . }}
{{- if not (kindIs "invalid" $value) }}
{{- $_ := set $out (snakecase $key) $value }}
{{- end }}
{{- end }}
{{- toJson $out }}
{{- end }}
