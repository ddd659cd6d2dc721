"""Logs: one DEBUG line per request under its request id, as text or as JSON lines (--log-format json)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch
from tokensampler_client import SamplerClient, TokenSamplerError
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc
from tokensampler_client.tensors import encode_tensor
from tokensampler_server.core.logs import ClientNoiseFilter, JsonFormatter, RequestIdFilter
from tokensampler_server.core.request_context import current_request_id

from .conftest import RunningServer, start_command, start_server
from .raw_h2 import call_status


def wait_for_line(server: RunningServer, match: Callable[[str], bool], timeout: float = 30.0) -> str:
    """The first log line that `match` accepts, once the pipe reader has seen it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(server.log):
            if match(line):
                return line
        time.sleep(0.05)
    raise AssertionError("no such log line:\n" + "\n".join(server.log))


@pytest.fixture(scope="module")
def json_server() -> Iterator[RunningServer]:
    command = [sys.executable, "-m", "tokensampler_server", "--host", "127.0.0.1", "--port", "0", "--no-metrics",
               "--device", "cpu", "--log-level", "DEBUG"]
    running = start_command(command, env={"TOKENSAMPLER_LOG_FORMAT": "json"})
    yield running
    running.stop()


def _entry(server: RunningServer, request_id: str) -> dict:
    """The JSON line of the request with this id."""
    def is_request_line(line: str) -> bool:
        entry = json.loads(line) if line.startswith("{") else {}
        return entry.get("request_id") == request_id and "code" in entry

    return json.loads(wait_for_line(server, is_request_line))


def test_json_lines_carry_the_request_line_fields(json_server: RunningServer) -> None:
    with SamplerClient(json_server.target, timeout=30) as client:
        client.sample(torch.randn(3, 50), top_k=5, request_id="json-ok")
        with pytest.raises(TokenSamplerError) as raised:
            client.sample(torch.randn(2, 50), top_p=0.0, request_id="json-bad")
    assert "json-bad" in raised.value.details  # the server's message names the request id

    ok = _entry(json_server, "json-ok")
    assert ok["level"] == "DEBUG" and ok["logger"] == "tokensampler_server.rpc.call_guard"
    assert ok["method"] == "tokensampler.v1.Sampler/Sample" and ok["code"] == "OK" and ok["rows"] == 3
    assert ok["duration_ms"] > 0 and "error" not in ok
    bad = _entry(json_server, "json-bad")
    assert bad["code"] == "INVALID_ARGUMENT" and bad["rows"] is None
    assert bad["error"].startswith("params.top_p:")
    for line in json_server.log:  # every line is one JSON object with the common fields
        entry = json.loads(line)
        assert {"timestamp", "level", "logger", "message"} <= entry.keys(), line


def test_a_generated_request_id_is_logged_and_returned(json_server: RunningServer) -> None:
    request = pb.SampleRequest()
    encode_tensor(torch.randn(1, 10), out=request.logits)
    with grpc.insecure_channel(json_server.target) as channel:
        _, call = pb_grpc.SamplerStub(channel).Sample.with_call(request, timeout=30)  # no x-request-id sent
    request_id = dict(call.trailing_metadata())["x-request-id"]
    assert _entry(json_server, request_id)["code"] == "OK"


def test_text_format_has_one_debug_line_per_request() -> None:
    running = start_server("--device", "cpu", "--no-metrics", "--log-level", "DEBUG")
    try:
        with SamplerClient(running.target, timeout=30) as client:
            client.sample(torch.randn(2, 10), request_id="text-ok")
        line = wait_for_line(running, lambda text: "text-ok" in text)
        assert "DEBUG tokensampler_server.rpc.call_guard: tokensampler.v1.Sampler/Sample text-ok OK rows=2" in line
        assert sum("text-ok" in text for text in running.log) == 1
    finally:
        running.stop()


