"""The images in docker/, checked without a Docker engine (there is none here), and `rekv health`,
which their HEALTHCHECK runs, against a real gRPC health service.

- hadolint and checkov lint both Dockerfiles (`bash .ci/install-linters.sh` puts them in
  .tools/bin/; each test skips, saying so, where its tool is missing);
- every file the Dockerfiles copy exists and passes .dockerignore, every command the images run
  (ENTRYPOINT, CMD, HEALTHCHECK) is one this repository provides, the images are multi-stage and
  run as a non-root user, and the package is installed from pyproject.toml.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rekv_cli.health import default_address
from services.settings import ROLES, ServiceSettings
from tests.support.paths import ROOT

DOCKER = ROOT / "docker"
DOCKERFILES = [DOCKER / "Dockerfile.cpu", DOCKER / "Dockerfile.cuda"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TOOL_TIMEOUT_S = 300


# -------------------------------------------------------------------------- reading a Dockerfile

def instructions(path: Path) -> list[tuple[int, str, str]]:
    """(stage index, INSTRUCTION, arguments) in order; continuations joined, comments dropped."""
    out, stage, pending = [], -1, ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comment lines inside a continuation are dropped too, as Docker does
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        pending = ""
        keyword = keyword.upper()
        stage += keyword == "FROM"
        out.append((stage, keyword, args.strip()))
    return out


def final_stage(path: Path) -> list[tuple[str, str]]:
    found = instructions(path)
    last = found[-1][0]
    return [(k, a) for s, k, a in found if s == last]


def exec_form(args: str, what: str) -> list[str]:
    assert args.startswith("["), f"{what} should use the exec (JSON) form, got {args!r}"
    return json.loads(args)


def healthcheck_command(path: Path) -> list[str]:
    [args] = [a for k, a in final_stage(path) if k == "HEALTHCHECK"]
    _, _, command = args.partition("CMD ")
    return exec_form(command.strip(), "HEALTHCHECK CMD")


def env_of(path: Path) -> dict[str, str]:
    """The final stage's ENV, `KEY=VALUE` pairs (the form these Dockerfiles use)."""
    env = {}
    for keyword, args in final_stage(path):
        if keyword == "ENV":
            env.update(dict(item.split("=", 1) for item in args.split()))
    return env


def arg_defaults(path: Path) -> dict[str, set[str]]:
    defaults: dict[str, set[str]] = {}
    for _, keyword, args in instructions(path):
        if keyword == "ARG" and "=" in args:
            name, value = args.split("=", 1)
            defaults.setdefault(name, set()).add(value)
    return defaults


def copy_sources(path: Path) -> list[str]:
    """Sources of every COPY/ADD from the build context (copies from a stage are skipped)."""
    sources = []
    for _, keyword, args in instructions(path):
        if keyword not in ("COPY", "ADD"):
            continue
        words = json.loads(args) if args.startswith("[") else args.split()
        flags = [w for w in words if w.startswith("--")]
        if any(f.startswith("--from=") for f in flags):
            continue
        sources += [w for w in words if not w.startswith("--")][:-1]
    return sources


