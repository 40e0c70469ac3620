// GPU producers -> host consumer through the real device push path (uccl_ep/fifo_device.cuh) and host Fifo.
// Built and run by test_gpu_fifo.py on a CUDA machine. For every push variant (the original fifo_push and the
// batched / single-owner ones) it checks no loss, no duplicate and per-producer order (several producers sharing a
// ring smaller than a warp's batch, and a single owner), that a full ring fails at the deadline with the printed
// message, and that head hand-over between variants works; then prints the drain rate for 1, 2, 4 and 8 FIFOs (one
// producer warp and one host consumer thread per FIFO) and the push-to-completion latency measured on the GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "proxy/fifo.hpp"
#include "uccl_ep/fifo_device.cuh"

using namespace uccl_ep;

namespace {

enum Variant {
  kPushRelease,         // fifo_push, st.release.sys per command (the original default)
  kPushRelaxedFence64,  // fifo_push(release=false), one __threadfence_system() per 64 commands
  kWarpRelease,         // fifo_push_warp: one atomicAdd and one fence per call of 32 lanes
  kWriterFence32,       // FifoWriter, one thread: relaxed stores, one fence per 32 commands
  kWriterWarpRelease,   // FifoWriter, one warp: one fence per call of 32 lanes
  kWriterWarpFence256,  // FifoWriter, one warp: relaxed stores, one fence per 8 calls (256 commands)
  kVariants
};
const char* const kNames[kVariants] = {"release-store", "relaxed-store+fence/64", "warp+fence/call",
                                       "writer+fence/32", "writer-warp+fence/call", "writer-warp+fence/256"};
__host__ __device__ constexpr bool warp_variant(int v) {
  return v == kWarpRelease || v == kWriterWarpRelease || v == kWriterWarpFence256;
}
__host__ __device__ constexpr bool owner_variant(int v) {
  return v == kWriterFence32 || v == kWriterWarpRelease || v == kWriterWarpFence256;
}

constexpr uint64_t kSeqWrap = 1u << 27;  // sequence numbers travel in remote_offset / 16

template <int V>
__device__ __forceinline__ unsigned long long push_step(const DeviceFifo& f, FifoWriter& w, uint64_t call,
                                                        const Command& c, bool has, uint64_t timeout_ns) {
  if (V == kPushRelease) return fifo_push(f, c, timeout_ns, true);
  if (V == kPushRelaxedFence64) {
    if (call % 64 == 0) __threadfence_system();
    return fifo_push(f, c, timeout_ns, false);
  }
  if (V == kWarpRelease) return fifo_push_warp(f, c, has, timeout_ns, FifoOrder::kRelease);
  if (V == kWriterFence32) {
    if (call % 32 == 0) fifo_publish_payload();
    return fifo_writer_push(f, w, c, timeout_ns, FifoOrder::kCallerFenced);
  }
  if (V == kWriterWarpRelease) return fifo_writer_push_warp(f, w, c, has, timeout_ns, FifoOrder::kRelease);
  if (call % 8 == 0) fifo_publish_payload();
  return fifo_writer_push_warp(f, w, c, has, timeout_ns, FifoOrder::kCallerFenced);
}

template <int V>
__device__ __forceinline__ void close_writer(const DeviceFifo& f, const FifoWriter& w) {
  if (!owner_variant(V)) return;
  if (warp_variant(V))
    fifo_writer_close_warp(f, w);
  else
    fifo_writer_close(f, w);
}

// Block b is producer b % per_fifo of FIFO b / per_fifo. Producer p sends n commands (dst_rank = p, sequence seq0 + k
// in remote_offset). `sparse`: warp variants leave some lanes without a command in each call.
template <int V>
__global__ void produce(const DeviceFifo* fifos, int per_fifo, uint64_t n, uint64_t seq0, bool sparse,
                        uint64_t timeout_ns, int* failed) {
  const DeviceFifo f = fifos[blockIdx.x / per_fifo];
  const uint32_t producer = blockIdx.x % per_fifo;
  if (!warp_variant(V) && threadIdx.x != 0) return;
  FifoWriter w{};
  if (owner_variant(V)) w = fifo_writer_open(f);
  Command c;
  if (!warp_variant(V)) {
    for (uint64_t i = 0; i < n; ++i) {
      encode_write(&c, producer, 16, 0, ((seq0 + i) % kSeqWrap) * 16);
      if (push_step<V>(f, w, i, c, true, timeout_ns) == kFifoPushTimedOut) {
        atomicExch(failed, 1);
        return;
      }
    }
  } else {
    const unsigned lane = threadIdx.x % 32;
    uint64_t sent = 0;
    for (uint64_t call = 0; sent < n; ++call) {
      const bool wanted = !sparse || (call * 7 + lane) % 5 != 0;
      const FifoLaneMask want = fifo_ballot(~0u, wanted);
      const uint64_t rank = fifo_popc(want & fifo_lanes_below());
      const bool has = wanted && sent + rank < n;
      encode_write(&c, producer, 16, 0, ((seq0 + sent + rank) % kSeqWrap) * 16);
      if (push_step<V>(f, w, call, c, has, timeout_ns) == kFifoPushTimedOut) {
        if (lane == 0) atomicExch(failed, 1);
        return;
      }
      sent += fifo_popc(fifo_ballot(~0u, has));
    }
  }
  close_writer<V>(f, w);
}

// One command at a time: the time from just before the push until the producer sees the tail pass it (the host
// consumer took it), on the GPU's global timer.
template <int V>
__global__ void latency(DeviceFifo f, int samples, uint64_t timeout_ns, unsigned long long* out, int* failed) {
  const unsigned lane = threadIdx.x % 32;
  if (!warp_variant(V) && lane != 0) return;
  FifoWriter w{};
  if (owner_variant(V)) w = fifo_writer_open(f);
  Command c;
  encode_write(&c, 0, 16, 0, 0);
  for (int s = 0; s < samples; ++s) {
    encode_write(&c, 0, 16, 0, (uint64_t(s) % kSeqWrap) * 16);
    const unsigned long long t0 = fifo_now_ns();
    const unsigned long long idx = push_step<V>(f, w, uint64_t(s), c, lane == 0, timeout_ns);
    if (idx == kFifoPushTimedOut) {
      if (lane == 0) atomicExch(failed, 1);
      return;
    }
    unsigned long long tail = 0;
    if (lane == 0) {
      while ((tail = fifo_load_tail(f.tail)) <= idx) {
        if (fifo_now_ns() - t0 > timeout_ns) {
          printf("uccl_ep: latency sample %d: tail %llu never passed %llu\n", s, tail, idx);
          atomicExch(failed, 1);
          break;
        }
      }
      out[s] = fifo_now_ns() - t0;
    }
    if (warp_variant(V)) {
      __syncwarp();
      tail = fifo_shfl(~0u, tail, 0);
    }
    if (*reinterpret_cast<volatile int*>(failed)) return;
    if (owner_variant(V)) w.tail = tail;  // acquired by lane 0 (and ordered for the others by the warp sync)
  }
  close_writer<V>(f, w);
}

__global__ void timer_resolution(unsigned long long* out) {
  unsigned long long best = ~0ull, prev = fifo_now_ns();
  for (int i = 0; i < 100000; ++i) {
    const unsigned long long t = fifo_now_ns();
    if (t != prev && t - prev < best) best = t - prev;
    prev = t;
  }
  *out = best;
}

// Calls fn(std::integral_constant<int, v>{}): the kernels are templates on the variant, so the hot loops carry no
// run-time switch.
template <typename Fn>
void with_variant(int v, Fn&& fn) {
  switch (v) {
    case kPushRelease: return fn(std::integral_constant<int, kPushRelease>{});
    case kPushRelaxedFence64: return fn(std::integral_constant<int, kPushRelaxedFence64>{});
    case kWarpRelease: return fn(std::integral_constant<int, kWarpRelease>{});
    case kWriterFence32: return fn(std::integral_constant<int, kWriterFence32>{});
    case kWriterWarpRelease: return fn(std::integral_constant<int, kWriterWarpRelease>{});
    default: return fn(std::integral_constant<int, kWriterWarpFence256>{});
  }
}

void launch_variant(int v, int blocks, const DeviceFifo* fifos, int per_fifo, uint64_t n, uint64_t seq0, bool sparse,
                    uint64_t timeout_ns, int* failed) {
  with_variant(v, [&](auto tag) {
    produce<decltype(tag)::value><<<blocks, 32>>>(fifos, per_fifo, n, seq0, sparse, timeout_ns, failed);
  });
}

void launch_latency(int v, DeviceFifo f, int samples, uint64_t timeout_ns, unsigned long long* out, int* failed) {
  with_variant(v, [&](auto tag) { latency<decltype(tag)::value><<<1, 32>>>(f, samples, timeout_ns, out, failed); });
}

// Consumes `producers * n` commands; counts those out of sequence for their producer (starting at seq0).
bool drain(Fifo& q, int producers, uint64_t n, uint64_t seq0, uint64_t* bad, double timeout_s = 60) {
  std::vector<uint64_t> next(producers, seq0);
  uint64_t got = 0, total = n * producers;
  const auto t0 = std::chrono::steady_clock::now();
  Command c;
  while (got < total) {
    if (!q.peek(&c)) {
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > timeout_s) {
        printf("drain: fifo %d got %llu of %llu commands within %.0f s\n", q.fifo_id(), (unsigned long long)got,
               (unsigned long long)total, timeout_s);
        return false;
      }
      continue;
    }
    const CommandFields f = decode(c);
    q.pop();
    ++got;
    if (f.type != kCmdWrite || f.dst_rank >= uint32_t(producers) ||
        f.remote_offset / 16 != next[f.dst_rank] % kSeqWrap) {
      if (*bad == 0)
        printf("drain: fifo %d command %llu: producer %u sequence %llu, expected %llu\n", q.fifo_id(),
               (unsigned long long)got - 1, f.dst_rank, (unsigned long long)(f.remote_offset / 16),
               f.dst_rank < uint32_t(producers) ? (unsigned long long)(next[f.dst_rank] % kSeqWrap) : 0ull);
      ++*bad;
    } else {
      ++next[f.dst_rank];
    }
  }
  return true;
}

