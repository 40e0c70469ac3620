// What the drain probes (probe_blocking_calls.cu, probe_two_process_copies.cu) share: the error check, the clock,
// the bounded poll, and the kernel that spins for a flag as our wait kernels do.
#pragma once
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); std::exit(1); } } while (0)

static double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Polls `query` (a cudaStreamQuery or cudaEventQuery) until it stops answering cudaErrorNotReady; exits naming `who`
// and `what` after 30 s (every spinner in the probes gives up after 3 s).
template <class Query>
static void wait_done(Query query, const char* who, const char* what) {
  const double deadline = now_ms() + 30000;
  while (query() == cudaErrorNotReady) {
    if (now_ms() > deadline) {
      std::fprintf(stderr, "%s: %s did not finish within 30 s\n", who, what);
      std::exit(2);
    }
  }
}

// Every thread polls until *flag != 0 or `ns` nanoseconds pass; block 0 writes the result: 1 = saw the flag,
// 2 = gave up.
__global__ void spin(volatile int* flag, unsigned long long ns, int* result) {
  unsigned long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (;;) {
    if (*flag != 0) { if (blockIdx.x == 0 && threadIdx.x == 0) *result = 1; return; }
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > ns) { if (blockIdx.x == 0 && threadIdx.x == 0) *result = 2; return; }
  }
}