def test_json_formatter_adds_the_current_request_id_and_the_traceback() -> None:
    record = logging.LogRecord("tokensampler_server.x", logging.ERROR, __file__, 1, "failed %s", ("here",), None)
    try:
        raise ValueError("boom")
    except ValueError:
        record.exc_info = sys.exc_info()
    record.rows = 4  # as `extra=` sets it
    token = current_request_id.set("req-7")
    try:
        RequestIdFilter().filter(record)
    finally:
        current_request_id.reset(token)
    entry = json.loads(JsonFormatter().format(record))
    assert (entry["message"], entry["level"], entry["logger"]) == ("failed here", "ERROR", "tokensampler_server.x")
    assert entry["request_id"] == "req-7" and entry["rows"] == 4
    assert "ValueError: boom" in entry["exception"]
    assert entry["timestamp"].endswith("+00:00")


def test_a_caller_that_hangs_up_on_unread_answers_leaves_no_traceback() -> None:
    """Two streams send messages whose answers (3 MiB each) they never read, then cancel: grpc cannot send what is
    pending and says so; the call has ended and nothing on the server failed, so the log holds no error and no
    traceback (a client could otherwise fill it by hanging up), and the server serves the next call."""
    running = start_server("--device", "cpu")
    try:
        request = pb.SampleRequest(logits=encode_tensor(torch.zeros(4096, 2, dtype=torch.float16)), num_samples=64,
                                   return_logprobs=True)
        with grpc.insecure_channel(running.target) as channel:
            stub = pb_grpc.SamplerStub(channel)
            calls = [stub.SampleStream(iter([request] * 8)) for _ in range(2)]
            time.sleep(3)  # the answers pile up behind the unread streams' flow-control windows
            for call in calls:
                call.cancel()
            time.sleep(1)
        with SamplerClient(running.target, timeout=30) as client:
            assert client.sample(torch.zeros(1, 4), seed=1).valid.all()
    finally:
        running.stop()
    log = "\\n".join(running.log)
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


def test_the_client_noise_filter_demotes_only_gone_callers_undecodable_metadata_and_stopped_calls() -> None:
    noise = ClientNoiseFilter()
    for message, args in (("ExecuteBatchError raised in core by servicer method [%s]", ("/a/B",)),
                          ("Invalid encoding on %s", (b"\xff\xfe",))):
        record = logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, "", 0, message, args, None)
        assert not noise.filter(record) and record.levelno == logging.DEBUG
    other = logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, "", 0, "Unexpected error in core", (), None)
    assert noise.filter(other) and other.levelno == logging.ERROR
    # A handler grpc cancels when the server stops (an open stream past the grace period): noise. Any other
    # exception escaping a handler is the server's own failure and stays an ERROR.
    escaped = "Exception not handled by _handle_exceptions in servicer method [%s]"
    for error, demoted in ((asyncio.CancelledError(), True), (RuntimeError("bug"), False)):
        record = logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, "", 0, escaped, ("/a/B",),
                                   (type(error), error, None))
        assert noise.filter(record) is not demoted and (record.levelno == logging.DEBUG) is demoted


def test_request_ids_that_are_not_printable_ascii_are_replaced_and_every_call_keeps_its_status() -> None:
    """x-request-id values that grpc's Python client refuses to send and other stacks send: UTF-8 ("é", "日本"), bytes
    that are not UTF-8, a control character. The server gives such calls an id of its own: a valid request answers
    OK and an invalid one INVALID_ARGUMENT (before: INTERNAL for both, the id echoed in trailers that grpc refused),
    and the log holds no error and no traceback (before: two a call for bytes that are not UTF-8)."""
    valid = pb.SampleRequest(logits=encode_tensor(torch.zeros(1, 8))).SerializeToString()
    invalid = pb.SampleRequest(logits=encode_tensor(torch.zeros(1, 8)),
                               params=pb.SamplingParams(top_p=[5.0])).SerializeToString()
    running = start_server("--device", "cpu")
    host, port = running.target.rsplit(":", 1)
    try:
        for request_id in ("é".encode(), "日本".encode(), b"\xff\xfe", b"a\x7fb", b"plain-id"):
            for message, status in ((valid, grpc.StatusCode.OK), (invalid, grpc.StatusCode.INVALID_ARGUMENT)):
                got = call_status(host, int(port), "/tokensampler.v1.Sampler/Sample", message,
                                  [(b"x-request-id", request_id)])
                assert got == status.value[0], (request_id, got)
    finally:
        running.stop()
    log = "\n".join(running.log)
    assert "Traceback" not in log and " ERROR " not in log and "Illegal header" not in log, log[-3000:]