def dockerignore_allows(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or one of its parent
    folders decides; `!` lets back in; `*` stays within one path element, `**` crosses them."""
    def regex(pattern: str) -> re.Pattern:
        out = re.escape(pattern.strip("/")).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        return re.compile(out.replace(r"\*", "[^/]*").replace(r"\?", "[^/]") + "$")

    parts = Path(path).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    allowed = True
    for pattern in patterns:
        negate = pattern.startswith("!")
        if any(regex(pattern.lstrip("!")).match(p) for p in prefixes):
            allowed = negate
    return allowed


def tool(name: str) -> str | None:
    local = ROOT / ".tools" / "bin" / name
    return str(local) if os.access(local, os.X_OK) else shutil.which(name)


# ------------------------------------------------------------------------------------ the linters

@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile):
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not found (.tools/bin/hadolint or PATH): bash .ci/install-linters.sh")
    run = subprocess.run([hadolint, "--no-color", "--config", str(DOCKER / ".hadolint.yaml"),
                          str(dockerfile)], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_lint_exception_says_why(dockerfile):
    """A `# hadolint ignore=` sits under the comment that gives its reason; a checkov skip
    carries its reason after the check id (`# checkov:skip=CKV_X: why`)."""
    lines = [line.strip() for line in dockerfile.read_text().splitlines()]
    for i, line in enumerate(lines):
        where = f"{dockerfile.name}:{i + 1}"
        if "hadolint ignore=" in line:
            above = lines[i - 1] if i else ""
            assert above.startswith("# ") and "ignore=" not in above, f"{where}: no reason above"
        if "checkov:skip=" in line:
            assert re.search(r"checkov:skip=\w+:\s*\S", line), f"{where}: no reason given"


@pytest.fixture(scope="module")
def checkov_report():
    """One checkov run over docker/ (it takes seconds to start). BC_SKIP_MAPPING and
    --skip-download keep it off the network: it would otherwise fetch guideline links."""
    checkov = tool("checkov")
    if checkov is None:
        pytest.skip("checkov not found (.tools/bin/checkov or PATH): bash .ci/install-linters.sh")
    run = subprocess.run([checkov, "-d", str(DOCKER), "--framework", "dockerfile", "--compact",
                          "--skip-download", "-o", "json"],
                         capture_output=True, text=True, timeout=TOOL_TIMEOUT_S,
                         env={**os.environ, "BC_SKIP_MAPPING": "TRUE"})
    assert run.stdout.strip(), f"checkov printed nothing (rc {run.returncode}): {run.stderr}"
    return run.returncode, json.loads(run.stdout)


def test_checkov_passes(checkov_report):
    returncode, report = checkov_report
    summary = report["summary"]
    failed = [f"{c['check_id']} {c['file_path']}:{c['file_line_range']} {c['check_name']}"
              for c in report["results"]["failed_checks"]]
    assert returncode == 0 and summary["failed"] == 0, "\n".join(failed)
    assert summary["parsing_errors"] == 0
    scanned = {Path(c["file_path"]).name for c in report["results"]["passed_checks"]}
    assert scanned == {p.name for p in DOCKERFILES}
    for check in report["results"]["skipped_checks"]:
        assert (check["check_result"].get("suppress_comment") or "").strip(), check["check_id"]


# ------------------------------------------------------------------------- what the images hold

@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copied_file_exists_and_passes_dockerignore(dockerfile):
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.strip().startswith("#")]
    sources = copy_sources(dockerfile)
    assert sources
    for source in sources:
        assert not any(ch in source for ch in "*?$"), f"{source}: name the file plainly"
        assert (ROOT / source).exists(), f"{dockerfile.name} copies {source}: not in the repo"
        assert dockerignore_allows(source, patterns), f"{source} is left out by .dockerignore"
    assert not dockerignore_allows(".venv/bin/python", patterns)
    assert not dockerignore_allows("rekv_core/__pycache__/x.pyc", patterns)
    assert all(not s.endswith((".gguf", ".safetensors", ".pt", ".bin")) for s in sources)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_package_is_installed_from_pyproject(dockerfile):
    """A stage copies pyproject.toml, its readme and every package it names, and then runs
    `pip install` on the folder it copied them to."""
    found = instructions(dockerfile)
    installs = [i for i, (_, k, a) in enumerate(found)
                if k == "RUN" and re.search(r"pip install [^&]*\s\.(\s|$)", a)]
    assert installs, f"{dockerfile.name}: no stage runs `pip install .`"
    stage = found[installs[0]][0]
    copied = {Path(w).parts[0] for s, k, a in found[:installs[0]]
              if s == stage and k == "COPY" and "--from=" not in a
              for w in a.split()[:-1] if not w.startswith("--")}
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in include}
    assert {"pyproject.toml", PYPROJECT["project"]["readme"]} | packages <= copied, copied


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_and_non_root(dockerfile):
    found = instructions(dockerfile)
    stages = [a for _, k, a in found if k == "FROM"]
    assert len(stages) >= 2, "multi-stage: a builder stage and a runtime stage"
    assert all(" AS " in a.upper() for a in stages), "every stage is named"
    last = final_stage(dockerfile)
    assert any(k == "COPY" and "--from=" in a for k, a in last), "the runtime stage copies a build"
    users = [a for k, a in last if k == "USER"]
    assert users, "the final stage sets USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) > 0, f"USER {users[-1]}: a numeric, non-zero uid"
    assert any(k == "RUN" and f"--uid {uid}" in a for k, a in last), "the uid has a passwd entry"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_environment_names_real_settings_and_ports_are_exposed(dockerfile):
    env = env_of(dockerfile)
    fields = {"REKV_" + name.upper() for name in ServiceSettings.__dataclass_fields__}
    unknown = [key for key in env if key.startswith("REKV_") and key not in fields]
    assert not unknown, f"ENV names no setting: {unknown}"
    assert env["REKV_HOST"] == "0.0.0.0"
    names = ("REKV_GRPC_PORT", "REKV_METRICS_PORT", "REKV_UCX_PORT", "REKV_HEALTH_PORT")
    ports = {env[k] for k in names}
    exposed = {p for k, a in final_stage(dockerfile) if k == "EXPOSE" for p in a.split()}
    assert ports <= exposed and "0" not in ports and len(ports) == len(names), (ports, exposed)
    assert env["HOME"].startswith("/tmp") and env["TRITON_CACHE_DIR"].startswith("/tmp")
    # secure by default: the user chooses TLS files or plaintext, the image presets neither
    assert not {"REKV_PLAINTEXT", "REKV_TLS_CERT", "REKV_TLS_KEY", "REKV_TLS_CA"} & env.keys()
    # the health check, run with the image's environment, asks the image's own ports: gRPC in
    # plaintext (-e REKV_PLAINTEXT=true), the health-only port once TLS files are configured
    assert default_address({**env, "REKV_PLAINTEXT": "true"}) == (
        f"127.0.0.1:{env['REKV_GRPC_PORT']}")
    assert default_address({**env, "REKV_TLS_CERT": "/tls/tls.crt"}) == (
        f"127.0.0.1:{env['REKV_HEALTH_PORT']}")


@pytest.fixture(scope="module")
def rekv_subcommands() -> dict[str, object]:
    from rekv_cli.main import build_parser

    [sub] = [a for a in build_parser()._actions if a.dest == "command"]
    return sub.choices


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_command_the_image_runs_is_the_repos(dockerfile, rekv_subcommands):
    last = final_stage(dockerfile)
    [entrypoint] = [exec_form(a, "ENTRYPOINT") for k, a in last if k == "ENTRYPOINT"]
    [cmd] = [exec_form(a, "CMD") for k, a in last if k == "CMD"]
    for argv in (entrypoint + cmd, healthcheck_command(dockerfile)):
        assert_repo_command(argv, rekv_subcommands)
    assert entrypoint + cmd == ["rekv", "serve", "prefill"]


def assert_repo_command(argv: list[str], subcommands) -> None:
    if argv[0] == "rekv":
        assert "rekv" in PYPROJECT["project"]["scripts"]
        assert argv[1] in subcommands, f"rekv has no subcommand {argv[1]!r}"
        if argv[1] == "serve":
            assert argv[2] in ROLES, f"rekv serve has no role {argv[2]!r}"
        return
    assert argv[:2] == ["python", "-m"], f"{argv}: neither `rekv` nor `python -m` a repo module"
    module = ROOT.joinpath(*argv[2].split(".")).with_suffix(".py")
    assert module.is_file() and 'if __name__ == "__main__":' in module.read_text(), argv
    run = subprocess.run([sys.executable, "-m", argv[2], *argv[3:], "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def test_cuda_image_swaps_ucxx_for_its_cuda_13_build():
    """The CUDA image installs pyproject's dependencies with ucxx-cu12 replaced (the script fails
    the build when pyproject no longer names it), and builds the UCX release its wheels bundle."""
    dockerfile = DOCKER / "Dockerfile.cuda"
    defaults = {k: v.pop() for k, v in arg_defaults(dockerfile).items() if len(v) == 1}
    assert "UCX_VERSION" in defaults, "every stage's UCX_VERSION has one and the same default"
    [replace] = re.findall(r'--replace "([^"]+)"', dockerfile.read_text())
    replace = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], replace)
    run = subprocess.run([sys.executable, str(DOCKER / "requirements_from_pyproject.py"),
                          str(ROOT / "pyproject.toml"), "--replace", replace],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    wanted = PYPROJECT["project"]["dependencies"]
    got = run.stdout.splitlines()
    assert len(got) == len(wanted) and not any("ucxx-cu12" in line for line in got)
    assert f"ucxx-cu13=={defaults['UCXX_VERSION']}; platform_system == 'Linux'" in got
    assert [g for g in got if "ucxx" not in g] == [w for w in wanted if "ucxx" not in w]
    bad = subprocess.run([sys.executable, str(DOCKER / "requirements_from_pyproject.py"),
                          str(ROOT / "pyproject.toml"), "--replace", "no-such-dep=x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "no-such-dep" in bad.stderr


# ------------------------------------------------------------------------------------ rekv health

@pytest.fixture
def health_server():
    """A gRPC server in this process with the standard health servicer: "" SERVING,
    rekv.v1.Prefill NOT_SERVING. Yields (address, servicer)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("rekv.v1.Prefill", health_pb2.HealthCheckResponse.NOT_SERVING)
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


