"""The Helm chart, helm/rekv, checked without a cluster for each of VALUE_SETS (default values,
ci/gpu-values.yaml, TLS off): helm lint and template, Kubernetes' schemas (kubernetes-validate),
checkov, the prometheus-operator monitors (CRDs) structurally, the rendered contract (ports,
labels, probes, TLS, NetworkPolicy, security), and golden copies ci/golden/<name>.yaml (without
the dashboard ConfigMaps, which hold dashboards/*.json; the generated TLS Secret's random data as
GENERATED): `REKV_UPDATE_GOLDEN=1 pytest tests/system/test_helm_chart.py -k golden` rewrites them
and fails, saying so. Tools (.tools/bin, else PATH): `bash .ci/install-helm.sh`, `bash
.ci/install-linters.sh`; tests skip, saying so, where their tool is missing."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from concurrent import futures

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.support.paths import ROOT

CHART = ROOT / "helm" / "rekv"
GOLDEN = CHART / "ci" / "golden"
RELEASE = NAMESPACE = "rekv"
VALUE_SETS = {"default": [], "gpu": ["-f", str(CHART / "ci" / "gpu-values.yaml")], "plaintext": [
    "--set", "tls.enabled=false,networkPolicy.allowHealthFromAnywhere=true"]}
TLS_ENV = {"REKV_TLS_CERT": "/etc/rekv/tls/tls.crt", "REKV_TLS_KEY": "/etc/rekv/tls/tls.key",
           "REKV_TLS_CA": "/etc/rekv/tls/ca.crt", "REKV_HEALTH_PORT": "50052"}
MONITORING = "monitoring.coreos.com/v1"
DASHBOARDS = "dashboards"  # app.kubernetes.io/component of the dashboard ConfigMaps
# Every checkov skip the chart may annotate, each justified where it is set (_helpers.tpl).
ALLOWED_SKIPS = {"CKV_K8S_43", "CKV_K8S_15", "CKV_K8S_18", "CKV_K8S_25"}
TIMEOUT_S = 300


def tool(name: str, installer: str = "install-linters") -> str:
    local = ROOT / ".tools" / "bin" / name
    found = str(local) if os.access(local, os.X_OK) else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not found (.tools/bin/{name} or PATH): bash .ci/{installer}.sh")
    return found


@pytest.fixture(scope="module")
def helm() -> str:
    return tool("helm", "install-helm")


def template(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    run = subprocess.run([helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args],
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0 or not check, run.stderr
    return run


def render(helm: str, *args: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(template(helm, *args).stdout) if doc]


@pytest.fixture(scope="module")
def rendered(helm) -> dict[str, list[dict]]:
    return {name: render(helm, *args) for name, args in VALUE_SETS.items()}


@pytest.fixture(scope="module")
def everything(helm) -> list[dict]:
    """Every optional object and mount on."""
    return render(helm, "--set", "tls.secretName=my-tls,networkPolicy.allowHealthFromAnywhere=true,"
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
    """Strict, at the chart's oldest Kubernetes and the newest known; CRDs: test_monitors_*."""
    validate = tool("kubernetes-validate")
    files = [tmp_path / f"{name}.yaml" for name in (*rendered, "everything")]
    for path, docs in zip(files, [*rendered.values(), everything]):
        path.write_text(yaml.safe_dump_all([d for d in docs if d["apiVersion"] != MONITORING]))
    floor = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    for version in (re.search(r"[0-9]+\.[0-9]+\.[0-9]+", floor).group(), None):
        run = subprocess.run([validate, "--strict", "--quiet",
                              *(["-k", version] if version else []), *map(str, files)],
                             capture_output=True, text=True, timeout=TIMEOUT_S)
        assert run.returncode == 0, run.stdout + run.stderr


