"""token_bitmask (docs/semantics.md, step 2 and choice 17) in the CPU reference, validation and batching.

The distribution test is a chi-square goodness-of-fit test at significance 0.001 over seeded draws (as in
test_cpu_semantics.py), after asserting that no draw falls outside the allowed set.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.merge import merge_key, merge_requests
from tokensampler_client.params import build_sample_request
from tokensampler_client.tensors import encode_tensor
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.backends.processing import unpack_bitmask
from tokensampler_server.batching.batch_merge import merge_batches, split_result
from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import InvalidArgument
from tokensampler_server.model.sampling import LogitProcessing, select_rows
from tokensampler_server.validation.sample import validate_sample_request
from tokensampler_server.validation.workloads import validate_diffusion_request

from .batches import make_batch
from .test_cpu_semantics import DRAWS, LOGITS, assert_fits, exact_distribution

BACKEND = CpuBackend()


def pack(allowed: np.ndarray, words: int | None = None) -> np.ndarray:
    """int32 [B, W] words of a bool [B, V] mask: bit i % 32 of word i // 32 is token i (xgrammar's layout)."""
    rows, vocab = allowed.shape
    words = words or -(-vocab // 32)
    bits = np.zeros((rows, words * 32), dtype=bool)
    bits[:, :vocab] = allowed
    return np.packbits(bits, axis=1, bitorder="little").view("<u4").view(np.int32)


def _sample(logits: torch.Tensor, **params):
    batch, _ = validate_sample_request(build_sample_request(logits, **params), Limits())
    return BACKEND.sample(batch)


def test_unpacking_reads_bit_i_mod_32_of_word_i_div_32() -> None:
    words = torch.from_numpy(np.random.default_rng(0).integers(-2**31, 2**31, size=(3, 4), dtype=np.int64)
                             .astype(np.int32))
    vocab = 100
    expected = [[bool((int(words[r, i // 32]) >> (i % 32)) & 1) for i in range(vocab)] for r in range(3)]
    assert unpack_bitmask(words, vocab).tolist() == expected
    allowed = np.random.default_rng(1).random((2, 70)) < 0.5
    assert torch.equal(unpack_bitmask(torch.from_numpy(pack(allowed)), 70), torch.from_numpy(allowed))


def test_distribution_over_the_allowed_tokens_matches_exact() -> None:
    allowed = np.zeros(LOGITS.numel(), dtype=bool)
    allowed[[0, 2, 4, 7, 9, 11]] = True
    bitmask = torch.from_numpy(pack(allowed[None])).expand(DRAWS, -1).contiguous()
    logits = LOGITS.unsqueeze(0).expand(DRAWS, -1).contiguous()
    params = dict(temperature=0.8, top_k=4, top_p=0.95)
    tokens = BACKEND.sample(make_batch(logits, seed=torch.arange(DRAWS), processing=LogitProcessing(
        token_bitmask=bitmask), **params)).tokens[:, 0].numpy()
    assert np.isin(tokens, np.nonzero(allowed)[0]).all(), "drew a token the bitmask disallows"
    x = np.where(allowed, LOGITS.numpy().astype(np.float64), -np.inf)
    assert_fits(np.bincount(tokens, minlength=LOGITS.numel()), exact_distribution(x, **params))


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5, top_p=0.9, return_logprobs=True, logprobs_mode="processed", top_logprobs=4),
    dict(temperature=0.0, return_logprobs=True, top_logprobs=3),
    dict(min_p=0.1, logit_bias={3: 5.0}, banned_token_ids=[1], output_token_ids=[2, 2, 5], repetition_penalty=1.2,
         frequency_penalty=0.3, typical_p=0.9, return_logprobs=True, logprobs_mode="processed"),
], ids=["plain", "filters", "greedy", "processing"])
def test_the_bitmask_samples_as_the_same_allowed_token_ids(params: dict) -> None:
    gen = torch.Generator().manual_seed(2)
    rows, vocab = 6, 75
    logits = torch.randn(rows, vocab, generator=gen) * 2
    allowed = torch.rand(rows, vocab, generator=gen) < 0.3
    allowed[:, 3] = True
    allowed[4] = True  # a row of all ones: unrestricted, like a row without a list
    lists = [row.nonzero().squeeze(1).tolist() for row in allowed]
    lists[4] = []
    seeds = list(range(10, 10 + rows))
    by_mask = _sample(logits, token_bitmask=pack(allowed.numpy()), seed=seeds, num_samples=3, **params)
    by_list = _sample(logits, allowed_token_ids=lists, seed=seeds, num_samples=3, **params)
    assert torch.equal(by_mask.tokens, by_list.tokens)
    for name in ("logprobs", "top_logprob_ids", "top_logprobs"):
        assert torch.equal(getattr(by_mask, name), getattr(by_list, name)) if getattr(by_list, name) is not None \
            else getattr(by_mask, name) is None
    assert allowed.gather(1, by_mask.tokens).all()


def test_bits_past_the_vocabulary_are_ignored() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 40, generator=gen)
    allowed = (torch.rand(4, 40, generator=gen) < 0.5).numpy()
    allowed[:, 0] = True
    clean = pack(allowed)  # 2 words: bits 40..63 clear
    noisy = pack(allowed, words=5)
    noisy[:, 1] |= np.int32(-(1 << 8))  # every bit of tokens 40..63
    noisy[:, 2:] = -1
    seeds = [1, 2, 3, 4]
    assert torch.equal(_sample(logits, token_bitmask=noisy, seed=seeds).tokens,
                       _sample(logits, token_bitmask=clean, seed=seeds).tokens)


def test_a_row_that_allows_nothing_is_not_valid_and_leaves_the_others_alone() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    allowed = np.ones((3, 50), dtype=bool)
    allowed[1] = False
    allowed[2, :] = False
    allowed[2, 7] = True  # its one allowed token is banned: nothing is left either
    result = _sample(logits, token_bitmask=pack(allowed), banned_token_ids=[[], [], [7]], seed=[5, 6, 7],
                     return_logprobs=True)
    assert result.valid.tolist() == [True, False, False]
    assert result.tokens[1:].eq(-1).all() and result.logprobs[1:].isnan().all()
    assert torch.equal(result.tokens[0], _sample(logits[:1], seed=5).tokens[0])


def _rejected(request: pb.SampleRequest) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as err:
        validate_sample_request(request, Limits())
    return err.value


def _request_with(vocab: int, mask: torch.Tensor) -> pb.SampleRequest:
    request = build_sample_request(torch.zeros(2, vocab))
    encode_tensor(mask, request.params.token_bitmask)
    return request


def test_validation_names_the_field_and_what_was_expected() -> None:
    short = _rejected(_request_with(100, torch.zeros(2, 3, dtype=torch.int32)))
    assert short.field == "params.token_bitmask.shape" and "at least ceil(V / 32) = 4" in short.message
    wrong_dtype = _rejected(_request_with(100, torch.zeros(2, 4, dtype=torch.int64)))
    assert wrong_dtype.field == "params.token_bitmask.dtype" and "int32" in wrong_dtype.message
    wrong_rows = _rejected(_request_with(100, torch.zeros(3, 4, dtype=torch.int32)))
    assert wrong_rows.field == "params.token_bitmask.shape" and "[2, W]" in wrong_rows.message
    flat = _rejected(_request_with(100, torch.zeros(8, dtype=torch.int32)))
    assert flat.field == "params.token_bitmask.shape"
    request = _request_with(100, torch.zeros(2, 4, dtype=torch.int32))
    request.params.token_bitmask.data = b"\0" * 12
    assert _rejected(request).field.startswith("params.token_bitmask")
    huge = _rejected(_with_words(100, Limits().max_batch_elements))
    assert huge.field == "params.token_bitmask.shape" and "max-batch-elements" in huge.message


def _with_words(vocab: int, words: int) -> pb.SampleRequest:
    """A request whose bitmask declares `words` words per row (its data is never read: the shape is refused)."""
    request = build_sample_request(torch.zeros(2, vocab))
    mask = request.params.token_bitmask
    mask.dtype, mask.shape[:] = pb.DTYPE_INT32, [2, words]
    return request


def test_workloads_of_many_positions_refuse_it() -> None:
    request = pb.DiffusionStepRequest()
    encode_tensor(torch.zeros(1, 2, 40), request.logits)
    encode_tensor(torch.ones(1, 2, dtype=torch.uint8), request.mask)
    encode_tensor(torch.full((1, 2), -1, dtype=torch.int32), request.params.token_bitmask)
    with pytest.raises(InvalidArgument) as err:
        validate_diffusion_request(request, Limits())
    assert err.value.field == "params.token_bitmask"


def test_the_client_checks_type_and_rows() -> None:
    with pytest.raises(TypeError, match="token_bitmask"):
        build_sample_request(torch.zeros(2, 40), token_bitmask=torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"token_bitmask: expected shape \[2, W\]"):
        build_sample_request(torch.zeros(2, 40), token_bitmask=np.zeros((3, 2), dtype=np.int32))
    unsigned = build_sample_request(torch.zeros(1, 40), token_bitmask=np.full(2, 0xFFFFFFFF, dtype=np.uint32))
    assert list(unsigned.params.token_bitmask.shape) == [1, 2]


def _calls() -> list[tuple[torch.Tensor, dict]]:
    gen = torch.Generator().manual_seed(5)
    vocab = 70
    masks = [(torch.rand(rows, vocab, generator=gen) < 0.4).numpy() for rows in (2, 3)]
    return [
        (torch.randn(2, vocab, generator=gen), {"seed": [1, 2], "token_bitmask": pack(masks[0])}),
        (torch.randn(1, vocab, generator=gen), {"seed": 3, "top_k": 5}),
        (torch.randn(3, vocab, generator=gen), {"seed": [4, 5, 6], "token_bitmask": pack(masks[1], words=4),
                                                "banned_token_ids": [2]}),
    ]


def test_server_batching_gives_every_request_its_tokens() -> None:
    batches = [validate_sample_request(build_sample_request(logits, **params), Limits())[0]
               for logits, params in _calls()]
    alone = [BACKEND.sample(batch).tokens for batch in batches]
    merged = merge_batches(batches)
    assert merged.processing.token_bitmask.shape == (6, 3)
    assert merged.processing.token_bitmask_rows.tolist() == [0, 1, 3, 4, 5]  # row 2's request had no mask
    parts = split_result(BACKEND.sample(merged), [b.num_rows for b in batches])
    assert all(torch.equal(part.tokens, tokens) for part, tokens in zip(parts, alone))
    picked = torch.tensor([4, 0, 2])
    expected = torch.cat([alone[2][1], alone[0][0], alone[1][0]]).unsqueeze(1)
    selected = select_rows(merged, picked)
    assert selected.processing.token_bitmask_rows.tolist() == [1, 0]
    assert torch.equal(BACKEND.sample(selected).tokens, expected)


def test_client_merging_gives_every_request_its_tokens() -> None:
    requests = [build_sample_request(logits, **params) for logits, params in _calls()]
    assert len({merge_key(r) for r in requests}) == 1
    merged = merge_requests(requests)
    assert list(merged.params.token_bitmask.shape) == [6, 3]
    tokens = _sample_request(merged)
    assert torch.equal(tokens, torch.cat([_sample_request(r) for r in requests]))


def _sample_request(request: pb.SampleRequest) -> torch.Tensor:
    return BACKEND.sample(validate_sample_request(request, Limits())[0]).tokens
