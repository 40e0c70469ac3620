// Lists a block or a warp builds in shared memory: the position of each thread's hit among the block's (a scan),
// and which of a row's slots or ranks a warp visits (a compaction). Used by the intranode kernels and the
// expert-major kernels.
#pragma once

#include "uccl_ep/portability.cuh"

namespace uccl_ep {

// Exclusive prefix sum of one int per thread over the block; also returns the block total in *total. Every thread of
// the block must call it (it synchronizes); `scratch` holds blockDim.x ints of shared memory.
UCCL_DEVICE int block_exclusive_scan(int value, int* scratch, int* total) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  for (int off = 1; off < static_cast<int>(blockDim.x); off <<= 1) {
    const int v = threadIdx.x >= static_cast<unsigned>(off) ? scratch[threadIdx.x - off] : 0;
    __syncthreads();
    scratch[threadIdx.x] += v;
    __syncthreads();
  }
  const int inclusive = scratch[threadIdx.x];
  *total = scratch[blockDim.x - 1];
  __syncthreads();  // the caller may reuse scratch at once
  return inclusive - value;
}

// Lane 0 of a warp packs the values keep(i) >= 0, i in [0, n), into list[] in increasing i; returns how many. Every
// lane evaluates keep() for its own indices first, so the loads behind keep() are issued in parallel. kBlockWarps:
// the warps of the block (one count each in shared memory).
template <int kBlockWarps, typename Keep>
UCCL_DEVICE int warp_compact(int n, int lane, int* scratch, int* list, const Keep& keep) {
  for (int i = lane; i < n; i += kWarpSize) scratch[i] = keep(i);
  warp_sync();
  __shared__ int s_count[kBlockWarps];
  const int warp = threadIdx.x / kWarpSize;
  if (lane == 0) {
    int m = 0;
    for (int i = 0; i < n; ++i)
      if (scratch[i] >= 0) list[m++] = scratch[i];
    s_count[warp] = m;
  }
  warp_sync();
  return s_count[warp];
}

}  // namespace uccl_ep
