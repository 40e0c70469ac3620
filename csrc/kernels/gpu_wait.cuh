// How the internode kernels wait for the proxy's counters and how they fail: a deadline on every wait, one error
// word per rank (the first failure wins), and a stop flag so that nothing queued behind a failed wait passes on rows
// that never arrived. Shared by the network kernels (internode.cu) and the consumers of arrivals (internode_plan.cu,
// through arrival_gate.cuh).
#pragma once

#include <cstdint>

#include "kernels/step_failure.hpp"
#include "uccl_ep/portability.cuh"

namespace uccl_ep::internode {

// A rank's stop flag (device memory, Context::stop_flag_ptr): it holds the generation of the failure, so a kernel
// launched with that generation (queued behind the failed wait) stops, and kernels launched after the host cleared
// the error (a new generation) run. The copy kernels test it in every block: a test of the host-mapped error word
// instead serialized over PCIe and made each scatter_rows take 17 ms on 2x H200 (session 7).
__device__ inline bool stopped(StopFlag s) {
  return s.flag && *reinterpret_cast<const volatile int32_t*>(s.flag) == s.generation;
}
__device__ inline void set_stop(StopFlag s) {
  if (!s.flag) return;
  *reinterpret_cast<volatile int32_t*>(s.flag) = s.generation;
  __threadfence();
}

// The fields go out before the code (the host reads the code first, then the rest); the CAS only reserves.
__device__ inline void report(ErrorWord* err, StopFlag stop, int code, int rank, int slot, int aux, int phase,
                              long long observed, long long expected) {
  set_stop(stop);
  if (!err) return;
  if (atomicCAS(&err->reserved, 0, 1) == 0) {
    err->rank = rank;
    err->slot = slot;
    err->aux = aux;
    err->phase = phase;
    err->observed = observed;
    err->expected = expected;
    __threadfence_system();
    *reinterpret_cast<volatile int32_t*>(&err->code) = code;
    __threadfence_system();
  }
}

// Between two polls of a counter: a tight acquire loop over PCIe gains nothing, so poll a few times per microsecond.
__device__ inline void poll_pause() {
#if defined(__HIPCC__)
  __builtin_amdgcn_s_sleep(4);
#else
  __nanosleep(200);
#endif
}

// Kernel timeline stamps (timeline.hpp); `stamps` nullptr: off, and these cost one test.
__device__ inline void stamp_earliest(unsigned long long* stamps, int field) {
  if (stamps) atomicMin(stamps + field, static_cast<unsigned long long>(now_ns()));
}
__device__ inline void stamp_latest(unsigned long long* stamps, int field) {
  if (stamps) atomicMax(stamps + field, static_cast<unsigned long long>(now_ns()));
}

// A counter's value with acquire at system scope (the proxy, a CPU thread, writes it).
__device__ inline unsigned long long load_counter(const unsigned long long* p) {
  return ld_acquire_sys_u64(reinterpret_cast<const uint64_t*>(p));
}

// One thread waits until counter `slot` reaches `expected`. False: it did not -- the deadline passed (reported as
// kErrWaitTimeout with the slot, the value seen and the one waited for), or another wait of this rank failed, or the
// host aborted the waits (its proxy failed): the stop flag is set either way and the caller must not read what the
// counter guards.
// watch_error_word = false: test only the stop flag (device memory), for waits on device memory by many blocks at
// once, whose reads of the host-mapped error word would flood PCIe; whoever sees the error word sets the flag.
__device__ inline bool wait_counter(const unsigned long long* signals, long long slot, long long expected,
                                    unsigned long long timeout_ns, ErrorWord* err, StopFlag stop, int rank,
                                    int phase, bool watch_error_word = true) {
  const uint64_t start = now_ns();
  for (unsigned spins = 0;; ++spins) {
    const long long v = static_cast<long long>(load_counter(signals + slot));
    if (v >= expected) return true;
    if (now_ns() - start > timeout_ns) {
      report(err, stop, kErrWaitTimeout, rank, int(slot), 0, phase, v, expected);
      return false;
    }
    if ((spins & 63) == 0 &&
        ((watch_error_word && err && *reinterpret_cast<volatile int*>(&err->code) != 0) || stopped(stop))) {
      set_stop(stop);
      return false;
    }
    poll_pause();
  }
}

// One thread waits until the int32 flag at `flag` -- device memory that a peer GPU of the node raises over NVLink
// (the pipelined combine gather's tile flags) -- reaches `expected`. It tests only the stop flag, as wait_counter does
// with watch_error_word = false: many blocks wait at once. False: the deadline passed (reported as `code`,
// kErrNodeFlagTimeout unless given, with `slot` and `aux`, the value seen and the one waited for) or the rank
// stopped; the caller must not read what the flag guards.
__device__ inline bool wait_flag(const int* flag, int expected, unsigned long long timeout_ns, ErrorWord* err,
                                 StopFlag stop, int rank, int phase, int slot, int aux,
                                 int code = kErrNodeFlagTimeout) {
  const uint64_t start = now_ns();
  for (unsigned spins = 0;; ++spins) {
    const int v = ld_acquire_sys(flag);
    if (v >= expected) return true;
    if (now_ns() - start > timeout_ns) {
      report(err, stop, code, rank, slot, aux, phase, v, expected);
      return false;
    }
    if ((spins & 63) == 0 && stopped(stop)) return false;
    poll_pause();
  }
}

}  // namespace uccl_ep::internode