def test_checkov_finds_nothing_unjustified(rendered, everything, tmp_path):
    """Every value set and every switch on; a skip is an annotation with its reason."""
    checkov = tool("checkov")
    for name, docs in {**rendered, "everything": everything}.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all(docs))
    run = subprocess.run([checkov, "-d", str(tmp_path), "--framework", "kubernetes", "--compact",
                          "--skip-download", "-o", "json"], capture_output=True, text=True,
                         timeout=TIMEOUT_S, env={**os.environ, "BC_SKIP_MAPPING": "TRUE"})
    report = r[0] if isinstance(r := json.loads(run.stdout), list) else r  # one per framework
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
    services, budgets = objects(docs, "Service"), objects(docs, "PodDisruptionBudget")
    assert sorted(budgets) == ["rekv-decode", "rekv-prefill"]
    for role in ("prefill", "decode"):
        pod = deployment(docs, role)["spec"]["template"]
        assert all(matches(o["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
                   for o in (deployment(docs, role), budgets[f"rekv-{role}"]))
        ports = {p["name"]: p["containerPort"] for p in container(docs, role)["ports"]}
        assert ports["grpc"] == 50051 and ports["metrics"] == 9400
        assert ("ucx" in ports) == (role == "decode")
        assert [container(docs, role)[f"{kind}Probe"]["grpc"] for kind in ("startup", "readiness",
                "liveness")] == 3 * [{"port": ports["grpc" if name == "plaintext" else "health"]}]
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
        tls = {k: v["value"] for k, v in variables.items()
               if re.match("REKV_(TLS|HEALTH|PLAINTEXT)", k)}
        assert tls == ({"REKV_PLAINTEXT": "true"} if name == "plaintext" else TLS_ENV | (
            {"REKV_TLS_SERVER_NAME": "rekv-prefill"} if role == "decode" else {}))
        spec = deployment(docs, role)["spec"]["template"]["spec"]
        grace = float(variables["REKV_SHUTDOWN_GRACE_S"]["value"])
        assert spec["terminationGracePeriodSeconds"] > grace + 5  # + the preStop sleep
        assert matches({"runAsNonRoot": True, "runAsUser": 10001,
                        "seccompProfile": {"type": "RuntimeDefault"}}, spec["securityContext"])
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
        assert [v["secret"]["secretName"] for v in spec["volumes"] if v["name"] == "tls"] == (
            sorted(objects(docs, "Secret"))) == ([] if name == "plaintext" else ["rekv-tls"])


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


def test_network_policy_admits_exactly_the_data_flows(rendered, everything):
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
    assert {r["ports"][-1].get("endPort") for p in policies.values()
            for r in p["spec"]["ingress"] if r["ports"][-1]["port"] == 13340} == {13379}
    assert env(docs, "prefill")["UCX_TCP_PORT_RANGE"]["value"] == "13340-13379"
    for docs, wanted in ((rendered["plaintext"], []), (everything, [50052])):  # health from all:
        for policy in objects(docs, "NetworkPolicy").values():  # TLS only, never the gRPC port
            assert [p["port"] for r in policy["spec"]["ingress"] if "from" not in r
                    for p in r["ports"]] == wanted


@pytest.mark.parametrize("kind", ["ServiceMonitor", "PodMonitor"])
def test_monitors_select_their_role_and_name_real_ports(rendered, everything, kind):
    docs = everything if kind == "ServiceMonitor" else rendered["gpu"]
    monitors = objects(docs, kind)
    assert sorted(monitors) == ["rekv-decode", "rekv-prefill"]
    for role in ("prefill", "decode"):
        assert monitors[f"rekv-{role}"]["apiVersion"] == MONITORING
        spec, service = monitors[f"rekv-{role}"]["spec"], kind == "ServiceMonitor"
        assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        targets = [t for t in objects(docs, "Service" if service else "Deployment").values()
                   if matches(spec["selector"]["matchLabels"],
                              (t if service else t["spec"]["template"])["metadata"]["labels"])]
        assert [t["metadata"]["name"] for t in targets] == [f"rekv-{role}"]
        names = {p["name"] for p in (targets[0]["spec"] if service else container(docs, role))
                 ["ports"]}
        for endpoint in spec["endpoints" if service else "podMetricsEndpoints"]:
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
        shipped = {key: json.loads(value) for m in maps for key, value in m["data"].items()}
        assert shipped == {path.name: json.loads(path.read_text()) for path in files}
        assert all(m["metadata"]["labels"]["grafana_dashboard"] == "1" and m["metadata"][
            "annotations"] == {"grafana_folder": "rekv"} for m in maps)


def test_optional_mounts_tls_plan_files_and_host_path_model(everything):
    docs = everything
    files = {**TLS_ENV, "REKV_MODEL": "/models", "REKV_PROFILE": "/etc/rekv/plan/profile.json",
             "REKV_POLICY": "/etc/rekv/plan/policy.json"}
    for role in ("prefill", "decode"):
        assert {name: env(docs, role)[name]["value"] for name in files} == files
        mounts = {m["mountPath"]: m for m in container(docs, role)["volumeMounts"]}
        assert mounts["/etc/rekv/tls"]["readOnly"] and mounts["/etc/rekv/plan"]["readOnly"]
        volumes = {v["name"]: v for v in deployment(docs, role)["spec"]["template"]["spec"]
                   ["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "my-tls"  # tls.secretName: no Secret
        sources = [s["configMap"]["name"] for s in volumes["plan"]["projected"]["sources"]]
        assert sources == ["rekv-plan", "gates"]
        assert volumes["model"]["hostPath"] == {"path": "/m", "type": "Directory"}
    assert objects(docs, "ConfigMap")["rekv-plan"]["data"] == {"profile.json": "{}"}
    assert not objects(docs, "Secret")


def test_generated_tls_secret_serves_mutual_tls_for_both_roles(rendered):
    """A CA and one certificate, server and client alike: a handshake as the services make it
    (client certificate required; the name checked, not the address) for every Service name."""
    secret = objects(rendered["default"], "Secret")["rekv-tls"]
    pem = {key: base64.b64decode(value) for key, value in secret["data"].items()}
    assert secret["type"] == "kubernetes.io/tls" and sorted(pem) == ["ca.crt", "tls.crt", "tls.key"]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)  # "": SERVING
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(pem["tls.key"], pem["tls.crt"])], pem["ca.crt"], require_client_auth=True))
    server.start()
    names = [f"rekv-{role}{kind}{domain}" for role in ("prefill", "decode") for kind in (
        "", "-headless") for domain in ("", ".rekv.svc", ".rekv.svc.cluster.local")]
    credentials = grpc.ssl_channel_credentials(pem["ca.crt"], pem["tls.key"], pem["tls.crt"])
    for name in [env(rendered["default"], "decode")["REKV_TLS_SERVER_NAME"]["value"], *names]:
        with grpc.secure_channel(f"127.0.0.1:{port}", credentials,
                                 options=[("grpc.ssl_target_name_override", name)]) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
    server.stop(None)


