// Two processes share one GPU, as two emulated nodes' ranks do under UCCL_EP_TEST_SHARE_GPU=1 (docs/internode.md,
// "Drains"). Each spins a kernel on a flag in its own memory; a proxy thread of each copies into the peer's flag
// through a CUDA IPC mapping 300 ms later, as the loopback transport does. The main thread of each queues one host
// call behind its spinning kernel (as the host does when it does not drain). Printed per call: whether each spinner
// saw its flag, and when each proxy's copy landed. Run it with and without MPS.
// Build and run on a GPU machine:
//   nvcc -O2 -std=c++17 -arch=sm_90 -o /tmp/probe2 scripts/probe_two_process_copies.cu && /tmp/probe2
// PROBE_SPIN_BLOCKS=N (default 1): blocks of 128 threads in each spinning grid; PROBE_COPY_BYTES=N: bytes each
// proxy copies into the peer before the flag (default 0).
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "probe_common.cuh"
__global__ void noop(int* p) { if (p[0] == 12345) p[1] = 0; }

static void wait_stream(cudaStream_t s, const char* what, int me) {
  const std::string who = "probe2 process " + std::to_string(me);
  wait_done([&] { return cudaStreamQuery(s); }, who.c_str(), what);
}
static void put(int fd, const void* p, size_t n) {
  if (write(fd, p, n) != ssize_t(n)) { std::perror("write"); std::exit(3); }
}
static void get(int fd, void* p, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, static_cast<char*>(p) + got, n - got);
    if (r <= 0) { std::fprintf(stderr, "probe2: pipe closed\n"); std::exit(3); }
    got += size_t(r);
  }
}

static const char* kNames[] = {"nothing (host polls the stream)", "kernel launch on the spinning stream",
                               "pageable D2H cudaMemcpyAsync + sync (torch .cpu())",
                               "pageable H2D 1 MiB cudaMemcpyAsync + sync (torch .to(cuda))",
                               "pinned H2D 4 B cudaMemcpyAsync, then sync", "D2D 1 MiB cudaMemcpyAsync, then sync",
                               "cudaMemsetAsync 1 MiB, then sync",
                               "pageable D2H 48 KiB cudaMemcpyAsync + sync (torch .cpu() of a 96 x 256 bf16 tensor)"};
static const int kCases = sizeof(kNames) / sizeof(kNames[0]);

// Every case ends within ~3.3 s (spinners give up after 3 s, stream waits after 30 s); the whole run within this.
static const unsigned kDeadlineSecs = 300;

