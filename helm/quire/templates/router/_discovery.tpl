{{/* QUIRE_* variables that tell the router where this release's engines are. */}}
{{- define "quire.routerDiscoveryEnv" -}}
{{- $d := .Values.router.discovery }}
{{- if and (not .Values.engine.enabled) (ne $d.mode "static") (not $d.service) }}
{{- fail "router.discovery.service: name the engines' Service when engine.enabled is false" }}
{{- end }}
- name: QUIRE_DISCOVERY
  value: {{ $d.mode | quote }}
- name: QUIRE_ENGINE_PORT
  value: {{ $d.enginePort | default .Values.engine.ports.grpc | quote }}
{{- if eq $d.engineKind "vllm" }}
{{- if .Values.engine.enabled }}
{{- fail "router.discovery.engineKind vllm fronts an existing vLLM Service: set engine.enabled=false" }}
{{- end }}
- name: QUIRE_ENGINE_KIND
  value: "vllm"
{{- with $d.vllmKvEventsPort }}
- name: QUIRE_VLLM_KV_EVENTS_PORT
  value: {{ . | quote }}
{{- end }}
{{- with $d.vllmKvReplayPort }}
- name: QUIRE_VLLM_KV_REPLAY_PORT
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- if eq $d.mode "kubernetes" }}
# EndpointSlices labelled kubernetes.io/service-name=<engine Service>, port named portName.
- name: QUIRE_K8S_NAMESPACE
  value: {{ include "quire.discoveryNamespace" . | quote }}
- name: QUIRE_K8S_SERVICE
  value: {{ include "quire.discoveryService" . | quote }}
- name: QUIRE_K8S_PORT_NAME
  value: {{ $d.portName | quote }}
- name: QUIRE_K8S_WATCH_TIMEOUT_S
  value: {{ $d.watchTimeoutS | quote }}
{{- else if eq $d.mode "dns" }}
# The headless Service resolves to the ready engine pods.
- name: QUIRE_DNS_NAME
  value: {{ printf "%s.%s.svc" (include "quire.discoveryService" .) (include "quire.discoveryNamespace" .) | quote }}
- name: QUIRE_DNS_INTERVAL_S
  value: {{ $d.dnsIntervalS | quote }}
{{- else }}
- name: QUIRE_ENGINES
  value: {{ required "router.discovery.engines: static discovery needs at least one host:port" (join "," $d.engines) | quote }}
{{- end }}
{{- end }}
