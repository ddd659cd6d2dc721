"""Every Python block and `tokensampler` command of README.md runs, verbatim, against a CPU server.

The README's snippets name the default address, localhost:50051; each runs in a process of its own (so that
it needs nothing the others defined) with that address replaced by the test server's.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import RunningServer, serving, start_command

README = Path(__file__).resolve().parents[1] / "README.md"
DEFAULT_TARGET = "localhost:50051"
_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _blocks(language: str) -> list[str]:
    return [body for lang, body in _BLOCK.findall(README.read_text()) if lang == language]


def _python_snippets() -> list[str]:
    return _blocks("python")


def _cli_lines() -> list[list[str]]:
    """The `tokensampler` commands of the bash blocks (`.venv/bin/tokensampler ...` too), without the prompt's
    comments; the server's own command and the install and test lines are not client calls."""
    lines = []
    for body in _blocks("bash"):
        for line in body.splitlines():
            words = shlex.split(line, comments=True)
            if words and Path(words[0]).name == "tokensampler":
                lines.append(words[1:])
    return lines


@pytest.fixture(scope="module")
def readme_server() -> Iterator[RunningServer]:
    yield from serving("--device", "cpu")


def _run(args: list[str], target: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TOKENSAMPLER_TARGET": target}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env)


def test_readme_has_snippets_and_the_test_command() -> None:
    assert len(_python_snippets()) >= 3 and len(_cli_lines()) >= 2
    assert all(DEFAULT_TARGET in snippet for snippet in _python_snippets())
    text = README.read_text()  # .ci/run runs the line after the marker
    assert "<!-- test-command -->\n```bash\n.venv/bin/python -m pytest\n```" in text


def _serve_command() -> tuple[str, str]:
    """The quick start's `INSTALL && SERVE` (the line after the serve-command marker): .ci/run runs INSTALL."""
    line = re.search(r"<!-- serve-command -->\n```bash\n(.*)\n```", README.read_text()).group(1)
    install, serve = line.split(" && ")
    return install, serve


def test_the_quick_start_server_command_serves_the_readme_calls() -> None:
    install, serve = _serve_command()
    assert install == "./scripts/install.sh"
    # Verbatim, from the repository's root; the environment moves it off the default port (every flag has a
    # TOKENSAMPLER_* variable), so that it never meets another server.
    command = shlex.split(serve)
    command[0] = str(README.parent / command[0])
    env = {"TOKENSAMPLER_HOST": "127.0.0.1", "TOKENSAMPLER_PORT": "0", "TOKENSAMPLER_METRICS_PORT": "0"}
    server = start_command(command, env, 120.0)
    try:
        args = _cli_lines()[0]
        done = _run(["-m", "tokensampler_client.cli", *args], server.target)
        assert done.returncode == 0, f"tokensampler {shlex.join(args)}:\n{done.stdout}{done.stderr}"
        assert done.stdout.strip()
    finally:
        assert server.stop() == 0, "\n".join(server.log)


@pytest.mark.parametrize("index", range(len(_python_snippets())))
def test_python_snippet_runs(index: int, readme_server: RunningServer) -> None:
    code = _python_snippets()[index].replace(DEFAULT_TARGET, readme_server.target)
    done = _run(["-c", code], readme_server.target)
    assert done.returncode == 0, f"snippet {index}:\n{code}\n{done.stdout}{done.stderr}"
    assert done.stdout.strip(), f"snippet {index} printed nothing"


@pytest.mark.parametrize("index", range(len(_cli_lines())))
def test_cli_line_runs(index: int, readme_server: RunningServer) -> None:
    args = _cli_lines()[index]
    done = _run(["-m", "tokensampler_client.cli", *args], readme_server.target)
    assert done.returncode == 0, f"tokensampler {shlex.join(args)}:\n{done.stdout}{done.stderr}"
    assert done.stdout.strip()
