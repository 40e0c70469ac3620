// portability.cuh first: under hipcc it brings in the HIP runtime the FIFO headers' __forceinline__ needs.
#include "uccl_ep/portability.cuh"

#include "kernels/fifo_bench.hpp"

#include <atomic>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "proxy/errors.hpp"

// The bench is bound only in CUDA builds (its launcher uses CUDA events and host registration, which the HIP
// spelling layer does not cover); a HIP build compiles this file to nothing.
#if defined(UCCL_EP_CUDA)

namespace uccl_ep {
namespace {

constexpr bool warp_push(PushVariant v) { return v == PushVariant::kWarp || v == PushVariant::kWriterWarp; }
constexpr bool owner_push(PushVariant v) { return v == PushVariant::kWriter || v == PushVariant::kWriterWarp; }

// One push of variant V. `has`: whether this lane has a command (warp variants; single-thread ones are called by one
// lane). `step` counts calls, for the single-thread fence cadence.
template <PushVariant V>
__device__ __forceinline__ unsigned long long push_one(const DeviceFifo& f, FifoWriter& w, uint64_t step,
                                                       const Command& c, bool has, uint64_t timeout_ns) {
  if constexpr (V == PushVariant::kPush) {
    return fifo_push(f, c, timeout_ns);
  } else if constexpr (V == PushVariant::kWarp) {
    return fifo_push_warp(f, c, has, timeout_ns, FifoOrder::kRelease);
  } else if constexpr (V == PushVariant::kWriter) {
    if (step % 32 == 0) fifo_publish_payload();
    return fifo_writer_push(f, w, c, timeout_ns, FifoOrder::kCallerFenced);
  } else {
    return fifo_writer_push_warp(f, w, c, has, timeout_ns, FifoOrder::kRelease);
  }
}

template <PushVariant V>
__device__ __forceinline__ void close_writer(const DeviceFifo& f, const FifoWriter& w) {
  if constexpr (V == PushVariant::kWriter) fifo_writer_close(f, w);
  if constexpr (V == PushVariant::kWriterWarp) fifo_writer_close_warp(f, w);
}

// Block b feeds FIFO b with one warp (single-thread variants: lane 0), then pushes a quiet and waits for it.
template <PushVariant V>
__global__ void fifo_bench_kernel(const DeviceFifo* fifos, uint64_t n, int dst_rank, uint64_t timeout_ns,
                                  int* failed) {
  const unsigned lane = threadIdx.x % 32;
  if (threadIdx.x >= 32 || (!warp_push(V) && lane != 0)) return;
  const DeviceFifo f = fifos[blockIdx.x];
  FifoWriter w{};
  if (owner_push(V)) w = fifo_writer_open(f);
  Command c;
  encode_write_signal(&c, uint32_t(dst_rank), 16, 16 * blockIdx.x, 16 * blockIdx.x, blockIdx.x, 1);
  const uint64_t per_call = warp_push(V) ? 32 : 1;
  for (uint64_t sent = 0, step = 0; sent < n; sent += per_call, ++step) {
    if (push_one<V>(f, w, step, c, sent + lane < n, timeout_ns) == kFifoPushTimedOut) {
      if (lane == 0) atomicExch(failed, 1);
      return;
    }
  }
  Command q;
  encode_control(&q, kCmdQuiet);
  unsigned long long idx = push_one<V>(f, w, 0, q, lane == 0, timeout_ns);
  if (idx == kFifoPushTimedOut) {
    if (lane == 0) atomicExch(failed, 1);
    return;
  }
  close_writer<V>(f, w);
  if (lane == 0 && !fifo_wait_done(f, idx, timeout_ns)) atomicExch(failed, 1);
}

// Several warps watch one host-mapped counter, each starting `stagger` ns after the previous one. Why: a GPU thread's
// acquire loads from host memory go one at a time, one PCIe round trip (~1 us) each, so a single poller notices a
// change on average a whole round trip after it landed; pollers whose loads are spread over the round trip notice it
// about half a round trip earlier. Every thread of the block calls it; returns the globaltimer value at which the
// first poller saw `*counter >= want`, or 0 after the deadline (the caller reports).
__device__ unsigned long long staggered_wait(const unsigned long long* counter, unsigned long long want,
                                             unsigned long long t0, unsigned long long stagger_ns,
                                             unsigned long long timeout_ns) {
  __shared__ unsigned long long s_seen_at;
  __shared__ int s_done;
  if (threadIdx.x == 0) {
    s_seen_at = ~0ull;
    s_done = 0;
  }
  __syncthreads();
  const unsigned warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    const unsigned long long start = t0 + warp * stagger_ns;
    while (fifo_now_ns() < start && !*reinterpret_cast<volatile int*>(&s_done)) {
    }
    while (!*reinterpret_cast<volatile int*>(&s_done)) {
      // Acquire loads, one PCIe round trip each. Relaxed polls with one fence at the end were tried and were much
      // worse (2x H200: 3.1 us with one watcher, 5 us with 4, 16 us with 16: unserialized polls flood the link).
      if (fifo_load_tail(counter) >= want) {
        atomicMin(&s_seen_at, fifo_now_ns());
        *reinterpret_cast<volatile int*>(&s_done) = 1;
        break;
      }
      if (fifo_now_ns() - t0 > timeout_ns) {
        *reinterpret_cast<volatile int*>(&s_done) = 1;
        break;
      }
    }
  }
  __syncthreads();
  const unsigned long long seen = s_seen_at;
  __syncthreads();  // s_seen_at is reset by the next call
  return seen == ~0ull ? 0 : seen;
}

// Warp 0 pushes (all its lanes for the warp variants); `blockDim.x / 32` warps watch the counter (staggered_wait).
template <PushVariant V>
__global__ void fifo_latency_kernel(DeviceFifo f, const unsigned long long* signal, int samples, int dst_rank,
                                    uint32_t slot, uint64_t timeout_ns, unsigned long long stagger_ns,
                                    unsigned long long* out, int* failed) {
  __shared__ unsigned long long s_t0;
  __shared__ int s_stop;
  const unsigned lane = threadIdx.x % 32;
  const bool pusher = threadIdx.x < 32 && (warp_push(V) || lane == 0);
  FifoWriter w{};
  if (pusher && owner_push(V)) w = fifo_writer_open(f);
  const unsigned long long base = fifo_load_tail(signal);
  Command c;
  encode_write_signal(&c, uint32_t(dst_rank), 16, 0, 4096, slot, 1);
  if (threadIdx.x == 0) s_stop = 0;
  for (int s = 0; s < samples; ++s) {
    const unsigned long long t0 = fifo_now_ns();
    if (pusher && push_one<V>(f, w, uint64_t(s), c, lane == 0, timeout_ns) == kFifoPushTimedOut && lane == 0) {
      atomicExch(failed, 1);
      s_stop = 1;
    }
    if (threadIdx.x == 0) s_t0 = t0;
    __syncthreads();
    // Read into a register before a second barrier: thread 0 may set s_stop again in the next round, and a barrier
    // some threads left early (return) is undefined.
    int stop = s_stop;
    __syncthreads();
    if (stop) return;
    const unsigned long long want = base + uint64_t(s) + 1;
    const unsigned long long seen = staggered_wait(signal, want, s_t0, stagger_ns, timeout_ns);
    if (threadIdx.x == 0) {
      if (seen == 0) {
        printf("uccl_ep: fifo latency bench: rank %d fifo %d signal slot %u is %llu, expected >= %llu after the "
               "deadline (is the proxy running?)\n", f.rank, f.fifo_id, slot, fifo_load_tail(signal), want);
        atomicExch(failed, 1);
        s_stop = 1;
      } else {
        out[s] = seen - s_t0;
      }
    }
    __syncthreads();
    stop = s_stop;
    __syncthreads();
    if (stop) return;
  }
  if (pusher) close_writer<V>(f, w);
}

// The floor under any GPU -> CPU -> GPU signal on this machine: the kernel stores `ping` into host memory, a host
// thread that spins on it copies it to `pong`, and the kernel watches `pong` the way the latency kernel watches a
// signal counter. No FIFO, no proxy, no transport. The store is relaxed, like a push whose payload fence was paid
// earlier (the `writer` variant): a system-scope release costs ~0.7 us more on an H200 (writer-warp vs writer).
__global__ void pcie_echo_kernel(unsigned long long* ping, const unsigned long long* pong, int samples,
                                 uint64_t timeout_ns, unsigned long long stagger_ns, unsigned long long* out,
                                 int* failed) {
  __shared__ unsigned long long s_t0;
  for (int s = 0; s < samples; ++s) {
    if (threadIdx.x == 0) {
      s_t0 = fifo_now_ns();
      asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(ping), "l"(uint64_t(s) + 1) : "memory");
    }
    __syncthreads();
    const unsigned long long seen = staggered_wait(pong, uint64_t(s) + 1, s_t0, stagger_ns, timeout_ns);
    if (threadIdx.x == 0) {
      if (seen == 0) {
        printf("uccl_ep: pcie echo: sample %d: the host echo word is %llu, expected >= %llu after the deadline (is "
               "the echo thread running?)\n", s, fifo_load_tail(pong), uint64_t(s) + 1);
        atomicExch(failed, 1);
      } else {
        out[s] = seen - s_t0;
      }
    }
    __syncthreads();
    if (*reinterpret_cast<volatile int*>(failed)) return;
  }
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw ProxyError(std::string("fifo bench: ") + what + ": " + cudaGetErrorString(e));
  }
}

