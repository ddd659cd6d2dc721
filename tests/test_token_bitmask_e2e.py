"""token_bitmask through a real server: the client's encodings, a bad mask's status, and a decode loop under a
grammar whose matcher (xgrammar's, when installed) fills the mask at every step."""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest
import torch
from tokensampler_client import AsyncSamplerClient, SamplerClient, TokenSamplerError

from .conftest import RunningServer
from .test_token_bitmask import _sample, pack


def test_the_server_samples_as_the_reference(client: SamplerClient, server: RunningServer) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 90, generator=gen)
    allowed = (torch.rand(3, 90, generator=gen) < 0.2).numpy()
    allowed[:, 5] = True
    params = dict(seed=[1, 2, 3], top_p=0.9, return_logprobs=True, logprobs_mode="processed")
    expected = _sample(logits, token_bitmask=pack(allowed), **params)
    for bitmask in (pack(allowed), torch.from_numpy(pack(allowed)), pack(allowed).view(np.uint32)):
        result = client.sample(logits, token_bitmask=bitmask, **params)
        assert torch.equal(result.tokens, expected.tokens) and torch.equal(result.logprobs, expected.logprobs)

    async def sample_async() -> torch.Tensor:
        async with AsyncSamplerClient(server.target, timeout=60) as aio:
            return (await aio.sample(logits, token_bitmask=pack(allowed), **params)).tokens

    assert torch.equal(asyncio.run(sample_async()), expected.tokens)


def test_a_short_mask_answers_invalid_argument_with_the_count_expected(client: SamplerClient) -> None:
    with pytest.raises(TokenSamplerError) as err:
        client.sample(torch.zeros(2, 100), token_bitmask=np.full((2, 3), -1, dtype=np.int32))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "params.token_bitmask.shape" in err.value.details and "ceil(V / 32) = 4" in err.value.details


# A small vocabulary the test builds: printable characters, a few multi-character tokens, and an end token.
VOCAB = [chr(c) for c in range(32, 127)] + ['{"', '":', '",', '"}', "true", "false", "  ", "<eos>"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                                           "tag": {"enum": ["a", "bc"]}},
          "required": ["name", "ok", "tag"], "additionalProperties": False}


def test_a_decode_loop_under_a_json_schema_emits_what_the_schema_accepts(client: SamplerClient) -> None:
    xgr = pytest.importorskip("xgrammar")
    eos = len(VOCAB) - 1
    info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, vocab_size=len(VOCAB), stop_token_ids=[eos])
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    rows = 3
    matchers = [xgr.GrammarMatcher(grammar) for _ in range(rows)]
    bitmask = xgr.allocate_token_bitmask(rows, len(VOCAB))
    gen = torch.Generator().manual_seed(7)
    texts: list[list[str]] = [[] for _ in range(rows)]
    done = [False] * rows
    for step in range(400):
        if all(done):
            break
        for row, matcher in enumerate(matchers):
            if not done[row]:
                matcher.fill_next_token_bitmask(bitmask, row)
            else:
                bitmask[row] = -1  # a finished row: unrestricted, its token unused
        logits = torch.randn(rows, len(VOCAB), generator=gen) * 3
        result = client.sample(logits, token_bitmask=bitmask, seed=[11, 12, 13], position=step)
        for row, matcher in enumerate(matchers):
            if done[row]:
                continue
            token = int(result.tokens[row, 0])
            assert matcher.accept_token(token), f"row {row} drew token {token!r} the grammar forbids"
            if matcher.is_terminated():
                done[row] = True
            else:
                texts[row].append(VOCAB[token])
    assert all(done), "a row did not reach the grammar's end in 400 steps"
    for text in texts:
        value = json.loads("".join(text))
        assert set(value) == {"name", "ok", "tag"} and isinstance(value["name"], str) and len(value["name"]) <= 6
        assert isinstance(value["ok"], bool) and value["tag"] in ("a", "bc")
