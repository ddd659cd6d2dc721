"""The committed seeded tokens and log-probs (tools/seeded_tokens.py) are what the backends answer today: a change
of structure that moves a token, a validity or a top id, or a log-prob beyond rounding, fails here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from seeded_tokens import FILES, differences, run  # noqa: E402


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_backend_answers_the_committed_seeded_tokens(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    path = FILES / f"{device}.json"
    if not path.exists():
        pytest.skip(f"{path.name} not written yet: python tools/seeded_tokens.py --device {device} --write")
    assert differences(json.loads(path.read_text()), run(device)) == []