struct DeviceViews {
  explicit DeviceViews(const std::vector<DeviceFifo>& v) {
    cudaMalloc(&ptr, sizeof(DeviceFifo) * v.size());
    cudaMemcpy(ptr, v.data(), sizeof(DeviceFifo) * v.size(), cudaMemcpyHostToDevice);
  }
  ~DeviceViews() { cudaFree(ptr); }
  DeviceFifo* ptr = nullptr;
};

bool read_failed(int* failed) {
  int f = 0;
  cudaMemcpy(&f, failed, sizeof(int), cudaMemcpyDeviceToHost);
  cudaMemset(failed, 0, sizeof(int));
  return f != 0;
}

bool after_drain(Fifo& q, uint64_t* bad) {
  Command extra;
  if (q.peek(&extra)) {  // a duplicate (or a command nobody asked for) would sit here
    printf("drain: fifo %d has a command past the expected total\n", q.fifo_id());
    ++*bad;
  }
  return *bad == 0;
}

}  // namespace

int main() {
  const uint64_t kTimeout = 10'000'000'000ull;
  int* failed;
  cudaMalloc(&failed, sizeof(int));
  cudaMemset(failed, 0, sizeof(int));
  {
    Fifo probe(2, 0, 0);
    if (!probe.device_mapped()) { printf("FAIL: ring not device-mapped\n"); return 1; }
  }

  // Correctness. Shared-head variants: 8 producers on one 16-slot ring (a warp's batch is twice the ring). Owner
  // variants: one producer. Warp variants leave lanes idle now and then.
  for (int v = 0; v < kVariants; ++v) {
    Fifo q(16, 0, 0);
    DeviceViews views({q.device_view()});
    const int producers = owner_variant(v) ? 1 : 8;
    const uint64_t n = 100000;
    launch_variant(v, producers, views.ptr, producers, n, 0, true, kTimeout, failed);
    uint64_t bad = 0;
    const bool ok = drain(q, producers, n, 0, &bad);
    cudaError_t e = cudaDeviceSynchronize();
    const bool f = read_failed(failed);
    after_drain(q, &bad);
    printf("correctness %s: producers=%d drained=%d bad=%llu device_timeout=%d cuda=%s\n", kNames[v], producers, ok,
           (unsigned long long)bad, f, cudaGetErrorString(e));
    if (!ok || bad || f || e != cudaSuccess) { printf("FAIL\n"); return 1; }
  }

  // Hand-over: every variant in turn on one ring, one producer identity, sequence continuing across kernels (a
  // writer must leave the head where the next producer, of any kind, continues).
  {
    Fifo q(64, 0, 0);
    DeviceViews views({q.device_view()});
    const uint64_t n = 5000;
    uint64_t bad = 0;
    std::thread consumer([&] { drain(q, 1, n * kVariants, 0, &bad); });
    for (int v = 0; v < kVariants; ++v) launch_variant(v, 1, views.ptr, 1, n, n * v, false, kTimeout, failed);
    consumer.join();
    cudaError_t e = cudaDeviceSynchronize();
    const bool f = read_failed(failed);
    after_drain(q, &bad);
    printf("handover: variants=%d commands=%llu bad=%llu device_timeout=%d cuda=%s\n", kVariants,
           (unsigned long long)(n * kVariants), (unsigned long long)bad, f, cudaGetErrorString(e));
    if (bad || f || e != cudaSuccess) { printf("FAIL\n"); return 1; }
  }

  // Deadline: nobody drains a 4-slot ring; every variant must give up after ~20 ms with the printed message.
  for (int v = 0; v < kVariants; ++v) {
    Fifo q(4, 7, 3);
    DeviceViews views({q.device_view()});
    launch_variant(v, 1, views.ptr, 1, 64, 0, false, 20'000'000ull, failed);
    cudaError_t e = cudaDeviceSynchronize();
    const bool f = read_failed(failed);
    fflush(stdout);
    printf("deadline %s: timed_out=%d cuda=%s\n", kNames[v], f, cudaGetErrorString(e));
    if (!f || e != cudaSuccess) { printf("FAIL\n"); return 1; }
  }

  // Throughput: one producer warp and one host consumer per FIFO.
  for (int v = 0; v < kVariants; ++v)
    for (int nf = 1; nf <= 8; nf *= 2) {
      const uint64_t n = 2'000'000;
      std::vector<std::unique_ptr<Fifo>> qs;
      std::vector<DeviceFifo> dv;
      for (int i = 0; i < nf; ++i) {
        qs.emplace_back(new Fifo(2048, 0, i));
        dv.push_back(qs.back()->device_view());
      }
      DeviceViews views(dv);
      std::atomic<uint64_t> bad{0};
      std::atomic<int> stuck{0};
      const auto t0 = std::chrono::steady_clock::now();
      launch_variant(v, nf, views.ptr, 1, n, 0, false, kTimeout, failed);
      std::vector<std::thread> th;
      for (int i = 0; i < nf; ++i)
        th.emplace_back([&, i] {
          uint64_t b = 0;
          if (!drain(*qs[i], 1, n, 0, &b)) stuck = 1;
          bad += b;
        });
      for (auto& t : th) t.join();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      cudaError_t e = cudaDeviceSynchronize();
      const bool f = read_failed(failed);
      uint64_t extra = 0;
      for (auto& q : qs) after_drain(*q, &extra);
      printf("%s fifos=%d commands=%llu seconds=%.4f Mcmd_per_s_total=%.2f per_fifo=%.2f bad=%llu\n", kNames[v], nf,
             (unsigned long long)(n * nf), s, n * nf / s / 1e6, n / s / 1e6, (unsigned long long)(bad + extra));
      fflush(stdout);
      if (bad || extra || stuck || f || e != cudaSuccess) { printf("FAIL\n"); return 1; }
    }

  // Push-to-completion latency on the GPU clock.
  {
    unsigned long long* d;
    unsigned long long res = 0;
    cudaMalloc(&d, sizeof(unsigned long long));
    timer_resolution<<<1, 1>>>(d);
    cudaMemcpy(&res, d, sizeof(res), cudaMemcpyDeviceToHost);
    cudaFree(d);
    printf("globaltimer_resolution_ns=%llu\n", res);
  }
  const int samples = 2000;
  unsigned long long* d_lat;
  cudaMalloc(&d_lat, sizeof(unsigned long long) * samples);
  for (int v = 0; v < kVariants; ++v) {
    Fifo q(2048, 0, 0);
    const DeviceFifo view = q.device_view();
    uint64_t bad = 0;
    launch_latency(v, view, samples, kTimeout, d_lat, failed);
    const bool ok = drain(q, 1, samples, 0, &bad);
    cudaError_t e = cudaDeviceSynchronize();
    const bool f = read_failed(failed);
    std::vector<unsigned long long> lat(samples);
    cudaMemcpy(lat.data(), d_lat, sizeof(unsigned long long) * samples, cudaMemcpyDeviceToHost);
    std::sort(lat.begin(), lat.end());
    printf("latency %s: samples=%d p50_us=%.2f p90_us=%.2f p99_us=%.2f max_us=%.2f bad=%llu\n", kNames[v], samples,
           lat[samples / 2] / 1e3, lat[samples * 90 / 100] / 1e3, lat[samples * 99 / 100] / 1e3, lat.back() / 1e3,
           (unsigned long long)bad);
    if (!ok || bad || f || e != cudaSuccess) { printf("FAIL\n"); return 1; }
  }
  cudaFree(d_lat);
  printf("PASS\n");
  return 0;
}
