"""Generate the rekv chart's values.schema.json from its values.yaml, or check that it is current.

    python tools/chart_schema.py            write helm/rekv/values.schema.json
    python tools/chart_schema.py --check    exit 1 when the committed file differs (drift)

Types are inferred from the defaults: a mapping becomes an object whose keys are its properties
(no others allowed, so a misspelt key fails `helm install` and `helm lint`), a list an array, a
scalar its JSON type. The comment block above a key becomes its description. What a default cannot
say (enums, ranges, nullable values, Kubernetes objects passed through verbatim) sits in FREEFORM
and OVERRIDES below. Every value must be documented: its own comment starting with "-- ", or one
on a mapping above it; an undocumented value is an error in both modes.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "rekv"
VALUES = CHART / "values.yaml"
SCHEMA = CHART / "values.schema.json"
ROLES = ("prefill", "decode")
# rekv_core.codecs.codec_names(); tests/system/test_helm_chart.py checks that the two agree.
CODECS = ["bf16", "int8", "int4", "int4h", "spectrum30", "spectrum50", "splitzip"]
LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
QUANTITY = {"type": ["string", "integer"]}
SELECTOR = {"type": ["object", "null"],  # a Kubernetes LabelSelector; null: the chart's default
            "properties": {"matchLabels": {"type": "object"},
                           "matchExpressions": {"type": "array"}},
            "additionalProperties": False}


def _role_paths(*suffixes: str) -> list[str]:
    return [f"{role}.{suffix}" for role in ROLES for suffix in suffixes]


# Values handed to Kubernetes (or UCX) as they are: typed by their default, never descended into.
FREEFORM = {
    "imagePullSecrets", "ucx.env", "accelerator.resources", "rdma.resources",
    "rdma.capabilities", "extraEnv", "extraVolumes", "extraVolumeMounts", "commonLabels",
    "serviceAccount.annotations", "networkPolicy.extraPrefillIngress",
    "networkPolicy.extraDecodeIngress", "monitoring.serviceMonitor.labels",
    "monitoring.serviceMonitor.relabelings", "monitoring.serviceMonitor.metricRelabelings",
    "monitoring.podMonitor.labels", "monitoring.podMonitor.relabelings",
    "monitoring.podMonitor.metricRelabelings",
    *_role_paths("resources", "extraEnv", "podLabels", "podAnnotations", "nodeSelector",
                 "tolerations", "affinity", "topologySpreadConstraints", "strategy",
                 "service.annotations", "autoscaling.metrics", "autoscaling.behavior"),
}

# Merged into the inferred schema of a path (a value of None removes the key).
OVERRIDES: dict[str, dict] = {
    "image.pullPolicy": {"enum": ["IfNotPresent", "Always", "Never"]},
    "image.digest": {"pattern": "^(sha256:[a-f0-9]{64})?$"},
    "image.tag": {"type": ["string", "number"]},
    "ports.grpc": PORT, "ports.metrics": PORT, "ports.ucx": PORT, "ports.health": PORT,
    "tls.validityDays": {"type": "integer", "minimum": 1},
    "ucx.tcpPortRange": {"pattern": "^([0-9]{1,5}-[0-9]{1,5})?$"},
    "model.source": {"enum": ["embedded", "pvc", "hostPath"]},
    "model.hostPath.type": {"enum": ["Directory", "DirectoryOrCreate"]},
    "config.device": {"pattern": "^(cpu|cuda(:[0-9]+)?)$"},
    "config.dtype": {"enum": ["auto", "float32", "bfloat16"]},
    "config.torchThreads": {"type": ["integer", "null"], "minimum": 0},
    "config.codecs": {"minItems": 1, "uniqueItems": True,
                      "items": {"type": "string", "enum": CODECS}},
    "config.maxPromptTokens": {"minimum": 1},
    "config.maxNewTokens": {"minimum": 1},
    "config.maxConcurrent": {"minimum": 1},
    "config.maxQueue": {"minimum": 0},
    "config.maxBatch": {"minimum": 1},
    "config.itlBudgetMs": {"minimum": 0},
    "config.decodePath": {"enum": ["batched", "per_request"]},
    "config.maxInflightBytes": {"minimum": 1},
    "config.onHandoffFailure": {"enum": ["recompute", "fail"]},
    "config.quality": {"enum": ["lossless", "gated"]},
    "config.linkGbps": {"exclusiveMinimum": 0},
    "config.paceGbps": {"minimum": 0},
    "config.ucxLoopNice": {"minimum": -1, "maximum": 19},
    "config.handoffTimeoutS": {"exclusiveMinimum": 0},
    "config.prefillRefreshS": {"exclusiveMinimum": 0},
    "config.prefillIncompatibleS": {"minimum": 0},
    "config.canaryFraction": {"minimum": 0, "maximum": 1},
    "config.canaryWindow": {"minimum": 1},
    "config.canaryContinuation": {"minimum": 0},
    "config.shutdownGraceS": {"minimum": 0},
    "config.logLevel": {"enum": LOG_LEVELS},
    "accelerator.type": {"minLength": 1},
    "rdma.capabilities": {"items": {"type": "string"}},
    "shm.sizeLimit": QUANTITY,
    "tmp.sizeLimit": QUANTITY,
    "preStopSleepSeconds": {"minimum": 0},
    "terminationGracePeriodSeconds": {"type": ["integer", "null"], "minimum": 1},
    "networkPolicy.router.podSelector": SELECTOR,
    "networkPolicy.router.namespaceSelector": SELECTOR,
    "networkPolicy.monitoring.podSelector": SELECTOR,
    "networkPolicy.monitoring.namespaceSelector": SELECTOR,
    "dashboards.labelKey": {"minLength": 1},
    "dashboards.folderAnnotationKey": {"minLength": 1},
}
for _role in ROLES:
    OVERRIDES.update({
        f"{_role}.replicas": {"minimum": 0},
        f"{_role}.accelerators": {"minimum": 0},
        f"{_role}.service.type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
        f"{_role}.pdb.maxUnavailable": {"type": ["integer", "string"]},
        f"{_role}.pdb.minAvailable": {"type": ["integer", "string", "null"]},
        f"{_role}.autoscaling.minReplicas": {"minimum": 1},
        f"{_role}.autoscaling.maxReplicas": {"minimum": 1},
        f"{_role}.autoscaling.targetCPUUtilizationPercentage": {"type": ["integer", "null"],
                                                               "minimum": 1},
    })
    for _probe in ("startup", "readiness", "liveness"):
        for _field in ("periodSeconds", "failureThreshold", "timeoutSeconds"):
            OVERRIDES[f"{_role}.probes.{_probe}.{_field}"] = {"minimum": 1}


class Undocumented(ValueError):
    pass


def _comment_above(lines: list[str], line: int) -> str:
    """The block of full-line comments right above a line (0-based), as one text."""
    block = []
    i = line - 1
    while i >= 0 and lines[i].strip().startswith("#"):
        block.append(lines[i].strip()[1:].strip())
        i -= 1
    return " ".join(reversed(block)).strip()


def _scalar_type(value) -> dict:
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "integer"}
    if isinstance(value, float):
        return {"type": "number"}
    if isinstance(value, str):
        return {"type": "string"}
    return {}  # null: the override says what it may be


def _array(value: list) -> dict:
    """An array; its items typed when every default item is a scalar of one type."""
    schema: dict = {"type": "array"}
    kinds = {json.dumps(_scalar_type(item)) for item in value}
    if value and len(kinds) == 1 and not isinstance(value[0], dict | list):
        schema["items"] = json.loads(kinds.pop())
    return schema


class Builder:
    """Walks values.yaml's node tree (for comments and lines) beside its loaded data."""

    def __init__(self, text: str):
        self.lines = text.splitlines()
        self.undocumented: list[str] = []

    def build(self, node: yaml.MappingNode, data: dict, path: str, documented: bool) -> dict:
        properties, required = {}, []
        for key_node, value_node in node.value:
            key = key_node.value
            full = f"{path}.{key}" if path else key
            comment = _comment_above(self.lines, key_node.start_mark.line)
            own = comment.startswith("--")
            description = comment[2:].strip() if own else comment
            value = data[key]
            if isinstance(value, dict) and value and full not in FREEFORM:
                schema = self.build(value_node, value, full, documented or own)
            else:
                if not (own or documented):
                    self.undocumented.append(f"{full} (line {key_node.start_mark.line + 1})")
                schema = self._leaf(value)
            if description:
                schema = {"description": description, **schema}
            properties[key] = self._override(full, schema)
            # Helm drops a key set to null before it validates: a nullable value is optional.
            if value is not None and "null" not in properties[key].get("type", []):
                required.append(key)
        return {"type": "object", "properties": properties, "required": required,
                "additionalProperties": False}

    @staticmethod
    def _leaf(value) -> dict:
        if isinstance(value, dict):
            return {"type": "object"}
        if isinstance(value, list):
            return _array(value)
        return _scalar_type(value)

    @staticmethod
    def _override(path: str, schema: dict) -> dict:
        for key, value in OVERRIDES.get(path, {}).items():
            if value is None:
                schema.pop(key, None)
            else:
                schema[key] = copy.deepcopy(value)
        return schema


