{{/*
The Deployment of one role; context (dict "root" $ "role" "prefill"|"decode"). Both roles run the
same image and settings (`config` with the role's `config` over it); decode adds its UCX listener
and the prefill pool's address.
*/}}
{{- define "rekv.deployment" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $role := .role }}
{{- $rv := index $v $role }}
{{- $config := mergeOverwrite (deepCopy $v.config) (deepCopy (default dict $rv.config)) }}
{{- $ctx := dict "root" $root "role" $role "config" $config }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "rekv.roleName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "rekv.roleLabels" . | nindent 4 }}
  {{- with include "rekv.checkovSkips" $ctx }}
  annotations:
    {{- . | nindent 4 }}
  {{- end }}
spec:
  {{- if not $rv.autoscaling.enabled }}
  replicas: {{ int $rv.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  {{- with $rv.strategy }}
  strategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "rekv.roleSelectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "rekv.roleSelectorLabels" . | nindent 8 }}
        app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
        app.kubernetes.io/part-of: rekv
        {{- with $rv.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- $annotations := deepCopy (default dict $rv.podAnnotations) }}
      {{- if include "rekv.hasPlanConfigMap" $root }}
      {{- $_ := set $annotations "checksum/plan" (toJson (dict "profile" $v.plan.profile.inline "policy" $v.plan.policy.inline) | sha256sum) }}
      {{- end }}
      {{- if $v.monitoring.scrapeAnnotations }}
      {{- $_ := set $annotations "prometheus.io/scrape" "true" }}
      {{- $_ := set $annotations "prometheus.io/port" (toString (int $v.ports.metrics)) }}
      {{- $_ := set $annotations "prometheus.io/path" "/metrics" }}
      {{- end }}
      {{- with $annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "rekv.serviceAccountName" $root }}
      automountServiceAccountToken: {{ $v.serviceAccount.automountServiceAccountToken }}
      enableServiceLinks: false
      terminationGracePeriodSeconds: {{ include "rekv.terminationGrace" $ctx }}
      {{- if $v.hostIPC }}
      hostIPC: true
      {{- end }}
      {{- with $v.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with $v.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $v.podSecurityContext | nindent 8 }}
      {{- with $rv.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $rv.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $rv.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $rv.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: rekv
          image: {{ include "rekv.image" $ctx | quote }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          args: ["serve", {{ $role | quote }}]
          ports:
            - name: grpc
              containerPort: {{ int $v.ports.grpc }}
              protocol: TCP
            - name: metrics
              containerPort: {{ int $v.ports.metrics }}
              protocol: TCP
            {{- if eq $role "decode" }}
            - name: ucx
              containerPort: {{ int $v.ports.ucx }}
              protocol: TCP
            {{- end }}
            {{- if $v.tls.enabled }}
            - name: health
              containerPort: {{ include "rekv.probePort" $root }}
              protocol: TCP
            {{- end }}
          env:
            {{- include "rekv.env" $ctx | nindent 12 }}
          {{- include "rekv.probes" $ctx | nindent 10 }}
          {{- if gt (int $v.preStopSleepSeconds) 0 }}
          lifecycle:
            preStop:
              sleep:
                seconds: {{ int $v.preStopSleepSeconds }}
          {{- end }}
          resources:
            {{- include "rekv.resources" $ctx | nindent 12 }}
          securityContext:
            {{- $sc := deepCopy $v.securityContext }}
            {{- if $v.rdma.resources }}
            {{- $_ := set $sc "capabilities" (merge (dict "add" $v.rdma.capabilities) (default dict $sc.capabilities)) }}
            {{- end }}
            {{- toYaml $sc | nindent 12 }}
          volumeMounts:
            {{- include "rekv.volumeMounts" $ctx | nindent 12 }}
      volumes:
        {{- include "rekv.volumes" $ctx | nindent 8 }}
{{- end }}

{{/* Native gRPC probes against grpc.health.v1's overall service "": on ports.health with TLS
(the kubelet's gRPC probes cannot speak TLS), else on ports.grpc. */}}
{{- define "rekv.probes" -}}
{{- $p := (index .root.Values .role).probes }}
{{- $port := include "rekv.probePort" .root }}
{{- range $kind := list "startup" "readiness" "liveness" }}
{{- $probe := index $p $kind }}
{{ $kind }}Probe:
  grpc:
    port: {{ $port }}
  periodSeconds: {{ int $probe.periodSeconds }}
  failureThreshold: {{ int $probe.failureThreshold }}
  timeoutSeconds: {{ int $probe.timeoutSeconds }}
{{- end }}
{{- end }}

{{/* Requests and limits: the role's, plus accelerators (not on cpu) and RDMA resources. */}}
{{- define "rekv.resources" -}}
{{- $v := .root.Values }}
{{- $rv := index $v .role }}
{{- $res := deepCopy (default dict $rv.resources) }}
{{- $limits := default dict $res.limits }}
{{- if ne (toString .config.device) "cpu" }}
{{- $name := index $v.accelerator.resources $v.accelerator.type }}
{{- if not $name }}
{{- fail (printf "accelerator.type: %q has no entry in accelerator.resources" $v.accelerator.type) }}
{{- end }}
{{- $_ := set $limits $name (int $rv.accelerators) }}
{{- end }}
{{- range $name, $count := $v.rdma.resources }}
{{- $_ := set $limits $name $count }}
{{- end }}
{{- $_ := set $res "limits" $limits }}
{{- toYaml $res }}
{{- end }}

{{- define "rekv.volumeMounts" -}}
{{- $v := .root.Values }}
- name: tmp
  mountPath: /tmp
{{- if $v.shm.enabled }}
- name: shm
  mountPath: /dev/shm
{{- end }}
{{- if ne $v.model.source "embedded" }}
- name: model
  mountPath: /models
  readOnly: true
{{- end }}
{{- if include "rekv.hasPlan" .root }}
- name: plan
  mountPath: /etc/rekv/plan
  readOnly: true
{{- end }}
{{- if $v.tls.enabled }}
- name: tls
  mountPath: /etc/rekv/tls
  readOnly: true
{{- end }}
{{- with $v.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "rekv.volumes" -}}
{{- $v := .root.Values }}
- name: tmp
  emptyDir:
    sizeLimit: {{ $v.tmp.sizeLimit }}
{{- if $v.shm.enabled }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ $v.shm.sizeLimit }}
{{- end }}
{{- if eq $v.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName: required when model.source is pvc" $v.model.pvc.claimName }}
    readOnly: true
{{- else if eq $v.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path: required when model.source is hostPath" $v.model.hostPath.path }}
    type: {{ $v.model.hostPath.type }}
{{- end }}
{{- if include "rekv.hasPlan" .root }}
- name: plan
  projected:
    defaultMode: 0444
    sources:
      {{- include "rekv.planSources" .root | nindent 6 }}
{{- end }}
{{- if $v.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "rekv.tlsSecretName" .root }}
    defaultMode: 0440
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- with $v.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The plan volume's sources: the chart's ConfigMap for inline files, else existing ones. */}}
{{- define "rekv.planSources" -}}
{{- $root := . }}
{{- range $file := list "profile" "policy" }}
{{- $p := index $root.Values.plan $file }}
{{- if $p.inline }}
- configMap:
    name: {{ include "rekv.fullname" $root }}-plan
    items:
      - key: {{ $file }}.json
        path: {{ $file }}.json
{{- else if $p.existingConfigMap }}
- configMap:
    name: {{ $p.existingConfigMap }}
    items:
      - key: {{ $p.key }}
        path: {{ $file }}.json
{{- end }}
{{- end }}
{{- end }}
