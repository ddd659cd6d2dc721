"""A CPU server whose backend holds chosen batches until the test lets them go.

A batch with a row seeded GATE_SEED is held: the backend reports its rows on one pipe, then waits for a byte on
another, both of them the test's; every other batch is sampled at once. A test thus knows that a request is in
the backend (not merely sent, nor already answered) while it signals, unregisters or cancels, instead of
trusting that a slow request is "in flight by now".

Run as `python tests/gated_server.py CONTROL_FD STATUS_FD SERVER_ARGS...` (start_server does it for a ServerGate);
imported, it gives the test's side, ServerGate.
"""

from __future__ import annotations

import os
import select
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

GATE_SEED = 0x6A7E_5EED
"""The seed that marks a request to hold (the tests' other seeds are small or random 64-bit values)."""


class ServerGate:
    """The test's ends of a gated server's two pipes. Each held batch waits for its own release; opening the
    gate (also at the server's stop) lets the held batch and every later one through."""

    def __init__(self) -> None:
        self._status, status_child = os.pipe()
        control_child, self._control = os.pipe()
        self.child_fds = (control_child, status_child)
        self._buffered = b""
        self._held = 0

    def command(self) -> list[str]:
        """How to start the gated server (tokensampler-server's flags follow)."""
        return [sys.executable, __file__, *map(str, self.child_fds)]

    def started(self) -> None:
        """Closes the server's ends here, so that its exit reads as the end of the status pipe."""
        for fd in self.child_fds:
            os.close(fd)

    def wait_held(self, timeout: float = 60.0) -> int:
        """Waits until the backend holds a gated batch; returns its rows."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffered:
            left = deadline - time.monotonic()
            assert left > 0, f"no gated batch reached the backend in {timeout} s"
            if select.select([self._status], [], [], left)[0]:
                chunk = os.read(self._status, 64)
                assert chunk, "the gated server exited before a gated batch reached its backend"
                self._buffered += chunk
        line, self._buffered = self._buffered.split(b"\n", 1)
        self._held += 1
        return int(line)

    def release(self) -> None:
        """Lets the batch that wait_held saw go on."""
        assert self._held, "no held batch to release"
        self._held -= 1
        if self._control >= 0:  # else opened already
            os.write(self._control, b"x")

    @contextmanager
    def holding(self, timeout: float = 60.0) -> Iterator[int]:
        """The next gated batch, held for the block (its rows given); released at the block's end."""
        rows = self.wait_held(timeout)
        try:
            yield rows
        finally:
            self.release()

    def open(self) -> None:
        """From now on no batch is held, the one held now included."""
        if self._control >= 0:
            os.close(self._control)
            self._control = -1

    def close(self) -> None:
        """Once the server has exited: the status pipe too."""
        self.open()
        if self._status >= 0:
            os.close(self._status)
            self._status = -1


def _serve(control_fd: int, status_fd: int, argv: list[str]) -> int:
    from tokensampler_server.backends.cpu import CpuBackend
    from tokensampler_server.app.cli import main
    from tokensampler_server.model.sampling import SamplingBatch, SamplingResult

    sample = CpuBackend.sample
    gate_open = False

    def gated_sample(self: CpuBackend, batch: SamplingBatch) -> SamplingResult:
        nonlocal gate_open
        if not gate_open and bool((batch.seed == GATE_SEED).any()):
            os.write(status_fd, f"{batch.num_rows}\n".encode())
            gate_open = os.read(control_fd, 1) == b""  # the test's end closed: let everything through
        return sample(self, batch)

    CpuBackend.sample = gated_sample  # type: ignore[method-assign]
    return main(argv)


if __name__ == "__main__":
    sys.exit(_serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]))