@pytest.mark.parametrize("args, message", [
    ("model.source=pvc", "model.pvc.claimName"),
    ("terminationGracePeriodSeconds=20", "terminationGracePeriodSeconds"),
    ("monitoring.serviceMonitor.enabled=true,monitoring.podMonitor.enabled=true", "not both"),
    ("config.codecs={int9}", "config.codecs"),
    ("ucx.tcpPortRange=13379-13340", "ucx.tcpPortRange"),
    ("ports.health=9400", "ports.health"),
    ("prefil.replicas=2", "prefil"),
])
def test_invalid_values_fail_naming_the_value(helm, args, message):
    run = template(helm, "--set", args, check=False)
    assert run.returncode != 0 and message in run.stderr, run.stderr


# ---------------------------------------------------------------------------------------- golden
def comparable(text: str) -> str:
    """Without the dashboard ConfigMaps (another file's content); generated TLS data GENERATED."""
    text = re.sub(r"^(  (tls\.crt|tls\.key|ca\.crt): ).+$", r"\1GENERATED", text, flags=re.M)
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
    text, path = comparable(template(helm, *VALUE_SETS[name]).stdout), GOLDEN / f"{name}.yaml"
    if os.environ.get("REKV_UPDATE_GOLDEN") == "1":  # then never a pass: it compares nothing
        path.write_text(text)
        pytest.fail(f"REKV_UPDATE_GOLDEN=1: wrote {path.relative_to(ROOT)}, compared nothing")
    assert path.exists() and text == path.read_text(), (
        f"the chart renders differently from {path.relative_to(ROOT)}; if intended: "
        f"REKV_UPDATE_GOLDEN=1 pytest tests/system/test_helm_chart.py -k golden")
