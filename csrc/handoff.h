/* C API of the colocated hand-off kernels (csrc/handoff.cu, docs/colocated.md). The server's stream reads the
 * engine's memory only after the engine's "input n ready" flag, and that memory can vanish with the engine: every
 * kernel here first reads the flag (a word of mapped, pinned host memory) and the server's own stop word (pinned
 * host memory the server's CPU writes), and does nothing unless the flag still holds the step it was launched for
 * and the stop word is 0. The server's CPU sets the stop word before it ends a loop, so no kernel of the loop that
 * runs after that touches the engine's memory, however late the GPU schedules it (without MPS, the engine's
 * kernels may hold the GPU until the engine has moved on). Every launcher returns a cudaError_t as int.
 */
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Copies nbytes from src (the engine's input) to dst (the server's) when *gate == step and *stop == 0. The two
 * words are read once, by a kernel of one thread just before the copy, which leaves its verdict in *verdict (a
 * word of device memory the caller owns; the copy's blocks read that instead of host memory). */
int ts_gated_copy(const void* src, void* dst, int64_t nbytes, const uint32_t* gate, const uint32_t* stop,
                  uint32_t step, uint32_t* verdict, void* stream);

/* When *gate == step and *stop == 0: writes count tokens (int64, -1 where the row is not valid) to out_tokens as int32 or int64,
 * and count log-probs to out_logprobs when both are given, then, after a system-wide fence, step to *release. */
int ts_deliver(const int64_t* tokens, int64_t count, void* out_tokens, int32_t out_int64, const float* logprobs,
               float* out_logprobs, const uint32_t* gate, const uint32_t* stop, uint32_t step, uint32_t* release,
               void* stream);

#ifdef __cplusplus
}
#endif
