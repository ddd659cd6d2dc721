"""tokensampler-client installs and works without the server's dependencies.

The client distribution (client/pyproject.toml) is built into a wheel and installed into a fresh virtual
environment without torch. Its dependencies come, offline, from this interpreter's environment: a .pth file
names a folder that links to exactly the distributions the wheel requires (and theirs), nothing else. In that
environment the client samples numpy logits from a server of this one, and must get the tokens the full
client (torch) gets for the same requests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from tokensampler_client import SamplerClient

from .conftest import RunningServer, serving

ROOT = Path(__file__).resolve().parents[1]
CLIENT = ROOT / "client"
# Nothing of this checkout on the environment's path (the tests may run with it on PYTHONPATH): the client
# there is the installed wheel.
CLEAN_ENV = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}

# Run by the environment without torch; argv: the server's target, the .npy file of the logits. Prints JSON.
SLIM_SCRIPT = """
import importlib.util, json, sys
import numpy as np
import tokensampler_client
from tokensampler_client import SamplerClient
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.tensors import decode_tensor, encode_tensor

assert importlib.util.find_spec("torch") is None, "torch is importable"
target, logits = sys.argv[1], np.load(sys.argv[2])
bfloat16 = pb.Tensor(dtype=pb.DTYPE_BFLOAT16, shape=[2], data=b"\\x80\\x3f\\x20\\xc0")  # 1.0, -2.5
assert decode_tensor(bfloat16).tolist() == [1.0, -2.5]
try:
    encode_tensor(np.zeros(2))
except TypeError as error:
    assert "tokensampler-client[torch]" in str(error), error
else:
    raise AssertionError("float64 was encoded")
out = {"version": tokensampler_client.__version__, "installed": "site-packages" in tokensampler_client.__file__}
with SamplerClient(target, timeout=30) as client:
    result = client.sample(logits, top_k=50, seed=[1, 2, 3, 4], return_logprobs=True, top_logprobs=3)
    out["types"] = sorted({type(value).__module__ for value in
                           (result.tokens, result.logprobs, result.top_logprob_ids, result.valid)})
    out["sample"] = [result.tokens.tolist(), result.logprobs.tolist(), result.top_logprob_ids.tolist(),
                     result.valid.tolist(), result.seeds]
    with client.stream() as stream:
        out["stream"] = stream.sample(logits.astype(np.float16), temperature=0.7, seed=9, position=3).tokens.tolist()
    top = client.topk_probs(logits[:, None, :], k=5, temperature=0.5)
    out["topk"] = [top.ids.tolist(), top.probs.tolist()]
    region = client.register_shm_region("logits", logits.nbytes)
    region.tensor(np.float32, logits.shape)[:] = logits
    out["shm"] = client.sample(region.view(np.float32, logits.shape), top_k=50, seed=[1, 2, 3, 4]).tokens.tolist()
    client.unregister_region(region)
    try:
        client.register_cuda_region("gpu", None)
    except ModuleNotFoundError as error:
        out["cuda_region"] = str(error)
print(json.dumps(out))
"""


def _requirements(dist: metadata.Distribution) -> list[str]:
    """The names of the distributions `dist` requires, extras' requirements left out."""
    return [re.split(r"[\s\[<>=!~;(]", requirement, maxsplit=1)[0] for requirement in dist.requires or []
            if "extra" not in requirement.partition(";")[2]]


