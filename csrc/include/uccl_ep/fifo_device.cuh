// Device side of the command FIFO: how a kernel pushes a 16-byte command for a CPU proxy.
//
// Protocol (host side: csrc/proxy/fifo.hpp; docs/host-core.md "FIFO protocol"):
//   - ring: `depth` commands in host-pinned, device-mapped memory; a zero type nibble marks an empty slot.
//   - head: a counter in GPU memory; a producer reserves slot `head % depth` with atomicAdd.
//   - tail: in host-mapped memory, advanced by the proxy after it cleared a slot. Reading it crosses PCIe, so each
//     FIFO keeps `cached_tail` in GPU memory and producers only re-read the real tail when the ring looks full.
//   - the command is written with ONE 16-byte release store at system scope, so the proxy never sees half a command.
// The POD below is shared with host code (the proxy fills it in); the functions compile only under nvcc/hipcc.
#pragma once

#include <cstdint>
#include <cstdio>

#include "uccl_ep/command.hpp"

namespace uccl_ep {

struct DeviceFifo {
  Command* ring;                // device pointer to the host-mapped ring
  unsigned long long* head;     // GPU memory
  unsigned long long* cached_tail;  // GPU memory
  const unsigned long long* tail;   // device pointer to the host-mapped tail
  uint32_t depth;               // power of two
  int rank;
  int fifo_id;
};

// Returned by fifo_push: the reserved index, or kFifoPushTimedOut after the deadline passed (the kernel should
// trap: the proxy is gone or wedged and the message printed says which ring and counters).
constexpr unsigned long long kFifoPushTimedOut = ~0ull;

#if defined(__CUDACC__) || defined(__HIPCC__)

__device__ __forceinline__ unsigned long long fifo_now_ns() {
#if defined(__HIPCC__)
  return wall_clock64() * 10ull;  // 100 MHz wall clock on CDNA
#else
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

__device__ __forceinline__ unsigned long long fifo_load_tail(const unsigned long long* p) {
#if defined(__HIPCC__)
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#endif
}

// release = false: the caller already made its payload visible (one __threadfence_system() per batch of pushes),
// so the store itself needs no fence; it is still a single 16-byte store.
__device__ __forceinline__ void fifo_store_command(Command* slot, const Command& c, bool release = true) {
#if defined(__HIPCC__)
  // No 16-byte atomic store on AMD: publish `hi` first, then `lo` (which holds the type) with release semantics.
  __hip_atomic_store(&slot->hi, c.hi, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
  __hip_atomic_store(&slot->lo, c.lo, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  if (release)
    asm volatile("st.release.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(slot), "l"(c.lo), "l"(c.hi) : "memory");
  else
    asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(slot), "l"(c.lo), "l"(c.hi) : "memory");
#endif
}

// Push one command; called by a single thread. Returns the slot index (a quiet's index is what a kernel waits on:
// the proxy advances the tail past it only when every earlier command completed).
__device__ __forceinline__ unsigned long long fifo_push(const DeviceFifo& f, const Command& c,
                                                        unsigned long long timeout_ns, bool release = true) {
  const unsigned long long idx = atomicAdd(f.head, 1ull);
  unsigned long long tail = *reinterpret_cast<volatile unsigned long long*>(f.cached_tail);
  if (idx - tail >= f.depth) {
    const unsigned long long start = fifo_now_ns();
    while (true) {
      tail = fifo_load_tail(f.tail);
      if (idx - tail < f.depth) {
        atomicMax(f.cached_tail, tail);
        break;
      }
      if (fifo_now_ns() - start > timeout_ns) {
        printf("uccl_ep: FIFO full past the deadline: rank %d fifo %d head(reserved) %llu tail %llu depth %u "
               "(is the proxy running?)\n", f.rank, f.fifo_id, idx, tail, f.depth);
        return kFifoPushTimedOut;
      }
    }
  }
  fifo_store_command(f.ring + (idx & (f.depth - 1)), c, release);
  return idx;
}

// Wait until the proxy moved the tail past `idx` (e.g. a quiet's index). Returns false on the deadline.
__device__ __forceinline__ bool fifo_wait_done(const DeviceFifo& f, unsigned long long idx,
                                               unsigned long long timeout_ns) {
  const unsigned long long start = fifo_now_ns();
  while (true) {
    const unsigned long long tail = fifo_load_tail(f.tail);
    if (tail > idx) {
      atomicMax(f.cached_tail, tail);
      return true;
    }
    if (fifo_now_ns() - start > timeout_ns) {
      printf("uccl_ep: waited past the deadline for rank %d fifo %d tail to pass %llu (tail %llu)\n", f.rank,
             f.fifo_id, idx, tail);
      return false;
    }
  }
}

#endif  // __CUDACC__ || __HIPCC__

}  // namespace uccl_ep