template <PushVariant V>
void launch_bench(const DeviceFifo* d_fifos, int num_fifos, uint64_t n, int dst_rank, uint64_t timeout_ns,
                  int* d_failed) {
  fifo_bench_kernel<V><<<num_fifos, 32>>>(d_fifos, n, dst_rank, timeout_ns, d_failed);
}

// The stagger spreads the pollers' loads over about one PCIe read round trip (~1 us on PCIe Gen5).
unsigned long long stagger_for(int poll_warps) { return 1024ull / unsigned(poll_warps); }

void check_poll_warps(int poll_warps) {
  if (poll_warps < 1 || poll_warps > 32)
    throw std::invalid_argument("poll_warps must be 1..32 (warps of one block), got " + std::to_string(poll_warps));
}

template <PushVariant V>
void launch_latency(const DeviceFifo& f, const unsigned long long* signal, int samples, int dst_rank, uint32_t slot,
                    uint64_t timeout_ns, int poll_warps, unsigned long long* out, int* failed) {
  fifo_latency_kernel<V><<<1, 32 * poll_warps>>>(f, signal, samples, dst_rank, slot, timeout_ns,
                                                 stagger_for(poll_warps), out, failed);
}

// Calls fn(std::integral_constant<PushVariant, v>) for the run-time variant: the one place that maps the setting to
// the compiled kernels.
template <class Fn>
void with_variant(PushVariant v, Fn&& fn) {
  switch (v) {
    case PushVariant::kPush: return fn(std::integral_constant<PushVariant, PushVariant::kPush>{});
    case PushVariant::kWarp: return fn(std::integral_constant<PushVariant, PushVariant::kWarp>{});
    case PushVariant::kWriter: return fn(std::integral_constant<PushVariant, PushVariant::kWriter>{});
    case PushVariant::kWriterWarp: return fn(std::integral_constant<PushVariant, PushVariant::kWriterWarp>{});
  }
}

}  // namespace