def _link_dependencies(wheel: Path, folder: Path) -> None:
    """Links into `folder` the top-level files of every installed distribution the wheel requires, recursively."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        pending = _requirements(metadata.PathDistribution(zipfile.Path(archive, name).parent))
    done: list[str] = []
    while pending:
        dist = metadata.distribution(pending.pop())
        if dist.name in done:
            continue
        done.append(dist.name)
        pending += _requirements(dist)
        base = Path(dist.locate_file(""))
        for top in {Path(file).parts[0] for file in dist.files or []} - {"..", "__pycache__"}:
            target = folder / top
            if not target.exists() and (base / top).exists():
                target.symlink_to(base / top)


@pytest.fixture(scope="module")
def slim_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a fresh virtual environment holding the client wheel and its dependencies, without torch."""
    scratch = tmp_path_factory.mktemp("client-dist")
    # Built from a copy: setuptools writes its build folders next to the sources.
    shutil.copytree(CLIENT, scratch / "client", ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(scratch / "wheels"), str(scratch / "client")],
        capture_output=True, text=True, timeout=120,
    )
    if built.returncode != 0:
        pytest.skip(f"the client wheel could not be built offline (pip wheel with this environment's setuptools): "
                    f"{built.stderr.strip()[-500:]}")
    wheel = next((scratch / "wheels").glob("tokensampler_client-*.whl"))
    venv.create(scratch / "venv", with_pip=False)  # no system site-packages: torch is out of reach
    python = scratch / "venv" / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True, env=CLEAN_ENV).stdout.strip()
    (scratch / "deps").mkdir()
    _link_dependencies(wheel, scratch / "deps")
    (Path(site) / "tokensampler-deps.pth").write_text(f"{scratch / 'deps'}\n")
    # pip of this environment installs into the other one; --no-index: the dependencies must already be there.
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-index", "--no-cache-dir",
         "--disable-pip-version-check", str(wheel)],
        capture_output=True, text=True, timeout=120, env=CLEAN_ENV,
    )
    if installed.returncode != 0 and "no such option: --python" in installed.stderr:
        pytest.skip("this pip cannot install into another environment (--python needs pip >= 22.3)")
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return python


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    yield from serving("--device", "cpu", "--allow-shm")


def test_the_server_requires_the_client_of_its_release() -> None:
    client = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]
    server = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"tokensampler-client=={client['version']}" in server["dependencies"]
    assert client["version"] == server["version"]
    assert not any(name.startswith(("torch", "tokensampler")) for name in client["dependencies"])


def test_client_without_torch_samples_what_the_full_client_does(
    slim_python: Path, server: RunningServer, tmp_path: Path
) -> None:
    logits = np.random.default_rng(5).standard_normal((4, 1000), dtype=np.float32)
    np.save(tmp_path / "logits.npy", logits)
    done = subprocess.run([slim_python, "-c", SLIM_SCRIPT, server.target, str(tmp_path / "logits.npy")],
                          capture_output=True, text=True, timeout=120, env=CLEAN_ENV)
    assert done.returncode == 0, done.stdout + done.stderr
    slim = json.loads(done.stdout)

    with SamplerClient(server.target, timeout=30) as client:
        full = client.sample(logits, top_k=50, seed=[1, 2, 3, 4], return_logprobs=True, top_logprobs=3)
        with client.stream() as stream:
            streamed = stream.sample(logits.astype(np.float16), temperature=0.7, seed=9, position=3)
        top = client.topk_probs(logits[:, None, :], k=5, temperature=0.5)
    version = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]["version"]
    assert (slim["version"], slim["installed"]) == (version, True)
    assert slim["types"] == ["numpy"]
    assert slim["sample"] == [full.tokens.tolist(), full.logprobs.tolist(), full.top_logprob_ids.tolist(),
                              full.valid.tolist(), full.seeds]
    assert slim["stream"] == streamed.tokens.tolist()
    assert slim["topk"] == [top.ids.tolist(), top.probs.tolist()]
    assert slim["shm"] == full.tokens.tolist()
    assert "pip install 'tokensampler-client[torch]'" in slim["cuda_region"]


def test_cli_entry_point_runs_without_torch(slim_python: Path, server: RunningServer) -> None:
    cli = slim_python.parent / "tokensampler"
    done = subprocess.run([cli, "--target", server.target, "--timeout", "10", "health"],
                          capture_output=True, text=True, timeout=60, env=CLEAN_ENV)
    assert done.returncode == 0 and "SERVING" in done.stdout, done.stdout + done.stderr
