"""Shared fixtures; the `server` fixture starts a real tokensampler-server subprocess."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from tokensampler_client import SampleResult, SamplerClient

from .gated_server import ServerGate
from .polling import wait_until

_SERVING = re.compile(r"tokensampler serving on .*:(\d+)$")


@dataclass
class RunningServer:
    process: subprocess.Popen
    port: int
    log: list[str] = field(default_factory=list)
    gate: ServerGate | None = None
    """Set for a server started with one (gated_server.py): its backend holds the batches seeded GATE_SEED."""

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.gate is not None:
            self.gate.open()  # a held batch would hold the shutdown for its whole grace period
        if self.process.poll() is None:
            self.process.send_signal(sig)
        code = self.process.wait(timeout=timeout)
        if self.gate is not None:
            self.gate.close()
        return code


def _serving_port(line: str) -> int | None:
    """The gRPC port named by the startup line, in the text or the JSON log format; None for other lines."""
    if line.startswith("{"):
        entry = json.loads(line)
        return entry["port"] if _SERVING.match(entry["message"]) else None
    match = _SERVING.search(line)
    return int(match.group(1)) if match else None


def start_command(command: list[str], env: dict[str, str] | None = None, timeout: float = 60.0,
                  gate: ServerGate | None = None) -> RunningServer:
    """Starts a server by any command line (`gate`: one that gate.command() starts) and waits for its startup line,
    text or JSON."""
    process = subprocess.Popen(
        command,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **(env or {})},
        pass_fds=gate.child_fds if gate is not None else (),
    )
    if gate is not None:
        gate.started()
    log: list[str] = []
    port: list[int] = []
    ready = threading.Event()

    def pump() -> None:  # keeps the pipe drained for the server's whole life
        for line in process.stderr:
            log.append(line.rstrip())
            if not port and (found := _serving_port(line.rstrip())) is not None:
                port.append(found)
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.1):
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError(f"{command} did not start:\n" + "\n".join(log))
    if not port:
        process.wait(timeout=10)
        raise RuntimeError(f"{command} exited with {process.returncode}:\n" + "\n".join(log))
    return RunningServer(process=process, port=port[0], log=log, gate=gate)


def start_server(*args: str, env: dict[str, str] | None = None, timeout: float = 60.0,
                 gate: ServerGate | None = None) -> RunningServer:
    """Starts `tokensampler-server --port 0 ARGS` and waits for the line that names its port; with `gate`,
    the gated server of gated_server.py."""
    launcher = gate.command() if gate is not None else [sys.executable, "-m", "tokensampler_server"]
    return start_command([*launcher, "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", *args], env, timeout,
                         gate)


def serving(*args: str, **kwargs: Any) -> Iterator[RunningServer]:
    """A server fixture's body: the server start_server(*args, **kwargs) starts, stopped after the fixture's tests."""
    running = start_server(*args, **kwargs)
    yield running
    running.stop()


def connected(server: RunningServer, timeout: float | None = 60.0) -> Iterator[SamplerClient]:
    """A client fixture's body: a SamplerClient of `server`, closed after the fixture's tests."""
    with SamplerClient(server.target, timeout=timeout) as client:
        yield client


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    """One CPU server for the whole session (the tests that stop a server start their own)."""
    yield from serving("--device", "cpu")


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[SamplerClient]:
    """A client of `server` (the one every module shares, or a module's own) for a module's tests."""
    yield from connected(server)


@pytest.fixture(scope="module")
def shm_server() -> Iterator[RunningServer]:
    """A gated CPU server that takes shared-memory regions, one for each test module that asks."""
    yield from serving("--device", "cpu", "--allow-shm", gate=ServerGate())


def assert_unregister_waits(gate: ServerGate, request: Callable[[], SampleResult], listed: Callable[[], list[Any]],
                            unregister: Callable[[], Any], what: str) -> None:
    """Unregisters a weight or region (`what`) while `gate` holds a request that uses it in the backend: the
    resource leaves `listed` at once, for new requests, and `unregister` returns once the request is done, which
    succeeds."""
    results: list[SampleResult] = []
    slow = threading.Thread(target=lambda: results.append(request()))
    slow.start()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with gate.holding():  # the request is in the backend, using the resource
            held = listed()[0].in_flight
            unregistering = pool.submit(unregister)
            wait_until(lambda: listed() == [], f"the {what} gone for new requests")
            assert not unregistering.done() and slow.is_alive()  # waiting for the request
        info = unregistering.result(60)
    slow.join(60)
    assert held, f"the request was not seen holding the {what}"
    assert info.in_flight == 0 and len(results) == 1 and results[0].valid.all()
