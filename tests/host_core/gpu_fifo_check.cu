// GPU producers -> host consumer through the real device push path (uccl_ep/fifo_device.cuh) and host Fifo.
// Built and run by test_gpu_fifo.py on a CUDA machine: checks no loss, no duplicate, per-producer order, then
// prints the drain rate for 1..4 FIFOs (one producer block each, one consumer thread per FIFO).
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "proxy/fifo.hpp"
#include "uccl_ep/fifo_device.cuh"

using namespace uccl_ep;

__global__ void produce(DeviceFifo f, uint64_t n, int* failed, bool release = true) {
  if (threadIdx.x != 0) return;
  for (uint64_t i = 0; i < n; ++i) {
    Command c;
    encode_write(&c, blockIdx.x, 16, 0, (i % (1u << 27)) * 16);
    if (!release && i % 64 == 0) __threadfence_system();
    if (fifo_push(f, c, 10'000'000'000ull, release) == kFifoPushTimedOut) { atomicExch(failed, 1); return; }
  }
}

static bool drain(Fifo& q, int producers, uint64_t n, uint64_t* bad) {
  std::vector<uint64_t> next(producers, 0);
  uint64_t got = 0, total = n * producers;
  auto t0 = std::chrono::steady_clock::now();
  Command c;
  while (got < total) {
    if (!q.peek(&c)) {
      if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(60)) return false;
      continue;
    }
    CommandFields f = decode(c);
    q.pop();
    ++got;
    if (f.type != kCmdWrite || f.dst_rank >= uint32_t(producers) || f.remote_offset / 16 != next[f.dst_rank] % (1u << 27)) ++*bad;
    else ++next[f.dst_rank];
  }
  return true;
}

int main() {
  int* failed;
  cudaMalloc(&failed, sizeof(int));
  cudaMemset(failed, 0, sizeof(int));
  // correctness: 8 GPU producers share one small ring
  {
    Fifo q(64, 0, 0);
    if (!q.device_mapped()) { printf("FAIL: ring not device-mapped\n"); return 1; }
    const uint64_t n = 200000;
    produce<<<8, 32>>>(q.device_view(), n, failed);
    uint64_t bad = 0;
    bool ok = drain(q, 8, n, &bad);
    cudaDeviceSynchronize();
    int f = 0;
    cudaMemcpy(&f, failed, sizeof(int), cudaMemcpyDeviceToHost);
    printf("correctness: drained=%d bad=%llu device_timeout=%d\n", ok, (unsigned long long)bad, f);
    if (!ok || bad || f) { printf("FAIL\n"); return 1; }
  }
  for (int mode = 0; mode < 2; ++mode)
  for (int nf = 1; nf <= 4; nf *= 2) {
    const uint64_t n = 2'000'000;
    std::vector<std::unique_ptr<Fifo>> qs;
    std::vector<cudaStream_t> st(nf);
    for (int i = 0; i < nf; ++i) { qs.emplace_back(new Fifo(2048, 0, i)); cudaStreamCreate(&st[i]); }
    std::vector<DeviceFifo> views;
    for (auto& q : qs) views.push_back(q->device_view());
    std::atomic<uint64_t> bad{0};
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> th;
    for (int i = 0; i < nf; ++i) {
      produce<<<1, 32, 0, st[i]>>>(views[i], n, failed, mode == 0);
      th.emplace_back([&, i] { uint64_t b = 0; drain(*qs[i], 1, n, &b); bad += b; });
    }
    for (auto& t : th) t.join();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    cudaDeviceSynchronize();
    printf("%s fifos=%d commands=%llu seconds=%.4f Mcmd_per_s_total=%.2f per_fifo=%.2f bad=%llu\n",
           mode == 0 ? "release-store" : "relaxed-store+fence/64", nf,
           (unsigned long long)(n * nf), s, n * nf / s / 1e6, n / s / 1e6, (unsigned long long)bad.load());
    if (bad) { printf("FAIL\n"); return 1; }
  }
  printf("PASS\n");
  return 0;
}
