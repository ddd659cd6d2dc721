"""transformers' generate through tokensampler (tokensampler_client.generate): the tokens of a plain decode loop
that samples each step with the same seeds and positions, in process and remote alike."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tokensampler_client import SamplerClient
from tokensampler_client.generate import TokenSamplerProcessor
from tokensampler_server.inprocess import LocalSampler

from .conftest import RunningServer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")

STEPS = 8
PARAMS = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": [11, 12]}


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def _prompt() -> torch.Tensor:
    return torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _plain_loop(model, sampler: LocalSampler) -> torch.Tensor:
    ids = _prompt()
    for _ in range(STEPS):
        scores = model(input_ids=ids).logits[:, -1, :].float()
        token = sampler.sample(scores, position=ids.shape[1], **PARAMS).tokens
        ids = torch.cat([ids, token], dim=1)
    return ids


@torch.no_grad()
def _generate(model, sampler) -> torch.Tensor:
    from transformers import LogitsProcessorList

    processor = TokenSamplerProcessor(sampler, **PARAMS)
    return model.generate(_prompt(), attention_mask=torch.ones(2, 5, dtype=torch.long), do_sample=False,
                          max_new_tokens=STEPS, min_new_tokens=STEPS, logits_processor=LogitsProcessorList([processor]),
                          pad_token_id=0)


def test_generate_in_process_and_remote_give_the_plain_loop_s_tokens(model, server: RunningServer) -> None:
    sampler = LocalSampler("cpu")
    want = _plain_loop(model, sampler)
    assert torch.equal(_generate(model, sampler), want)
    with SamplerClient(server.target) as client:
        assert torch.equal(_generate(model, client), want)


def test_the_processor_sets_the_position_itself() -> None:
    with pytest.raises(ValueError, match="position"):
        TokenSamplerProcessor(LocalSampler("cpu"), position=3)
