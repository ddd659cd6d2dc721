"""The e2e benchmark's decode loop (benchmarks/bench_e2e.py) on the CPU, with a tiny random Llama in float32 (a CPU's
bf16 matmuls are slow): its cached steps give the model's own outputs; for the same seeds the tokens of one input
kind are the same in process and remote (logits, and hidden states through the model's LM head); the agreement
across kinds is reported; the script writes its result file. The GPU's pieces have CPU stand-ins here: eager steps
for the CUDA graphs, the host clock for the CUDA events, direct reads for the pinned copies, shared-memory regions
(a copy a step) for CUDA IPC regions; FlashInfer is skipped."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from tokensampler_client import SamplerClient
from tokensampler_server.inprocess import LocalSampler

from .conftest import RunningServer

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_e2e  # noqa: E402

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1000}
# FlashInfer and the colocated hand-off need a GPU (tests/gpu/test_colocated.py checks the latter's tokens).
ON_CPU = [m for m in bench_e2e.METHODS if m != "flashinfer" and not m.startswith("tokensampler_colocated_")]
BATCH, PROMPT, STEPS = 3, 6, 5


@pytest.fixture(scope="module")
def model():
    return bench_e2e.build_model(bench_e2e.llama_config(2, TINY), torch.device("cpu"), torch.float32)


@torch.no_grad()
def test_cached_steps_give_the_model_s_own_outputs(model) -> None:
    """Prefill and steps against the model's forward over the whole sequence; a step without the LM head leaves the
    logits buffer as it was."""
    decoder = bench_e2e.Decoder(model, BATCH, PROMPT + STEPS)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, TINY["vocab_size"], (BATCH, PROMPT), generator=gen)
    decoder.prefill(ids)
    assert torch.allclose(decoder.logits, model(input_ids=ids).logits[:, -1].float(), atol=0.05)
    for step in range(STEPS):
        token = torch.randint(0, TINY["vocab_size"], (BATCH, 1), generator=gen)
        ids = torch.cat([ids, token], dim=1)
        decoder.input_ids.copy_(token)
        with_logits = step % 2 == 0
        before = decoder.logits.clone()
        decoder.step(with_logits)
        want = model(input_ids=ids).logits[:, -1].float()
        got = decoder.logits if with_logits else model.lm_head(decoder.hidden).float()
        assert torch.allclose(got, want, atol=0.05), (step, (got - want).abs().max())
        assert with_logits or torch.equal(decoder.logits, before)
    assert int(decoder.position) == PROMPT + STEPS


def test_one_kind_s_tokens_are_the_same_in_process_and_remote(model, shm_server: RunningServer) -> None:
    with SamplerClient(shm_server.target, timeout=60) as client:
        case = bench_e2e.run_case(model, BATCH, PROMPT, STEPS, 2, ON_CPU, sampler=LocalSampler("cpu"), client=client,
                                  probe_iters=2)
        assert client.list_regions() == [] and client.list_weights() == []  # every method cleaned up
    tokens, rows = case.tokens, {row["method"]: row for row in case.rows}
    assert set(rows) == set(ON_CPU), case.skipped
    for kind in ("logits", "hidden"):
        remote = f"tokensampler_remote_{kind}"
        assert torch.equal(tokens[remote], tokens[f"tokensampler_inprocess_{kind}"]), kind
        assert rows[remote]["tokens_identical_to_inprocess"] is True
        assert rows[remote]["remote_form"] in ("stream", "unary") and set(rows[remote]["remote_form_probe_p50_us"]) == {
            "stream", "unary"}
        assert isinstance(rows[remote]["remote_overhead_us"], float)
        graph = rows[f"tokensampler_graph_{kind}"]
        assert torch.equal(tokens[f"tokensampler_graph_{kind}"], tokens[f"tokensampler_inprocess_{kind}"]), kind
        assert graph["tokens_identical_to_inprocess"] is True and graph["sampling"] == "eager"
    for name in ("tokensampler_inprocess_hidden", "tokensampler_remote_hidden"):
        cross = rows[name]["agreement_with_logits"]
        assert cross["compared_with"] == "tokensampler_inprocess_logits"
        assert all(0.0 <= cross[key] <= 1.0 for key in ("agreement_rate", "first_step_agreement", "rows_identical"))
    for row in rows.values():
        assert tuple(tokens[row["method"]].shape) == (BATCH, STEPS)
        assert row["tokens_same_every_run"] and row["runs"] == 2 and row["forward"] == "eager"
        assert row["tokens_per_s"] > 0 and 0 < row["step_p50_us"] <= row["step_p99_us"]
        assert row["mode"] == ("hidden" if row["method"].endswith("hidden") else "logits")
    assert 1 <= case.step0["kept_tokens_mean"] <= bench_e2e.PARAMS["top_k"]


def test_the_script_starts_its_server_and_writes_its_result_file(tmp_path: Path) -> None:
    path = bench_e2e.main(["--small", "--layers", "1", "--batch-sizes", "2", "--steps", "3", "--prompt", "4",
                           "--repeats", "1", "--probe-iters", "2", "--out", str(tmp_path)])
    assert path.parent == tmp_path and path.name.startswith("e2e-")
    data = json.loads(path.read_text())
    assert data["meta"]["flashinfer"] == "not run: no GPU" and data["meta"]["V"] == bench_e2e.SMALL["vocab_size"]
    rows = {row["method"]: row for row in data["rows"]}
    assert list(rows) == ON_CPU
    for row in rows.values():
        assert row["workload"] == "e2e" and (row["B"], row["layers"]) == (2, 1)
        assert {"tokens_per_s", "step_p50_us", "step_p99_us"} <= set(row)
    assert rows["tokensampler_remote_logits"]["tokens_identical_to_inprocess"]
    assert rows["tokensampler_remote_hidden"]["tokens_identical_to_inprocess"]


def test_a_method_that_cannot_be_set_up_is_left_out_with_its_reason(model) -> None:
    case = bench_e2e.run_case(model, 2, 4, 2, 1, ["torch", "flashinfer"])  # flashinfer without its module
    assert [row["method"] for row in case.rows] == ["torch"]
    assert list(case.skipped) == ["flashinfer"] and "AttributeError" in case.skipped["flashinfer"]
