// Which host CUDA calls, made by the main thread while one of our kernels spins, hold up a copy that another host
// thread (the loopback proxy) issues -- the copy the spinning kernel waits for (docs/internode.md, "Drains").
// Build and run on a GPU machine: nvcc -O2 -std=c++17 -o /tmp/probe scripts/probe_blocking_calls.cu && /tmp/probe
// (PROBE_COPY_BYTES=N: the stream-sharing part copies N bytes on the proxy stream before the flag; PROBE_PROXY and
// PROBE_CASES, PROBE_LEGACY below: what the proxy thread does, which of the main thread's calls are tried, and on
// which stream the spinner and those calls run)
#include <cuda_runtime.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "probe_common.cuh"
static void wait_stream(cudaStream_t s, const char* what) {
  wait_done([&] { return cudaStreamQuery(s); }, "probe", what);
}

__global__ void noop(int* p) { if (p[0] == 12345) p[1] = 0; }
__global__ void copy_word(int* to, const int* from) { *to = *from; }  // PROBE_PROXY=5: a copy made by a kernel

int main() {
  CK(cudaSetDevice(0));
  int *flag, *one, *result, *pinned;
  CK(cudaMalloc(&flag, 4)); CK(cudaMalloc(&one, 4)); CK(cudaMalloc(&result, 4));
  CK(cudaHostAlloc(&pinned, 4, cudaHostAllocDefault));
  void* pinned_big; CK(cudaHostAlloc(&pinned_big, 1 << 20, cudaHostAllocDefault));
  const int v1 = 1; CK(cudaMemcpy(one, &v1, 4, cudaMemcpyHostToDevice));
  std::vector<char> big_host(64 << 20);
  void* big_dev; CK(cudaMalloc(&big_dev, 64 << 20));
  cudaStream_t s, proxy;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // PROBE_LEGACY=1: the spinner and the main thread's calls go to the legacy default stream, as torch's do
  // PROBE_LEGACY=2: the spinner on a stream of its own, and the legacy stream waits for it through an event (a
  // library that spins on a side stream, as DeepEP's comm stream) before the main thread's calls go there
  const int legacy = std::getenv("PROBE_LEGACY") ? std::atoi(std::getenv("PROBE_LEGACY")) : 0;
  // 3: both on a blocking stream (cudaStreamCreate's default flags); 4: both on the per-thread default stream
  if (legacy == 1 || legacy == 2) s = cudaStreamLegacy;
  if (legacy == 3) CK(cudaStreamCreateWithFlags(&s, cudaStreamDefault));
  if (legacy == 4) s = cudaStreamPerThread;
  cudaStream_t spin_stream = s;
  if (legacy == 2) CK(cudaStreamCreateWithFlags(&spin_stream, cudaStreamNonBlocking));
  cudaEvent_t spun; CK(cudaEventCreateWithFlags(&spun, cudaEventDisableTiming));
  CK(cudaStreamCreateWithFlags(&proxy, cudaStreamNonBlocking));
  noop<<<1, 1, 0, s>>>(result); CK(cudaStreamSynchronize(s));  // modules loaded before any probe

  const char* names[] = {"poll (cudaStreamQuery loop)", "pageable D2H cudaMemcpyAsync (torch .cpu())",
                         "pageable D2H cudaMemcpy (legacy stream)", "pinned D2H cudaMemcpyAsync + cudaStreamSynchronize",
                         "cudaStreamSynchronize", "cudaMalloc 256 MiB + cudaFree", "cudaMalloc 256 MiB (kept)",
                         "kernel launch on the spinning stream", "pageable H2D cudaMemcpyAsync 64 MiB on the spinning stream",
                         "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaHostAlloc 64 MiB + cudaFreeHost",
                         "cudaHostAlloc 64 MiB (kept)", "cudaHostRegister + cudaHostUnregister 64 MiB",
                         "cudaEventCreate + cudaEventDestroy", "cudaStreamCreate + cudaStreamDestroy (idle stream)",
                         "cudaMemset (synchronous)", "cudaMemsetAsync on another stream + its sync",
                         "cudaMallocAsync + cudaFreeAsync on another stream", "cudaIpcGetMemHandle",
                         "pinned H2D cudaMemcpyAsync 4 B on the spinning stream",
                         "D2D cudaMemcpyAsync 1 MiB on the spinning stream (torch copy_)",
                         "cudaMemsetAsync 1 MiB on the spinning stream",
                         "pageable D2H cudaMemcpyAsync 48 KiB on the spinning stream + sync",
                         "pageable D2H cudaMemcpyAsync 1 MiB on the spinning stream + sync",
                         "pageable H2D cudaMemcpyAsync 56 KiB on the spinning stream + sync",
                         "pinned D2H cudaMemcpyAsync 1 MiB on the spinning stream + sync"};
  const int n = sizeof(names) / sizeof(names[0]);
  const unsigned long long spin_ns = 3000000000ull;  // the spinner gives up after 3 s
  const double proxy_after_ms = 300;                 // the proxy copies the flag 300 ms after the spinner starts
  std::vector<void*> kept;
  // PROBE_PROXY: what the proxy thread does. 0: a copy and stream queries; 1: the copy, an event recorded behind
  // it (made before the spin) and event queries, as the loopback does; 2: as 1 with the event created in the post;
  // 3: as 2 after a cudaSetDevice (a proxy thread's first post); 4: as 1 with the copy's direction left to the driver
  // (cudaMemcpyDefault, as the loopback did until session 35); 5: as 1 with the copy made by a kernel launch.
  const int proxy_mode = std::getenv("PROBE_PROXY") ? std::atoi(std::getenv("PROBE_PROXY")) : 0;
  cudaEvent_t kept_event; CK(cudaEventCreateWithFlags(&kept_event, cudaEventDisableTiming));
  // PROBE_CASES: a comma-separated list of the main thread's calls to try (default: all)
  std::vector<bool> chosen(n, std::getenv("PROBE_CASES") == nullptr);
  if (const char* c = std::getenv("PROBE_CASES"))
    for (const char* p = c; *p;) { const int v = std::atoi(p); if (v >= 0 && v < n) chosen[v] = true;
      while (*p && *p != ',') ++p; if (*p) ++p; }
  std::printf("proxy thread: PROBE_PROXY=%d, main stream %s\n", proxy_mode,
              legacy == 2   ? "legacy, waiting for the spinner's stream"
              : legacy == 1 ? "legacy"
              : legacy == 3 ? "blocking"
              : legacy == 4 ? "per-thread default"
                            : "non-blocking");
  for (int v = 0; v < n; ++v) {
    if (!chosen[v]) continue;
    CK(cudaMemset(flag, 0, 4)); CK(cudaMemset(result, 0, 4)); CK(cudaDeviceSynchronize());
    std::atomic<double> call_ms{-1}, done_ms{-1};
    const double t0 = now_ms();
    spin<<<1, 1, 0, spin_stream>>>(flag, spin_ns, result);
    CK(cudaGetLastError());
    if (spin_stream != s) { CK(cudaEventRecord(spun, spin_stream)); CK(cudaStreamWaitEvent(s, spun, 0)); }
    std::thread px([&] {
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(proxy_after_ms));
      const double a = now_ms();
      if (proxy_mode == 0) {
        CK(cudaMemcpyAsync(flag, one, 4, cudaMemcpyDeviceToDevice, proxy));  // the proxy's "network write"
        call_ms = now_ms() - a;
        wait_stream(proxy, "the proxy's copy");
      } else {  // the loopback's post and poll: [device bind,] [event creation,] copy, event record; event queries
        if (proxy_mode == 3) CK(cudaSetDevice(0));
        cudaEvent_t e = kept_event;
        const bool made = proxy_mode == 2 || proxy_mode == 3;
        if (made) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        if (proxy_mode == 5) {
          copy_word<<<1, 1, 0, proxy>>>(flag, one);
          CK(cudaGetLastError());
        } else {
          CK(cudaMemcpyAsync(flag, one, 4, proxy_mode == 4 ? cudaMemcpyDefault : cudaMemcpyDeviceToDevice, proxy));
        }
        CK(cudaEventRecord(e, proxy));
        call_ms = now_ms() - a;
        wait_done([&] { return cudaEventQuery(e); }, "probe", "the proxy's event");
        if (made) CK(cudaEventDestroy(e));
      }
      done_ms = now_ms() - t0;
    });
    int host_result = 0;
    cudaEvent_t ev; CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    switch (v) {
      case 0: wait_stream(s, "the spinning kernel"); break;
      case 1: CK(cudaMemcpyAsync(&host_result, result, 4, cudaMemcpyDeviceToHost, s)); CK(cudaStreamSynchronize(s)); break;
      case 2: CK(cudaMemcpy(&host_result, result, 4, cudaMemcpyDeviceToHost)); break;
      case 3: CK(cudaMemcpyAsync(pinned, result, 4, cudaMemcpyDeviceToHost, s)); CK(cudaStreamSynchronize(s)); break;
      case 4: CK(cudaStreamSynchronize(s)); break;
      case 5: { void* p; CK(cudaMalloc(&p, 256 << 20)); CK(cudaFree(p)); CK(cudaStreamSynchronize(s)); break; }
      case 6: { void* p; CK(cudaMalloc(&p, 256 << 20)); kept.push_back(p); CK(cudaStreamSynchronize(s)); break; }
      case 7: noop<<<1, 1, 0, s>>>(result); CK(cudaStreamSynchronize(s)); break;
      case 8: CK(cudaMemcpyAsync(big_dev, big_host.data(), 64 << 20, cudaMemcpyHostToDevice, s)); CK(cudaStreamSynchronize(s)); break;
      case 9: CK(cudaDeviceSynchronize()); break;
      case 10: CK(cudaEventRecord(ev, s)); CK(cudaEventSynchronize(ev)); break;
      case 11: { void* p; CK(cudaHostAlloc(&p, 64 << 20, cudaHostAllocDefault)); CK(cudaFreeHost(p)); CK(cudaStreamSynchronize(s)); break; }
      case 12: { void* p; CK(cudaHostAlloc(&p, 64 << 20, cudaHostAllocDefault)); CK(cudaStreamSynchronize(s)); break; }
      case 13: CK(cudaHostRegister(big_host.data(), 64 << 20, cudaHostRegisterDefault)); CK(cudaHostUnregister(big_host.data()));
               CK(cudaStreamSynchronize(s)); break;
      case 14: { cudaEvent_t e; CK(cudaEventCreate(&e)); CK(cudaEventDestroy(e)); CK(cudaStreamSynchronize(s)); break; }
      case 15: { cudaStream_t t; CK(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking)); CK(cudaStreamDestroy(t));
                 CK(cudaStreamSynchronize(s)); break; }
      case 16: CK(cudaMemset(big_dev, 0, 1 << 20)); CK(cudaStreamSynchronize(s)); break;
      case 17: { cudaStream_t t; CK(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking)); CK(cudaMemsetAsync(big_dev, 0, 1 << 20, t));
                 CK(cudaStreamSynchronize(t)); CK(cudaStreamSynchronize(s)); break; }
      case 18: { cudaStream_t t; CK(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking)); void* p; CK(cudaMallocAsync(&p, 1 << 20, t));
                 CK(cudaFreeAsync(p, t)); CK(cudaStreamSynchronize(t)); CK(cudaStreamSynchronize(s)); break; }
      case 19: { cudaIpcMemHandle_t h; CK(cudaIpcGetMemHandle(&h, big_dev)); CK(cudaStreamSynchronize(s)); break; }
      case 20: CK(cudaMemcpyAsync(big_dev, pinned, 4, cudaMemcpyHostToDevice, s)); CK(cudaStreamSynchronize(s)); break;
      case 21: CK(cudaMemcpyAsync(big_dev, static_cast<char*>(big_dev) + (32 << 20), 1 << 20, cudaMemcpyDeviceToDevice, s));
               CK(cudaStreamSynchronize(s)); break;
      case 22: CK(cudaMemsetAsync(big_dev, 0, 1 << 20, s)); CK(cudaStreamSynchronize(s)); break;
      case 23: CK(cudaMemcpyAsync(big_host.data(), big_dev, 48 << 10, cudaMemcpyDeviceToHost, s));
               CK(cudaStreamSynchronize(s)); break;
      case 24: CK(cudaMemcpyAsync(big_host.data(), big_dev, 1 << 20, cudaMemcpyDeviceToHost, s));
               CK(cudaStreamSynchronize(s)); break;
      case 25: CK(cudaMemcpyAsync(big_dev, big_host.data(), 56 << 10, cudaMemcpyHostToDevice, s));
               CK(cudaStreamSynchronize(s)); break;
      case 26: CK(cudaMemcpyAsync(pinned_big, big_dev, 1 << 20, cudaMemcpyDeviceToHost, s));
               CK(cudaStreamSynchronize(s)); break;
    }
    const double main_ms = now_ms() - t0;
    px.join();
    CK(cudaStreamSynchronize(s)); CK(cudaStreamSynchronize(spin_stream));
    int r = 0; CK(cudaMemcpy(&r, result, 4, cudaMemcpyDeviceToHost));
    CK(cudaEventDestroy(ev));
    std::printf("%-58s spinner %-9s main back at %7.1f ms; proxy's post took %7.1f ms, copy done at %7.1f ms\n",
                names[v], r == 1 ? "saw-flag" : "GAVE-UP", main_ms, call_ms.load(), done_ms.load());
    std::fflush(stdout);
  }

  // Which streams share the proxy's hardware queue: a kernel queued behind a spinning one on stream i holds the
  // proxy's copy when stream i and the proxy's stream share a queue (CUDA_DEVICE_MAX_CONNECTIONS of them, assigned
  // as streams are created).
  std::vector<cudaStream_t> streams(24);
  for (auto& t : streams) CK(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking));
  cudaStream_t late_proxy; CK(cudaStreamCreateWithFlags(&late_proxy, cudaStreamNonBlocking));
  const size_t copy_bytes = std::getenv("PROBE_COPY_BYTES") ? std::strtoull(std::getenv("PROBE_COPY_BYTES"), nullptr, 10) : 0;
  void* copy_src = nullptr; void* copy_dst = nullptr;
  if (copy_bytes) { CK(cudaMalloc(&copy_src, copy_bytes)); CK(cudaMalloc(&copy_dst, copy_bytes)); }
  std::printf("streams created before the proxy's whose queued kernel holds its copy (%zu bytes before the flag):",
              copy_bytes);
  for (size_t i = 0; i < streams.size(); ++i) {
    CK(cudaMemset(flag, 0, 4)); CK(cudaDeviceSynchronize());
    spin<<<1, 1, 0, streams[i]>>>(flag, 1000000000ull, result);
    noop<<<1, 1, 0, streams[i]>>>(result);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const double a = now_ms();
    if (copy_bytes) CK(cudaMemcpyAsync(copy_dst, copy_src, copy_bytes, cudaMemcpyDeviceToDevice, late_proxy));
    CK(cudaMemcpyAsync(flag, one, 4, cudaMemcpyDeviceToDevice, late_proxy));
    wait_stream(late_proxy, "the proxy's copy behind a queued kernel");
    if (now_ms() - a > 500) std::printf(" %zu", i);
    CK(cudaDeviceSynchronize());
  }
  std::printf(" (of %zu)\n", streams.size());
  return 0;
}
