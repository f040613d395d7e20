{{/*
The container's environment: every service setting as REKV_<FIELD> (services/settings.py), the
TLS files (or REKV_PLAINTEXT=true with tls.enabled false), the caches under /tmp, UCX's port
range, the OTEL_* variables of tracing (tracing.endpoint set); context (dict "root" $ "role" role "config" roleConfig).
*/}}
{{- define "rekv.env" -}}
{{- $v := .root.Values }}
{{- $c := .config }}
{{- $rv := index $v .role }}
- name: REKV_HOST
  value: "0.0.0.0"
- name: REKV_ADVERTISE_HOST
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: REKV_GRPC_PORT
  value: {{ int $v.ports.grpc | quote }}
- name: REKV_METRICS_PORT
  value: {{ int $v.ports.metrics | quote }}
- name: REKV_TRANSPORT
  value: "ucx"
{{- if eq .role "decode" }}
- name: REKV_UCX_PORT
  value: {{ int $v.ports.ucx | quote }}
- name: REKV_PREFILL_ADDRESS
  value: {{ include "rekv.prefillAddress" .root | quote }}
- name: REKV_PREFILL_REFRESH_S
  value: {{ toString $c.prefillRefreshS | quote }}
- name: REKV_PREFILL_INCOMPATIBLE_S
  value: {{ toString $c.prefillIncompatibleS | quote }}
- name: REKV_CANARY_FRACTION
  value: {{ toString $c.canaryFraction | quote }}
- name: REKV_CANARY_WINDOW
  value: {{ int $c.canaryWindow | quote }}
- name: REKV_CANARY_CONTINUATION
  value: {{ int $c.canaryContinuation | quote }}
- name: REKV_MAX_BATCH
  value: {{ int $c.maxBatch | quote }}
- name: REKV_ITL_BUDGET_MS
  value: {{ toString $c.itlBudgetMs | quote }}
- name: REKV_DECODE_PATH
  value: {{ toString $c.decodePath | quote }}
{{- end }}
- name: REKV_MODEL
  value: {{ include "rekv.modelPath" .root | quote }}
- name: REKV_DEVICE
  value: {{ toString $c.device | quote }}
- name: REKV_DTYPE
  value: {{ toString $c.dtype | quote }}
{{- if kindIs "invalid" $c.torchThreads }}
- name: REKV_TORCH_THREADS
  valueFrom:
    resourceFieldRef:
      containerName: rekv
      resource: limits.cpu
      divisor: "1"
{{- else }}
- name: REKV_TORCH_THREADS
  value: {{ int $c.torchThreads | quote }}
{{- end }}
- name: REKV_CODECS
  value: {{ join "," $c.codecs | quote }}
- name: REKV_MAX_PROMPT_TOKENS
  value: {{ int $c.maxPromptTokens | quote }}
- name: REKV_MAX_NEW_TOKENS
  value: {{ int $c.maxNewTokens | quote }}
- name: REKV_MAX_CONCURRENT
  value: {{ int $c.maxConcurrent | quote }}
- name: REKV_MAX_QUEUE
  value: {{ int $c.maxQueue | quote }}
- name: REKV_MAX_INFLIGHT_BYTES
  value: {{ int64 $c.maxInflightBytes | quote }}
- name: REKV_ON_HANDOFF_FAILURE
  value: {{ toString $c.onHandoffFailure | quote }}
- name: REKV_QUALITY
  value: {{ toString $c.quality | quote }}
- name: REKV_ENCRYPT_DATA_PLANE
  value: {{ ternary "true" "false" $c.encryptDataPlane | quote }}
- name: REKV_LINK_GBPS
  value: {{ toString $c.linkGbps | quote }}
- name: REKV_PACE_GBPS
  value: {{ toString $c.paceGbps | quote }}
- name: REKV_UCX_LOOP_NICE
  value: {{ int $c.ucxLoopNice | quote }}
- name: REKV_HANDOFF_TIMEOUT_S
  value: {{ toString $c.handoffTimeoutS | quote }}
- name: REKV_SHUTDOWN_GRACE_S
  value: {{ toString $c.shutdownGraceS | quote }}
- name: REKV_LOG_LEVEL
  value: {{ toString $c.logLevel | quote }}
{{- $plan := $v.plan }}
{{- if or $plan.profile.inline $plan.profile.existingConfigMap }}
- name: REKV_PROFILE
  value: /etc/rekv/plan/profile.json
{{- end }}
{{- if or $plan.policy.inline $plan.policy.existingConfigMap }}
- name: REKV_POLICY
  value: /etc/rekv/plan/policy.json
{{- end }}
{{- if $v.tls.enabled }}
- name: REKV_TLS_CERT
  value: /etc/rekv/tls/tls.crt
- name: REKV_TLS_KEY
  value: /etc/rekv/tls/tls.key
- name: REKV_TLS_CA
  value: /etc/rekv/tls/ca.crt
{{- if eq .role "decode" }}
- name: REKV_TLS_SERVER_NAME
  value: {{ include "rekv.tlsServerName" .root | quote }}
{{- end }}
- name: REKV_HEALTH_PORT
  value: {{ include "rekv.probePort" .root | quote }}
{{- else }}
- name: REKV_PLAINTEXT
  value: "true"
{{- end }}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: TRITON_CACHE_DIR
  value: /tmp/triton
{{- with $v.ucx.tcpPortRange }}
- name: UCX_TCP_PORT_RANGE
  value: {{ include "rekv.ucxPortRange" $.root | fromJsonArray | join "-" | quote }}
{{- end }}
{{- range $name, $value := $v.ucx.env }}
- name: {{ $name }}
  value: {{ toString $value | quote }}
{{- end }}
{{- with $v.tracing }}
{{- if .endpoint }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_INSECURE
  value: {{ ternary "true" "false" .insecure | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "%s-%s" (default (include "rekv.fullname" $.root) .serviceName) $.role | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .sampler | quote }}
{{- if .samplerArg }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ toString .samplerArg | quote }}
{{- end }}
{{- $attributes := printf "k8s.namespace.name=%s,k8s.pod.name=$(POD_NAME)" $.root.Release.Namespace }}
{{- if .resourceAttributes }}
{{- $attributes = printf "%s,%s" .resourceAttributes $attributes }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ $attributes | quote }}
{{- end }}
{{- end }}
{{- with $v.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- with $rv.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}
