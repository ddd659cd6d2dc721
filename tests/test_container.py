"""The CPU image, built by a Docker engine from docker/Dockerfile and run as Kubernetes would run it.

Skipped when no Docker engine answers (.ci/run installs Debian's docker.io and starts one when it runs as
root). Offline but for Debian's archive and pip's configured package sources:
- the base is Debian bookworm made with debootstrap and imported (kept in the engine as BASE_IMAGE, so a
  later run reuses it: debootstrap takes about 80 s);
- the wheels are downloaded on the host, for the base's Python, into the wheelhouse of a copy of the build
  context; the CPU torch wheel comes from pip's configured indexes and find-links (`pip config list`), or
  from TORCH_INDEX_URL, as in scripts/install.sh.
The build runs `docker build` as the machine has it (Debian's docker.io: the classic builder, which also
builds every stage the file names). Measured on 2 cores: 3.4 minutes with no image in the engine (debootstrap
80 s, the wheels 25 s, the build), 1.8 with the base and the build's layers left by a run before.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tokensampler_client import SamplerClient

from .test_metrics import parse_samples, value

pytestmark = [pytest.mark.container, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[1]
BASE_IMAGE = "tokensampler-test/debian:bookworm"
BASE_PYTHON = "3.11"  # bookworm's python3: the wheels are for it
DEBIAN_MIRROR = "http://deb.debian.org/debian"
IMAGE = "tokensampler-test:cpu"
PORT = 6000  # not the image's TOKENSAMPLER_PORT (50051): the health check must follow --port
GRACE_S = 5


def _docker(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, f"docker {' '.join(args)}:\n{result.stdout[-4000:]}{result.stderr[-4000:]}"
    return result


def _skip_without_an_engine() -> None:
    if shutil.which("docker") is None:
        pytest.skip("no docker command (.ci/run installs Debian's docker.io when it runs as root)")
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        reason = (info.stderr.strip().splitlines() or ["no answer"])[-1]
        pytest.skip(f"no Docker engine answers `docker info` ({reason}); .ci/run starts dockerd when it runs as root")


def _base_image(scratch: Path) -> str:
    """Debian bookworm made with debootstrap and imported; an image left by an earlier run is reused."""
    if _docker("image", "inspect", BASE_IMAGE, check=False).returncode == 0:
        return BASE_IMAGE
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        pytest.skip(f"no {BASE_IMAGE} image, and making it needs debootstrap run as root")
    rootfs = scratch / "rootfs"
    made = subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), DEBIAN_MIRROR],
                          capture_output=True, text=True, timeout=1200)
    assert made.returncode == 0, made.stdout[-4000:] + made.stderr[-4000:]
    with subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE) as tar:
        imported = subprocess.run(["docker", "import", "-", BASE_IMAGE], stdin=tar.stdout, capture_output=True,
                                  text=True, timeout=600)
    assert tar.returncode == 0 and imported.returncode == 0, imported.stderr
    shutil.rmtree(rootfs)
    return BASE_IMAGE


def _build_context(scratch: Path) -> Path:
    """A copy of what .dockerignore lets into the context (it still applies), with the Dockerfile."""
    context = scratch / "context"
    rules = (ROOT / ".dockerignore").read_text().splitlines()
    entries = [rule[1:].rstrip("/") for rule in rules if rule.startswith("!")] + [".dockerignore", "docker/Dockerfile"]
    for entry in entries:
        source, target = ROOT / entry, context / entry
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.whl"))
        else:
            shutil.copy2(source, target)
    return context


def _fill_wheelhouse(wheelhouse: Path, torch_version: str) -> None:
    """Every wheel the image installs, for the base's Python: CPU torch, tokensampler's dependencies and
    setuptools (its build backend). pip resolves the dependencies from the two pyproject.toml files (the
    server's, and the client's it depends on)."""
    machine = platform.machine()
    platforms = [f"manylinux_2_{minor}_{machine}" for minor in range(5, 37)]  # bookworm has glibc 2.36
    platforms += [f"manylinux2014_{machine}", f"manylinux2010_{machine}", f"manylinux1_{machine}"]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(wheelhouse),
               "--only-binary=:all:", "--python-version", BASE_PYTHON, "--implementation", "cp",
               *(f"--platform={tag}" for tag in platforms), f"torch=={torch_version}+cpu", "setuptools",
               str(ROOT / "client"), str(ROOT)]
    if os.environ.get("TORCH_INDEX_URL"):
        command += ["--extra-index-url", os.environ["TORCH_INDEX_URL"]]
    downloaded = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert downloaded.returncode == 0, downloaded.stderr[-4000:]
    assert list(wheelhouse.glob(f"torch-{torch_version}+cpu-*.whl")), sorted(p.name for p in wheelhouse.iterdir())


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    _skip_without_an_engine()
    scratch = tmp_path_factory.mktemp("container")
    base = _base_image(scratch)
    context = _build_context(scratch)
    torch_version = torch.__version__.split("+")[0]
    _fill_wheelhouse(context / "docker" / "wheelhouse", torch_version)
    build = ["build", "--file", "docker/Dockerfile", "--tag", IMAGE, "--build-arg", "VARIANT=cpu",
             "--build-arg", f"BUILD_BASE={base}", "--build-arg", f"RUN_BASE={base}",
             "--build-arg", f"TORCH_VERSION={torch_version}", str(context)]
    _docker(*build, timeout=1500)
    shutil.rmtree(context)  # the wheels: hundreds of MB
    return IMAGE


@dataclass
class Container:
    name: str
    grpc_port: int
    metrics_port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def inspect(self, template: str) -> str:
        return _docker("inspect", "--format", template, self.name).stdout.strip()


def _published(name: str, port: int) -> int:
    """The host port Docker published the container's `port` on (loopback only)."""
    return int(_docker("port", name, f"{port}/tcp").stdout.split()[0].rpartition(":")[2])


