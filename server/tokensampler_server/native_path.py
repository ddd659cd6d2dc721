"""The native request path beside the Python one (csrc/request_path.cpp; issue 5).

On the CUDA backend, a SampleRequest whose logits lie in a CUDA region of the backend's GPU or are carried in
the request (uploaded straight from its bytes), and that asks for tokens alone (no log-probs, no logit
processing, no output regions, one sample) is parsed, validated, sampled and answered in C++ from its bytes:
the per-message Python that dominated a stream message's time (benchmarks/SERVICE_NOTES.md) is not run.
Everything else, errors included, is declined before anything a client could see, and sample_rpc.py answers it
as before. The region registry tells this path which CUDA regions exist (`region_added` / `region_removed`).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from .backends import Backend
from .config import Limits
from .regions import Region

log = logging.getLogger(__name__)


class NativeAnswer(NamedTuple):
    response: bytes
    """The serialized SampleResponse, or SampleStreamResponse for a stream message."""
    num_rows: int
    decode_ns: int
    compute_ns: int
    encode_ns: int
    rows_by_mode: tuple[int, int, int, int, int]
    """Rows per mode in metrics.ROW_MODES order (fused excluded: never on this path)."""


class NativeRequestPath:
    """The C++ path of one CUDA backend, with the CUDA regions it may read."""

    def __init__(self, backend: Backend, limits: Limits) -> None:
        from .backends.cuda_build import load_kernels

        self._device = backend.device
        module = load_kernels(self._device.index)
        self._path = module.RequestPath(self._device.index, limits.max_batch_rows, limits.max_batch_elements,
                                        backend.fallback_counter_address)

    def region_added(self, region: Region) -> None:
        """A region the registry has just made usable: CUDA regions of this GPU become readable here."""
        if region.kind == "cuda_ipc" and region.buffer.device == self._device:
            event = region.ready_event.cuda_event if region.ready_event is not None else 0
            self._path.add_region(region.name, region.buffer.data_ptr(), region.byte_size, region.producer_pid, event)

    def region_removed(self, name: str) -> None:
        """A region about to go: waits for a request reading it, then forgets it."""
        self._path.remove_region(name)

    def sample(self, request: bytes, request_id: str, stream_message: bool) -> NativeAnswer | None:
        """The answer to `request` (SampleRequest bytes), or None: the Python path must answer it."""
        answer = self._path.sample(request, request_id, stream_message)
        return None if answer is None else NativeAnswer(*answer)


def create_native_path(backend: Backend, limits: Limits, enabled: bool) -> NativeRequestPath | None:
    """The native path of a CUDA backend; None on the CPU backend, when turned off, or when it fails to start
    (logged: the Python path serves everything then)."""
    if not enabled or backend.info().name != "cuda":
        return None
    try:
        path = NativeRequestPath(backend, limits)
    except Exception as err:  # noqa: BLE001 - the Python path still serves every request
        log.warning("native request path unavailable (%s): every request takes the Python path", err)
        return None
    log.info("native request path on: plain requests (logits in a CUDA region or carried) are answered in C++")
    return path
