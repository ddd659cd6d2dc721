"""The local samplers end to end: through a real server, the client's merging, and a bad value's status."""

from __future__ import annotations

import grpc
import pytest
import torch
from tokensampler_client import SamplerClient, TokenSamplerError
from tokensampler_client.merge import merge_key, merge_requests
from tokensampler_client.params import build_sample_request
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.core.config import Limits
from tokensampler_server.validation.sample import validate_sample_request


LOCAL = {"output_token_ids": [[1, 2, 3, 1, 2], [4, 4, 4, 4, 4]], "prompt_token_ids": [5, 1],
         "dry_multiplier": 0.8, "dry_allowed_length": 1, "dry_sequence_breakers": [[3]],
         "no_repeat_ngram_size": 2, "min_tokens": 8, "num_generated": [2, 9], "stop_token_ids": [0],
         "top_n_sigma": 2.0, "typical_p": 0.9, "xtc_threshold": 0.08, "xtc_probability": [0.5, 1.0], "seed": [3, 4]}


def _reference(logits: torch.Tensor, **params) -> torch.Tensor:
    batch, _ = validate_sample_request(build_sample_request(logits, **params), Limits())
    return CpuBackend().sample(batch).tokens


def test_the_server_samples_as_the_reference(client: SamplerClient) -> None:
    logits = torch.randn(2, 12, generator=torch.Generator().manual_seed(0)) * 2
    for position in range(4):
        result = client.sample(logits, position=position, **LOCAL)
        assert torch.equal(result.tokens, _reference(logits, position=position, **LOCAL))


def test_a_bad_value_answers_invalid_argument_naming_the_field(client: SamplerClient) -> None:
    with pytest.raises(TokenSamplerError) as err:
        client.sample(torch.zeros(1, 8), typical_p=1.5)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "params.typical_p" in err.value.details


def test_client_merging_keeps_every_row_its_answer() -> None:
    gen = torch.Generator().manual_seed(1)
    calls = [
        (torch.randn(2, 12, generator=gen), LOCAL),
        (torch.randn(3, 12, generator=gen), {"seed": 7, "typical_p": 0.5}),
        (torch.randn(1, 12, generator=gen), {"seed": 8, "dry_sequence_breakers": [[[2, 3]]], "dry_multiplier": 1.0,
                                             "output_token_ids": [2, 3, 2, 3]}),
        (torch.randn(2, 12, generator=gen), {"seed": [9, 10]}),
    ]
    requests = [build_sample_request(logits, **params) for logits, params in calls]
    assert len({merge_key(r) for r in requests}) == 1
    batch, _ = validate_sample_request(merge_requests(requests), Limits())
    merged = CpuBackend().sample(batch).tokens
    assert torch.equal(merged, torch.cat([_reference(logits, **params) for logits, params in calls]))
