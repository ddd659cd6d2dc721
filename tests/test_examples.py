"""The examples run end to end against a real server (each skipped when its dependency is absent)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_transformers_decode_loop_matches_generate() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "transformers_decode.py"), "--steps", "12"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "greedy tokens match model.generate for all 12 steps" in done.stdout
    assert "seeded top-k/top-p continuation is reproducible" in done.stdout


def test_diffusion_loop_commits_every_position() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "diffusion_loop.py"), "--rows", "2", "--length", "48", "--vocab", "2000"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all 96 positions committed" in done.stdout
