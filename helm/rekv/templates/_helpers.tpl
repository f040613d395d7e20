{{/*
Names, labels and the small computations every template shares. Role templates call these with
(dict "root" $ "role" "prefill"|"decode").
*/}}

{{- define "rekv.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name, cut to 45 characters: the longest suffix added to it is "-prefill-headless" (17),
and Service names are DNS labels of at most 63.
*/}}
{{- define "rekv.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "rekv.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The labels a selector uses: stable across upgrades. */}}
{{- define "rekv.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rekv.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of every resource. */}}
{{- define "rekv.labels" -}}
helm.sh/chart: {{ include "rekv.chart" . }}
{{ include "rekv.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rekv
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* A role's selector labels; context (dict "root" $ "role" role). */}}
{{- define "rekv.roleSelectorLabels" -}}
{{ include "rekv.selectorLabels" .root }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{/* A role's labels; context (dict "root" $ "role" role). */}}
{{- define "rekv.roleLabels" -}}
{{ include "rekv.labels" .root }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{/* <fullname>-<role>; context (dict "root" $ "role" role). */}}
{{- define "rekv.roleName" -}}
{{ include "rekv.fullname" .root }}-{{ .role }}
{{- end }}

{{- define "rekv.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rekv.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The prefill pool's address as the decode pods resolve it: every A record of the headless
Service, resolved again every config.prefillRefreshS. */}}
{{- define "rekv.prefillAddress" -}}
{{- printf "dns:///%s-prefill-headless.%s.svc.%s:%d" (include "rekv.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.ports.grpc) }}
{{- end }}

{{/* The image reference; context (dict "root" $ "config" roleConfig). */}}
{{- define "rekv.image" -}}
{{- $image := .root.Values.image }}
{{- $tag := $image.tag | default (ternary "cpu" "cuda" (eq (toString .config.device) "cpu")) }}
{{- if and $image.digest $image.tag }}
{{- printf "%s:%s@%s" $image.repository (toString $image.tag) $image.digest }}
{{- else if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (toString $tag) }}
{{- end }}
{{- end }}

{{/* REKV_MODEL: the embedded model's name or its path under /models. */}}
{{- define "rekv.modelPath" -}}
{{- $model := .Values.model }}
{{- if eq $model.source "embedded" }}
{{- required "model.name: required when model.source is embedded" $model.name }}
{{- else }}
{{- trimSuffix "/" (printf "/models/%s" (trimPrefix "/" $model.path)) }}
{{- end }}
{{- end }}

{{/* Whether the plan volume has anything to mount ("true" or ""). */}}
{{- define "rekv.hasPlan" -}}
{{- $p := .Values.plan }}
{{- if or $p.profile.inline $p.profile.existingConfigMap $p.policy.inline $p.policy.existingConfigMap }}true{{ end }}
{{- end }}

{{/* Whether the chart creates the plan ConfigMap ("true" or ""). */}}
{{- define "rekv.hasPlanConfigMap" -}}
{{- if or .Values.plan.profile.inline .Values.plan.policy.inline }}true{{ end }}
{{- end }}

{{/* terminationGracePeriodSeconds: larger than the preStop sleep plus the shutdown grace. */}}
{{- define "rekv.terminationGrace" -}}
{{- $config := .config }}
{{- $floor := add (int .root.Values.preStopSleepSeconds) (int (ceil (float64 $config.shutdownGraceS))) }}
{{- $explicit := .root.Values.terminationGracePeriodSeconds }}
{{- if kindIs "invalid" $explicit }}
{{- add $floor 15 }}
{{- else if le (int $explicit) $floor }}
{{- fail (printf "terminationGracePeriodSeconds: must exceed preStopSleepSeconds + %s.config.shutdownGraceS (%d), got %d" .role $floor (int $explicit)) }}
{{- else }}
{{- int $explicit }}
{{- end }}
{{- end }}

{{/* The UCX TCP port range as [first, last]; empty list when unset. */}}
{{- define "rekv.ucxPortRange" -}}
{{- $range := toString .Values.ucx.tcpPortRange }}
{{- if $range }}
{{- $parts := splitList "-" $range }}
{{- if or (ne (len $parts) 2) (not (regexMatch "^[0-9]+-[0-9]+$" $range)) }}
{{- fail (printf "ucx.tcpPortRange: must be first-last, e.g. 13340-13379, got %q" $range) }}
{{- end }}
{{- $first := int (index $parts 0) }}
{{- $last := int (index $parts 1) }}
{{- if or (lt $first 1) (gt $last 65535) (gt $first $last) }}
{{- fail (printf "ucx.tcpPortRange: need 1 <= first <= last <= 65535, got %q" $range) }}
{{- end }}
{{- list $first $last | toJson }}
{{- else }}
{{- list | toJson }}
{{- end }}
{{- end }}

{{/* A one-peer `from` list from a selector pair {podSelector, namespaceSelector}; a null
namespaceSelector is left out (the policy's own namespace), {} selects every namespace. */}}
{{- define "rekv.peer" -}}
{{- $peer := dict }}
{{- if not (kindIs "invalid" .podSelector) }}
{{- $_ := set $peer "podSelector" .podSelector }}
{{- end }}
{{- if not (kindIs "invalid" .namespaceSelector) }}
{{- $_ := set $peer "namespaceSelector" .namespaceSelector }}
{{- end }}
{{- if not $peer }}
{{- fail "networkPolicy: a peer needs a podSelector or a namespaceSelector" }}
{{- end }}
{{- list $peer | toYaml }}
{{- end }}

{{/* A selector pair with its podSelector defaulted when null; context (dict "peer" {podSelector,
namespaceSelector} "default" defaultPodSelector); JSON. */}}
{{- define "rekv.peerWithDefault" -}}
{{- $pods := .peer.podSelector }}
{{- if kindIs "invalid" $pods }}
{{- $pods = .default }}
{{- end }}
{{- dict "podSelector" $pods "namespaceSelector" .peer.namespaceSelector | toJson }}
{{- end }}

{{- define "rekv.routerPeer" -}}
{{- include "rekv.peerWithDefault" (dict "peer" .Values.networkPolicy.router "default" (dict "matchLabels" (dict "rekv.io/router" "true"))) }}
{{- end }}

{{- define "rekv.monitoringPeer" -}}
{{- include "rekv.peerWithDefault" (dict "peer" .Values.networkPolicy.monitoring "default" (dict "matchLabels" (dict "app.kubernetes.io/name" "prometheus"))) }}
{{- end }}

{{/* checkov skip annotations that hold for the rendered pod, each with its reason; context
(dict "root" $ "role" role "config" roleConfig). */}}
{{- define "rekv.checkovSkips" -}}
{{- $v := .root.Values }}
{{- $skips := list }}
{{- if not $v.image.digest }}
{{- $skips = append $skips "CKV_K8S_43=image.digest is empty: set it to pin the image; tags are what docker/README.md builds" }}
{{- end }}
{{- if and (not $v.image.digest) (ne $v.image.pullPolicy "Always") }}
{{- $skips = append $skips "CKV_K8S_15=image.pullPolicy is a value: IfNotPresent keeps multi-GB CUDA images cached on the node" }}
{{- end }}
{{- if $v.hostIPC }}
{{- $skips = append $skips "CKV_K8S_18=hostIPC is on by choice: UCX's CUDA IPC between prefill and decode pods on one node" }}
{{- end }}
{{- if $v.rdma.resources }}
{{- $skips = append $skips "CKV_K8S_25=rdma.capabilities (IPC_LOCK) are added with RDMA: UCX registers (pins) memory" }}
{{- end }}
{{- range $i, $skip := $skips }}
checkov.io/skip{{ add1 $i }}: {{ $skip | quote }}
{{- end }}
{{- end }}

{{/* The TLS Secret the pods mount: tls.secretName, else the one the chart generates. */}}
{{- define "rekv.tlsSecretName" -}}
{{- .Values.tls.secretName | default (printf "%s-tls" (include "rekv.fullname" .)) }}
{{- end }}

{{/* The name the decode pods expect in the prefill pods' certificate (REKV_TLS_SERVER_NAME). */}}
{{- define "rekv.tlsServerName" -}}
{{- .Values.tls.serverName | default (printf "%s-prefill" (include "rekv.fullname" .)) }}
{{- end }}

{{/* The port every probe asks: ports.health with TLS (plaintext health beside the TLS port),
else ports.grpc. Fails when ports.health collides with another port. */}}
{{- define "rekv.probePort" -}}
{{- $ports := .Values.ports }}
{{- if .Values.tls.enabled }}
{{- $health := int $ports.health }}
{{- if or (lt $health 1) (gt $health 65535) (has $health (list (int $ports.grpc) (int $ports.metrics) (int $ports.ucx))) }}
{{- fail (printf "ports.health: must be a free port in 1-65535 other than ports.grpc, ports.metrics and ports.ucx, got %d" $health) }}
{{- end }}
{{- $health }}
{{- else }}
{{- int $ports.grpc }}
{{- end }}
{{- end }}
