#include "kernels/fifo_bench.hpp"

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "proxy/errors.hpp"

namespace uccl_ep {
namespace {

__global__ void fifo_bench_kernel(const DeviceFifo* fifos, uint64_t n, int dst_rank, uint64_t timeout_ns,
                                  int* failed) {
  if (threadIdx.x != 0) return;
  const DeviceFifo f = fifos[blockIdx.x];
  Command c;
  encode_write_signal(&c, uint32_t(dst_rank), 16, 16 * blockIdx.x, 16 * blockIdx.x, blockIdx.x, 1);
  for (uint64_t i = 0; i < n; ++i) {
    if (fifo_push(f, c, timeout_ns) == kFifoPushTimedOut) {
      atomicExch(failed, 1);
      return;
    }
  }
  Command q;
  encode_control(&q, kCmdQuiet);
  const unsigned long long idx = fifo_push(f, q, timeout_ns);
  if (idx == kFifoPushTimedOut || !fifo_wait_done(f, idx, timeout_ns)) atomicExch(failed, 1);
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw ProxyError(std::string("fifo bench: ") + what + ": " + cudaGetErrorString(e));
}

}  // namespace

double launch_fifo_bench(const DeviceFifo* fifos, int num_fifos, uint64_t commands_per_fifo, int dst_rank,
                         uint64_t timeout_ns) {
  if (num_fifos < 1) throw ProxyError("fifo bench: need at least one FIFO");
  DeviceFifo* d_fifos = nullptr;
  int* d_failed = nullptr;
  cudaEvent_t start, stop;
  check(cudaMalloc(&d_fifos, sizeof(DeviceFifo) * num_fifos), "cudaMalloc");
  check(cudaMalloc(&d_failed, sizeof(int)), "cudaMalloc");
  check(cudaMemset(d_failed, 0, sizeof(int)), "cudaMemset");
  check(cudaMemcpy(d_fifos, fifos, sizeof(DeviceFifo) * num_fifos, cudaMemcpyHostToDevice), "cudaMemcpy");
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  check(cudaEventRecord(start), "cudaEventRecord");
  fifo_bench_kernel<<<num_fifos, 32>>>(d_fifos, commands_per_fifo, dst_rank, timeout_ns, d_failed);
  check(cudaGetLastError(), "kernel launch");
  check(cudaEventRecord(stop), "cudaEventRecord");
  check(cudaEventSynchronize(stop), "kernel");
  float ms = 0;
  int failed = 0;
  check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  check(cudaMemcpy(&failed, d_failed, sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(d_fifos);
  cudaFree(d_failed);
  if (failed) throw TimeoutError("fifo bench: a GPU producer passed its deadline (FIFO full or quiet not done)");
  return ms / 1e3;
}

}  // namespace uccl_ep
