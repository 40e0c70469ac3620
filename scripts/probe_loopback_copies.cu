// Probe: how fast can the loopback transport's copies move one hop's bytes from GPU 0 to GPU 1?
//
// The loopback (csrc/transport/loopback.cpp) gives each proxy thread one non-blocking stream; a write is a
// cudaMemcpyAsync plus an event, and a thread keeps at most `window` writes in flight, polling the oldest event and
// posting the next write when it lands. This probe does exactly that with `threads` host threads, one stream each,
// in one process (peer access on), for a grid of chunk sizes and windows, and prints GB/s beside one whole copy of
// the same bytes (the bench's "raw copy"). It tells the copy engine's per-transfer cost apart from the proxy's.
//
// Build and run on a GPU machine with two GPUs:
//   nvcc -O2 -std=c++17 -o /tmp/probe scripts/probe_loopback_copies.cu && /tmp/probe
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <thread>
#include <vector>

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

static double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One run: `threads` threads split `bytes` into `chunk`-byte writes, chunk c to thread c % threads; each keeps at
// most `window` writes in flight (window 0: everything enqueued at once, no host round trip). Returns microseconds.
static double run(char* dst, const char* src, size_t bytes, size_t chunk, int threads, int window) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<double> end(threads);
  std::vector<std::thread> ts;
  const size_t nchunks = (bytes + chunk - 1) / chunk;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      CHECK(cudaSetDevice(0));
      cudaStream_t s;
      CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      std::vector<cudaEvent_t> all(window > 0 ? window : 0), free_events;
      for (auto& e : all) CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      free_events = all;
      ready.fetch_add(1);
      while (!go.load()) {
      }
      std::deque<cudaEvent_t> inflight;
      for (size_t c = t; c < nchunks; c += threads) {
        const size_t off = c * chunk, n = std::min(chunk, bytes - off);
        if (window > 0) {
          while (int(inflight.size()) >= window) {  // poll the oldest, as the loopback's complete() does
            if (cudaEventQuery(inflight.front()) == cudaSuccess) {
              free_events.push_back(inflight.front());
              inflight.pop_front();
            }
          }
        }
        CHECK(cudaMemcpyAsync(dst + off, src + off, n, cudaMemcpyDefault, s));
        if (window > 0) {
          cudaEvent_t e = free_events.back();
          free_events.pop_back();
          CHECK(cudaEventRecord(e, s));
          inflight.push_back(e);
        }
      }
      CHECK(cudaStreamSynchronize(s));
      end[t] = now_us();
      for (auto& e : all) CHECK(cudaEventDestroy(e));
      CHECK(cudaStreamDestroy(s));
    });
  while (ready.load() < threads) {
  }
  const double t0 = now_us();
  go.store(true);
  for (auto& th : ts) th.join();
  double last = 0;
  for (double e : end) last = std::max(last, e);
  return last - t0;
}

int main() {
  int n = 0;
  CHECK(cudaGetDeviceCount(&n));
  if (n < 2) {
    std::fprintf(stderr, "needs two GPUs\n");
    return 1;
  }
  const size_t bytes = 58433536;  // one hop of the headline bench (4096 tokens, hidden 7168, top-8, 2 nodes x 1)
  char *src, *dst;
  CHECK(cudaSetDevice(1));
  CHECK(cudaMalloc(&dst, bytes));
  CHECK(cudaSetDevice(0));
  CHECK(cudaDeviceEnablePeerAccess(1, 0));
  CHECK(cudaMalloc(&src, bytes));
  CHECK(cudaMemset(src, 1, bytes));
  auto best = [&](size_t chunk, int threads, int window) {
    double b = 1e30;
    for (int i = 0; i < 5; ++i) b = std::min(b, run(dst, src, bytes, chunk, threads, window));
    return b;
  };
  const double whole = best(bytes, 1, 0);
  std::printf("one copy of %zu bytes: %.1f us, %.1f GB/s\n", bytes, whole, bytes / whole / 1e3);
  std::printf("%8s %7s %6s %9s %8s %6s\n", "chunk", "threads", "window", "us", "GB/s", "ratio");
  for (size_t chunk : {256u << 10, 512u << 10, 1u << 20, 2u << 20, 4u << 20})
    for (int threads : {1, 4, 8})
      for (int window : {0, 1, 4, 16}) {
        const double us = best(chunk, threads, window);
        std::printf("%7zuK %7d %6d %9.1f %8.1f %6.2f\n", chunk >> 10, threads, window, us, bytes / us / 1e3,
                    whole / us);
      }
  return 0;
}
