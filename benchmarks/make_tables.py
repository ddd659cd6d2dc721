"""Renders the performance tables of docs/performance.md from benchmarks/results/*.json.

  python benchmarks/make_tables.py            # print the tables
  python benchmarks/make_tables.py --write    # replace the block between the markers in docs/performance.md

Kernel tables: median µs per B for our modes and the peers of the same file (same run, same GPU),
for the logits workloads and then fused, diffusion, topk_probs and verify.
Service table: p50/p99 per call and throughput from the latest service-*.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- performance-tables: begin -->", "<!-- performance-tables: end -->"
PEERS = {
    "torch_argmax": "torch argmax",
    "flashinfer_topk_topp": "FlashInfer top_k_top_p_sampling_from_logits",
    "flashinfer_topk_topp_scalar_k": "FlashInfer top_k_top_p_sampling_from_logits, one int k and p",
    "flashinfer_gumbel": "FlashInfer sampling_from_logits",
    "flashinfer_softmax+top_p": "torch softmax + FlashInfer top_p_sampling_from_probs",
    "flashinfer_softmax+min_p": "torch softmax + FlashInfer min_p_sampling_from_probs",
    "flashinfer_fused_softmax+top_p": "FlashInfer's softmax + top_p_sampling_from_probs",
    "flashinfer_fused_softmax+min_p": "FlashInfer's softmax + min_p_sampling_from_probs",
    "vllm_native_topk_topp": "vLLM PyTorch-native top-k/top-p",
}


def _fmt(value: float | None) -> str:
    return "—" if value is None else (f"{value:.1f}" if value < 1000 else f"{value:.0f}")


def _head(title: str, batches: list[int]) -> list[str]:
    """A table's title and header, one column per batch size."""
    return [title, "", "| method | " + " | ".join(f"B={b}" for b in batches) + " |", "| --- |" + " --- |" * len(batches)]


def kernel_table(path: Path) -> str:
    data = json.loads(path.read_text())
    rows = data["rows"]
    batches = sorted({r["B"] for r in rows})
    meta = data["meta"]
    lines = _head(f"**{rows[0]['workload']}**, fp32 logits [B, {meta.get('V')}], {meta['gpu']}, {meta['date']} "
                  f"(`{path.relative_to(ROOT)}`); median µs, L2 flushed", batches)

    def line(label: str, select) -> None:
        values = {r["B"]: r["median_us"] for r in rows if select(r)}
        if values:
            lines.append(f"| {label} | " + " | ".join(_fmt(values.get(b)) for b in batches) + " |")

    for mode in ("greedy", "gumbel", "top_k_top_p", "top_k", "top_p", "min_p"):
        line(f"tokensampler {mode}", lambda r, m=mode: r["method"] == "tokensampler" and r.get("mode") == m)
    for method, label in PEERS.items():
        line(label, lambda r, m=method: r["method"] == m)
    roofline = {r["B"]: r["roofline_us"] for r in rows if r.get("roofline_us") is not None}
    lines.append("| HBM roofline (one read) | " + " | ".join(_fmt(roofline.get(b)) for b in batches) + " |")
    return "\n".join(lines)


def workload_table(path: Path) -> str:
    """Any other workload (fused, diffusion, topk_probs, verify): one line per method and mode."""
    data = json.loads(path.read_text())
    rows, meta = data["rows"], data["meta"]
    batches = sorted({r["B"] for r in rows})
    shape = ", ".join(f"{key} = {meta[key]}" for key in ("V", "D", "n", "k") if key in meta)
    lines = _head(f"**{rows[0]['workload']}** ({shape}), {meta['gpu']}, {meta['date']} (`{path.relative_to(ROOT)}`); "
                  "median µs, L2 flushed", batches)
    for label in dict.fromkeys(r["method"] + (f" {r['mode']}" if r.get("mode") else "") for r in rows):
        values = {r["B"]: r["median_us"] for r in rows
                  if r["method"] + (f" {r['mode']}" if r.get("mode") else "") == label}
        lines.append(f"| {label} | " + " | ".join(_fmt(values.get(b)) for b in batches) + " |")
    roofline = {r["B"]: r["roofline_us"] for r in rows if r.get("roofline_us") is not None}
    lines.append("| HBM roofline (one read) | " + " | ".join(_fmt(roofline.get(b)) for b in batches) + " |")
    return "\n".join(lines)


def service_table(path: Path) -> str:
    data = json.loads(path.read_text())
    meta = data["meta"]
    latency = [r for r in data["rows"] if "p50_us" in r]
    batches = sorted({r["B"] for r in latency if r["B"]})
    methods = list(dict.fromkeys(r["method"] for r in latency))
    lines = _head(f"**service**, {meta['gpu']}, {meta['date']}, grpcio {meta['grpc']} (`{path.relative_to(ROOT)}`); "
                  "p50 / p99 µs per call", batches)
    for method in methods:
        cells = []
        for b in batches:
            row = next((r for r in latency if r["method"] == method and r["B"] in (b, 0)), None)
            cells.append("—" if row is None else f"{_fmt(row['p50_us'])} / {_fmt(row['p99_us'])}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    throughput = [r for r in data["rows"] if "rows_per_s" in r]
    if throughput:
        clients = sorted({r["clients"] for r in throughput})
        lines += ["", "| throughput (B = 16 per call) | " + " | ".join(f"{c} clients" for c in clients) + " |",
                  "| --- |" + " --- |" * len(clients)]
        for method in dict.fromkeys(r["method"] for r in throughput):
            cells = []
            for c in clients:
                row = next(r for r in throughput if r["method"] == method and r["clients"] == c)
                cells.append(f"{row['calls_per_s']:.0f} calls/s" if method.startswith("echo") else f"{row['rows_per_s']:.0f} rows/s")
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render() -> str:
    parts = [kernel_table(p) for p in sorted(RESULTS.glob("logits-*.json"))]
    for workload in ("fused", "diffusion", "topk_probs", "verify"):
        # The vocabulary-parallel files hold several shapes and GPU counts: docs/performance.md tables them by hand.
        parts += [workload_table(p) for p in sorted(RESULTS.glob(f"{workload}-*.json"))
                  if not p.name.startswith("fused-vocab-parallel")]
    services = sorted(RESULTS.glob("service-*.json"))
    if services:
        parts.append(service_table(services[-1]))
    return "\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the marked block of docs/performance.md")
    args = parser.parse_args()
    tables = render()
    if not args.write:
        print(tables)
        return
    text = DOC.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(text[:start] + "\n" + tables + "\n" + text[stop:])


if __name__ == "__main__":
    main()