PushVariant parse_push_variant(const std::string& name) {
  std::string known;
  for (int i = 0; i < kPushVariantCount; ++i) {
    if (name == push_variant_name(PushVariant(i))) return PushVariant(i);
    known += std::string(i ? ", " : "") + push_variant_name(PushVariant(i));
  }
  throw std::invalid_argument("unknown push variant '" + name + "' (one of: " + known + ")");
}

double launch_fifo_bench(const DeviceFifo* fifos, int num_fifos, uint64_t commands_per_fifo, int dst_rank,
                         uint64_t timeout_ns, PushVariant variant) {
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
  with_variant(variant, [&](auto v) {
    launch_bench<decltype(v)::value>(d_fifos, num_fifos, commands_per_fifo, dst_rank, timeout_ns, d_failed);
  });
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

std::vector<uint64_t> launch_fifo_latency(const DeviceFifo& fifo, int64_t* signals, uint32_t num_slots, uint32_t slot,
                                          int samples, int dst_rank, uint64_t timeout_ns, PushVariant variant,
                                          int poll_warps) {
  check_poll_warps(poll_warps);
  if (slot >= num_slots) throw ProxyError("fifo latency bench: slot " + std::to_string(slot) + " >= " +
                                          std::to_string(num_slots) + " signal slots");
  if (samples < 1) return {};
  // The counters live in the proxy's host memory; the kernel polls them through a mapping. Someone (the internode
  // context) may have registered them already: then use that registration and leave it in place.
  const size_t bytes = size_t(num_slots) * sizeof(int64_t);
  bool registered_here = false;
  cudaError_t e = cudaHostRegister(signals, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (e == cudaSuccess) {
    registered_here = true;
  } else if (e == cudaErrorHostMemoryAlreadyRegistered) {
    (void)cudaGetLastError();
  } else {
    check(e, "cudaHostRegister of the signal counters");
  }
  void* d_signals = nullptr;
  unsigned long long* d_out = nullptr;
  int* d_failed = nullptr;
  std::vector<unsigned long long> out(samples);
  int failed = 0;
  try {
    check(cudaHostGetDevicePointer(&d_signals, signals, 0), "cudaHostGetDevicePointer of the signal counters");
    check(cudaMalloc(&d_out, sizeof(unsigned long long) * samples), "cudaMalloc");
    check(cudaMalloc(&d_failed, sizeof(int)), "cudaMalloc");
    check(cudaMemset(d_failed, 0, sizeof(int)), "cudaMemset");
    const auto* signal = static_cast<const unsigned long long*>(d_signals) + slot;
    with_variant(variant, [&](auto v) {
      launch_latency<decltype(v)::value>(fifo, signal, samples, dst_rank, slot, timeout_ns, poll_warps, d_out,
                                         d_failed);
    });
    check(cudaGetLastError(), "kernel launch");
    check(cudaDeviceSynchronize(), "latency kernel");
    check(cudaMemcpy(out.data(), d_out, sizeof(unsigned long long) * samples, cudaMemcpyDeviceToHost), "cudaMemcpy");
    check(cudaMemcpy(&failed, d_failed, sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy");
  } catch (...) {
    if (d_out) cudaFree(d_out);
    if (d_failed) cudaFree(d_failed);
    if (registered_here) (void)cudaHostUnregister(signals);
    throw;
  }
  cudaFree(d_out);
  cudaFree(d_failed);
  if (registered_here) (void)cudaHostUnregister(signals);
  if (failed)
    throw TimeoutError("fifo latency bench: signal slot " + std::to_string(slot) +
                       " did not count a GPU-pushed write+signal within the deadline (FIFO " +
                       std::to_string(fifo.fifo_id) + "; the kernel printed the counters)");
  return std::vector<uint64_t>(out.begin(), out.end());
}

std::vector<uint64_t> launch_pcie_echo(int samples, uint64_t timeout_ns, int poll_warps) {
  check_poll_warps(poll_warps);
  if (samples < 1) return {};
  unsigned long long* words = nullptr;  // [0] ping (GPU writes), [8] pong (host writes): separate cache lines
  check(cudaHostAlloc(reinterpret_cast<void**>(&words), 128, cudaHostAllocMapped), "cudaHostAlloc");
  words[0] = words[8] = 0;
  unsigned long long* d_words = nullptr;
  unsigned long long* d_out = nullptr;
  int* d_failed = nullptr;
  std::vector<unsigned long long> out(samples);  // before the echo thread: nothing may throw while it is joinable
  std::atomic<bool> stop{false};
  // The echo thread spins without pausing: it stands for a proxy thread's poll loop, which does not sleep either.
  std::thread echo([&] {
    unsigned long long last = 0;
    while (!stop.load(std::memory_order_relaxed)) {
      const unsigned long long v = __atomic_load_n(&words[0], __ATOMIC_ACQUIRE);
      if (v != last) {
        __atomic_store_n(&words[8], v, __ATOMIC_RELEASE);
        last = v;
      }
    }
  });
  int failed = 0;
  std::string error;
  try {
    check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_words), words, 0), "cudaHostGetDevicePointer");
    check(cudaMalloc(&d_out, sizeof(unsigned long long) * samples), "cudaMalloc");
    check(cudaMalloc(&d_failed, sizeof(int)), "cudaMalloc");
    check(cudaMemset(d_failed, 0, sizeof(int)), "cudaMemset");
    pcie_echo_kernel<<<1, 32 * poll_warps>>>(d_words, d_words + 8, samples, timeout_ns, stagger_for(poll_warps),
                                             d_out, d_failed);
    check(cudaGetLastError(), "echo kernel launch");
    check(cudaDeviceSynchronize(), "echo kernel");
    check(cudaMemcpy(out.data(), d_out, sizeof(unsigned long long) * samples, cudaMemcpyDeviceToHost), "cudaMemcpy");
    check(cudaMemcpy(&failed, d_failed, sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy");
  } catch (const std::exception& e) {
    error = e.what();
  }
  stop.store(true);
  echo.join();
  if (d_out) cudaFree(d_out);
  if (d_failed) cudaFree(d_failed);
  cudaFreeHost(words);
  if (!error.empty()) throw ProxyError(error);
  if (failed)
    throw TimeoutError("pcie echo: the host echo did not come back within " + std::to_string(timeout_ns / 1e9) +
                       " s (the kernel printed the sample and the values)");
  return std::vector<uint64_t>(out.begin(), out.end());
}

}  // namespace uccl_ep

#endif  // UCCL_EP_CUDA
