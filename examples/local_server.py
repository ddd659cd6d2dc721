"""The server an example talks to: the one at --target, else a tokensampler server of the example's own."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def server_target(target: str | None, *flags: str) -> Iterator[str]:
    """`target`; or, when it is None, the address of a local server started with `flags` on a free port,
    stopped when the block ends."""
    if target is not None:
        yield target
        return
    command = [sys.executable, "-m", "tokensampler_server", "--host", "127.0.0.1", "--port", "0", "--no-metrics",
               *flags]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        yield _listening_address(process)
    finally:
        process.terminate()
        process.wait(30)


def _listening_address(process: subprocess.Popen) -> str:
    """The address the server says it serves on, read from its log."""
    for line in process.stderr:
        match = re.search(r"tokensampler serving on .*:(\d+)", line)
        if match:
            return f"127.0.0.1:{match.group(1)}"
    raise RuntimeError(f"tokensampler-server exited with {process.wait()}")
