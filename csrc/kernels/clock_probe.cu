// The GPU timer against the host's steady clock (clock_probe.hpp).
#include "kernels/clock_probe.hpp"

#include <chrono>
#include <stdexcept>
#include <string>

#include "uccl_ep/portability.cuh"

namespace uccl_ep::internode {
namespace {

constexpr uint64_t kProbeWaitNs = 1'000'000'000ull;

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

// words[0]: the host's go flag; words[1]: the kernel is running; words[2]: the timer when it saw the flag (0: gave up).
__global__ void clock_probe_kernel(volatile unsigned long long* words) {
  words[1] = 1;
  __threadfence_system();
  const uint64_t start = now_ns();
  uint64_t seen = 0;
  while (now_ns() - start < kProbeWaitNs) {
    if (words[0]) {
      seen = now_ns();
      break;
    }
  }
  words[2] = seen;
  __threadfence_system();
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error(std::string("gpu_timer_minus_steady_ns: ") + what + " failed: " + cudaGetErrorString(e));
  }
}

}  // namespace

ClockOffset gpu_timer_minus_steady_ns(int device, int rounds) {
  if (rounds < 1) throw std::invalid_argument("gpu_timer_minus_steady_ns: rounds must be >= 1");
  int previous = 0;
  check(cudaGetDevice(&previous), "cudaGetDevice");
  unsigned long long* host = nullptr;
  cudaStream_t stream = nullptr;
  ClockOffset best{0, -1};
  std::string failure;
  try {
    check(cudaSetDevice(device), "cudaSetDevice");
    check(cudaHostAlloc(reinterpret_cast<void**>(&host), 3 * sizeof(unsigned long long), cudaHostAllocMapped),
          "cudaHostAlloc");
    volatile unsigned long long* w = host;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    unsigned long long* dev = nullptr;
    check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), host, 0), "cudaHostGetDevicePointer");
    for (int r = 0; r < rounds; ++r) {
      w[0] = w[1] = w[2] = 0;
      clock_probe_kernel<<<1, 1, 0, stream>>>(dev);
      check(cudaGetLastError(), "probe launch");
      const int64_t deadline = steady_ns() + int64_t(kProbeWaitNs);
      while (!w[1] && steady_ns() < deadline) {
      }
      if (!w[1]) throw std::runtime_error("gpu_timer_minus_steady_ns: the probe kernel did not start within 1 s "
                                          "(is the device busy?)");
      const int64_t before = steady_ns();
      w[0] = 1;
      while (!w[2] && steady_ns() < deadline + int64_t(kProbeWaitNs)) {
      }
      const int64_t after = steady_ns();
      check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      if (!w[2]) throw std::runtime_error("gpu_timer_minus_steady_ns: the probe kernel never saw the host's flag");
      const int64_t half = (after - before) / 2;
      if (best.error_ns < 0 || half < best.error_ns)
        best = ClockOffset{int64_t(w[2]) - (before + half), half};
    }
  } catch (const std::exception& e) {
    failure = e.what();
  }
  if (stream) {
    (void)cudaStreamSynchronize(stream);  // the probe gives up within its own second
    (void)cudaStreamDestroy(stream);
  }
  if (host) (void)cudaFreeHost(host);
  (void)cudaSetDevice(previous);  // the caller's thread keeps its current device
  if (!failure.empty()) throw std::runtime_error(failure);
  return best;
}

}  // namespace uccl_ep::internode
