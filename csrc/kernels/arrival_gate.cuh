// Device side of the arrival gate (arrival_gate.hpp): which counters cover a range of rows, and the wait for them.
#pragma once

#include "kernels/arrival_gate.hpp"
#include "kernels/gpu_wait.cuh"

namespace uccl_ep::internode {

// The lane counter's value once chunk c of the block of gate-table `row` has landed (through lane `lane`).
__device__ inline long long chunk_threshold(const long long* row, int lane, long long c, long long per, int lanes) {
  const long long rest = row[kGateRecords] - c * per;
  return row[kGateBase + lane] + (c / lanes) * per + (rest < per ? rest : per);
}

// The counter value at which lane `lane` of a block has carried all its chunks (the threshold of its last chunk);
// -1: no chunk of the block goes through that lane.
__device__ inline long long gate_lane_target(const long long* row, int lane, long long per, int lanes) {
  const long long chunks = (row[kGateRecords] + per - 1) / per;
  const long long c0 = ((lane - row[kGateHint]) % lanes + lanes) % lanes;
  if (c0 >= chunks) return -1;
  return chunk_threshold(row, lane, c0 + (chunks - 1 - c0) / lanes * lanes, per, lanes);
}

// Block 0 of a gated launch: copy each (block, lane) counter into the mirror as it moves, until every lane has
// carried its last chunk (then stamped kTlAllIn on the kernel timeline). The only reads of host memory in a gated
// launch; the deadline and the host's abort end it like wait_signals, and the stop flag it sets ends the readers'
// waits.
__device__ inline void gate_watch(const ArrivalGate& g) {
  const int width = kGateBase + g.lanes;
  const int pairs = g.blocks * g.lanes;
  const uint64_t start = now_ns();
  for (unsigned spins = 0;; ++spins) {
    bool done = true;
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
      const long long* row = g.table + static_cast<long long>(i / g.lanes) * width;
      const int lane = i % g.lanes;
      const long long target = gate_lane_target(row, lane, g.per_chunk, g.lanes);
      if (target < 0) continue;
      const long long slot = row[kGateSlot] + lane;
      const unsigned long long v = load_counter(g.signals + slot);
      if (v > *reinterpret_cast<volatile unsigned long long*>(g.mirror + slot)) {
        __threadfence();  // the rows the counter covers are read after the mirror: publish it as a release
        atomicMax(g.mirror + slot, v);
      }
      if (static_cast<long long>(v) >= target) continue;
      done = false;
      if (now_ns() - start > g.timeout_ns) {
        report(g.err, g.stop, kErrWaitTimeout, g.rank, int(slot), 0, g.phase, static_cast<long long>(v), target);
        return;
      }
    }
    if (done) {
      stamp_latest(g.stamps, kTlAllIn);  // the last of the watcher's threads to see its lanes complete stamps last
      return;
    }
    if ((spins & 63) == 0 && ((g.err && *reinterpret_cast<volatile int*>(&g.err->code) != 0) || stopped(g.stop))) {
      set_stop(g.stop);
      return;
    }
    poll_pause();
  }
}

// One thread waits until rows [lo, hi] of the gate's row space have landed: for every block that holds some of them,
// the counter of each chunk that carries them. Rows outside every block (our own node's, copied locally) need no
// wait. False: a wait failed and was reported; the caller must not read the rows.
__device__ inline bool gate_wait_rows(const ArrivalGate& g, long long lo, long long hi) {
  const int width = kGateBase + g.lanes;
  const long long per = g.per_chunk;
  for (int b = 0; b < g.blocks; ++b) {
    const long long* row = g.table + static_cast<long long>(b) * width;
    const long long first = row[kGateFirstRow], records = row[kGateRecords];
    const long long a = lo > first ? lo : first;
    const long long z = hi < first + records - 1 ? hi : first + records - 1;
    if (a > z) continue;
    for (long long c = (a - first) / per; c <= (z - first) / per; ++c) {
      const int lane = int((row[kGateHint] + c) % g.lanes);
      const long long need = chunk_threshold(row, lane, c, per, g.lanes);
      if (!wait_counter(g.mirror, row[kGateSlot] + lane, need, g.timeout_ns, g.err, g.stop, g.rank, g.phase,
                        /*watch_error_word=*/false))
        return false;
    }
  }
  return true;
}

// The whole thread block waits: thread 0 runs `wait` (true: go on), the others wait at the barrier; the acquire loads
// of thread 0 then order every thread's reads of the rows (bar.sync is cumulative). Every thread gets the answer.
template <typename Wait>
__device__ inline bool block_wait(bool* s_ok, const Wait& wait) {
  if (threadIdx.x == 0) *s_ok = wait();
  __syncthreads();
  const bool ok = *s_ok;
  __syncthreads();  // s_ok is rewritten by the next call
  return ok;
}

// ... for rows [lo, hi] of the gate's row space. False: do not read.
__device__ inline bool block_gate_rows(const ArrivalGate& g, long long lo, long long hi, bool* s_ok) {
  return block_wait(s_ok, [&] { return gate_wait_rows(g, lo, hi); });
}

// A gated reader's blocks stamp the kernel timeline: the first to begin, and each as it ends (the last wins). Every
// thread of the block calls reader_end (it holds a barrier).
__device__ inline void reader_begins(const ArrivalGate& g) {
  if (threadIdx.x == 0) stamp_earliest(g.stamps, kTlReaderStart);
}
__device__ inline void reader_ends(const ArrivalGate& g) {
  if (!g.stamps) return;
  __syncthreads();  // the block's rows are all written
  if (threadIdx.x == 0) stamp_latest(g.stamps, kTlReaderEnd);
}

}  // namespace uccl_ep::internode