def run_health(*args: str, module: str = "rekv_cli.health", env: dict | None = None):
    base = {k: v for k, v in os.environ.items() if not k.startswith("REKV_")}
    command = [sys.executable, "-m", *module.split(), *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**base, **(env or {})})


def test_rekv_health_exits_0_when_serving(health_server):
    address, _ = health_server
    run = run_health("--address", address, module="rekv_cli health")  # as `rekv health`
    assert run.returncode == 0, run.stderr
    assert "SERVING" in run.stdout


def test_rekv_health_exits_1_with_a_reason(health_server):
    address, servicer = health_server
    run = run_health("--address", address, "--service", "rekv.v1.Prefill")
    assert run.returncode == 1 and "NOT_SERVING" in run.stderr
    run = run_health("--address", address, "--service", "rekv.v1.Nothing")
    assert run.returncode == 1 and "unknown service" in run.stderr
    servicer.enter_graceful_shutdown()  # what a service does on SIGTERM
    run = run_health("--address", address)
    assert run.returncode == 1 and "NOT_SERVING" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_rekv_health_exits_1_when_unreachable():
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = run_health("--address", f"127.0.0.1:{port}", "--timeout", "5")
    assert run.returncode == 1 and "unreachable" in run.stderr


def test_rekv_health_defaults_to_this_hosts_grpc_port(health_server):
    address, _ = health_server
    port = address.rsplit(":", 1)[1]
    run = run_health(env={"REKV_GRPC_PORT": port, "REKV_HOST": "0.0.0.0"})
    assert run.returncode == 0, run.stderr
    assert default_address({}) == "127.0.0.1:50051"
    assert default_address({"REKV_HOST": "::", "REKV_GRPC_PORT": "7"}) == "127.0.0.1:7"
    assert default_address({"REKV_HOST": "10.1.2.3"}) == "10.1.2.3:50051"
    assert default_address({"REKV_HOST": "fd00::1"}) == "[fd00::1]:50051"


