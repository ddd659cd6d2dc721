"""The tensor codec takes a tensor of any strides: transposed, sliced, expanded, 0-d; every wire dtype."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.params import serialize_sample_request
from tokensampler_client.tensors import TORCH_TO_DTYPE, decode_tensor, encode_tensor
from tokensampler_client.workloads import build_verify_request

BASE = torch.arange(24).view(4, 6)
LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "[B, 1] from a transpose": lambda x: x[:1].t(),  # contiguous, yet stride (1, 6)
    "[1, B] from a transpose": lambda x: x[:, :1].t(),
    "transposed": lambda x: x.t(),
    "column slice": lambda x: x[:, 2:3],
    "strided rows and columns": lambda x: x[::2, 1::2],
    "expanded row": lambda x: x[0].expand(3, 6),
    "permuted 3-D": lambda x: x.view(2, 2, 6).permute(2, 0, 1),
    "0-d": lambda x: x[1, 2],
}


@pytest.mark.parametrize("dtype", list(TORCH_TO_DTYPE), ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_encode_takes_any_strides(dtype: torch.dtype, layout: str) -> None:
    tensor = LAYOUTS[layout](BASE.to(dtype))
    message = encode_tensor(tensor)
    assert message.data == encode_tensor(tensor.clone(memory_format=torch.contiguous_format)).data
    decoded = decode_tensor(message)
    assert decoded.dtype == dtype and decoded.shape == tensor.shape and torch.equal(decoded, tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_request_logits_take_a_transposed_column(dtype: torch.dtype) -> None:
    logits = torch.randn(1, 5).to(dtype).t()  # 5 rows of 1 logit, stride (1, 5)
    request = pb.SampleRequest.FromString(serialize_sample_request(logits, top_k=1))
    assert torch.equal(decode_tensor(request.logits), logits)


def test_verify_takes_draft_ids_from_a_transpose() -> None:
    draft_ids = torch.tensor([[3, 1, 4]]).t()  # [B = 3, n = 1] int64, stride (1, 3)
    request = build_verify_request(draft_ids, torch.randn(3, 2, 10), draft_probs=torch.rand(3, 1, 10))
    assert decode_tensor(request.draft_ids).tolist() == [[3], [1], [4]]
