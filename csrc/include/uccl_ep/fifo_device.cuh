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
// Returned by the warp-collective pushes to the lanes that had no command in that call.
constexpr unsigned long long kFifoNothingPushed = ~0ull - 1;

// How the new push variants order the payload a command refers to before the command itself.
//   kRelease: the push makes this thread's earlier stores visible system-wide first (the warp variants do it with one
//     fence per call, i.e. per up-to-32/64 commands, instead of one per command).
//   kCallerFenced: the caller already issued fifo_publish_payload() (or __threadfence_system()) after writing every
//     payload these commands refer to (one fence can cover many pushes); the command goes out as a relaxed 16-byte
//     store.
enum class FifoOrder { kRelease, kCallerFenced };

// Register-resident producer state of a FIFO that one thread, or one warp acting together, owns exclusively
// (fifo_writer_open .. fifo_writer_close): no other thread of any kernel may push to that FIFO in between.
struct FifoWriter {
  unsigned long long head;  // next index to fill
  unsigned long long tail;  // a tail value this producer observed (acquire); never ahead of the real tail
};

#if defined(__CUDACC__) || defined(__HIPCC__)

__device__ __forceinline__ unsigned long long fifo_now_ns() {
#if defined(__HIPCC__)
  // 100 MHz constant clock on CDNA. The builtin rather than wall_clock64(): older HIP headers declare that for the
  // device pass only, and the host pass of a __device__ function then fails to compile.
  return static_cast<unsigned long long>(__builtin_amdgcn_s_memrealtime()) * 10ull;
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

// ---------------------------------------------------------------- faster producers (additions, issue 2)
//
// Why fifo_push is slow (0.6 M/s per FIFO with release, 2.9 M/s relaxed on an H200): each push waits for an
// atomicAdd's result from L2 and, with release, for a system-scope fence that drains earlier stores over PCIe
// (about 1.6 us). The variants below keep the ring protocol (same slots, same tail, same consumer) and change only how
// the producer reserves slots and orders its payload:
//   - fifo_push_warp: one atomicAdd reserves a slot for every lane of the warp that has a command, so the L2 round
//     trip and the fence (kRelease) are paid once per warp call (up to 32 commands; 64 on AMD), and the stores of
//     one call are contiguous (coalesced into full-line PCIe writes). Safe alongside fifo_push and other warps on
//     the same FIFO.
//   - FifoWriter (fifo_writer_push / fifo_writer_push_warp): the producer owns the FIFO, so head and the last seen
//     tail stay in registers; a push is a compare and a store. The head goes back to GPU memory at close, so later
//     kernels (or fifo_push after a barrier) continue from it.
// Guarantees shared by all: each command lands in exactly one slot; the slots one producer (thread, or warp for the
// warp calls, in lane order within a call) fills are increasing in program order, so the consumer, which reads slots
// in index order, sees its commands in order; a slot is written only after a tail proving the consumer cleared it
// was acquired (by this producer, or, through cached_tail, by another one, as in fifo_push). Past the deadline they
// print the same "FIFO full past the deadline" message as fifo_push and return kFifoPushTimedOut (every lane of a
// warp call does); the FIFO is dead from then on.

#if defined(__HIPCC__)
using FifoLaneMask = unsigned long long;  // 64-lane wavefronts
__device__ __forceinline__ FifoLaneMask fifo_active_lanes() { return __ballot(1); }
__device__ __forceinline__ FifoLaneMask fifo_warp_lanes() { return __ballot(1); }  // no forced convergence on AMD
__device__ __forceinline__ FifoLaneMask fifo_ballot(FifoLaneMask, bool p) { return __ballot(p); }
__device__ __forceinline__ FifoLaneMask fifo_lanes_below() { return (1ull << __lane_id()) - 1ull; }
__device__ __forceinline__ unsigned long long fifo_shfl(FifoLaneMask, unsigned long long v, int src) {
  return __shfl(v, src);
}
__device__ __forceinline__ int fifo_popc(FifoLaneMask m) { return __popcll(m); }
__device__ __forceinline__ int fifo_first_lane(FifoLaneMask m) {
  return __ffsll(static_cast<unsigned long long>(m)) - 1;
}
// A wavefront runs in lockstep: nothing to converge; the compiler barrier keeps memory operations in place.
__device__ __forceinline__ void fifo_sync_lanes(FifoLaneMask) { __builtin_amdgcn_wave_barrier(); }
#else
using FifoLaneMask = unsigned;
__device__ __forceinline__ FifoLaneMask fifo_active_lanes() { return __activemask(); }
__device__ __forceinline__ FifoLaneMask fifo_warp_lanes() { return 0xffffffffu; }
__device__ __forceinline__ FifoLaneMask fifo_ballot(FifoLaneMask m, bool p) { return __ballot_sync(m, p); }
__device__ __forceinline__ FifoLaneMask fifo_lanes_below() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}
__device__ __forceinline__ unsigned long long fifo_shfl(FifoLaneMask m, unsigned long long v, int src) {
  return __shfl_sync(m, v, src);
}
__device__ __forceinline__ int fifo_popc(FifoLaneMask m) { return __popc(m); }
__device__ __forceinline__ int fifo_first_lane(FifoLaneMask m) { return __ffs(m) - 1; }
// Orders the memory operations of the participating lanes (a lane's acquire before another lane's store).
__device__ __forceinline__ void fifo_sync_lanes(FifoLaneMask m) { __syncwarp(m); }
#endif

