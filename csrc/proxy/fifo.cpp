#include "proxy/fifo.hpp"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "proxy/errors.hpp"

#ifdef UCCL_EP_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace uccl_ep {
namespace {

constexpr size_t kTailPad = 64;

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

#ifdef UCCL_EP_WITH_CUDA
bool cuda_usable() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}
#endif

}  // namespace

const char* fifo_producer_name(FifoProducer p) {
  switch (p) {
    case FifoProducer::kNone: return "none";
    case FifoProducer::kHost: return "host";
    case FifoProducer::kDevice: return "device";
  }
  return "?";
}

void Fifo::bind_producer(FifoProducer kind) {
  int seen = int(FifoProducer::kNone);
  if (producer_.compare_exchange_strong(seen, int(kind), std::memory_order_acq_rel) || seen == int(kind)) return;
  if (kind == FifoProducer::kHost)
    throw ProxyError("rank " + std::to_string(rank_) + " fifo " + std::to_string(fifo_id_) +
                     ": host push refused: GPU producers feed this FIFO (a kernel took its device view); their head "
                     "lives in GPU memory, so a host push would fill a slot the proxy has already passed or that a "
                     "kernel fills too. Push from a kernel, or give host producers a FIFO no kernel uses");
  throw ProxyError("rank " + std::to_string(rank_) + " fifo " + std::to_string(fifo_id_) +
                   ": device view refused: host producers already pushed " + std::to_string(host_head()) +
                   " commands to this FIFO, and kernels reserve slots from a separate head in GPU memory. Give GPU "
                   "producers a FIFO no host thread pushes to");
}

Fifo::Fifo(uint32_t depth, int rank, int fifo_id) : depth_(depth), mask_(depth - 1), rank_(rank), fifo_id_(fifo_id) {
  if (depth < 2 || (depth & (depth - 1)))
    throw ProxyError("FIFO depth " + std::to_string(depth) + " must be a power of two >= 2 (UCCL_EP_FIFO_DEPTH)");
  const size_t bytes = size_t(depth) * sizeof(Command) + kTailPad;
#ifdef UCCL_EP_WITH_CUDA
  if (cuda_usable()) {
    void* p = nullptr;
    if (cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable) == cudaSuccess) {
      alloc_ = p;
      device_mapped_ = true;
    } else {
      cudaGetLastError();
    }
  }
#endif
  if (!alloc_) {
    alloc_ = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    if (!alloc_) throw ProxyError("FIFO allocation of " + std::to_string(bytes) + " bytes failed");
  }
  std::memset(alloc_, 0, bytes);
  ring_ = static_cast<Command*>(alloc_);
  tail_ = reinterpret_cast<uint64_t*>(static_cast<char*>(alloc_) + size_t(depth) * sizeof(Command));
}

Fifo::~Fifo() {
#ifdef UCCL_EP_WITH_CUDA
  if (dev_counters_) cudaFree(dev_counters_);
  if (device_mapped_) {
    cudaFreeHost(alloc_);
    return;
  }
#endif
  std::free(alloc_);
}

bool Fifo::wait_space(uint64_t idx, double timeout_secs, const std::atomic<bool>* abort) {
  if (idx - cached_tail_.load(std::memory_order_relaxed) < depth_) return true;
  const auto t0 = Clock::now();
  uint32_t spins = 0;
  while (true) {
    const uint64_t tail = __atomic_load_n(tail_, __ATOMIC_ACQUIRE);
    if (idx - tail < depth_) {
      uint64_t seen = cached_tail_.load(std::memory_order_relaxed);
      while (seen < tail && !cached_tail_.compare_exchange_weak(seen, tail)) {
      }
      return true;
    }
    if (abort && abort->load(std::memory_order_relaxed)) return false;
    if (++spins % 256 == 0) {
      if (seconds_since(t0) > timeout_secs)
        throw TimeoutError("FIFO full past the deadline (" + std::to_string(timeout_secs) + " s): rank " +
                           std::to_string(rank_) + " fifo " + std::to_string(fifo_id_) + " waited for tail > " +
                           std::to_string(idx - depth_) + ", tail is " + std::to_string(tail) +
                           " (is the proxy running? UCCL_EP_CPU_TIMEOUT_SECS)");
      std::this_thread::yield();
    }
  }
}

