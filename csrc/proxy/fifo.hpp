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
  // Reads the command at the consumer's position (acquire). False when that slot is still empty.
  bool peek(Command* out) const {
    // Slots taken since the last release() still hold their commands (release clears them): a drain that took a
    // whole ring's worth must stop here, or it would lap the ring and take those commands a second time.
    if (consumer_tail_ - published_tail_ > mask_) return false;
    Command* slot = ring_ + (consumer_tail_ & mask_);
    const uint64_t lo = __atomic_load_n(&slot->lo, __ATOMIC_ACQUIRE);
    if (command_type(Command{lo, 0}) == kCmdEmpty) return false;
    out->lo = lo;
    out->hi = __atomic_load_n(&slot->hi, __ATOMIC_ACQUIRE);
    return true;
  }
  // Moves past the command peek() returned. Its slot is neither cleared nor given back yet: release() does both for
  // every command taken since the last release, so a drain of many commands costs one tail store, not one each.
  void advance() { ++consumer_tail_; }
  // Clears the slots taken since the last release (release stores: whoever sees a slot empty also sees what the
  // consumer published before calling this, e.g. the proxy's count of queued operations) and publishes the tail
  // (release): those slots may be reused from then on.
  void release() {
    if (published_tail_ == consumer_tail_) return;
    for (uint64_t i = published_tail_; i != consumer_tail_; ++i) {
      Command* slot = ring_ + (i & mask_);
      __atomic_store_n(&slot->hi, 0, __ATOMIC_RELAXED);
      __atomic_store_n(&slot->lo, 0, __ATOMIC_RELEASE);
    }
    published_tail_ = consumer_tail_;
    __atomic_store_n(tail_, consumer_tail_, __ATOMIC_RELEASE);
  }
  void pop() {
    advance();
    release();
  }
  // Index of the command peek() reads (the published tail lags it until release()).
  uint64_t consumer_index() const { return consumer_tail_; }
  uint64_t tail() const { return __atomic_load_n(tail_, __ATOMIC_ACQUIRE); }
  // Slots reserved by host producers. A FIFO fed by GPU producers keeps its head in GPU memory; this stays 0 there.
  uint64_t host_head() const { return head_.load(std::memory_order_acquire); }

  // Any thread: true when no command that has been published to the ring is still waiting for the consumer to take
  // it. Host producers: every reserved slot was taken (tail == host head; a reserved, not yet written slot counts as
  // waiting). GPU producers: their head is in GPU memory, so the test is the slot at the published tail: empty means
  // the consumer took every command published so far (it clears slots only together with publishing the tail, after
  // its own bookkeeping). A GPU push that reserved a slot but whose store has not landed is invisible to the host;
  // ask after the kernels that push finished, or after the caller knows their stores landed.
  bool drained() const;

  // Any thread, for diagnostics: what the ring holds from the published tail on. A ring whose slot at the tail is
  // empty while a later slot is full has a hole: a producer reserved that slot and its store never became visible
  // to the host (or was lost); the consumer waits at the hole forever, and no watchdog sees it, since nothing is
  // queued or in flight.
  struct Snapshot {
    uint64_t tail = 0;         // published tail: commands before it were taken and their slots given back
    uint32_t full = 0;         // non-empty slots in [tail, tail + depth)
    int64_t first_full = -1;   // index of the first of them (-1: none)
    int64_t last_full = -1;    // ... and of the last
  };
  Snapshot snapshot() const;

  // Wait until the tail passed `index` (e.g. a quiet pushed at that index completed).
  void wait_done(uint64_t index, double timeout_secs, const std::atomic<bool>* abort = nullptr) const;

  // Pointers for a kernel. Allocates the head / cached tail in GPU memory on first use (every view shares them, so
  // kernels launched one after another continue the same sequence); throws when the ring is not device-mapped (no
  // GPU at run time or a build without CUDA) or host producers already pushed to it.
  DeviceFifo device_view();

  // Host stand-in for a kernel's fifo_push, for tests on machines without a GPU: claims the FIFO for device producers
  // (host pushes are then refused), reserves from a counter of its own playing the head in GPU memory (host_head()
  // stays 0, as with a real kernel) and writes the command as the HIP path of fifo_store_command does (hi, then lo
  // with release). Refused once a real device head exists (device_view() was taken), and device_view() is refused
  // after it was used: two heads would hand out the same slots.
  uint64_t push_as_device(const Command& c, double timeout_secs);

 private:
  // Waits until slot `idx` is free (the consumer's tail passed idx - depth). False when `abort` turned true; throws
  // TimeoutError past the deadline.
  bool wait_space(uint64_t idx, double timeout_secs, const std::atomic<bool>* abort);

  uint32_t depth_;
  uint64_t mask_;
  int rank_;
  int fifo_id_;
  bool device_mapped_ = false;
  void* alloc_ = nullptr;            // ring + tail block
  Command* ring_ = nullptr;
  uint64_t* tail_ = nullptr;         // published tail (host memory, device-mapped when available)
  uint64_t consumer_tail_ = 0;       // the consumer's position: commands before it were taken
  uint64_t published_tail_ = 0;      // the consumer's last release(): slots before it are cleared and given back
  alignas(64) std::atomic<uint64_t> head_{0};
  alignas(64) std::atomic<uint64_t> cached_tail_{0};
  std::atomic<int> producer_{int(FifoProducer::kNone)};
  void* dev_counters_ = nullptr;     // GPU memory: head, cached tail
  std::atomic<uint64_t> emulated_device_head_{0};  // push_as_device's stand-in for the GPU head
};

}  // namespace uccl_ep
