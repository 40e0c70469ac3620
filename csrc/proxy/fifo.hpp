// Host side of a command FIFO (device side and protocol: uccl_ep/fifo_device.cuh).
//
// The ring and the tail live in host-pinned, device-mapped memory when CUDA is usable at run time (kernels push into
// it), else in plain aligned host memory (CPU producers only). One consumer (the proxy thread owning the FIFO);
// any number of host producers, or any number of GPU producers, never both: host pushes reserve slots from a host
// counter and kernels from a counter in GPU memory, so on a shared ring each would fill slots the other side also
// fills, or that the consumer's tail has already passed. The first kind to use a FIFO owns it (`bind_producer`); the
// other kind is then refused with ProxyError.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "uccl_ep/command.hpp"
#include "uccl_ep/fifo_device.cuh"

namespace uccl_ep {

enum class FifoProducer : int { kNone = 0, kHost = 1, kDevice = 2 };
const char* fifo_producer_name(FifoProducer p);

class Fifo {
 public:
  Fifo(uint32_t depth, int rank, int fifo_id);
  ~Fifo();
  Fifo(const Fifo&) = delete;
  Fifo& operator=(const Fifo&) = delete;

  uint32_t depth() const { return depth_; }
  int fifo_id() const { return fifo_id_; }
  bool device_mapped() const { return device_mapped_; }
  FifoProducer producer() const { return FifoProducer(producer_.load(std::memory_order_acquire)); }
  // Claims the FIFO for one kind of producer; throws ProxyError (naming rank, FIFO and both kinds) when the other
  // kind already uses it. push() claims kHost, device_view() kDevice.
  void bind_producer(FifoProducer kind);

  // ---- producers (thread-safe). Blocks while the ring is full; throws TimeoutError after `timeout_secs`
  // naming rank, FIFO, head and tail. `abort` (optional) is polled while waiting: when it turns true the push
  // gives up and returns UINT64_MAX (the proxy failed; its error is what the caller should report). Throws ProxyError
  // on a FIFO GPU producers use.
  uint64_t push(const Command& c, double timeout_secs, const std::atomic<bool>* abort = nullptr);

  // ---- consumer (one thread)
  // Reads the command at the tail (acquire). False when that slot is still empty.
  bool peek(Command* out) const {
    Command* slot = ring_ + (consumer_tail_ & mask_);
    const uint64_t lo = __atomic_load_n(&slot->lo, __ATOMIC_ACQUIRE);
    if (command_type(Command{lo, 0}) == kCmdEmpty) return false;
    out->lo = lo;
    out->hi = __atomic_load_n(&slot->hi, __ATOMIC_ACQUIRE);
    return true;
  }
  // Clears the slot at the tail and publishes tail + 1 (release): the slot may be reused from then on.
  void pop() {
    Command* slot = ring_ + (consumer_tail_ & mask_);
    __atomic_store_n(&slot->hi, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&slot->lo, 0, __ATOMIC_RELAXED);
    ++consumer_tail_;
    __atomic_store_n(tail_, consumer_tail_, __ATOMIC_RELEASE);
  }
  uint64_t tail() const { return __atomic_load_n(tail_, __ATOMIC_ACQUIRE); }
  // Slots reserved by host producers. A FIFO fed by GPU producers keeps its head in GPU memory; this stays 0 there.
  uint64_t host_head() const { return head_.load(std::memory_order_acquire); }

  // Wait until the tail passed `index` (e.g. a quiet pushed at that index completed).
  void wait_done(uint64_t index, double timeout_secs, const std::atomic<bool>* abort = nullptr) const;

  // Pointers for a kernel. Allocates the head / cached tail in GPU memory on first use (every view shares them, so
  // kernels launched one after another continue the same sequence); throws when the ring is not device-mapped (no
  // GPU at run time or a build without CUDA) or host producers already pushed to it.
  DeviceFifo device_view();

 private:
  uint32_t depth_;
  uint64_t mask_;
  int rank_;
  int fifo_id_;
  bool device_mapped_ = false;
  void* alloc_ = nullptr;            // ring + tail block
  Command* ring_ = nullptr;
  uint64_t* tail_ = nullptr;         // published tail (host memory, device-mapped when available)
  uint64_t consumer_tail_ = 0;       // the consumer's private copy
  alignas(64) std::atomic<uint64_t> head_{0};
  alignas(64) std::atomic<uint64_t> cached_tail_{0};
  std::atomic<int> producer_{int(FifoProducer::kNone)};
  void* dev_counters_ = nullptr;     // GPU memory: head, cached tail
};

}  // namespace uccl_ep
