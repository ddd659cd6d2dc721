"""print(result) of every public result type names the public class and shows tensors by dtype and shape."""

from __future__ import annotations

import re

import torch
from tokensampler_client import SampleResult
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.tensors import encode_tensor
from tokensampler_client.workloads import DiffusionStepResult, TopKProbsResult, VerifyDraftResult

ROWS, VOCAB = 64, 1000
TIMINGS = pb.Timings(queue_ns=1, compute_ns=2, total_ns=3)


def _no_tensor_values(text: str) -> None:
    assert "tensor(" not in text and len(text) < 400, text


def test_sample_result_repr_names_the_public_class_and_shapes() -> None:
    response = pb.SampleResponse(
        tokens=encode_tensor(torch.zeros(ROWS, 2, dtype=torch.int64)), seeds=list(range(ROWS)),
        logprobs=encode_tensor(torch.zeros(ROWS, 2)), valid=[True] * ROWS, nan_detected=[False] * ROWS,
        timings=TIMINGS, request_id="r1",
    )
    lazy = SampleResult.from_response(response)  # a private subclass that decodes on read
    text = repr(lazy)
    assert text.startswith("SampleResult(tokens=int64[64, 2], seeds=list[64], logprobs=float32[64, 2], "
                           "top_logprob_ids=None, top_logprobs=None, valid=bool[64], nan_detected=bool[64], "), text
    assert text.endswith("request_id='r1')") and "queue_ns=1" in text
    assert str(lazy) == text
    assert repr(lazy.rows(0, 3)).startswith("SampleResult(tokens=int64[3, 2], seeds=list[3], ")
    _no_tensor_values(text)


def test_workload_results_repr_shows_shapes() -> None:
    timings = SampleResult.from_response(pb.SampleResponse(timings=TIMINGS)).timings
    big = torch.zeros(ROWS, VOCAB)
    results = {
        "DiffusionStepResult": DiffusionStepResult(big.long(), big, big.bool(), [1] * ROWS, timings, "d"),
        "TopKProbsResult": TopKProbsResult(big, big.long(), timings, "t"),
        "VerifyDraftResult": VerifyDraftResult(big[:, 0].long(), big[:, :5].long(), [1] * ROWS, timings, "v"),
    }
    for name, result in results.items():
        text = repr(result)
        assert re.match(rf"{name}\((\w+=(int64|float32|bool)\[\d+(, \d+)*\], )+", text), text
        _no_tensor_values(text)
    assert "accepted=int64[64], tokens=int64[64, 5], seeds=list[64]" in repr(results["VerifyDraftResult"])
