"""What bounds a one-read row pass (max, argmax, sum exp) over [R, V] fp32? Structure variants of the
chunked pass, timed beside torch.amax / sum and a grid-stride read (peers.bench: L2 flushed, medians).
An experiment, not part of the package (benchmarks/NOTES.md, nineteenth session); on a GPU machine:

  python benchmarks/experiments/rowpass_probe.py 512 256
"""
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_kernels import load_peers  # noqa: E402

peers = load_peers()

SRC = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <map>
#include <ATen/cuda/CUDAContext.h>
constexpr float kInf = __builtin_huge_valf();
struct Part { float max, sum; int arg; };
__device__ __forceinline__ float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ Part mergep(Part a, Part b, float c2) {
  float m = fmaxf(a.max, b.max);
  a.sum = m == -kInf ? 0.f : a.sum * ex2((a.max - m) * c2) + b.sum * ex2((b.max - m) * c2);
  if (b.max > a.max || (b.max == a.max && b.arg < a.arg)) a.arg = b.arg;
  a.max = m; return a;
}
template <int HINT> __device__ __forceinline__ float4 ld4(const float* p) {
  float4 q;
  if constexpr (HINT == 0) q = *reinterpret_cast<const float4*>(p);
  else if constexpr (HINT == 1) asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(q.x), "=f"(q.y), "=f"(q.z), "=f"(q.w) : "l"(p));
  else if constexpr (HINT == 2) asm volatile("ld.global.nc.L2::128B.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(q.x), "=f"(q.y), "=f"(q.z), "=f"(q.w) : "l"(p));
  else q = __ldcs(reinterpret_cast<const float4*>(p));
  return q;
}
template <int THREADS, int GPT, int HINT>
__device__ __forceinline__ void load_items(const float* row, long V, long g0, float (&v)[GPT][4]) {
#pragma unroll
  for (int j = 0; j < GPT; ++j) {
    long g = g0 + threadIdx.x + j * THREADS;
    if (4 * g + 4 <= V) { float4 q = ld4<HINT>(row + 4 * g); v[j][0] = q.x; v[j][1] = q.y; v[j][2] = q.z; v[j][3] = q.w; }
    else for (int e = 0; e < 4; ++e) v[j][e] = 4 * g + e < V ? row[4 * g + e] : -kInf;
  }
}
template <int THREADS, int GPT>
__device__ __forceinline__ Part thread_part(const float (&v)[GPT][4], long g0, float c2) {
  Part s{-kInf, 0.f, 0x7fffffff};
#pragma unroll
  for (int j = 0; j < GPT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) if (v[j][e] > s.max) s.max = v[j][e], s.arg = int(4 * (g0 + threadIdx.x + j * THREADS) + e);
  if (s.max > -kInf) {
#pragma unroll
    for (int j = 0; j < GPT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s.sum += ex2((v[j][e] - s.max) * c2);
  }
  return s;
}
template <int THREADS>
__device__ __forceinline__ Part block_part(Part s, float c2) {
#pragma unroll
  for (int o = 16; o; o >>= 1) s = mergep(s, Part{__shfl_xor_sync(~0u, s.max, o), __shfl_xor_sync(~0u, s.sum, o), __shfl_xor_sync(~0u, s.arg, o)}, c2);
  __shared__ Part wp[THREADS / 32];
  __syncthreads();
  if ((threadIdx.x & 31) == 0) wp[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x == 0) for (int i = 1; i < THREADS / 32; ++i) s = mergep(s, wp[i], c2);
  return s;
}
__device__ void finish_row(const Part* partial, int splits, float c2, int w, float* omax, int* oarg, float* osum) {
  Part r{-kInf, 0.f, 0x7fffffff};
  for (int i = 0; i < splits; ++i) { const Part* p = partial + i; r = mergep(r, Part{__ldcg(&p->max), __ldcg(&p->sum), __ldcg(&p->arg)}, c2); }
  omax[w] = r.max; oarg[w] = r.arg; osum[w] = r.sum;
}
// one chunk a block; COUNTER: the row's last block merges (else merge_kernel after)
template <int THREADS, int GPT, int HINT, bool COUNTER, int MINB>
__global__ void __launch_bounds__(THREADS, MINB) chunk_kernel(const float* x, long V, Part* partial, unsigned* counters,
                                                          float* omax, int* oarg, float* osum) {
  const int w = blockIdx.y, split = blockIdx.x, splits = gridDim.x;
  const float c2 = 1.4426950408889634f;
  const long g0 = (long)split * THREADS * GPT;
  float v[GPT][4];
  load_items<THREADS, GPT, HINT>(x + (long)w * V, V, g0, v);
  Part s = block_part<THREADS>(thread_part<THREADS, GPT>(v, g0, c2), c2);
  if (threadIdx.x != 0) return;
  partial[(long)w * splits + split] = s;
  if constexpr (COUNTER) {
    __threadfence();
    if (atomicAdd(counters + w, 1u) != (unsigned)splits - 1) return;
    counters[w] = 0u; __threadfence();
    finish_row(partial + (long)w * splits, splits, c2, w, omax, oarg, osum);
  }
}
__global__ void merge_kernel(const Part* partial, int rows, int splits, float* omax, int* oarg, float* osum) {
  int w = blockIdx.x * blockDim.x + threadIdx.x;
  if (w < rows) finish_row(partial + (long)w * splits, splits, 1.4426950408889634f, w, omax, oarg, osum);
}
// persistent: items (row, chunk) row-major, block b takes b, b + grid, ...; the next item's loads issued
// before the current item is reduced (register double buffer)
template <int THREADS, int GPT, int HINT, int MINB>
__global__ void __launch_bounds__(THREADS, MINB) persist_kernel(const float* x, long V, int rows, int splits, Part* partial,
                                                            unsigned* counters, float* omax, int* oarg, float* osum) {
  const float c2 = 1.4426950408889634f;
  const int items = rows * splits;
  int it = blockIdx.x;
  float a[GPT][4], b[GPT][4];
  auto load = [&](int item, float (&v)[GPT][4]) {
    if (item < items) load_items<THREADS, GPT, HINT>(x + (long)(item / splits) * V, V, (long)(item % splits) * THREADS * GPT, v);
  };
  auto work = [&](int item, float (&v)[GPT][4]) {
    const int w = item / splits, split = item % splits;
    const long g0 = (long)split * THREADS * GPT;
    Part s = block_part<THREADS>(thread_part<THREADS, GPT>(v, g0, c2), c2);
    if (threadIdx.x == 0) {
      partial[(long)w * splits + split] = s;
      __threadfence();
      if (atomicAdd(counters + w, 1u) == (unsigned)splits - 1) {
        counters[w] = 0u; __threadfence();
        finish_row(partial + (long)w * splits, splits, c2, w, omax, oarg, osum);
      }
    }
  };
  load(it, a);
  while (it < items) {
    load(it + gridDim.x, b);
    work(it, a);
    it += gridDim.x;
    if (it >= items) break;
    load(it + gridDim.x, a);
    work(it, b);
    it += gridDim.x;
  }
}
// plain grid-stride read: the bandwidth a simple read reaches on the same bytes
template <int HINT>
__global__ void __launch_bounds__(256) read_kernel(const float* x, long n4, float* out) {
  float s = 0.f;
  for (long i = blockIdx.x * 256L + threadIdx.x; i < n4; i += 4L * gridDim.x * 256) {
    float4 q[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) { long k = i + u * (long)gridDim.x * 256; q[u] = k < n4 ? ld4<HINT>(x + 4 * k) : make_float4(0, 0, 0, 0); }
#pragma unroll
    for (int u = 0; u < 4; ++u) s += fmaxf(fmaxf(q[u].x, q[u].y), fmaxf(q[u].z, q[u].w));
  }
  if (s == 12345.f) out[0] = s;
}

struct Bufs {
  torch::Tensor partial, counters, omax, oarg, osum;
  Part* parts() { return (Part*)partial.data_ptr<float>(); }
  unsigned* counts() { return (unsigned*)counters.data_ptr<int>(); }
};
// Scratch and outputs per (rows, splits), reused by every variant: the row counters reset themselves.
static Bufs& bufs_for(const torch::Tensor& x, int splits) {
  static std::map<std::pair<long, int>, Bufs> cache;
  const auto key = std::make_pair((long)x.size(0), splits);
  auto it = cache.find(key);
  if (it == cache.end()) {
    auto o = x.options();
    const long R = x.size(0);
    it = cache.emplace(key, Bufs{torch::empty({R * splits * 3}, o), torch::zeros({R}, o.dtype(torch::kInt32)),
                                 torch::empty({R}, o), torch::empty({R}, o.dtype(torch::kInt32)),
                                 torch::empty({R}, o)}).first;
  }
  return it->second;
}
template <int THREADS, int GPT>
int splits_of(long V) { return (int)((V + 4L * THREADS * GPT - 1) / (4L * THREADS * GPT)); }

template <int THREADS, int GPT, int HINT, bool COUNTER, int MINB>
std::vector<torch::Tensor> run_chunk(torch::Tensor x) {
  const long V = x.size(1); const int R = x.size(0);
  const int splits = splits_of<THREADS, GPT>(V);
  auto stream = at::cuda::getCurrentCUDAStream();
  Bufs& B = bufs_for(x, splits);
  chunk_kernel<THREADS, GPT, HINT, COUNTER, MINB><<<dim3(splits, R), THREADS, 0, stream>>>(
      x.data_ptr<float>(), V, B.parts(), B.counts(), B.omax.data_ptr<float>(), B.oarg.data_ptr<int>(),
      B.osum.data_ptr<float>());
  if (!COUNTER)
    merge_kernel<<<(R + 127) / 128, 128, 0, stream>>>(B.parts(), R, splits, B.omax.data_ptr<float>(),
                                                      B.oarg.data_ptr<int>(), B.osum.data_ptr<float>());
  return {B.omax, B.oarg, B.osum};
}
template <int THREADS, int GPT, int HINT, int MINB>
std::vector<torch::Tensor> run_persist(torch::Tensor x, int blocks_per_sm) {
  const long V = x.size(1); const int R = x.size(0);
  const int splits = splits_of<THREADS, GPT>(V);
  Bufs& B = bufs_for(x, splits);
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.get_device());
  int occ; cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, persist_kernel<THREADS, GPT, HINT, MINB>, THREADS, 0);
  int grid = sms * (blocks_per_sm > 0 ? std::min(blocks_per_sm, occ) : occ);
  persist_kernel<THREADS, GPT, HINT, MINB><<<grid, THREADS, 0, at::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), V, R, splits, B.parts(), B.counts(), B.omax.data_ptr<float>(), B.oarg.data_ptr<int>(),
      B.osum.data_ptr<float>());
  return {B.omax, B.oarg, B.osum};
}
template <int HINT>
void run_read(torch::Tensor x, torch::Tensor out, int blocks_per_sm) {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.get_device());
  read_kernel<HINT><<<sms * blocks_per_sm, 256, 0, at::cuda::getCurrentCUDAStream()>>>(x.data_ptr<float>(), x.numel() / 4, out.data_ptr<float>());
}
template <typename K> int occ_of(K k, int threads) { int o; cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o, k, threads, 0); return o; }
std::vector<int64_t> occupancies() {
  return {occ_of(chunk_kernel<256, 8, 0, true, 1>, 256), occ_of(chunk_kernel<256, 8, 0, true, 5>, 256),
          occ_of(chunk_kernel<128, 8, 0, true, 1>, 128), occ_of(chunk_kernel<512, 8, 0, true, 1>, 512),
          occ_of(chunk_kernel<256, 16, 0, true, 1>, 256), occ_of(chunk_kernel<256, 4, 0, true, 1>, 256),
          occ_of(persist_kernel<256, 8, 0, 1>, 256), occ_of(persist_kernel<256, 4, 0, 1>, 256), occ_of(persist_kernel<128, 8, 0, 1>, 128)};
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("occupancies", &occupancies);
  m.def("c256x8", &run_chunk<256, 8, 0, true, 1>);
  m.def("c256x8_b5", &run_chunk<256, 8, 0, true, 5>);
  m.def("c256x8_h1", &run_chunk<256, 8, 1, true, 1>);
  m.def("c256x8_h2", &run_chunk<256, 8, 2, true, 1>);
  m.def("c256x8_h3", &run_chunk<256, 8, 3, true, 1>);
  m.def("c256x8_nocounter", &run_chunk<256, 8, 0, false, 1>);
  m.def("c128x8", &run_chunk<128, 8, 0, true, 1>);
  m.def("c128x8_h1", &run_chunk<128, 8, 1, true, 1>);
  m.def("c512x8", &run_chunk<512, 8, 0, true, 1>);
  m.def("c256x16", &run_chunk<256, 16, 0, true, 1>);
  m.def("c256x16_h1", &run_chunk<256, 16, 1, true, 1>);
  m.def("c256x4", &run_chunk<256, 4, 0, true, 1>);
  m.def("c256x4_h1", &run_chunk<256, 4, 1, true, 1>);
  m.def("c128x16", &run_chunk<128, 16, 0, true, 1>);
  m.def("p256x8", &run_persist<256, 8, 0, 1>);
  m.def("p256x8_h1", &run_persist<256, 8, 1, 1>);
  m.def("p256x4", &run_persist<256, 4, 0, 1>);
  m.def("p256x4_h1", &run_persist<256, 4, 1, 1>);
  m.def("p128x8", &run_persist<128, 8, 0, 1>);
  m.def("read_h0", &run_read<0>);
  m.def("read_h1", &run_read<1>);
}
"""

mod = load_inline("rowpass_probe", cpp_sources="", cuda_sources=SRC, verbose=False,
                  extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas=-v"],
                  build_directory=None)
print("occupancy (blocks/SM): c256x8 c256x8_b5 c128x8 c512x8 c256x16 c256x4 p256x8 p256x4 p128x8:",
      mod.occupancies(), flush=True)
READ_BW = peers.bandwidth()[1]
print(f"read bandwidth {READ_BW / 1e9:.0f} GB/s", flush=True)
V = 151936
gen = torch.Generator(device="cuda").manual_seed(0)
for R in [int(a) for a in sys.argv[1:]] or [512, 256]:
    x = torch.randn(R, V, device="cuda", generator=gen) * 2
    x[:, 1000::7919] += 25.0  # spikes
    ref_max, ref_arg = x.max(-1)
    ref_sum = torch.exp(x - ref_max[:, None]).sum(-1)
    roof = R * V * 4 / READ_BW * 1e6
    out = torch.empty(1, device="cuda")
    res = {}
    res["torch.amax"] = peers.bench(lambda: torch.amax(x, -1))
    res["torch.sum"] = peers.bench(lambda: x.sum(-1))
    res["torch.max(dim)"] = peers.bench(lambda: x.max(-1))
    for bps in (2, 4, 8):
        res[f"read_h0 x{bps}"] = peers.bench(lambda: mod.read_h0(x, out, bps))
        res[f"read_h1 x{bps}"] = peers.bench(lambda: mod.read_h1(x, out, bps))
    names = ["c256x8", "c256x8_b5", "c256x8_h1", "c256x8_h2", "c256x8_h3", "c256x8_nocounter", "c128x8", "c128x8_h1",
             "c512x8", "c256x16", "c256x16_h1", "c256x4", "c256x4_h1", "c128x16"]
    for n in names:
        f = getattr(mod, n)
        m, a, s = f(x)
        ok = bool(torch.equal(a.long(), ref_arg)) and bool(torch.allclose(s, ref_sum, rtol=1e-4))
        res[n + ("" if ok else " WRONG")] = peers.bench(lambda: f(x))
    for n in ["p256x8", "p256x8_h1", "p256x4", "p256x4_h1", "p128x8"]:
        f = getattr(mod, n)
        for bps in (0, 2, 3, 4):
            m, a, s = f(x, bps)
            ok = bool(torch.equal(a.long(), ref_arg)) and bool(torch.allclose(s, ref_sum, rtol=1e-4))
            res[f"{n} bps={bps or 'occ'}" + ("" if ok else " WRONG")] = peers.bench(lambda: f(x, bps))
    print(f"R = {R}: roofline {roof:.1f} us (peers.bandwidth)")
    for k, v in res.items():
        print(f"  {k:28s} {v:7.1f} us  {R * V * 4 / v / 1e3:6.0f} GB/s", flush=True)