// The fence that orders this thread's earlier stores (payload) before its later command stores, as seen by the proxy
// and the NIC. FifoOrder::kCallerFenced means: the caller issued this (or __threadfence_system) after the payload.
// acq_rel rather than the sequentially consistent __threadfence_system(): release ordering is all a push needs.
__device__ __forceinline__ void fifo_publish_payload() {
#if defined(__HIPCC__)
  __threadfence_system();
#else
  asm volatile("fence.acq_rel.sys;" ::: "memory");
#endif
}

// Scalars, not the DeviceFifo: an address passed to an out-of-line call would move the caller's copy to local memory.
inline __device__ __noinline__ void fifo_report_full(int rank, int fifo_id, unsigned long long idx,
                                                     unsigned long long tail, uint32_t depth) {
  printf("uccl_ep: FIFO full past the deadline: rank %d fifo %d head(reserved) %llu tail %llu depth %u "
         "(is the proxy running?)\n", rank, fifo_id, idx, tail, depth);
}

// Warp-collective push onto a FIFO shared with any other producers. Meant for the lanes of a warp calling together;
// lanes with has_command = false take no slot and get kFifoNothingPushed. Returns each pushing lane's index, or
// kFifoPushTimedOut on every lane after the deadline. Lanes that happen not to be converged form separate groups,
// each with its own reservation: correct, only less batched.
__device__ __forceinline__ unsigned long long fifo_push_warp(const DeviceFifo& f, const Command& c, bool has_command,
                                                             unsigned long long timeout_ns,
                                                             FifoOrder order = FifoOrder::kRelease) {
  const FifoLaneMask lanes = fifo_active_lanes();
  const FifoLaneMask want = fifo_ballot(lanes, has_command);
  if (want == 0) return kFifoNothingPushed;
  const int leader = fifo_first_lane(want);
  const bool is_leader = (fifo_lanes_below() & want) == 0 && has_command;
  unsigned long long base = 0, tail = 0;
  if (is_leader) {
    base = atomicAdd(f.head, static_cast<unsigned long long>(fifo_popc(want)));
    tail = *reinterpret_cast<volatile unsigned long long*>(f.cached_tail);
  }
  base = fifo_shfl(lanes, base, leader);
  tail = fifo_shfl(lanes, tail, leader);
  const unsigned long long idx = base + fifo_popc(want & fifo_lanes_below());
  if (order == FifoOrder::kRelease && has_command) fifo_publish_payload();
  // A uniform loop: on AMD the lanes of a wavefront cannot wait for each other inside divergent code, and a batch
  // larger than the free space (or than the ring) must let its first lanes store before the later ones fit.
  bool pending = has_command;
  bool reloaded = false;
  unsigned long long start = 0;
  while (true) {
    if (pending && idx - tail < f.depth) {
      fifo_store_command(f.ring + (idx & (f.depth - 1)), c, false);
      pending = false;
    }
    const FifoLaneMask waiting = fifo_ballot(lanes, pending);
    if (waiting == 0) break;
    if (pending) {
      if (!reloaded) start = fifo_now_ns();
      tail = fifo_load_tail(f.tail);  // every waiting lane acquires the tail it relies on
      reloaded = true;
    }
    const bool expired = pending && fifo_now_ns() - start > timeout_ns;
    const FifoLaneMask late = fifo_ballot(lanes, expired);
    if (late != 0) {
      if (expired && (fifo_lanes_below() & late) == 0) fifo_report_full(f.rank, f.fifo_id, idx, tail, f.depth);
      return kFifoPushTimedOut;
    }
  }
  if (reloaded) atomicMax(f.cached_tail, tail);
  return has_command ? idx : kFifoNothingPushed;
}

// ---- single-owner producer

// Takes over a FIFO for this thread (or, for the _warp calls, this warp: every lane calls it and holds a copy).
// Needs every earlier push to the FIFO to be ordered before it: an earlier kernel, or a barrier after the previous
// owner's fifo_writer_close.
__device__ __forceinline__ FifoWriter fifo_writer_open(const DeviceFifo& f) {
  FifoWriter w;
  w.head = *reinterpret_cast<volatile unsigned long long*>(f.head);
  w.tail = *reinterpret_cast<volatile unsigned long long*>(f.cached_tail);
  return w;
}

