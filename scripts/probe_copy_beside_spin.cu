// Does a device-to-device copy on one GPU finish while kernels of the same process fill every SM?
// The loopback transport's copies become same-device copies when ranks share a GPU (one GPU playing two nodes); if
// the driver moves them with a kernel rather than a copy engine, our spinning readers can starve them.
// Build: nvcc -O2 -std=c++17 -o /tmp/probe_spin scripts/probe_copy_beside_spin.cu && /tmp/probe_spin
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <thread>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  std::printf("%s failed: %s\n", #x, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void spin(volatile int* release, long long max_cycles) {
  const long long t0 = clock64();
  while (!*release && clock64() - t0 < max_cycles) {}
}

using Clock = std::chrono::steady_clock;

// Queue one copy with `how`, then poll its event for up to 300 ms while `sms` x `per_sm` spinning blocks run:
// microseconds to finish, or -1.
template <class Copy>
double copy_while_held(const char* name, int sms, int per_sm, Copy how) {
  int* release = nullptr;
  cudaHostAlloc(&release, sizeof(int), cudaHostAllocMapped);
  *release = 0;
  int* dev_release = nullptr;
  cudaHostGetDevicePointer(&dev_release, release, 0);
  cudaStream_t ks, cs;
  cudaStreamCreateWithFlags(&ks, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking);
  spin<<<sms * per_sm, 1024, 0, ks>>>(dev_release, 4'000'000'000ll);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the spinners are resident
  cudaEvent_t ev;
  cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  const auto t0 = Clock::now();
  cudaError_t e = how(cs);
  cudaEventRecord(ev, cs);
  double us = -1;
  while (std::chrono::duration<double>(Clock::now() - t0).count() < 0.3) {
    if (cudaEventQuery(ev) == cudaSuccess) {
      us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      break;
    }
  }
  *release = 1;
  cudaDeviceSynchronize();
  std::printf("%-58s %s: %s\n", name, e == cudaSuccess ? "queued" : cudaGetErrorString(e),
              us < 0 ? "NOT finished within 300 ms while the spinning grid ran" : "finished while the spinning grid ran");
  if (us >= 0) std::printf("    after %.0f us\n", us);
  cudaEventDestroy(ev);
  cudaStreamDestroy(ks);
  cudaStreamDestroy(cs);
  cudaFreeHost(release);
  return us;
}

int main() {
  int dev = 0, sms = 0, per_sm = 0;
  CK(cudaSetDevice(dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, spin, 1024, 0));
  cudaDeviceProp p{};
  CK(cudaGetDeviceProperties(&p, dev));
  std::printf("%s: %d SMs, %d spinning blocks of 1024 threads each\n", p.name, sms, per_sm);
  const size_t bytes = 512 << 10;
  char *a = nullptr, *b = nullptr;
  CK(cudaMalloc(&a, 64 << 20));
  CK(cudaMalloc(&b, 64 << 20));
  copy_while_held("cudaMemcpyAsync device to device, 512 KiB", sms, per_sm,
                  [&](cudaStream_t s) { return cudaMemcpyAsync(b, a, bytes, cudaMemcpyDefault, s); });
  copy_while_held("cudaMemcpyBatchAsync + PreferOverlapWithCompute, 512 KiB", sms, per_sm, [&](cudaStream_t s) {
    void* dsts[1] = {b};
    const void* srcs[1] = {a};
    size_t sizes[1] = {bytes}, idx[1] = {0};
    cudaMemcpyAttributes at{};
    at.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    at.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    return cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &at, idx, 1, s);
  });
  // the control: a spinning grid of one block leaves the copy 131 free SMs
  copy_while_held("cudaMemcpyAsync device to device, 512 KiB, one SM held", 1, 1,
                  [&](cudaStream_t s) { return cudaMemcpyAsync(b, a, bytes, cudaMemcpyDefault, s); });
  return 0;
}
