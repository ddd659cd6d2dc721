"""The colocated hand-off's parts that need no GPU: the flags' layout, the refusals of a CPU server and of the
client, the prepared request's parameter check, the MPS state (tests/gpu/test_colocated.py runs the loops)."""

from __future__ import annotations

import socket

import grpc
import pytest
import torch
from tokensampler_client import SamplerClient
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.handoff import ABORT, FLAGS_BYTES, MAX_STEP, READY_OFFSET, RELEASE_OFFSET
from tokensampler_server.backends.mps import mps_state
from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import InvalidArgument
from tokensampler_server.validation.prepared import validate_prepared_request


def test_each_flag_has_its_own_cache_line_inside_the_page() -> None:
    assert READY_OFFSET % 64 == 0 and RELEASE_OFFSET % 64 == 0 and abs(RELEASE_OFFSET - READY_OFFSET) >= 64
    assert max(READY_OFFSET, RELEASE_OFFSET) + 4 <= FLAGS_BYTES


def _reaches(word: int, n: int) -> bool:
    """CU_STREAM_WAIT_VALUE_GEQ as the driver documents it: (int32_t)(*addr - value) >= 0, a cyclic comparison."""
    return ((word - n) & 0xFFFFFFFF) < 0x80000000


@pytest.mark.parametrize("step", [1, 2, 3, 1000, MAX_STEP // 2, MAX_STEP - 1, MAX_STEP])
def test_the_abort_ends_a_wait_for_any_step_and_no_step_reads_as_the_abort(step: int) -> None:
    assert _reaches(ABORT, step)  # the server's wait for step n ends on the abort
    assert _reaches(step, step) and not _reaches(step - 1, step)  # and otherwise only once the engine wrote n
    assert not _reaches(step, ABORT)


def test_a_cpu_server_refuses_a_loop_naming_the_backend(client: SamplerClient) -> None:
    opened = pb.ColocateOpen(logits=pb.TensorRef(region="x", dtype=pb.DTYPE_FLOAT32, shape=[1, 10]), flags="f")
    with pytest.raises(grpc.RpcError) as raised:
        next(client._stub.Colocate(iter([pb.ColocateRequest(open=opened)])))
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "CUDA backend" in raised.value.details()
    assert client.health() == "SERVING"


def test_the_client_refuses_parameters_a_loop_does_not_take(client: SamplerClient) -> None:
    with pytest.raises(ValueError, match="repetition_penalty: not taken by a colocated loop"):
        client.colocate(torch.zeros(2, 10), repetition_penalty=1.2)


@pytest.mark.parametrize("options, name", [(dict(watchdog_s=-1.0), "watchdog_s"), (dict(watchdog_s=0), "watchdog_s"),
                                           (dict(wait_timeout_s=float("nan")), "wait_timeout_s"),
                                           (dict(num_samples=0), "num_samples")])
def test_the_client_refuses_timeouts_and_samples_out_of_range(client: SamplerClient, options: dict, name: str) -> None:
    """A negative watchdog period killed the watchdog thread at its first sleep (no fallback, and close() raised);
    zero made it spin. Refused before anything else, the source's check included."""
    with pytest.raises(ValueError, match=f"^{name}: got"):
        client.colocate(torch.zeros(2, 10), **options)


def test_a_loop_needs_a_cuda_source(client: SamplerClient) -> None:
    with pytest.raises(ValueError, match="source: expected a contiguous"):
        client.colocate(torch.zeros(2, 10), top_k=5)


@pytest.mark.parametrize("field", ["repetition_penalty", "typical_p", "min_tokens"])
def test_a_prepared_request_refuses_processing_by_field(field: str) -> None:
    request = pb.SampleRequest()
    getattr(request.params, field).append(1)
    request.logits_ref.SetInParent()
    with pytest.raises(InvalidArgument, match=f"open.params.{field}: not taken by a call planned once"):
        validate_prepared_request(request, Limits(), 2, 10, None, "open.params")


def test_a_prepared_request_keeps_the_rows_parameters() -> None:
    request = pb.SampleRequest()
    request.params.top_k.append(5)
    request.params.seed.extend([7, 8])
    request.logits_ref.SetInParent()
    template, seeds = validate_prepared_request(request, Limits(), 2, 10, None)
    assert template.num_rows == 2 and template.vocab_size == 10 and list(seeds) == [7, 8]


def test_mps_is_active_only_where_a_daemon_s_control_pipe_is(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert mps_state() == "inactive"
    (tmp_path / "control").write_text("")  # a regular file is no daemon's pipe
    assert mps_state() == "inactive"
    (tmp_path / "control").unlink()
    pipe = socket.socket(socket.AF_UNIX)
    pipe.bind(str(tmp_path / "control"))
    try:
        assert mps_state() == "active"
    finally:
        pipe.close()