// Hands the FIFO back: later producers (fifo_push, another writer) continue from this head. The __threadfence lets a
// producer in another block of this kernel take over after a barrier.
__device__ __forceinline__ void fifo_writer_close(const DeviceFifo& f, const FifoWriter& w) {
  *reinterpret_cast<volatile unsigned long long*>(f.head) = w.head;
  atomicMax(f.cached_tail, w.tail);
  __threadfence();
}

// The same for a warp writer: every lane calls it, one writes (the copies are identical).
__device__ __forceinline__ void fifo_writer_close_warp(const DeviceFifo& f, const FifoWriter& w) {
  if ((fifo_lanes_below() & fifo_active_lanes()) == 0) fifo_writer_close(f, w);
}

// Slow path of fifo_writer_push, kept out of line so the fast path stays small: spins on the real tail until slot
// `idx` is free and returns the tail it acquired, or kFifoPushTimedOut past the deadline. Takes scalars so that the
// caller's writer and FIFO copy stay in registers.
inline __device__ __noinline__ unsigned long long fifo_wait_space(const unsigned long long* tail_ptr,
                                                                  unsigned long long idx, uint32_t depth,
                                                                  unsigned long long timeout_ns, int rank,
                                                                  int fifo_id) {
  const unsigned long long start = fifo_now_ns();
  while (true) {
    const unsigned long long tail = fifo_load_tail(tail_ptr);
    if (idx - tail < depth) return tail;
    if (fifo_now_ns() - start > timeout_ns) {
      fifo_report_full(rank, fifo_id, idx, tail, depth);
      return kFifoPushTimedOut;
    }
  }
}

// One thread, owning the FIFO: returns the index, or kFifoPushTimedOut.
__device__ __forceinline__ unsigned long long fifo_writer_push(const DeviceFifo& f, FifoWriter& w, const Command& c,
                                                               unsigned long long timeout_ns,
                                                               FifoOrder order = FifoOrder::kRelease) {
  const unsigned long long idx = w.head;
  if (idx - w.tail >= f.depth) {
    const unsigned long long tail = fifo_wait_space(f.tail, idx, f.depth, timeout_ns, f.rank, f.fifo_id);
    if (tail == kFifoPushTimedOut) return kFifoPushTimedOut;
    w.tail = tail;
  }
  fifo_store_command(f.ring + (idx & (f.depth - 1)), c, order == FifoOrder::kRelease);
  w.head = idx + 1;
  return idx;
}

// One warp owning the FIFO, every lane in `lanes` holding the same FifoWriter and calling together (the same lanes
// every call, from converged code: two groups of lanes advancing their copies separately would fill the same slots;
// on CUDA the _sync intrinsics over `lanes` enforce the convergence). Lanes with a command fill consecutive slots in
// lane order. Returns each pushing lane's index, kFifoNothingPushed to the others, kFifoPushTimedOut to all after the
// deadline. kRelease costs one fence for the whole call.
__device__ __forceinline__ unsigned long long fifo_writer_push_warp(const DeviceFifo& f, FifoWriter& w,
                                                                    const Command& c, bool has_command,
                                                                    unsigned long long timeout_ns,
                                                                    FifoOrder order = FifoOrder::kRelease,
                                                                    FifoLaneMask lanes = fifo_warp_lanes()) {
  const FifoLaneMask want = fifo_ballot(lanes, has_command);
  const unsigned long long idx = w.head + fifo_popc(want & fifo_lanes_below());
  const unsigned long long last = w.head + fifo_popc(want) - 1;
  w.head += fifo_popc(want);
  if (want == 0) return kFifoNothingPushed;
  if (order == FifoOrder::kRelease && has_command) fifo_publish_payload();
  if (last - w.tail < f.depth) {  // the common case: the whole batch fits in the space already known to be free
    if (has_command) fifo_store_command(f.ring + (idx & (f.depth - 1)), c, false);
    return has_command ? idx : kFifoNothingPushed;
  }
  bool pending = has_command;
  unsigned long long start = fifo_now_ns();
  while (true) {
    if (pending && idx - w.tail < f.depth) {
      fifo_store_command(f.ring + (idx & (f.depth - 1)), c, false);
      pending = false;
    }
    if (fifo_ballot(lanes, pending) == 0) break;
    // One lane acquires the tail for all (the writer copies must stay identical); the lane sync orders that acquire
    // before the other lanes' stores.
    unsigned long long tail = 0;
    if ((fifo_lanes_below() & lanes) == 0) tail = fifo_load_tail(f.tail);
    w.tail = fifo_shfl(lanes, tail, fifo_first_lane(lanes));
    fifo_sync_lanes(lanes);
    const bool expired = pending && fifo_now_ns() - start > timeout_ns;
    const FifoLaneMask late = fifo_ballot(lanes, expired);
    if (late != 0) {
      if (expired && (fifo_lanes_below() & late) == 0) fifo_report_full(f.rank, f.fifo_id, idx, w.tail, f.depth);
      return kFifoPushTimedOut;
    }
  }
  return has_command ? idx : kFifoNothingPushed;
}

#endif  // __CUDACC__ || __HIPCC__

}  // namespace uccl_ep
