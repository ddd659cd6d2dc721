"""The CUDA backend's reading of its kernels' row flags (csrc/sampling.h TsOutputs.flags), on CPU tensors, and the
names both sides give the row parameters and flag bits."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from tokensampler_server.backends.cuda_buffers import FLAG_UNSETTLED, FLAG_INVALID, FLAG_NAN, row_states
from tokensampler_server.model.sampling import ROW_FIELDS


def test_row_states_read_each_flag_bit_alone() -> None:
    flags = torch.tensor([0, FLAG_NAN, FLAG_INVALID, FLAG_NAN | FLAG_INVALID, FLAG_UNSETTLED, FLAG_UNSETTLED | FLAG_INVALID],
                         dtype=torch.uint8)
    valid, nan = row_states(flags)
    assert valid.tolist() == [True, True, False, False, True, False]
    assert nan.tolist() == [False, True, False, True, False, False]


def _sampling_header() -> str:
    return (Path(__file__).resolve().parents[1] / "csrc" / "sampling.h").read_text()


def test_the_row_parameters_are_the_kernels_in_their_order() -> None:
    # The bindings take the parameters' device addresses in ROW_FIELDS' order and read them in TS_ROW_PARAMS' order.
    macro = re.search(r"#define TS_ROW_PARAMS\(X\)((?:.*\\\n)+.*)", _sampling_header()).group(1)
    assert tuple(re.findall(r"X\(\w+, (\w+)\)", macro)) == ROW_FIELDS


def test_the_flag_bits_are_the_kernels() -> None:
    bits = dict(re.findall(r"TS_ROW_(\w+) = (\d+)", _sampling_header()))
    assert bits == {"NAN": str(FLAG_NAN), "INVALID": str(FLAG_INVALID), "UNSETTLED": str(FLAG_UNSETTLED)}