@pytest.fixture(scope="module")
def container(image: str) -> Iterator[Container]:
    """The image as the Kubernetes Deployment runs it: read-only root but /tmp, no capabilities, no privilege
    escalation; published on loopback only; --port moved off the image's default."""
    name = f"tokensampler-test-{os.getpid()}"
    _docker("run", "--detach", "--name", name,
            "--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            "--publish", f"127.0.0.1::{PORT}", "--publish", "127.0.0.1::9400",
            "--health-interval", "1s",  # the image's 30 s, shortened: the command stays the image's
            image, "--port", str(PORT), "--grace-period-s", str(GRACE_S))
    try:
        yield Container(name, _published(name, PORT), _published(name, 9400))
    finally:
        _docker("rm", "--force", name, check=False)


def _health(container: Container, timeout: float = 120) -> dict:
    """Docker's health record once it has left "starting" (the image's start period is 120 s)."""
    deadline = time.monotonic() + timeout
    while True:
        health = json.loads(container.inspect("{{json .State.Health}}"))
        if health["Status"] != "starting" or time.monotonic() > deadline:
            return health
        time.sleep(0.5)


def test_healthcheck_follows_the_port_flag(container: Container) -> None:
    health = _health(container)
    assert health["Status"] == "healthy", health
    assert health["Log"][-1]["Output"].strip() == "SERVING"


def test_runs_as_the_images_non_root_user(image: str, container: Container) -> None:
    assert _docker("image", "inspect", "--format", "{{.Config.User}}", image).stdout.strip() == "10001:10001"
    assert _docker("exec", container.name, "id", "-u").stdout.strip() == "10001"
    assert _docker("exec", container.name, "id", "-g").stdout.strip() == "10001"


def test_serves_sample_health_and_metrics(container: Container) -> None:
    assert _health(container)["Status"] == "healthy"
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    with SamplerClient(container.target, timeout=30) as client:
        assert client.health() == "SERVING"
        assert (client.server_info().backend, client.server_info().device) == ("cpu", "cpu")
        result = client.sample(logits, temperature=0.0)
    assert torch.equal(result.tokens[:, 0], logits.argmax(dim=1))
    with urllib.request.urlopen(f"http://127.0.0.1:{container.metrics_port}/metrics", timeout=10) as response:
        samples = parse_samples(response.read().decode())
    assert value(samples, "tokensampler_requests_total", method="tokensampler.v1.Sampler/Sample", code="OK") == 1


def test_device_cuda_refuses_to_start_without_a_gpu(image: str) -> None:
    refused = _docker("run", "--rm", "--env", "TOKENSAMPLER_DEVICE=cuda", image, check=False, timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "--device cuda: the CUDA backend cannot run here: torch sees no CUDA GPU" in refused.stderr


def test_sigterm_stops_it_within_the_grace_period(container: Container) -> None:
    """Last: `docker stop` sends SIGTERM, then SIGKILL after --time; exit code 0 means the server ended itself."""
    assert _health(container)["Status"] == "healthy"
    started = time.monotonic()
    _docker("stop", "--time", "30", container.name, timeout=60)
    took = time.monotonic() - started
    assert container.inspect("{{.State.ExitCode}}") == "0"
    assert took < GRACE_S + 5, took
    assert "stopped" in _docker("logs", container.name).stderr.splitlines()[-1]


def _compose() -> list[str]:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.skip("no Compose implementation (Debian's docker-compose, or the docker compose plugin)")


@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.gpu.yml"],
                                   ["docker-compose.yml", "docker-compose.gpu.yml", "docker-compose.colocated.yml"]])
def test_compose_files_are_valid(files: list[str]) -> None:
    command = [*_compose(), "--project-name", "tokensampler"]
    for name in files:
        command += ["--file", str(ROOT / "docker" / name)]
    checked = subprocess.run([*command, "--profile", "demo", "config", "--quiet"], capture_output=True, text=True,
                             timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