uint64_t Fifo::push(const Command& c, double timeout_secs, const std::atomic<bool>* abort) {
  if (command_type(c) == kCmdEmpty || command_type(c) >= kCmdTypeCount)
    throw ProxyError("Fifo::push: command type " + std::to_string(command_type(c)) + " is not a valid command");
  if (producer_.load(std::memory_order_relaxed) != int(FifoProducer::kHost)) bind_producer(FifoProducer::kHost);
  const uint64_t idx = head_.fetch_add(1, std::memory_order_acq_rel);
  if (!wait_space(idx, timeout_secs, abort)) return UINT64_MAX;
  Command* slot = ring_ + (idx & mask_);
  __atomic_store_n(&slot->hi, c.hi, __ATOMIC_RELAXED);
  __atomic_store_n(&slot->lo, c.lo, __ATOMIC_RELEASE);
  return idx;
}

uint64_t Fifo::push_as_device(const Command& c, double timeout_secs) {
  if (command_type(c) == kCmdEmpty || command_type(c) >= kCmdTypeCount)
    throw ProxyError("Fifo::push_as_device: command type " + std::to_string(command_type(c)) +
                     " is not a valid command");
  if (dev_counters_)
    throw ProxyError("rank " + std::to_string(rank_) + " fifo " + std::to_string(fifo_id_) +
                     ": push_as_device refused: kernels already took a device view (their head lives in GPU memory)");
  bind_producer(FifoProducer::kDevice);
  const uint64_t idx = emulated_device_head_.fetch_add(1, std::memory_order_acq_rel);
  wait_space(idx, timeout_secs, nullptr);
  Command* slot = ring_ + (idx & mask_);
  __atomic_store_n(&slot->hi, c.hi, __ATOMIC_RELAXED);
  __atomic_store_n(&slot->lo, c.lo, __ATOMIC_RELEASE);
  return idx;
}

bool Fifo::drained() const {
  if (producer() == FifoProducer::kHost) return tail() == host_head();
  const Command* slot = ring_ + (tail() & mask_);
  return command_type(Command{__atomic_load_n(&slot->lo, __ATOMIC_ACQUIRE), 0}) == kCmdEmpty;
}

Fifo::Snapshot Fifo::snapshot() const {
  Snapshot s;
  s.tail = tail();
  for (uint64_t i = s.tail; i != s.tail + depth_; ++i) {
    const Command* slot = ring_ + (i & mask_);
    if (command_type(Command{__atomic_load_n(&slot->lo, __ATOMIC_ACQUIRE), 0}) == kCmdEmpty) continue;
    ++s.full;
    if (s.first_full < 0) s.first_full = int64_t(i);
    s.last_full = int64_t(i);
  }
  return s;
}

void Fifo::wait_done(uint64_t index, double timeout_secs, const std::atomic<bool>* abort) const {
  const auto t0 = Clock::now();
  uint32_t spins = 0;
  while (tail() <= index) {
    if (abort && abort->load(std::memory_order_relaxed)) return;
    if (++spins % 64 == 0) {
      if (seconds_since(t0) > timeout_secs)
        throw TimeoutError("rank " + std::to_string(rank_) + " fifo " + std::to_string(fifo_id_) +
                           ": tail did not pass " + std::to_string(index) + " within " +
                           std::to_string(timeout_secs) + " s (tail is " + std::to_string(tail()) + ")");
      std::this_thread::yield();
    }
  }
}

DeviceFifo Fifo::device_view() {
#ifdef UCCL_EP_WITH_CUDA
  if (device_mapped_) {
    if (emulated_device_head_.load(std::memory_order_acquire))
      throw ProxyError("rank " + std::to_string(rank_) + " fifo " + std::to_string(fifo_id_) +
                       ": device view refused: push_as_device already reserved slots from its own head");
    bind_producer(FifoProducer::kDevice);
    if (!dev_counters_) {
      if (cudaMalloc(&dev_counters_, 2 * sizeof(unsigned long long)) != cudaSuccess ||
          cudaMemset(dev_counters_, 0, 2 * sizeof(unsigned long long)) != cudaSuccess)
        throw ProxyError("cudaMalloc of the FIFO head failed: " + std::string(cudaGetErrorString(cudaGetLastError())));
    }
    DeviceFifo v{};
    void* dring = nullptr;
    if (cudaHostGetDevicePointer(&dring, alloc_, 0) != cudaSuccess)
      throw ProxyError("cudaHostGetDevicePointer failed for the FIFO ring");
    v.ring = static_cast<Command*>(dring);
    v.tail = reinterpret_cast<const unsigned long long*>(static_cast<char*>(dring) + size_t(depth_) * sizeof(Command));
    v.head = static_cast<unsigned long long*>(dev_counters_);
    v.cached_tail = v.head + 1;
    v.depth = depth_;
    v.rank = rank_;
    v.fifo_id = fifo_id_;
    return v;
  }
#endif
  throw ProxyError("FIFO " + std::to_string(fifo_id_) +
                   " is not device-mapped: no usable GPU at run time or the module was built without CUDA");
}

}  // namespace uccl_ep
