// Device side of the arrival gate (arrival_gate.hpp): which counters cover a range of rows, and the wait for them.
#pragma once

#include "kernels/arrival_gate.hpp"
#include "kernels/gpu_wait.cuh"

namespace uccl_ep::internode {

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
      const long long rest = records - c * per;
      const long long need = row[kGateBase + lane] + (c / g.lanes) * per + (rest < per ? rest : per);
      if (!wait_counter(g.signals, row[kGateSlot] + lane, need, g.timeout_ns, g.err, g.stop, g.rank, g.phase))
        return false;
    }
  }
  return true;
}

// The whole thread block waits for rows [lo, hi]: thread 0 polls, the others wait at the barrier; the acquire loads of
// thread 0 then order every thread's reads of the rows (bar.sync is cumulative). False (in every thread): do not read.
__device__ inline bool block_gate_rows(const ArrivalGate* g, long long lo, long long hi, bool* s_ok) {
  if (!g) return true;
  if (threadIdx.x == 0) *s_ok = gate_wait_rows(*g, lo, hi);
  __syncthreads();
  const bool ok = *s_ok;
  __syncthreads();  // s_ok is rewritten by the next call
  return ok;
}

}  // namespace uccl_ep::internode
