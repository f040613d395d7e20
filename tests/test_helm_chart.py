"""The Helm chart, helm/rekv, checked without a cluster: helm lint and template (default values and
ci/gpu-values.yaml), the rendered manifests against Kubernetes' schemas (kubernetes-validate) and
checkov, the prometheus-operator monitors (CRDs, so outside those schemas) structurally, the
rendered objects' contract (ports, labels, probes, NetworkPolicy, security), and golden copies.

helm: `bash .ci/install-helm.sh` (.tools/bin/helm, else PATH); kubernetes-validate and checkov:
`bash .ci/install-linters.sh`. Each test skips, saying so, where its tool is missing.
Golden copies (ci/golden/<name>.yaml) leave out the dashboard ConfigMaps, which carry another
file's content (test_dashboards_ship_as_configmaps checks them against dashboards/*.json);
`REKV_UPDATE_GOLDEN=1 pytest tests/test_helm_chart.py -k golden` rewrites them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "rekv"
GOLDEN = CHART / "ci" / "golden"
RELEASE = NAMESPACE = "rekv"
VALUE_SETS = {"default": [], "gpu": ["-f", str(CHART / "ci" / "gpu-values.yaml")]}
MONITORING = "monitoring.coreos.com/v1"
DASHBOARDS = "dashboards"  # app.kubernetes.io/component of the dashboard ConfigMaps
# Every checkov skip the chart may annotate, each justified where it is set (_helpers.tpl).
ALLOWED_SKIPS = {"CKV_K8S_43", "CKV_K8S_15", "CKV_K8S_18", "CKV_K8S_25"}
TIMEOUT_S = 300


def tool(name: str) -> str | None:
    local = ROOT / ".tools" / "bin" / name
    return str(local) if os.access(local, os.X_OK) else shutil.which(name)


@pytest.fixture(scope="module")
def helm() -> str:
    found = tool("helm")
    if found is None:
        pytest.skip("helm not found (.tools/bin/helm or PATH): bash .ci/install-helm.sh")
    return found


def template(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args],
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def template_text(helm: str, *args: str) -> str:
    run = template(helm, *args)
    assert run.returncode == 0, run.stderr
    return run.stdout


def render(helm: str, *args: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(template_text(helm, *args)) if doc]


@pytest.fixture(scope="module")
def rendered(helm) -> dict[str, list[dict]]:
    return {name: render(helm, *args) for name, args in VALUE_SETS.items()}


@pytest.fixture(scope="module")
def everything(helm) -> list[dict]:
    """Every optional object and mount on."""
    return render(helm, "--set", "tls.enabled=true,tls.secretName=rekv-tls,"
                  "monitoring.serviceMonitor.enabled=true,prefill.autoscaling.enabled=true,"
                  "model.source=hostPath,model.hostPath.path=/m,"
                  "plan.policy.existingConfigMap=gates", "--set-json", 'plan.profile.inline="{}"')


def objects(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def deployment(docs: list[dict], role: str) -> dict:
    return objects(docs, "Deployment")[f"rekv-{role}"]


def container(docs: list[dict], role: str) -> dict:
    (main,) = deployment(docs, role)["spec"]["template"]["spec"]["containers"]
    return main


def env(docs: list[dict], role: str) -> dict[str, dict]:
    return {e["name"]: e for e in container(docs, role)["env"]}


def matches(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


# -------------------------------------------------------------------------------- chart and tools

def test_app_version_is_pyprojects_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2" and chart["appVersion"] == project["version"]


def test_values_schema_is_generated_from_values():
    """No drift (`tools/chart_schema.py --check`), and its codec enum is the registry's."""
    from rekv_core.codecs import codec_names

    tool_path = ROOT / "tools" / "chart_schema.py"
    run = subprocess.run([sys.executable, str(tool_path), "--check"],
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr
    spec = importlib.util.spec_from_file_location("chart_schema", tool_path)
    spec.loader.exec_module(chart_schema := importlib.util.module_from_spec(spec))
    assert chart_schema.CODECS == codec_names()


@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint_strict(helm, name):
    run = subprocess.run([helm, "lint", "--strict", str(CHART), "--namespace", NAMESPACE,
                          *VALUE_SETS[name]], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stdout + run.stderr


def test_manifests_pass_kubernetes_schemas(rendered, everything, tmp_path):
    """Strict (unknown fields rejected) at the chart's oldest Kubernetes and the newest known.
    The monitors are CRDs the schemas lack: test_monitors_* check them."""
    validate = tool("kubernetes-validate")
    if validate is None:
        pytest.skip("kubernetes-validate not found (.tools/bin or PATH): "
                    "bash .ci/install-linters.sh")
    files = []
    for name, docs in {**rendered, "everything": everything}.items():
        files.append(tmp_path / f"{name}.yaml")
        files[-1].write_text(yaml.safe_dump_all([d for d in docs if d["apiVersion"] != MONITORING]))
    floor = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    for version in (re.search(r"[0-9]+\.[0-9]+\.[0-9]+", floor).group(), None):
        run = subprocess.run([validate, "--strict", "--quiet",
                              *(["-k", version] if version else []), *map(str, files)],
                             capture_output=True, text=True, timeout=TIMEOUT_S)
        assert run.returncode == 0, run.stdout + run.stderr


def test_checkov_finds_nothing_unjustified(rendered, everything, tmp_path):
    """Default values, GPU values and every switch on; a skip is an annotation with its reason."""
    checkov = tool("checkov")
    if checkov is None:
        pytest.skip("checkov not found (.tools/bin/checkov or PATH): bash .ci/install-linters.sh")
    for name, docs in {**rendered, "everything": everything}.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all(docs))
    run = subprocess.run([checkov, "-d", str(tmp_path), "--framework", "kubernetes", "--compact",
                          "--skip-download", "-o", "json"], capture_output=True, text=True,
                         timeout=TIMEOUT_S, env={**os.environ, "BC_SKIP_MAPPING": "TRUE"})
    report = json.loads(run.stdout)
    report = report[0] if isinstance(report, list) else report  # one framework: one report
    results = report["results"]
    assert not results["failed_checks"], [(c["check_id"], c["resource"], c["file_path"])
                                          for c in results["failed_checks"]]
    for check in results["skipped_checks"]:
        assert check["check_id"] in ALLOWED_SKIPS, check["check_id"]
        assert len(check["check_result"].get("suppress_comment", "")) > 20, check["check_id"]
    assert report["summary"]["passed"] > 100 and report["summary"]["parsing_errors"] == 0


# ------------------------------------------------------------------------------ rendered contract

@pytest.mark.parametrize("name", VALUE_SETS)
def test_ports_labels_probes_and_budgets_agree(rendered, name):
    docs = rendered[name]
    services = objects(docs, "Service")
    for role in ("prefill", "decode"):
        pod = deployment(docs, role)["spec"]["template"]
        assert matches(deployment(docs, role)["spec"]["selector"]["matchLabels"],
                       pod["metadata"]["labels"])
        ports = {p["name"]: p["containerPort"] for p in container(docs, role)["ports"]}
        assert ports["grpc"] == 50051 and ports["metrics"] == 9400
        assert ("ucx" in ports) == (role == "decode")
        for kind in ("startup", "readiness", "liveness"):
            probe = container(docs, role)[f"{kind}Probe"]
            assert probe["grpc"] == {"port": ports["grpc"]}, probe  # service "": the server
        assert container(docs, role)["args"] == ["serve", role]
        other = deployment(docs, "decode" if role == "prefill" else "prefill")["spec"]["template"]
        for service in services.values():
            selector = service["spec"]["selector"]
            if selector["app.kubernetes.io/component"] == role:
                assert matches(selector, pod["metadata"]["labels"])
                assert not matches(selector, other["metadata"]["labels"])
                assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports.keys()
    for headless in (services[f"rekv-{role}-headless"]["spec"] for role in ("prefill", "decode")):
        assert headless["clusterIP"] == "None" and not headless["publishNotReadyAddresses"]
    assert env(docs, "decode")["REKV_PREFILL_ADDRESS"]["value"] == (
        "dns:///rekv-prefill-headless.rekv.svc.cluster.local:50051")
    assert "REKV_PREFILL_ADDRESS" not in env(docs, "prefill")
    budgets = objects(docs, "PodDisruptionBudget")
    assert sorted(budgets) == ["rekv-decode", "rekv-prefill"]
    for role in ("prefill", "decode"):
        assert matches(budgets[f"rekv-{role}"]["spec"]["selector"]["matchLabels"],
                       deployment(docs, role)["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("name", VALUE_SETS)
def test_environment_and_security(rendered, name):
    docs = rendered[name]
    for role in ("prefill", "decode"):
        variables = env(docs, role)
        assert variables["REKV_HOST"]["value"] == "0.0.0.0"
        assert variables["REKV_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            "status.podIP")
        assert variables["REKV_GRPC_PORT"]["value"] == "50051"
        assert variables["REKV_METRICS_PORT"]["value"] == "9400"
        assert ("REKV_UCX_PORT" in variables) == (role == "decode")
        spec = deployment(docs, role)["spec"]["template"]["spec"]
        grace = float(variables["REKV_SHUTDOWN_GRACE_S"]["value"])
        assert spec["terminationGracePeriodSeconds"] > grace + 5  # + the preStop sleep
        pod_security = spec["securityContext"]
        assert pod_security["runAsNonRoot"] and pod_security["runAsUser"] == 10001
        assert pod_security["seccompProfile"] == {"type": "RuntimeDefault"}
        # no Service links: they would add REKV_PREFILL_PORT and the like to the environment
        assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
        security = container(docs, role)["securityContext"]
        assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
        assert security["capabilities"]["drop"] == ["ALL"] and security["runAsNonRoot"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container(docs, role)["volumeMounts"]}
        assert mounts["/tmp"] == "tmp" and "emptyDir" in volumes["tmp"]
        assert mounts["/dev/shm"] == "shm" and volumes["shm"]["emptyDir"]["medium"] == "Memory"
        assert volumes["shm"]["emptyDir"]["sizeLimit"]


def test_gpu_values_request_accelerators_rdma_and_the_model_volume(rendered, helm):
    docs = rendered["gpu"]
    for role in ("prefill", "decode"):
        limits = container(docs, role)["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1 and limits["rdma/ib"] == 1
        assert container(docs, role)["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        spec = deployment(docs, role)["spec"]["template"]["spec"]
        assert spec["hostIPC"] is True
        assert {v["name"]: v for v in spec["volumes"]}["model"]["persistentVolumeClaim"] == {
            "claimName": "rekv-models", "readOnly": True}
        (mount,) = [m for m in container(docs, role)["volumeMounts"] if m["name"] == "model"]
        assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}
        assert env(docs, role)["REKV_MODEL"]["value"] == "/models/SmolLM2-135M-Instruct"
        assert env(docs, role)["REKV_DEVICE"]["value"] == "cuda"
    assert env(docs, "decode")["REKV_MAX_CONCURRENT"]["value"] == "32"  # decode.config wins
    assert env(docs, "prefill")["REKV_MAX_CONCURRENT"]["value"] == "16"
    assert "replicas" not in deployment(docs, "decode")["spec"]  # the HPA owns it
    assert objects(docs, "HorizontalPodAutoscaler")["rekv-decode"]["spec"]["minReplicas"] == 4
    for role in ("prefill", "decode"):  # on the CPU: no accelerator, no hostIPC
        assert "hostIPC" not in deployment(rendered["default"], role)["spec"]["template"]["spec"]
        assert sorted(container(rendered["default"], role)["resources"]["limits"]) == [
            "cpu", "memory"]
    amd = render(helm, "--set", "config.device=cuda,accelerator.type=amd")
    assert container(amd, "decode")["resources"]["limits"]["amd.com/gpu"] == 1


def test_network_policy_admits_exactly_the_data_flows(rendered):
    docs = rendered["default"]
    policies = objects(docs, "NetworkPolicy")
    labels = {role: deployment(docs, role)["spec"]["template"]["metadata"]["labels"]
              for role in ("prefill", "decode")}

    def admitted(role: str) -> dict[int, list[dict]]:
        policy = policies[f"rekv-{role}"]["spec"]
        assert matches(policy["podSelector"]["matchLabels"], labels[role])
        assert policy["policyTypes"] == ["Ingress"]
        out: dict[int, list[dict]] = {}
        for rule in policy["ingress"]:
            for port in rule["ports"]:
                out.setdefault(port["port"], []).extend(rule["from"])
        return out

    def only_pods_of(peers: list[dict], role: str) -> bool:
        return all(set(p) == {"podSelector"} and matches(p["podSelector"]["matchLabels"],
                                                         labels[role]) for p in peers)

    decode, prefill = admitted("decode"), admitted("prefill")
    assert sorted(decode) == [9400, 13337, 13340, 50051]
    assert sorted(prefill) == [9400, 13340, 50051]
    assert decode[50051] == [{"podSelector": {"matchLabels": {"rekv.io/router": "true"}}}]
    assert only_pods_of(decode[13337], "prefill") and only_pods_of(decode[13340], "prefill")
    assert only_pods_of(prefill[50051], "decode") and only_pods_of(prefill[13340], "decode")
    for ports in (decode, prefill):
        assert ports[9400][0]["podSelector"]["matchLabels"] == {
            "app.kubernetes.io/name": "prometheus"}
    ranges = {r["ports"][-1].get("endPort") for p in policies.values()
              for r in p["spec"]["ingress"] if r["ports"][-1]["port"] == 13340}
    assert ranges == {13379}
    assert env(docs, "prefill")["UCX_TCP_PORT_RANGE"]["value"] == "13340-13379"


@pytest.mark.parametrize("kind", ["ServiceMonitor", "PodMonitor"])
def test_monitors_select_their_role_and_name_real_ports(rendered, everything, kind):
    docs = everything if kind == "ServiceMonitor" else rendered["gpu"]
    monitors = objects(docs, kind)
    assert sorted(monitors) == ["rekv-decode", "rekv-prefill"]
    for role in ("prefill", "decode"):
        monitor = monitors[f"rekv-{role}"]
        assert monitor["apiVersion"] == MONITORING
        spec = monitor["spec"]
        assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        selector = spec["selector"]["matchLabels"]
        if kind == "ServiceMonitor":
            targets = [s for s in objects(docs, "Service").values()
                       if matches(selector, s["metadata"]["labels"])]
            assert [t["metadata"]["name"] for t in targets] == [f"rekv-{role}"]
            names = {p["name"] for p in targets[0]["spec"]["ports"]}
            endpoints = spec["endpoints"]
        else:
            targets = [d for d in objects(docs, "Deployment").values()
                       if matches(selector, d["spec"]["template"]["metadata"]["labels"])]
            assert [t["metadata"]["name"] for t in targets] == [f"rekv-{role}"]
            names = {p["name"] for p in container(docs, role)["ports"]}
            endpoints = spec["podMetricsEndpoints"]
        for endpoint in endpoints:
            assert endpoint["port"] in names and endpoint["path"] == "/metrics"
            assert re.fullmatch(r"[0-9]+(ms|s|m|h)", endpoint["interval"])
            assert {"sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"],
                    "targetLabel": "role"} in endpoint["relabelings"]
    assert not objects(rendered["default"], kind)  # off by default


def test_dashboards_ship_as_configmaps(rendered):
    files = sorted((CHART / "dashboards").glob("*.json"))
    for docs in rendered.values():
        maps = [d for d in objects(docs, "ConfigMap").values()
                if d["metadata"]["labels"].get("app.kubernetes.io/component") == DASHBOARDS]
        assert len(maps) == len(files)
        shipped = {key: value for m in maps for key, value in m["data"].items()}
        assert sorted(shipped) == [f.name for f in files]
        for path in files:
            assert json.loads(shipped[path.name]) == json.loads(path.read_text())
        for m in maps:
            assert m["metadata"]["labels"]["grafana_dashboard"] == "1"
            assert m["metadata"]["annotations"] == {"grafana_folder": "rekv"}


def test_optional_mounts_tls_plan_files_and_host_path_model(everything):
    docs = everything
    files = {"REKV_TLS_CERT": "/etc/rekv/tls/tls.crt", "REKV_TLS_KEY": "/etc/rekv/tls/tls.key",
             "REKV_TLS_CA": "/etc/rekv/tls/ca.crt", "REKV_MODEL": "/models",
             "REKV_PROFILE": "/etc/rekv/plan/profile.json",
             "REKV_POLICY": "/etc/rekv/plan/policy.json"}
    for role in ("prefill", "decode"):
        assert {name: env(docs, role)[name]["value"] for name in files} == files
        mounts = {m["mountPath"]: m for m in container(docs, role)["volumeMounts"]}
        assert mounts["/etc/rekv/tls"]["readOnly"] and mounts["/etc/rekv/plan"]["readOnly"]
        volumes = {v["name"]: v for v in deployment(docs, role)["spec"]["template"]["spec"]
                   ["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "rekv-tls"
        sources = [s["configMap"]["name"] for s in volumes["plan"]["projected"]["sources"]]
        assert sources == ["rekv-plan", "gates"]
        assert volumes["model"]["hostPath"] == {"path": "/m", "type": "Directory"}
    assert objects(docs, "ConfigMap")["rekv-plan"]["data"] == {"profile.json": "{}"}


@pytest.mark.parametrize("args, message", [
    ("model.source=pvc", "model.pvc.claimName"),
    ("terminationGracePeriodSeconds=20", "terminationGracePeriodSeconds"),
    ("monitoring.serviceMonitor.enabled=true,monitoring.podMonitor.enabled=true", "not both"),
    ("config.codecs={int9}", "config.codecs"),
    ("ucx.tcpPortRange=13379-13340", "ucx.tcpPortRange"),
    ("prefil.replicas=2", "prefil"),
])
def test_invalid_values_fail_naming_the_value(helm, args, message):
    run = template(helm, "--set", args)
    assert run.returncode != 0 and message in run.stderr, run.stderr


# ---------------------------------------------------------------------------------------- golden

def without_dashboards(text: str) -> str:
    """The rendered text without the dashboard ConfigMaps (their content is another file's)."""
    kept = []
    for chunk in re.split(r"^---\n", text, flags=re.M):
        doc = yaml.safe_load(chunk) if chunk.strip() else None
        labels = (doc or {}).get("metadata", {}).get("labels", {})
        if doc and not (doc["kind"] == "ConfigMap" and
                        labels.get("app.kubernetes.io/component") == DASHBOARDS):
            kept.append(chunk)
    return "---\n" + "---\n".join(kept)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_render_matches_golden_copy(helm, name):
    text = without_dashboards(template_text(helm, *VALUE_SETS[name]))
    path = GOLDEN / f"{name}.yaml"
    if os.environ.get("REKV_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists() and text == path.read_text(), (
        f"the chart renders differently from {path.relative_to(ROOT)}; if intended: "
        f"REKV_UPDATE_GOLDEN=1 pytest tests/test_helm_chart.py -k golden")