// One process: `to_parent` carries its IPC handle and its per-case lines; `from_parent` the peer's handle and the go.
static void child(int me, int to_parent, int from_parent) {
  alarm(kDeadlineSecs);  // (alarms do not survive fork: each process arms its own)
  CK(cudaSetDevice(0));
  const int blocks = std::getenv("PROBE_SPIN_BLOCKS") ? std::atoi(std::getenv("PROBE_SPIN_BLOCKS")) : 1;
  const char* cb = std::getenv("PROBE_COPY_BYTES");
  const size_t copy_bytes = cb ? std::strtoull(cb, nullptr, 10) : 0;
  char* area;  // [flag 4 B | pad | copy landing zone]
  const size_t area_bytes = 4096 + copy_bytes;
  CK(cudaMalloc(&area, area_bytes));
  int *one, *result, *pinned;
  CK(cudaMalloc(&one, 4)); CK(cudaMalloc(&result, 4));
  CK(cudaHostAlloc(&pinned, 4, cudaHostAllocDefault));
  const int v1 = 1; CK(cudaMemcpy(one, &v1, 4, cudaMemcpyHostToDevice));
  void* src = nullptr; if (copy_bytes) CK(cudaMalloc(&src, copy_bytes));
  void* big; CK(cudaMalloc(&big, 2 << 20));
  std::vector<char> host(1 << 20);
  cudaIpcMemHandle_t mine, theirs;
  CK(cudaIpcGetMemHandle(&mine, area));
  put(to_parent, &mine, sizeof mine);
  get(from_parent, &theirs, sizeof theirs);
  char* peer;
  CK(cudaIpcOpenMemHandle(reinterpret_cast<void**>(&peer), theirs, cudaIpcMemLazyEnablePeerAccess));
  cudaStream_t s, proxy;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&proxy, cudaStreamNonBlocking));
  noop<<<1, 1, 0, s>>>(result); CK(cudaStreamSynchronize(s));
  for (int v = 0; v < kCases; ++v) {
    CK(cudaMemset(area, 0, 4)); CK(cudaMemset(result, 0, 4)); CK(cudaDeviceSynchronize());
    char go;
    put(to_parent, "r", 1); get(from_parent, &go, 1);  // both processes start the case together
    const double t0 = now_ms();
    spin<<<blocks, 128, 0, s>>>(reinterpret_cast<volatile int*>(area), 3000000000ull, result);
    CK(cudaGetLastError());
    std::atomic<double> done_ms{-1};
    std::thread px([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      if (copy_bytes) CK(cudaMemcpyAsync(peer + 4096, src, copy_bytes, cudaMemcpyDeviceToDevice, proxy));
      CK(cudaMemcpyAsync(peer, one, 4, cudaMemcpyDeviceToDevice, proxy));
      wait_stream(proxy, "the proxy's copy", me);
      done_ms = now_ms() - t0;
    });
    int hr = 0;
    switch (v) {
      case 0: wait_stream(s, "the spinning kernel", me); break;
      case 1: noop<<<1, 1, 0, s>>>(result); CK(cudaStreamSynchronize(s)); break;
      case 2: CK(cudaMemcpyAsync(&hr, result, 4, cudaMemcpyDeviceToHost, s)); CK(cudaStreamSynchronize(s)); break;
      case 3: CK(cudaMemcpyAsync(big, host.data(), 1 << 20, cudaMemcpyHostToDevice, s));
              CK(cudaStreamSynchronize(s)); break;
      case 4: CK(cudaMemcpyAsync(big, pinned, 4, cudaMemcpyHostToDevice, s)); CK(cudaStreamSynchronize(s)); break;
      case 5: CK(cudaMemcpyAsync(big, static_cast<char*>(big) + (1 << 20), 1 << 20, cudaMemcpyDeviceToDevice, s));
              CK(cudaStreamSynchronize(s)); break;
      case 6: CK(cudaMemsetAsync(big, 0, 1 << 20, s)); CK(cudaStreamSynchronize(s)); break;
      case 7: CK(cudaMemcpyAsync(host.data(), big, 48 << 10, cudaMemcpyDeviceToHost, s));
              CK(cudaStreamSynchronize(s)); break;
    }
    const double main_ms = now_ms() - t0;
    px.join();
    CK(cudaStreamSynchronize(s));
    int r = 0; CK(cudaMemcpy(&r, result, 4, cudaMemcpyDeviceToHost));
    char line[256];
    std::snprintf(line, sizeof line,
                  "  process %d: spinner %-8s main back at %7.1f ms, its proxy's copy landed at %7.1f ms\n", me,
                  r == 1 ? "saw-flag" : "GAVE-UP", main_ms, done_ms.load());
    put(to_parent, line, sizeof line);
  }
  CK(cudaIpcCloseMemHandle(peer));
  std::exit(0);
}

int main() {
  alarm(kDeadlineSecs);  // a process stuck in a CUDA call or a pipe read ends with SIGALRM instead of hanging
  int up[2][2], down[2][2];
  pid_t pids[2];
  for (int i = 0; i < 2; ++i) {
    if (pipe(up[i]) || pipe(down[i])) { std::perror("pipe"); return 1; }
    pids[i] = fork();
    if (pids[i] == 0) child(i, up[i][1], down[i][0]);  // CUDA starts only in the children
  }
  cudaIpcMemHandle_t h[2];
  for (int i = 0; i < 2; ++i) get(up[i][0], &h[i], sizeof h[i]);
  for (int i = 0; i < 2; ++i) put(down[i][1], &h[1 - i], sizeof h[i]);
  std::printf("two processes on GPU 0, spinning grids of %s blocks, %s bytes before each flag\n",
              std::getenv("PROBE_SPIN_BLOCKS") ? std::getenv("PROBE_SPIN_BLOCKS") : "1",
              std::getenv("PROBE_COPY_BYTES") ? std::getenv("PROBE_COPY_BYTES") : "0");
  for (int v = 0; v < kCases; ++v) {
    char c;
    for (int i = 0; i < 2; ++i) get(up[i][0], &c, 1);
    for (int i = 0; i < 2; ++i) put(down[i][1], "g", 1);
    std::printf("%s\n", kNames[v]);
    for (int i = 0; i < 2; ++i) { char line[256]; get(up[i][0], line, sizeof line); std::fputs(line, stdout); }
    std::fflush(stdout);
  }
  int bad = 0;
  for (int i = 0; i < 2; ++i) { int st = 0; waitpid(pids[i], &st, 0); bad |= !(WIFEXITED(st) && WEXITSTATUS(st) == 0); }
  return bad;
}
