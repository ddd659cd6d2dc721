"""A/B of the top-p route (frontier_kernel + nucleus_mass_kernel, then the filter for the rows they leave) between
source trees: each process times one tree's route at every B on both generators (peers.bench: L2 flushed,
medians) and saves the tokens, so that alternating processes on one machine compare trees and a last call
checks the tokens are equal. An experiment, not part of the package (benchmarks/NOTES.md, twenty-sixth
session); on a GPU machine, with each tree built into its own TOKENSAMPLER_BUILD_DIR:

  TOKENSAMPLER_BUILD_DIR=/tmp/a python benchmarks/experiments/top_p_route_ab.py --tree /path/a --tag a
  TOKENSAMPLER_BUILD_DIR=/tmp/b python benchmarks/experiments/top_p_route_ab.py --tree /path/b --tag b
  python benchmarks/experiments/top_p_route_ab.py --compare /tmp/top_p_a.pt /tmp/top_p_b.pt
"""
import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
V = 151936
BATCHES = (1, 8, 32, 64, 128, 256)


def time_tree(tree: Path, tag: str) -> None:
    sys.path.insert(0, str(tree / "server"))
    # The tree's package first: bench_kernels puts this checkout's server/ ahead on the path as it is imported.
    from tokensampler_server.backends import cuda_kernels  # noqa: PLC0415
    from tokensampler_server.backends.cuda_kernels import Kernels, Outputs, RowParams  # noqa: PLC0415

    if not Path(cuda_kernels.__file__).resolve().is_relative_to(tree):
        raise SystemExit(f"imported {cuda_kernels.__file__}, not the tree's package")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_kernels import load_peers  # noqa: PLC0415

    peers = load_peers()
    kernels = Kernels(torch.cuda.current_device())
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens: dict[str, list[int]] = {}
    for name, make in (("spiky", peers.spiky_logits), ("flat", peers.flat_logits)):
        for b in BATCHES:
            logits = make(b, V, gen)
            params = RowParams.make(b, "cuda", top_p=0.9, seed=7)
            pre = Outputs(tokens=torch.empty(b, 1, dtype=torch.int64, device="cuda"),
                          flags=torch.empty(b, dtype=torch.uint8, device="cuda"),
                          row_max=torch.empty(b, dtype=torch.float32, device="cuda"),
                          row_min=torch.empty(b, dtype=torch.float32, device="cuda"))

            def route() -> torch.Tensor:
                out = Outputs(tokens=torch.empty(b, 1, dtype=torch.int64, device="cuda"),
                              flags=torch.empty(b, dtype=torch.uint8, device="cuda"))
                kernels.nucleus(logits, params, pre, out, 0)
                return out.tokens

            before = int(kernels.fallback_count.item())
            tokens[f"{name}{b}"] = route()[:, 0].tolist()
            fallbacks = int(kernels.fallback_count.item()) - before
            print(f"{tag} {name:5s} B={b:4d} {peers.bench(route):8.1f} us  fallbacks {fallbacks}", flush=True)
    torch.save(tokens, f"/tmp/top_p_{tag}.pt")


def compare(a: str, b: str) -> None:
    ta, tb = torch.load(a), torch.load(b)
    differ = [key for key in ta if ta[key] != tb.get(key)]
    print("tokens equal everywhere" if not differ else f"tokens differ in {differ}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", type=Path, default=ROOT, help="the source tree whose kernels to time")
    ap.add_argument("--tag", default="tree", help="a name for the printed rows and the saved tokens")
    ap.add_argument("--compare", nargs=2, metavar="TOKENS", help="check two saved token files agree")
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
    else:
        time_tree(args.tree.resolve(), args.tag)


if __name__ == "__main__":
    main()