def generate(text: str) -> dict:
    """The schema of a values.yaml text; Undocumented lists values without a comment."""
    builder = Builder(text)
    root = yaml.compose(text)
    body = builder.build(root, yaml.safe_load(text), "", False)
    if builder.undocumented:
        raise Undocumented("values without a '# -- ' comment (on them or a mapping above):\n  "
                           + "\n  ".join(builder.undocumented))
    # A role's `config` overrides single keys of `config`: the same properties, none required.
    config = body["properties"]["config"]
    for role in ROLES:
        role_config = body["properties"][role]["properties"]["config"]
        role_config.update({"properties": copy.deepcopy(config["properties"]),
                            "additionalProperties": False})
    # Helm hands a subchart its parent's `global` values.
    body["properties"]["global"] = {"type": "object",
                                    "description": "Global values of a parent chart."}
    return {"$schema": "http://json-schema.org/draft-07/schema#",
            "title": "Values of the rekv Helm chart",
            "description": "Generated by tools/chart_schema.py from values.yaml: do not edit.",
            **body}


def render(schema: dict) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when values.schema.json differs from what values.yaml gives")
    parser.add_argument("--values", type=Path, default=VALUES)
    parser.add_argument("--schema", type=Path, default=SCHEMA)
    args = parser.parse_args(argv)
    try:
        wanted = render(generate(args.values.read_text()))
    except Undocumented as error:
        print(f"{args.values}: {error}", file=sys.stderr)
        return 1
    current = args.schema.read_text() if args.schema.exists() else ""
    if not args.check:
        if current != wanted:
            args.schema.write_text(wanted)
            print(f"wrote {args.schema}")
        return 0
    if current == wanted:
        return 0
    diff = difflib.unified_diff(current.splitlines(), wanted.splitlines(), str(args.schema),
                                "generated", lineterm="", n=1)
    print("\n".join(list(diff)[:60]), file=sys.stderr)
    print(f"{args.schema} is out of date: run python tools/chart_schema.py", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
