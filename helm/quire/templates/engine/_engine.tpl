{{/* Pieces of the engine pod: model source, resources, probes. */}}

{{/* Where the engine reads its model from (empty: the embedded default model). */}}
{{- define "quire.engineModelPath" -}}
{{- $m := .Values.engine.model }}
{{- if eq $m.source "hub" }}
{{- print "/models/model" }}
{{- else if eq $m.source "pvc" }}
{{- printf "/models/%s" (required "engine.model.pvc.path: required when engine.model.source is pvc" $m.pvc.path | trimPrefix "/") }}
{{- else if eq $m.source "image" }}
{{- required "engine.model.image.path: required when engine.model.source is image" $m.image.path }}
{{- end }}
{{- end }}

{{/* Container resources with the GPUs added: gpu.count, at least one a rank (tensor x pipeline). */}}
{{- define "quire.engineResources" -}}
{{- $e := .Values.engine }}
{{- $res := deepCopy $e.resources }}
{{- if $e.gpu.enabled }}
{{- $ranks := mul (int (default 1 $e.config.tensorParallelSize)) (int (default 1 $e.config.pipelineParallelSize)) }}
{{- $count := max (int $e.gpu.count) $ranks }}
{{- $gpus := dict $e.gpu.resourceName (toString $count) }}
{{- $_ := set $res "limits" (merge (default (dict) $res.limits) $gpus) }}
{{- $_ := set $res "requests" (merge (default (dict) $res.requests) (deepCopy $gpus)) }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* Engine options; the device follows gpu.enabled unless set. */}}
{{- define "quire.engineConfig" -}}
{{- $cfg := deepCopy .Values.engine.config }}
{{- if kindIs "invalid" $cfg.device }}
{{- $_ := set $cfg "device" (ternary "cuda" "cpu" .Values.engine.gpu.enabled) }}
{{- end }}
{{- if and (kindIs "invalid" $cfg.modelName) (eq .Values.engine.model.source "hub") }}
{{- $_ := set $cfg "modelName" .Values.engine.model.hub.repoId }}
{{- end }}
{{- include "quire.configEnv" $cfg }}
{{- end }}

{{/* The health check a probe runs. The kubelet's gRPC probe cannot speak TLS, so with TLS the
     probe runs a short grpc.health.v1 client in the container (same semantics, more CPU). */}}
{{- define "quire.engineHealthCheck" -}}
{{- if .Values.tls.enabled }}
exec:
  command:
    - python
    - -c
    - |
      import sys, grpc
      from grpc_health.v1 import health_pb2 as pb, health_pb2_grpc as rpc
      read = lambda name: open("/etc/quire/tls/" + name, "rb").read()
      creds = grpc.ssl_channel_credentials(read("ca.crt"), read("tls.key"), read("tls.crt"))
      channel = grpc.secure_channel("127.0.0.1:{{ .Values.engine.ports.grpc }}", creds,
          options=[("grpc.ssl_target_name_override", "{{ include "quire.tlsServerName" . }}")])
      reply = rpc.HealthStub(channel).Check(pb.HealthCheckRequest(service=""), timeout=4)
      sys.exit(0 if reply.status == pb.HealthCheckResponse.SERVING else 1)
timeoutSeconds: 5
{{- else }}
grpc:
  port: {{ .Values.engine.ports.grpc }}
  service: ""
{{- end }}
{{- end }}

{{/* The model name clients send: the router's, else the engines' (as the engine names it). */}}
{{- define "quire.servedModelName" -}}
{{- $m := .Values.engine.model }}
{{- if .Values.router.config.modelName }}{{ .Values.router.config.modelName }}
{{- else if .Values.engine.config.modelName }}{{ .Values.engine.config.modelName }}
{{- else if eq $m.source "hub" }}{{ $m.hub.repoId }}
{{- else if eq $m.source "embedded" }}HuggingFaceTB/SmolLM2-135M-Instruct
{{- else }}{{ include "quire.engineModelPath" . }}
{{- end }}
{{- end }}
