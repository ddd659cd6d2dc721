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


def test_penalties_and_min_tokens_read_the_rows_history() -> None:
    """Penalties and min_tokens given to the processor apply to the row's own tokens. Before, the processor sent
    no history: a penalty changed nothing, and min_tokens banned the stop token for good."""
    sampler = LocalSampler("cpu")
    scores = torch.zeros(1, 16)
    scores[0, 7], scores[0, 8] = 2.0, 1.9  # 7, in the prompt, wins unless it is penalised
    penalised = TokenSamplerProcessor(sampler, temperature=0.0, repetition_penalty=2.0)
    assert int(penalised(torch.tensor([[5, 7, 6]]), scores.clone()).argmax()) == 8
    stop = torch.zeros(1, 16)
    stop[0, 1] = 3.0  # the stop token wins once it is allowed
    stopping = TokenSamplerProcessor(sampler, temperature=0.0, min_tokens=2, stop_token_ids=[1])
    ids, chosen = torch.tensor([[5, 6]]), []
    for _ in range(3):
        token = int(stopping(ids, stop.clone()).argmax())
        chosen.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    assert 1 not in chosen[:2] and chosen[2] == 1


def test_reset_starts_a_new_generation_whose_prompt_is_the_last_output() -> None:
    """A generate() whose prompt is the last one's output looks like its next step; after reset() its tokens are
    the prompt: min_tokens counts from there (before, the stop token was allowed at once)."""
    sampler = LocalSampler("cpu")
    stop = torch.zeros(1, 16)
    stop[0, 1] = 3.0  # the stop token wins once it is allowed
    processor = TokenSamplerProcessor(sampler, temperature=0.0, min_tokens=2, stop_token_ids=[1])
    ids = torch.tensor([[5, 6]])
    for _ in range(3):  # a first generation: 2 tokens, then the stop token
        ids = torch.cat([ids, processor(ids, stop.clone()).argmax(dim=1, keepdim=True)], dim=1)
    assert ids[0, -1] == 1
    processor.reset()
    assert int(processor(ids, stop.clone()).argmax()) != 1  # a new generation: no token of its own yet


class _Recording:
    """A sampler that answers token 0 and records what each call was given."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def sample(self, logits: torch.Tensor, **params):  # noqa: ANN003, ANN201
        self.calls.append(params)
        rows = logits.shape[0]
        return type("R", (), {"tokens": torch.zeros(rows, 1, dtype=torch.long), "valid": torch.ones(rows, dtype=torch.bool)})


def test_left_pads_count_neither_in_the_position_nor_in_the_prompt() -> None:
    """A row of 3 tokens padded to 5 is sampled at positions 3, 4, ... with its 3 tokens as prompt, as it would be
    alone; a call that does not continue the last one starts a new generation."""
    recording = _Recording()
    processor = TokenSamplerProcessor(recording, pad_token_id=0, repetition_penalty=1.5)
    ids = torch.tensor([[0, 0, 7, 8, 9], [3, 4, 5, 6, 7]])
    scores = torch.zeros(2, 16)
    processor(ids, scores)
    processor(torch.cat([ids, torch.tensor([[2], [2]])], dim=1), scores)
    processor(torch.tensor([[5, 6]]), scores[:1])  # a new generation, one row
    first, second, third = recording.calls
    assert first["position"] == [3, 5] and first["prompt_token_ids"] == [[7, 8, 9], [3, 4, 5, 6, 7]]
    assert first["output_token_ids"] == [[], []] and first["num_generated"] == 0
    assert second["position"] == [4, 6] and second["output_token_ids"] == [[2], [2]] and second["num_generated"] == 1
    assert third["position"] == [2] and third["prompt_token_ids"] == [[5, 6]] and third["num_generated"] == 0
