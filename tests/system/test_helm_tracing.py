"""The Helm chart's tracing values (helm/rekv, `tracing.*`): off by default, and set, the
standard `OTEL_*` variables on both roles that `services/tracing.py` and the OpenTelemetry SDK
read, in manifests Kubernetes' schemas accept. The chart's other checks: test_helm_chart.py."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from tests.system.test_helm_chart import CHART, TIMEOUT_S, VALUE_SETS, env, render, tool

TRACING = ("tracing.endpoint=http://otel:4317,tracing.sampler=parentbased_traceidratio,"
           "tracing.samplerArg=0.25,tracing.resourceAttributes=deployment.environment=prod")


@pytest.fixture(scope="module")
def helm() -> str:
    return tool("helm", "install-helm")


@pytest.mark.parametrize("name", VALUE_SETS)
def test_no_otel_variable_while_tracing_endpoint_is_empty(helm, name):
    docs = render(helm, *VALUE_SETS[name])
    for role in ("prefill", "decode"):
        assert not [variable for variable in env(docs, role) if variable.startswith("OTEL_")]


def test_tracing_values_become_the_otel_variables_of_both_roles(helm, tmp_path):
    docs = render(helm, "--set", TRACING)
    for role in ("prefill", "decode"):
        variables = env(docs, role)
        otel = {k: v["value"] for k, v in variables.items() if k.startswith("OTEL_")}
        assert otel == {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4317",
            "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_SERVICE_NAME": f"rekv-{role}",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25",
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,"
                                        "k8s.namespace.name=rekv,k8s.pod.name=$(POD_NAME)"}
        # $(POD_NAME) expands only from a variable defined before it
        names = list(variables)
        assert variables["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert names.index("POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    named = env(render(helm, "--set", "tracing.endpoint=https://c:4317,tracing.insecure=false,"
                       "tracing.serviceName=llm"), "decode")
    assert named["OTEL_SERVICE_NAME"]["value"] == "llm-decode"
    assert named["OTEL_EXPORTER_OTLP_INSECURE"]["value"] == "false"
    assert "OTEL_TRACES_SAMPLER_ARG" not in named
    path = tmp_path / "tracing.yaml"
    path.write_text(yaml.safe_dump_all([d for d in docs if d["kind"] != "ServiceMonitor"]))
    floor = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    run = subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", "-k",
                          re.search(r"[0-9]+\.[0-9]+\.[0-9]+", floor).group(), str(path)],
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stdout + run.stderr
