// Top-p 0.9 on the exact filter route (ts_stats, then ts_filter) over fp32 rows of V = 151936, timed by CUDA events
// with L2 flushed before each call: medians of the two kernels and their sum. Plain CUDA against the C API of
// csrc/sampling.h, so that the same program builds against csrc/ of any commit and the kernels' cost can be followed
// from commit to commit (benchmarks/filter_across_commits.sh).
//   filter_one_row [B=1] [spiky=1] [iterations=400]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "sampling.h"

#define CK(x)                                                                     \
  do {                                                                            \
    cudaError_t e = (x);                                                          \
    if (e != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

template <typename T>
T* upload(const std::vector<T>& v) {
  T* d;
  CK(cudaMalloc(&d, v.size() * sizeof(T)));
  CK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <typename T>
T* zeroed(size_t bytes) {
  void* d;
  CK(cudaMalloc(&d, bytes));
  CK(cudaMemset(d, 0, bytes));
  return static_cast<T*>(d);
}

int main(int argc, char** argv) {
  const int B = argc > 1 ? std::atoi(argv[1]) : 1;
  const int spiky = argc > 2 ? std::atoi(argv[2]) : 1;
  const int iters = argc > 3 ? std::atoi(argv[3]) : 400;
  const int64_t V = 151936;
  std::mt19937 gen(1234);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> spike(10.f, 30.f);
  std::uniform_int_distribution<int64_t> where(0, V - 1);
  std::vector<float> x(static_cast<size_t>(B) * V);
  for (auto& v : x) v = normal(gen);
  if (spiky)
    for (int r = 0; r < B; ++r)
      for (int s = 0; s < 50; ++s) x[static_cast<size_t>(r) * V + where(gen)] = spike(gen);
  float* d_x = upload(x);

  TsLogits lg{};
  lg.data = d_x, lg.num_rows = B, lg.vocab = V, lg.dtype = 0;
  TsRows rows{};
  rows.rows = nullptr, rows.num_work_rows = B;
  rows.temperature = upload(std::vector<float>(B, 1.f));
  rows.top_k = upload(std::vector<int32_t>(B, 0));
  rows.top_p = upload(std::vector<float>(B, 0.9f));
  rows.min_p = upload(std::vector<float>(B, 0.f));
  rows.seed = upload(std::vector<int64_t>(B, 7));
  rows.position = upload(std::vector<int64_t>(B, 0));
  rows.iteration = upload(std::vector<int64_t>(B, 0));

  TsOutputs pre{};
  pre.tokens = zeroed<int64_t>(8 * B), pre.num_samples = 1, pre.flags = zeroed<uint8_t>(B);
  pre.row_max = zeroed<float>(4 * B), pre.row_min = zeroed<float>(4 * B);
  TsOutputs out{};
  out.tokens = zeroed<int64_t>(8 * B), out.num_samples = 1, out.flags = zeroed<uint8_t>(B);
  TsWorkspace ws{};
  ws.counters = zeroed<unsigned int>(1 << 20);
  ws.hist = zeroed<void>(64 << 20);
  ws.scratch = zeroed<void>(256 << 20);
  ws.fallback_count = zeroed<unsigned long long>(8);
  const int splits = std::max(1, std::min(64, (264 + B - 1) / B));

  void* flush = zeroed<void>(512 << 20);
  cudaEvent_t e0, e1, e2;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventCreate(&e2));
  std::vector<float> total, stats, filt;
  for (int i = 0; i < iters + 25; ++i) {
    CK(cudaMemsetAsync(flush, i & 0xff, 512 << 20, 0));
    CK(cudaEventRecord(e0, 0));
    CK(static_cast<cudaError_t>(ts_stats(&lg, &rows, nullptr, &pre, &ws, nullptr)));
    CK(cudaEventRecord(e1, 0));
    CK(static_cast<cudaError_t>(
        ts_filter(&lg, &rows, pre.row_max, pre.row_min, pre.tokens, pre.flags, 0, splits, &out, &ws, nullptr)));
    CK(cudaEventRecord(e2, 0));
    CK(cudaEventSynchronize(e2));
    float a, b;
    CK(cudaEventElapsedTime(&a, e0, e1));
    CK(cudaEventElapsedTime(&b, e1, e2));
    if (i >= 25) stats.push_back(a * 1e3f), filt.push_back(b * 1e3f), total.push_back((a + b) * 1e3f);
  }
  auto med = [](std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  int64_t tok;
  CK(cudaMemcpy(&tok, out.tokens, 8, cudaMemcpyDeviceToHost));
  std::printf("B=%d %s total %.2f us (stats %.2f, filter %.2f) token0 %lld\n", B, spiky ? "spiky" : "flat", med(total),
              med(stats), med(filt), static_cast<long long>(tok));
  return 0;
}