def test_rekv_health_asks_the_health_port_when_tls_is_configured(health_server):
    """With TLS the service's gRPC port speaks only TLS; grpc.health.v1 is also served alone, in
    plaintext, on REKV_HEALTH_PORT: the default address follows the service's settings."""
    address, _ = health_server
    port = address.rsplit(":", 1)[1]
    tls = {"REKV_TLS_CERT": "/etc/rekv/tls/tls.crt", "REKV_GRPC_PORT": "1"}  # 1: nothing there
    run = run_health(env={**tls, "REKV_HEALTH_PORT": port})
    assert run.returncode == 0, run.stderr
    assert default_address(tls) == "127.0.0.1:50052"  # REKV_HEALTH_PORT unset: the images' value
    assert default_address({**tls, "REKV_HEALTH_PORT": "7"}) == "127.0.0.1:7"
    for plaintext in ("true", "1", "YES"):  # plaintext wins over TLS files: the gRPC port
        assert default_address({**tls, "REKV_PLAINTEXT": plaintext}) == "127.0.0.1:1"
    assert default_address({**tls, "REKV_PLAINTEXT": "false"}) == "127.0.0.1:50052"
    assert default_address({"REKV_HEALTH_PORT": "7", "REKV_GRPC_PORT": "8"}) == "127.0.0.1:8"
    assert default_address({**tls, "REKV_HOST": "10.1.2.3"}) == "10.1.2.3:50052"
