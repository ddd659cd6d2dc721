"""Energy a call takes, read from NVML's energy counter while each call runs back to back for two seconds: cuBLAS
alone (bf16 and fp32 logits), the fused Gumbel call, and, on fp32 logits already in memory, our Gumbel logits kernel
beside a plain read of the same bytes (a row max). With the card at its power limit, a kernel that does cuBLAS's
multiply plus the sampling's arithmetic needs at least the energy of both, so its time over cuBLAS's is bounded
below by 1 + (the sampling arithmetic's dynamic energy) / (the multiply's). An experiment, not part of the package
(benchmarks/FUSED_NOTES.md, forty-sixth session); on a GPU machine:

  python benchmarks/experiments/energy_probe.py 128 256
"""
import statistics
import sys
import threading
import time
from pathlib import Path

import pynvml
import torch

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS.parent / "server")]
from bench_fused import D, V, fused_fn  # noqa: E402
from bench_kernels import tokensampler_fn  # noqa: E402
from tokensampler_server.backends.cuda_kernels import Kernels  # noqa: E402

SECONDS = 2.0


class Counters:
    """NVML's energy counter (mJ since the driver loaded) and, sampled every 20 ms, the SM clock."""

    def __init__(self) -> None:
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        self.clocks: list[int] = []
        self._sampling = False

    def energy_mj(self) -> int:
        return pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)

    def _sample(self) -> None:
        while self._sampling:
            self.clocks.append(pynvml.nvmlDeviceGetClockInfo(self.handle, pynvml.NVML_CLOCK_SM))
            time.sleep(0.02)

    def measure(self, call) -> dict:
        """Per call: time, energy and mean power while `call` runs back to back for SECONDS (never waited on)."""
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        self.clocks, self._sampling = [], True
        sampler = threading.Thread(target=self._sample)
        sampler.start()
        calls, energy0, start = 0, self.energy_mj(), time.perf_counter()
        while time.perf_counter() - start < SECONDS:
            for _ in range(10):
                call()
            calls += 10
            torch.cuda.synchronize()
        elapsed, energy = time.perf_counter() - start, self.energy_mj() - energy0
        self._sampling = False
        sampler.join()
        return {"us": elapsed / calls * 1e6, "mj": energy / calls, "watts": energy / 1e3 / elapsed,
                "mhz": statistics.median(self.clocks) if self.clocks else 0}

    def idle_watts(self) -> float:
        torch.cuda.synchronize()
        energy0, start = self.energy_mj(), time.perf_counter()
        time.sleep(SECONDS)
        return (self.energy_mj() - energy0) / 1e3 / (time.perf_counter() - start)


def main() -> None:
    counters = Counters()
    kernels = Kernels(torch.cuda.current_device())
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(V, D, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    idle = counters.idle_watts()
    print(f"idle {idle:.1f} W", flush=True)
    for b in (int(arg) for arg in sys.argv[1:] or ["128", "256"]):
        hidden = torch.randn(b, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        logits = torch.mm(hidden, weight.T, out_dtype=torch.float32)
        calls = {
            "cublas_bf16": lambda: hidden @ weight.T,
            "cublas_fp32": lambda: torch.mm(hidden, weight.T, out_dtype=torch.float32),
            "fused_gumbel": fused_fn(weight, hidden, "gumbel"),
            "logits_gumbel": tokensampler_fn(kernels, "gumbel", logits),
            "logits_read": lambda: logits.amax(dim=1),
        }
        results = {}
        for name, call in calls.items():
            r = results[name] = counters.measure(call)
            r["dyn_mj"] = r["mj"] - idle * r["us"] / 1e3  # W x ms = mJ
            print(f"B={b:4d} {name:14s} {r['us']:8.1f} us {r['mj']:7.1f} mJ ({r['dyn_mj']:7.1f} above idle) "
                  f"{r['watts']:6.1f} W, SM clock median {r['mhz']:.0f} MHz", flush=True)
        arithmetic = results["logits_gumbel"]["dyn_mj"] - results["logits_read"]["dyn_mj"]
        multiply = results["cublas_bf16"]["dyn_mj"]
        print(f"B={b:4d} sampling arithmetic {arithmetic:.1f} mJ over the read, cuBLAS {multiply:.1f} mJ above idle: "
              f"at the power limit, time >= {1 + arithmetic / multiply:.3f}x cuBLAS's", flush=True)


if __name__ == "__main__":
    main()
