"""The CUDA backend's reading of its kernels' row flags (csrc/sampling.h TsOutputs.flags), on CPU tensors."""

from __future__ import annotations

import torch
from tokensampler_server.backends.cuda_buffers import FLAG_UNSETTLED, FLAG_INVALID, FLAG_NAN, row_states


def test_row_states_read_each_flag_bit_alone() -> None:
    flags = torch.tensor([0, FLAG_NAN, FLAG_INVALID, FLAG_NAN | FLAG_INVALID, FLAG_UNSETTLED, FLAG_UNSETTLED | FLAG_INVALID],
                         dtype=torch.uint8)
    valid, nan = row_states(flags)
    assert valid.tolist() == [True, True, False, False, True, False]
    assert nan.tolist() == [False, True, False, True, False, False]
