// Intranode dispatch/combine over IPC-mapped peer buffers (NVLink on NVIDIA, xGMI on AMD).
//
// Design ("direct placement", docs/intranode.md): notify exchanges the token counts, so every sender knows the exact
// row of every (token, destination) pair in the destination's receive area. Senders then store their tokens
// straight into those rows with 16-byte stores over the fabric; a barrier publishes them; each receiver copies its
// receive area out to the output tensors. Combine is the mirror image: each rank stores its rows into row
// (source index, own rank) of the source's combine area, a barrier, and the source sums its copies in rank order.
// No rings and no head/tail flow control: the price is a buffer sized for the worst case.
#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

#include "intranode.hpp"
#include "uccl_ep/cuda_errors.cuh"
#include "uccl_ep/portability.cuh"
#include "expert_major.hpp"
#include "uccl_ep/block_lists.cuh"
#include "uccl_ep/row_sum.cuh"

namespace uccl_ep::intranode {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarpSize;

// ---------------------------------------------------------------- control region (ints from the buffer start)
constexpr int kEpochOffset = 0;                  // this rank's barrier epoch (touched by its own kernels only)
constexpr int kFlagsOffset = 64;                 // [kMaxRanks] barrier flags, written by peers
// [kMaxRanks] uint64 copy-engine combine flags: the end row of the last chunk of this combine that rank r has landed
// in our area, written by r after each chunk and cleared by us once our reduce has read them all.
constexpr int kCopyFlagsOffset = kFlagsOffset + kMaxRanks;
constexpr int kCountsOffset = kCopyFlagsOffset + 2 * kMaxRanks;   // [R][R] counts[src][dst], written by src
constexpr int kMaxCopyStreams = 8;
constexpr int kExpertCountsOffset = kCountsOffset + kMaxRanks * kMaxRanks;  // [R][L] written by src
constexpr int64_t kMaxExpertCountInts = static_cast<int64_t>(kControlBytes / 4) - kExpertCountsOffset;

UCCL_HOST_DEVICE int64_t align16(int64_t x) { return (x + 15) & ~int64_t(15); }

// Receive area of dispatch, structure of arrays over `cap` rows.
struct RecvArea {
  int64_t x, scales, idx, weights, src, end;
  UCCL_HOST_DEVICE RecvArea(int64_t cap, int hidden_bytes, int num_scales, int topk) {
    x = 0;
    scales = align16(cap * hidden_bytes);
    idx = scales + align16(cap * num_scales * 4);
    weights = idx + align16(cap * topk * 8);
    src = weights + align16(cap * topk * 4);
    end = src + align16(cap * 4);
  }
};

// Combine area: rows (token, from_rank) for up to `cap` source tokens, then their weights.
struct CombineArea {
  int64_t x, weights, end;
  UCCL_HOST_DEVICE CombineArea(int64_t cap, int num_ranks, int hidden, int topk) {
    x = 0;
    weights = align16(cap * num_ranks * hidden * 2);
    end = weights + align16(cap * num_ranks * topk * 4);
  }
};

UCCL_HOST_DEVICE char* data_of(void* buffer) { return static_cast<char*>(buffer) + kControlBytes; }
UCCL_DEVICE int* ctrl_of(void* buffer) { return static_cast<int*>(buffer); }
UCCL_HOST_DEVICE uint64_t* copy_flags_of(void* buffer) {
  return reinterpret_cast<uint64_t*>(static_cast<int*>(buffer) + kCopyFlagsOffset);
}

// ---------------------------------------------------------------- errors
UCCL_DEVICE void report(ErrorWord* err, int code, int rank, int channel, int peer, int64_t observed, int64_t expected,
                        const char* what) {
  if (atomicCAS(&err->code, 0, code) == 0) {
    err->rank = rank;
    err->channel = channel;
    err->peer = peer;
    err->observed = observed;
    err->expected = expected;
    int i = 0;
    for (; what[i] && i < 31; ++i) err->what[i] = what[i];
    err->what[i] = 0;
    fence_system();
  }
  printf("uccl-ep: rank %d block %d: %s: waited for peer %d, counter %lld, expected %lld\n", rank, channel, what, peer,
         static_cast<long long>(observed), static_cast<long long>(expected));
}

// Every rank bumps its epoch and stores it into flags[rank] of every peer; then waits until every peer's flag in
// its own buffer reached the same epoch. All ranks run the same sequence of barriers, so epochs line up; the
// epoch lives in device memory, so a captured CUDA graph replays correctly.
UCCL_DEVICE bool barrier_block(void** peers, int rank, int num_ranks, ErrorWord* err, uint64_t timeout_ns,
                               const char* what) {
  __shared__ int s_epoch;
  __shared__ int s_failed;
  if (threadIdx.x == 0) {
    int* ctrl = ctrl_of(peers[rank]);
    const int e = ctrl[kEpochOffset] + 1;
    ctrl[kEpochOffset] = e;
    s_epoch = e;
    s_failed = 0;
    // Everything this kernel (and, by stream order, earlier kernels) stored must be visible before the flag.
    drain_stores_before_release();
  }
  __syncthreads();
  const int e = s_epoch;
  for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) {
    drain_stores_before_release();
    st_release_sys(ctrl_of(peers[r]) + kFlagsOffset + rank, e);
  }
  for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) {
    const int* flag = ctrl_of(peers[rank]) + kFlagsOffset + r;
    const uint64_t deadline = now_ns() + timeout_ns;
    int seen;
    while ((seen = ld_acquire_sys(flag)) - e < 0) {
      if (now_ns() > deadline) {
        report(err, 1, rank, blockIdx.x, r, seen, e, what);
        s_failed = 1;
        break;
      }
    }
  }
  __syncthreads();
  return s_failed == 0;
}

__global__ void barrier_kernel(void** peers, int rank, int num_ranks, ErrorWord* err, uint64_t timeout_ns) {
  barrier_block(peers, rank, num_ranks, err, timeout_ns, "barrier");
}

// ---------------------------------------------------------------- notify
// Block 0 exchanges counts and derives the prefix matrix; blocks 1..R compute, per destination, each token's
// position among this rank's tokens for that destination (send_pos, -1 when not sent).
__global__ void notify_kernel(void** peers, int rank, int num_ranks, const int* __restrict__ per_rank,
                              const int* __restrict__ per_expert, const bool* __restrict__ in_rank, int num_tokens,
                              int num_experts, int64_t rows_capacity, int* __restrict__ rank_prefix,
                              int* __restrict__ recv_info, int* __restrict__ send_pos, ErrorWord* err,
                              HostCounts* host, int host_seq, uint64_t timeout_ns) {
  const int R = num_ranks;
  if (blockIdx.x == 0) {
    const int L = num_experts / R;
    for (int i = threadIdx.x; i < R * R; i += blockDim.x) {
      const int dst = i / R, r = i % R;
      ctrl_of(peers[dst])[kCountsOffset + rank * R + r] = per_rank[r];
    }
    for (int i = threadIdx.x; i < R * L; i += blockDim.x) {
      const int dst = i / L, l = i % L;
      ctrl_of(peers[dst])[kExpertCountsOffset + rank * L + l] = per_expert[dst * L + l];
    }
    __syncthreads();
    if (threadIdx.x == 0) drain_stores_before_release();
    __syncthreads();
    // A barrier past its deadline leaves the counts below stale (the error word says so). The host may already
    // have queued the send behind us, so the send must learn it on the device: recv_info[1] then says "skip".
    const bool synced = barrier_block(peers, rank, R, err, timeout_ns, "notify barrier");
    __shared__ int s_overflow;
    if (threadIdx.x == 0) s_overflow = 0;
    __syncthreads();
    const volatile int* counts = ctrl_of(peers[rank]) + kCountsOffset;
    const volatile int* expert_counts = ctrl_of(peers[rank]) + kExpertCountsOffset;
    for (int d = threadIdx.x; d < R; d += blockDim.x) {
      int acc = 0;
      for (int s = 0; s < R; ++s) {
        acc += counts[s * R + d];
        rank_prefix[s * R + d] = acc;
      }
      if (acc > rows_capacity) atomicMax(&s_overflow, acc);
    }
    for (int l = threadIdx.x; l < L; l += blockDim.x) {
      int acc = 0;
      for (int s = 0; s < R; ++s) acc += expert_counts[s * L + l];
      recv_info[2 + l] = acc;
      host->per_expert[l] = acc;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int num_recv = 0;
      for (int s = 0; s < R; ++s) {
        num_recv += counts[s * R + rank];
        host->rows_from[s] = counts[s * R + rank];
      }
      recv_info[0] = num_recv;
      recv_info[1] = synced ? s_overflow : INT_MAX;
      host->num_recv_tokens = num_recv;
      host->overflow_rows_needed = s_overflow;
      host->num_local_experts = L;
      fence_system();
      host->ready = host_seq;
      if (s_overflow > 0) report(err, 2, rank, 0, rank, s_overflow, rows_capacity, "receive area overflow");
    }
    return;
  }
  // Positions: a block-wide scan of is_token_in_rank[:, dst].
  const int dst = blockIdx.x - 1;
  __shared__ int s_sum[kThreads];
  const int per_thread = (num_tokens + blockDim.x - 1) / blockDim.x;
  const int begin = min(num_tokens, static_cast<int>(threadIdx.x) * per_thread);
  const int end = min(num_tokens, begin + per_thread);
  int local = 0;
  for (int t = begin; t < end; ++t) local += in_rank[static_cast<int64_t>(t) * R + dst] ? 1 : 0;
  int total;
  int pos = block_exclusive_scan(local, s_sum, &total);
  for (int t = begin; t < end; ++t) {
    const bool in = in_rank[static_cast<int64_t>(t) * R + dst];
    send_pos[static_cast<int64_t>(t) * R + dst] = in ? pos : -1;
    pos += in ? 1 : 0;
  }
}

// ---------------------------------------------------------------- dispatch
// Each warp sends whole tokens: loads a 16-byte unit once and stores it to every destination's row. The rows this
// rank sends to itself go where `own_rows` says (intranode.hpp, OwnRows): its own receive area, or straight into
// the output when that already exists (self-direct: the receive then copies only what peers sent). Their metadata
// always goes to the own area.
template <int kUnroll>
__global__ void __launch_bounds__(kThreads) dispatch_send_kernel(
    void** peers, int rank, int num_ranks, const int4* __restrict__ x, const float* __restrict__ x_scales,
    const int64_t* __restrict__ topk_idx, const float* __restrict__ topk_weights, const int* __restrict__ send_pos,
    const int* __restrict__ rank_prefix, const int* __restrict__ recv_info, int num_tokens, int hidden_bytes,
    int num_scales, int topk, int experts_per_rank, int64_t rows_capacity, int own_rows, int4* __restrict__ self_x,
    float* __restrict__ self_scales, int64_t self_rows) {
  const int R = num_ranks;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  __shared__ int s_base[kMaxRanks];             // first row of this rank's tokens at each destination
  __shared__ int s_slot[kWarps][kMaxRanks];     // per warp: the row of the current token at each destination ...
  __shared__ int s_rk[kWarps][kMaxRanks];       // ... and the destination rank
  __shared__ int s_n[kWarps];
  for (int r = threadIdx.x; r < R; r += blockDim.x) s_base[r] = rank == 0 ? 0 : rank_prefix[(rank - 1) * R + r];
  __syncthreads();
  // Some receive area is too small (every rank computed the same counts, so every rank skips), or this rank's
  // notify timed out and its counts are stale (this rank skips; the host raises).
  if (recv_info[1] > 0) return;

  const RecvArea area(rows_capacity, hidden_bytes, num_scales, topk);
  const int units = hidden_bytes / 16;
  const int total_warps = gridDim.x * kWarps;
  const bool own_in_output = own_rows == kOwnInOutput && self_x != nullptr;
  auto self_direct = [&](int j) { return own_in_output && s_rk[warp][j] == rank; };
  auto payload_row = [&](int j) -> int4* {
    const int64_t slot = s_slot[warp][j];
    if (self_direct(j)) return self_x + slot * units;
    return reinterpret_cast<int4*>(data_of(peers[s_rk[warp][j]]) + area.x) + slot * units;
  };
  auto scales_row = [&](int j) -> float* {
    const int64_t slot = s_slot[warp][j];
    if (self_direct(j) && self_scales != nullptr) return self_scales + slot * num_scales;
    return reinterpret_cast<float*>(data_of(peers[s_rk[warp][j]]) + area.scales) + slot * num_scales;
  };
  for (int t = blockIdx.x * kWarps + warp; t < num_tokens; t += total_warps) {
    if (lane == 0) {
      int n = 0;
      for (int r = 0; r < R; ++r) {
        const int p = send_pos[static_cast<int64_t>(t) * R + r];
        if (p < 0) continue;
        const int slot = s_base[r] + p;
        // Past the output's end only when num_worst_tokens is too small: the receive kernel reports that.
        if (r == rank && own_in_output && slot >= self_rows) continue;
        s_slot[warp][n] = slot;
        s_rk[warp][n] = r;
        ++n;
      }
      s_n[warp] = n;
    }
    warp_sync();
    const int n = s_n[warp];
    // Payload: each 16-byte unit is loaded once and stored to every destination.
    warp_copy_v4_to_each<kUnroll>(x + static_cast<int64_t>(t) * units, units, lane, n, payload_row);
    for (int s = lane; s < num_scales; s += kWarpSize) {
      const float v = x_scales[static_cast<int64_t>(t) * num_scales + s];
      for (int j = 0; j < n; ++j) scales_row(j)[s] = v;
    }
    for (int k = lane; topk_idx != nullptr && k < topk; k += kWarpSize) {
      const int64_t e = topk_idx[static_cast<int64_t>(t) * topk + k];
      const float w = topk_weights ? topk_weights[static_cast<int64_t>(t) * topk + k] : 0.0f;
      for (int j = 0; j < n; ++j) {
        const int64_t lo = static_cast<int64_t>(s_rk[warp][j]) * experts_per_rank;
        const bool local = e >= lo && e < lo + experts_per_rank;
        const int64_t row = s_slot[warp][j];
        char* d = data_of(peers[s_rk[warp][j]]);
        reinterpret_cast<int64_t*>(d + area.idx)[row * topk + k] = local ? e - lo : -1;
        reinterpret_cast<float*>(d + area.weights)[row * topk + k] = local ? w : 0.0f;
      }
    }
    if (lane == 0)
      for (int j = 0; j < n; ++j) reinterpret_cast<int*>(data_of(peers[s_rk[warp][j]]) + area.src)[s_slot[warp][j]] = t;
    warp_sync();
  }
  fence_system();  // the barrier kernel that follows publishes these stores
}

// Copies the receive area out to the output tensors. Rows in [self_begin, self_end) carry this rank's own tokens;
// with kOwnInOutput the send kernel already stored their payload in the output (self-direct) and only their
// metadata is copied here. `copy_payload` false: the copy engine moves the payload and scales
// (Context::dispatch_recv), this kernel only the metadata and the sync-free padding.
template <int kUnroll>
__global__ void __launch_bounds__(kThreads) dispatch_recv_kernel(
    void* local, int rank, int num_ranks, int4* __restrict__ recv_x, float* __restrict__ recv_scales,
    int64_t* __restrict__ recv_topk_idx, float* __restrict__ recv_topk_weights, int* __restrict__ recv_src_idx,
    const int* __restrict__ recv_info, const int* __restrict__ rank_prefix, bool self_direct, bool copy_payload,
    int64_t out_rows, int hidden_bytes, int num_scales, int topk, int64_t rows_capacity, ErrorWord* err) {
  const int R = num_ranks;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const RecvArea area(rows_capacity, hidden_bytes, num_scales, topk);
  const char* base = data_of(local);
  int64_t num_recv = recv_info[0];
  if (num_recv > out_rows) {
    if (blockIdx.x == 0 && threadIdx.x == 0)
      report(err, 3, rank, 0, rank, num_recv, out_rows, "num_worst_tokens too small");
    num_recv = out_rows;
  }
  const int64_t self_begin = self_direct ? (rank == 0 ? 0 : rank_prefix[(rank - 1) * R + rank]) : 0;
  const int64_t self_end = self_direct ? rank_prefix[rank * R + rank] : 0;
  const int units = hidden_bytes / 16;
  const int64_t total_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t row = blockIdx.x * kWarps + warp; row < out_rows; row += total_warps) {
    if (row < num_recv) {
      const bool payload = copy_payload && !(row >= self_begin && row < self_end);
      if (recv_x != nullptr && payload)
        warp_copy_v4<kUnroll>(recv_x + row * units, reinterpret_cast<const int4*>(base + area.x) + row * units, units,
                              lane);
      for (int s = lane; recv_scales != nullptr && payload && s < num_scales; s += kWarpSize)
        recv_scales[row * num_scales + s] = reinterpret_cast<const float*>(base + area.scales)[row * num_scales + s];
      for (int k = lane; recv_topk_idx != nullptr && k < topk; k += kWarpSize) {
        recv_topk_idx[row * topk + k] = reinterpret_cast<const int64_t*>(base + area.idx)[row * topk + k];
        if (recv_topk_weights)
          recv_topk_weights[row * topk + k] = reinterpret_cast<const float*>(base + area.weights)[row * topk + k];
      }
      if (lane == 0 && recv_src_idx != nullptr) recv_src_idx[row] = reinterpret_cast<const int*>(base + area.src)[row];
    } else {
      // Sync-free padding rows: zero payload, no expert, no weight, no source.
      if (recv_x != nullptr)
        for (int u = lane; u < units; u += kWarpSize) recv_x[row * units + u] = make_int4(0, 0, 0, 0);
      for (int s = lane; recv_scales != nullptr && s < num_scales; s += kWarpSize) recv_scales[row * num_scales + s] = 0.0f;
      for (int k = lane; recv_topk_idx != nullptr && k < topk; k += kWarpSize) {
        recv_topk_idx[row * topk + k] = -1;
        if (recv_topk_weights) recv_topk_weights[row * topk + k] = 0.0f;
      }
      if (lane == 0 && recv_src_idx != nullptr) recv_src_idx[row] = -1;
    }
  }
}

// ---------------------------------------------------------------- combine
// Row i of this rank's received tokens (rank-major: the dispatch output, or the partials above) goes back to row
// (recv_src_idx[i], rank) of its source's combine area, in x's dtype, with its rank-major weights [rows, topk].
// Rows past recv_info[0] (sync-free padding) are not sent.
template <int kUnroll, bool kF32>
__global__ void __launch_bounds__(kThreads) combine_send_kernel(
    void** peers, int rank, int num_ranks, const int4* __restrict__ x, const float* __restrict__ topk_weights,
    const int* __restrict__ recv_src_idx, const int* __restrict__ rank_prefix, const int* __restrict__ recv_info,
    int num_rows, int hidden, int topk, int64_t max_src_tokens) {
  const int R = num_ranks;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const CombineArea area(max_src_tokens, R, hidden * (kF32 ? 2 : 1), topk);
  const int units = hidden / (kF32 ? 4 : 8);
  const int rows = min(num_rows, recv_info[0]);
  const int total_warps = gridDim.x * kWarps;
  for (int i = blockIdx.x * kWarps + warp; i < rows; i += total_warps) {
    int s = 0;
    while (s < R - 1 && rank_prefix[s * R + rank] <= i) ++s;
    const int64_t out_row = static_cast<int64_t>(recv_src_idx[i]) * R + rank;
    char* dst_base = data_of(peers[s]);
    warp_copy_v4<kUnroll>(reinterpret_cast<int4*>(dst_base + area.x) + out_row * units,
                          x + static_cast<int64_t>(i) * units, units, lane);
    if (topk_weights)
      for (int k = lane; k < topk; k += kWarpSize)
        reinterpret_cast<float*>(dst_base + area.weights)[out_row * topk + k] =
            topk_weights[static_cast<int64_t>(i) * topk + k];
  }
  fence_system();  // the barrier kernel that follows publishes these stores
}

// Token t's copies sit in rows (t, r) of this rank's combine area for every rank r it was sent to; sum them in rank
// order (fp32) into out_x[t].
template <bool kF32>
__global__ void __launch_bounds__(kThreads) combine_reduce_kernel(
    void* local, int num_ranks, const bool* __restrict__ in_rank, int num_tokens, int hidden, int topk,
    int4* __restrict__ out_x, float* __restrict__ out_weights, int64_t max_src_tokens) {
  const int R = num_ranks;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  __shared__ int s_scratch[kWarps][kMaxRanks];
  __shared__ int s_ranks[kWarps][kMaxRanks];
  const CombineArea area(max_src_tokens, R, hidden * (kF32 ? 2 : 1), topk);
  const char* base = data_of(local);
  const int units = hidden / (kF32 ? 4 : 8);
  const int total_warps = gridDim.x * kWarps;
  for (int t = blockIdx.x * kWarps + warp; t < num_tokens; t += total_warps) {
    const bool* mask = in_rank + static_cast<int64_t>(t) * R;
    const int n = warp_compact<kWarps>(R, lane, s_scratch[warp], s_ranks[warp], [&](int r) { return mask[r] ? r : -1; });
    const int* ranks = s_ranks[warp];
    const int4* rows = reinterpret_cast<const int4*>(base + area.x) + static_cast<int64_t>(t) * R * units;
    int4* out = out_x + static_cast<int64_t>(t) * units;
    warp_sum_rows<kF32>(n, units, lane, [&](int j) { return rows + static_cast<int64_t>(ranks[j]) * units; },
                        [&](int u, const int4& v) { out[u] = v; });
    if (out_weights) {
      const float* w = reinterpret_cast<const float*>(base + area.weights) + static_cast<int64_t>(t) * R * topk;
      for (int k = lane; k < topk; k += kWarpSize) {
        float acc = 0.0f;
        for (int j = 0; j < n; ++j) acc += w[ranks[j] * topk + k];
        out_weights[static_cast<int64_t>(t) * topk + k] = acc;
      }
    }
    warp_sync();  // s_ranks is reused by the next token
  }
}

// ---------------------------------------------------------------- combine through the copy engine
// Why: with both GPUs of a 2x H200 pair sending, SM stores, copy engines and NCCL all move ~260 GB/s each way, so
// the stores buy no bandwidth but hold the SMs the sum needs; a copy engine holds none. In normal and cached modes
// the host knows how many rows it holds from each source (notify mirrors them), and those rows are contiguous in the
// rank-major x, so each source's share is one memcpy per chunk into our block of the source's combine area (row
// send_pos[t][me] for the source's token t). After each chunk a stream write-value publishes the rows landed so far;
// the source's reduce, running at the same time, waits per token for the rows it needs, so the sum overlaps the
// transfer. docs/intranode.md, "Combine through the copy engine".

// Every chunk from one rank to one peer goes on the same copy stream, in row order, so the peer's single flag per
// sender only grows within a call. Peers at distance 1, 2, ... (mod R) from the sender take streams 0, 1, ...
// (mod the stream count): several peers, several copy engines at once.
UCCL_HOST_DEVICE int copy_stream_of(int sender, int receiver, int num_ranks, int num_streams) {
  return ((receiver - sender + num_ranks) % num_ranks - 1) % num_streams;
}

// Token t's copies: this rank's own row straight from x (self_x = x + the first row received from itself), each
// peer r's from row send_pos[t][r] of r's block in our combine area, once r's flag covers that row. Summed in rank
// order in fp32 like combine_reduce_kernel, so the two paths agree bit for bit.
template <bool kF32>
__global__ void __launch_bounds__(kThreads) combine_reduce_blocks_kernel(
    void* local, int rank, int num_ranks, const bool* __restrict__ in_rank, const int* __restrict__ send_pos,
    const int4* __restrict__ self_x, const float* __restrict__ self_weights, int num_tokens, int hidden, int topk,
    int4* __restrict__ out_x, float* __restrict__ out_weights, int64_t max_src_tokens, ErrorWord* err,
    uint64_t timeout_ns) {
  const int R = num_ranks;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  __shared__ int s_scratch[kWarps][kMaxRanks];
  __shared__ int s_ranks[kWarps][kMaxRanks];
  __shared__ int s_failed;
  if (threadIdx.x == 0) s_failed = 0;
  __syncthreads();
  const int units_per_row = hidden / (kF32 ? 4 : 8);
  const CombineArea area(max_src_tokens, R, hidden * (kF32 ? 2 : 1), topk);
  const char* base = data_of(local);
  const int4* blocks = reinterpret_cast<const int4*>(base + area.x);
  const float* block_weights = reinterpret_cast<const float*>(base + area.weights);
  const uint64_t* flags = copy_flags_of(local);
  const int total_warps = gridDim.x * kWarps;
  for (int t = blockIdx.x * kWarps + warp; t < num_tokens; t += total_warps) {
    const bool* mask = in_rank + static_cast<int64_t>(t) * R;
    const int* pos = send_pos + static_cast<int64_t>(t) * R;
    const int n = warp_compact<kWarps>(R, lane, s_scratch[warp], s_ranks[warp], [&](int r) { return mask[r] ? r : -1; });
    const int* ranks = s_ranks[warp];
    for (int j = lane; j < n; j += kWarpSize) {
      const int r = ranks[j];
      if (r == rank) continue;
      const uint64_t need = static_cast<uint64_t>(pos[r]) + 1;
      const uint64_t deadline = now_ns() + timeout_ns;
      uint64_t seen;
      const uint64_t* flag = flags + r;
      // (A __nanosleep between polls made the whole combine slower on H200, 293 -> 375 us at 24 SMs: the sleeping
      // warps woke late for rows that had landed.)
      while ((seen = ld_acquire_sys_u64(flag)) < need) {
        if (*static_cast<volatile int*>(&s_failed) || now_ns() > deadline) {
          if (!s_failed) report(err, 1, rank, blockIdx.x, r, static_cast<int64_t>(seen), static_cast<int64_t>(need),
                                "copy-engine combine rows");
          s_failed = 1;
          break;
        }
      }
    }
    warp_sync();  // the lanes that acquired the flags order the whole warp's loads below
    if (*static_cast<volatile int*>(&s_failed)) return;  // the error word names the wait; the output is not valid
    auto row_of = [&](int j) {
      const int r = ranks[j];
      return r == rank ? self_x + static_cast<int64_t>(pos[r]) * units_per_row
                       : blocks + (static_cast<int64_t>(r) * max_src_tokens + pos[r]) * units_per_row;
    };
    int4* out = out_x + static_cast<int64_t>(t) * units_per_row;
    warp_sum_rows<kF32, 4, 4, true>(n, units_per_row, lane, row_of, [&](int u, const int4& v) { out[u] = v; });
    if (out_weights) {
      for (int k = lane; k < topk; k += kWarpSize) {
        float acc = 0.0f;
        for (int j = 0; j < n; ++j) {
          const int r = ranks[j];
          acc += r == rank ? self_weights[static_cast<int64_t>(pos[r]) * topk + k]
                           : ld_cg_f32(block_weights + (static_cast<int64_t>(r) * max_src_tokens + pos[r]) * topk + k);
        }
        out_weights[static_cast<int64_t>(t) * topk + k] = acc;
      }
    }
    warp_sync();  // s_ranks is reused by the next token
  }
}

void check(cudaError_t err, const char* what) { uccl_ep::throw_on_cuda_error(err, "uccl-ep intranode", what); }

struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int dev) {
    check(cudaGetDevice(&prev), "cudaGetDevice");
    if (prev != dev) check(cudaSetDevice(dev), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev) (void)cudaSetDevice(prev);
  }
};

int grid_of(int num_sms) { return num_sms > 0 ? num_sms : 1; }

// The argument checks every combine launcher shares (topk 0: the launcher takes no top-k bound of its own).
void check_combine_shape(int hidden, int elem_size, int topk) {
  if (hidden % 8) throw std::invalid_argument("combine: hidden must be a multiple of 8");
  if (elem_size != 2 && elem_size != 4) throw std::invalid_argument("combine: x must be bfloat16 or float32");
  if (topk > kMaxTopk) throw std::invalid_argument("combine: top-k above " + std::to_string(kMaxTopk));
}

}  // namespace

// ---------------------------------------------------------------- Context
Context::Context(int rank, int num_ranks, int64_t num_bytes, int device, double timeout_secs)
    : rank_(rank), num_ranks_(num_ranks), device_(device), num_bytes_(num_bytes),
      timeout_ns_(static_cast<uint64_t>(timeout_secs * 1e9)) {
  if (num_ranks < 1 || num_ranks > kMaxRanks)
    throw std::invalid_argument("intranode: num_ranks must be in [1, " + std::to_string(kMaxRanks) + "]");
  if (rank < 0 || rank >= num_ranks) throw std::invalid_argument("intranode: rank out of range");
  if (num_bytes < 0) throw std::invalid_argument("intranode: num_bytes must be >= 0");
  DeviceGuard guard(device_);
  check(cudaMalloc(&local_, kControlBytes + num_bytes_), "cudaMalloc of the NVLink buffer");
  check(cudaMemset(local_, 0, kControlBytes), "cudaMemset");
  void* host = nullptr;
  check(cudaHostAlloc(&host, sizeof(ErrorWord), cudaHostAllocMapped), "cudaHostAlloc");
  error_ = static_cast<ErrorWord*>(host);
  std::memset(error_, 0, sizeof(ErrorWord));
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_dev_), error_, 0), "cudaHostGetDevicePointer");
  const size_t counts_bytes = sizeof(HostCounts) + sizeof(int32_t) * kMaxExpertCountInts;
  check(cudaHostAlloc(&host, counts_bytes, cudaHostAllocMapped), "cudaHostAlloc");
  host_counts_ = static_cast<HostCounts*>(host);
  std::memset(host_counts_, 0, counts_bytes);
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_counts_dev_), host_counts_, 0),
        "cudaHostGetDevicePointer");
  peers_.assign(num_ranks_, nullptr);
  peers_[rank_] = local_;
  check(cudaMalloc(reinterpret_cast<void**>(&peers_dev_), sizeof(void*) * num_ranks_), "cudaMalloc");
  // Grid of the local kernels: every SM, as many resident blocks as fit. Asked once here: a launch may be under
  // CUDA-graph capture, and this never changes for the device.
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_), "cudaDeviceGetAttribute");
  sms_ = sms;
  const void* local_kernels[kLocalKernels] = {
      reinterpret_cast<const void*>(dispatch_recv_kernel<4>),
      reinterpret_cast<const void*>(combine_reduce_kernel<false>),
      reinterpret_cast<const void*>(combine_reduce_kernel<true>),
      expert_major::kernel_address(expert_major::kPartialsBf16),
      expert_major::kernel_address(expert_major::kPartialsF32),
      reinterpret_cast<const void*>(combine_reduce_blocks_kernel<false>),
      reinterpret_cast<const void*>(combine_reduce_blocks_kernel<true>),
      expert_major::kernel_address(expert_major::kCopy)};
  for (int i = 0; i < kLocalKernels; ++i) {
    int per_sm = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, local_kernels[i], kThreads, 0),
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    whole_gpu_grid_[i] = std::max(1, sms * std::max(1, per_sm));
  }
}

int Context::local_grid(LocalKernel k, int local_sms) const {
  return local_sms > 0 ? local_sms : whole_gpu_grid_[k];
}

Context::~Context() {
  try {
    destroy();
  } catch (...) {
  }
}

std::string Context::ipc_handle() const {
  cudaIpcMemHandle_t h;
  check(cudaIpcGetMemHandle(&h, local_), "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

void Context::open_peers(const std::vector<std::string>& handles) {
  if (static_cast<int>(handles.size()) != num_ranks_)
    throw std::invalid_argument("open_peers: expected one handle per rank");
  DeviceGuard guard(device_);
  for (int r = 0; r < num_ranks_; ++r) {
    if (r == rank_) continue;
    if (handles[r].size() != sizeof(cudaIpcMemHandle_t)) throw std::invalid_argument("open_peers: malformed handle");
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handles[r].data(), sizeof(h));
    void* p = nullptr;
    check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
          ("cudaIpcOpenMemHandle of rank " + std::to_string(r)).c_str());
    peers_[r] = p;
  }
  check(cudaMemcpy(peers_dev_, peers_.data(), sizeof(void*) * num_ranks_, cudaMemcpyHostToDevice), "cudaMemcpy");
  opened_ = true;
}

void Context::destroy() {
  if (!local_) return;
  DeviceGuard guard(device_);
  (void)cudaDeviceSynchronize();
  for (int r = 0; r < num_ranks_; ++r)
    if (r != rank_ && peers_[r]) (void)cudaIpcCloseMemHandle(peers_[r]);
  peers_.clear();
  (void)cudaFree(peers_dev_);
  (void)cudaFree(local_);
  (void)cudaFreeHost(error_);
  (void)cudaFreeHost(host_counts_);
  for (void* cs : copy_streams_) (void)cudaStreamDestroy(static_cast<cudaStream_t>(cs));
  for (void* e : copy_joins_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(e));
  if (copy_fork_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(copy_fork_));
  copy_streams_.clear();
  copy_joins_.clear();
  copy_fork_ = nullptr;
  write_value64_ = nullptr;
  local_ = nullptr;
  peers_dev_ = nullptr;
  error_ = nullptr;
  host_counts_ = nullptr;
  opened_ = false;
}

std::string Context::error_message() const {
  if (!error_) return "";
  const volatile ErrorWord* e = error_;
  if (e->code == 0) return "";
  char buf[512];
  const char* kinds[] = {"", "GPU wait timed out", "receive buffer too small", "num_worst_tokens too small"};
  std::snprintf(buf, sizeof(buf), "uccl-ep intranode: %s on rank %d (block %d, %s): peer %d, counter %lld, expected %lld",
                kinds[e->code >= 0 && e->code <= 3 ? e->code : 0], e->rank, e->channel, const_cast<const char*>(e->what),
                e->peer, static_cast<long long>(e->observed), static_cast<long long>(e->expected));
  return buf;
}

void Context::clear_error() {
  if (error_) std::memset(error_, 0, sizeof(ErrorWord));
}

void Context::reset_host_counts() { host_counts_->ready = 0; }

std::vector<int64_t> Context::wait_host_counts(int num_local_experts) const {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(timeout_ns_);
  int spins = 0;
  while (host_counts_->ready != host_seq_) {
    if (error_->code != 0 && error_->code != 2) throw std::runtime_error(error_message());
    if (++spins > 1024) {
      if (std::chrono::steady_clock::now() > deadline)
        throw std::runtime_error("uccl-ep intranode: rank " + std::to_string(rank_) +
                                 " timed out waiting for notify's counts on the host (counter ready=" +
                                 std::to_string(host_counts_->ready) + ", expected " + std::to_string(host_seq_) + ")");
      if (spins > 1 << 20) std::this_thread::yield();
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  std::vector<int64_t> out;
  out.push_back(host_counts_->num_recv_tokens);
  out.push_back(host_counts_->overflow_rows_needed);
  for (int l = 0; l < num_local_experts; ++l) out.push_back(host_counts_->per_expert[l]);
  for (int r = 0; r < num_ranks_; ++r) out.push_back(host_counts_->rows_from[r]);
  return out;
}

void Context::barrier(uintptr_t stream) {
  barrier_kernel<<<1, kWarpSize, 0, reinterpret_cast<cudaStream_t>(stream)>>>(peers_dev_, rank_, num_ranks_, error_dev_,
                                                                              timeout_ns_);
  check(cudaGetLastError(), "barrier_kernel launch");
}

void Context::notify(uintptr_t num_tokens_per_rank, uintptr_t num_tokens_per_expert, uintptr_t is_token_in_rank,
                     int num_tokens, int num_experts, int64_t rows_capacity, uintptr_t rank_prefix_matrix,
                     uintptr_t recv_info, uintptr_t send_pos, uintptr_t stream) {
  if (static_cast<int64_t>(num_experts) > kMaxExpertCountInts)
    throw std::invalid_argument("notify: too many experts for the control region");
  notify_kernel<<<1 + num_ranks_, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      peers_dev_, rank_, num_ranks_, reinterpret_cast<const int*>(num_tokens_per_rank),
      reinterpret_cast<const int*>(num_tokens_per_expert), reinterpret_cast<const bool*>(is_token_in_rank), num_tokens,
      num_experts, rows_capacity, reinterpret_cast<int*>(rank_prefix_matrix), reinterpret_cast<int*>(recv_info),
      reinterpret_cast<int*>(send_pos), error_dev_, host_counts_dev_, ++host_seq_, timeout_ns_);
  check(cudaGetLastError(), "notify_kernel launch");
}

void Context::dispatch_send(uintptr_t x, uintptr_t x_scales, uintptr_t topk_idx, uintptr_t topk_weights,
                            uintptr_t send_pos, uintptr_t rank_prefix_matrix, uintptr_t recv_info, int num_tokens,
                            int hidden_bytes, int num_scales, int topk, int num_experts, int64_t rows_capacity,
                            int own_rows, uintptr_t self_x, uintptr_t self_scales, int64_t self_rows, int num_sms,
                            uintptr_t stream) {
  if (hidden_bytes % 16) throw std::invalid_argument("dispatch: hidden bytes must be a multiple of 16");
  if (own_rows != kOwnInArea && own_rows != kOwnInOutput) throw std::invalid_argument("dispatch_send: bad own_rows");
  if (own_rows == kOwnInOutput && self_x == 0 && self_rows > 0)
    throw std::invalid_argument("dispatch_send: own rows into the output need self_x");
  if (num_tokens == 0) return;
  dispatch_send_kernel<4><<<grid_of(num_sms), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      peers_dev_, rank_, num_ranks_, reinterpret_cast<const int4*>(x), reinterpret_cast<const float*>(x_scales),
      reinterpret_cast<const int64_t*>(topk_idx), reinterpret_cast<const float*>(topk_weights),
      reinterpret_cast<const int*>(send_pos), reinterpret_cast<const int*>(rank_prefix_matrix),
      reinterpret_cast<const int*>(recv_info), num_tokens, hidden_bytes, num_scales, topk, num_experts / num_ranks_,
      rows_capacity, own_rows, reinterpret_cast<int4*>(self_x), reinterpret_cast<float*>(self_scales), self_rows);
  check(cudaGetLastError(), "dispatch_send_kernel launch");
}

void Context::dispatch_recv(uintptr_t recv_x, uintptr_t recv_scales, uintptr_t recv_topk_idx,
                            uintptr_t recv_topk_weights, uintptr_t recv_src_idx, uintptr_t recv_info,
                            uintptr_t rank_prefix_matrix, int own_rows, const std::vector<int64_t>& rows_from,
                            int64_t out_rows, int hidden_bytes, int num_scales, int topk, int64_t rows_capacity,
                            int local_sms, uintptr_t stream) {
  if (own_rows != kOwnInArea && own_rows != kOwnInOutput) throw std::invalid_argument("dispatch_recv: bad own_rows");
  if (out_rows == 0) return;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const bool copy_engine = !rows_from.empty() && recv_x != 0;
  int64_t num_recv = 0;
  if (copy_engine) {
    if (own_rows != kOwnInOutput)
      throw std::invalid_argument("dispatch_recv: the copy engine copies the peers' rows of a self-direct receive only");
    if (static_cast<int>(rows_from.size()) != num_ranks_)
      throw std::invalid_argument("dispatch_recv: rows_from needs one count per rank");
    // Rank-major rows: the area's row i is the output's row i, so the peers' rows are the (at most) two blocks
    // around the own ones, which the send already stored in the output.
    int64_t self_begin = 0;
    for (int r = 0; r < num_ranks_; ++r) {
      if (rows_from[r] < 0) throw std::invalid_argument("dispatch_recv: negative rows_from");
      if (r < rank_) self_begin += rows_from[r];
      num_recv += rows_from[r];
    }
    if (num_recv > std::min(out_rows, rows_capacity))
      throw std::invalid_argument("dispatch_recv: rows_from adds up to " + std::to_string(num_recv) +
                                  " rows, more than the output's " + std::to_string(out_rows) + " or the area's " +
                                  std::to_string(rows_capacity));
    const int64_t blocks[2][2] = {{0, self_begin}, {self_begin + rows_from[rank_], num_recv}};
    DeviceGuard guard(device_);
    auto cs = static_cast<cudaStream_t>(fork_copy_streams(s, 1)[0]);  // behind the barrier that published the rows
    const RecvArea area(rows_capacity, hidden_bytes, num_scales, topk);
    const char* base = data_of(local_);
    const int64_t scale_bytes = static_cast<int64_t>(num_scales) * 4;
    for (const auto& b : blocks) {
      if (b[1] <= b[0]) continue;
      check(cudaMemcpyAsync(reinterpret_cast<char*>(recv_x) + b[0] * hidden_bytes, base + area.x + b[0] * hidden_bytes,
                            (b[1] - b[0]) * hidden_bytes, cudaMemcpyDeviceToDevice, cs),
            "cudaMemcpyAsync (received rows)");
      if (recv_scales && scale_bytes)
        check(cudaMemcpyAsync(reinterpret_cast<char*>(recv_scales) + b[0] * scale_bytes,
                              base + area.scales + b[0] * scale_bytes, (b[1] - b[0]) * scale_bytes,
                              cudaMemcpyDeviceToDevice, cs),
              "cudaMemcpyAsync (received scales)");
    }
  }
  // With the copy engine on the peers' rows, a cached rank-major receive (no metadata, own rows already in place,
  // no padding) leaves the kernel nothing to do.
  const bool kernel_needed = !copy_engine || recv_topk_idx || recv_src_idx || out_rows > num_recv;
  if (kernel_needed) {
    dispatch_recv_kernel<4><<<local_grid(kLocalRecv, local_sms), kThreads, 0, s>>>(
        local_, rank_, num_ranks_, reinterpret_cast<int4*>(recv_x), reinterpret_cast<float*>(recv_scales),
        reinterpret_cast<int64_t*>(recv_topk_idx), reinterpret_cast<float*>(recv_topk_weights),
        reinterpret_cast<int*>(recv_src_idx), reinterpret_cast<const int*>(recv_info),
        reinterpret_cast<const int*>(rank_prefix_matrix), own_rows == kOwnInOutput, !copy_engine, out_rows,
        hidden_bytes, num_scales, topk, rows_capacity, error_dev_);
    check(cudaGetLastError(), "dispatch_recv_kernel launch");
  }
  if (copy_engine) join_copy_streams(s, 1);
}

void Context::expert_major(uintptr_t src_x, uintptr_t src_scales, uintptr_t recv_topk_idx,
                           uintptr_t recv_topk_weights, uintptr_t recv_info, int64_t out_rows, int64_t expert_rows,
                           int num_local_experts, int alignment, int hidden_bytes, int num_scales, int topk,
                           uintptr_t out_x, uintptr_t out_scales, uintptr_t em_token, uintptr_t em_slot,
                           uintptr_t em_expert, uintptr_t em_weights, uintptr_t slot_of, int local_sms,
                           uintptr_t stream) {
  // the receive area holds the rows densely; one block per SM clears the sync-free tail
  expert_major::layout(recv_topk_idx, recv_topk_weights, recv_info, out_rows, expert_rows, num_local_experts,
                       alignment, topk, em_token, em_slot, em_expert, em_weights, slot_of, sms_, stream);
  if (num_local_experts == 0) return;
  expert_major::copy(src_x, hidden_bytes, src_scales, 4 * int64_t(num_scales), recv_info, out_rows, expert_rows,
                     hidden_bytes, num_scales, topk, slot_of, em_token, out_x, out_scales,
                     local_grid(kLocalExpertCopy, local_sms), stream);
}

void Context::expert_major_partials(uintptr_t x, uintptr_t topk_weights, uintptr_t slot_of, uintptr_t recv_info,
                                    int num_rows, int hidden, int elem_size, int topk, uintptr_t partials,
                                    uintptr_t out_topk_weights, int local_sms, uintptr_t stream) {
  check_combine_shape(hidden, elem_size, topk);
  // Local work only: local_sms (0: the whole GPU), not num_sms (docs/intranode.md, "Combine of expert-major rows").
  expert_major::partials(x, topk_weights, slot_of, recv_info, num_rows, hidden, elem_size, topk, partials,
                         out_topk_weights, local_grid(elem_size == 4 ? kLocalPartialsF32 : kLocalPartialsBf16,
                                                      local_sms), stream);
}

void Context::combine_send(uintptr_t x, uintptr_t topk_weights, uintptr_t recv_src_idx, uintptr_t rank_prefix_matrix,
                           uintptr_t recv_info, int num_rows, int hidden, int elem_size, int topk,
                           int64_t max_src_tokens, int num_sms, uintptr_t stream) {
  check_combine_shape(hidden, elem_size, 0);
  if (num_rows == 0) return;
  auto kernel = elem_size == 4 ? combine_send_kernel<4, true> : combine_send_kernel<4, false>;
  kernel<<<grid_of(num_sms), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      peers_dev_, rank_, num_ranks_, reinterpret_cast<const int4*>(x), reinterpret_cast<const float*>(topk_weights),
      reinterpret_cast<const int*>(recv_src_idx), reinterpret_cast<const int*>(rank_prefix_matrix),
      reinterpret_cast<const int*>(recv_info), num_rows, hidden, topk, max_src_tokens);
  check(cudaGetLastError(), "combine_send_kernel launch");
}

void Context::combine_reduce(uintptr_t is_token_in_rank, int num_tokens, int hidden, int elem_size, int topk,
                             uintptr_t out_x, uintptr_t out_topk_weights, int64_t max_src_tokens, int local_sms,
                             uintptr_t stream) {
  if (num_tokens == 0) return;
  auto kernel = elem_size == 4 ? combine_reduce_kernel<true> : combine_reduce_kernel<false>;
  kernel<<<local_grid(elem_size == 4 ? kLocalReduceF32 : kLocalReduceBf16, local_sms), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      local_, num_ranks_, reinterpret_cast<const bool*>(is_token_in_rank), num_tokens, hidden, topk,
      reinterpret_cast<int4*>(out_x), reinterpret_cast<float*>(out_topk_weights), max_src_tokens);
  check(cudaGetLastError(), "combine_reduce_kernel launch");
}

void Context::combine_copy_engine(uintptr_t x, uintptr_t topk_weights, const std::vector<int64_t>& rows_from,
                                  uintptr_t is_token_in_rank, uintptr_t send_pos, int num_tokens, int hidden,
                                  int elem_size, int topk, uintptr_t out_x, uintptr_t out_topk_weights,
                                  int64_t max_src_tokens, int64_t chunk_bytes, int num_streams, int local_sms,
                                  uintptr_t stream) {
  check_combine_shape(hidden, elem_size, topk);
  if (static_cast<int>(rows_from.size()) != num_ranks_)
    throw std::invalid_argument("combine_copy_engine: rows_from needs one count per rank");
  if (chunk_bytes <= 0) throw std::invalid_argument("combine_copy_engine: chunk_bytes must be > 0");
  // A block past a peer's area would land in its next block: refuse before anything is queued.
  for (int r = 0; r < num_ranks_; ++r)
    if (rows_from[r] < 0 || rows_from[r] > max_src_tokens)
      throw std::invalid_argument("combine_copy_engine: " + std::to_string(rows_from[r]) + " rows for rank " +
                                  std::to_string(r) + " exceed its combine area of " + std::to_string(max_src_tokens) +
                                  " tokens");
  DeviceGuard guard(device_);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  barrier(stream);  // every peer is done reading the combine area of its previous combine
  const int64_t row_bytes = static_cast<int64_t>(hidden) * elem_size;
  const CombineArea area(max_src_tokens, num_ranks_, hidden * (elem_size == 4 ? 2 : 1), topk);
  std::vector<int64_t> start(num_ranks_ + 1, 0);
  for (int r = 0; r < num_ranks_; ++r) start[r + 1] = start[r] + rows_from[r];
  const char* src = reinterpret_cast<const char*>(x);
  bool any_copy = false;
  int64_t max_rows = 0;  // the most rows we copy to one peer
  for (int r = 0; r < num_ranks_; ++r)
    if (r != rank_) {
      any_copy |= rows_from[r] > 0;
      max_rows = std::max(max_rows, rows_from[r]);
    }
  const int64_t chunk_rows = std::max<int64_t>(1, chunk_bytes / row_bytes);
  const int streams = std::max(1, std::min({num_streams, kMaxCopyStreams, num_ranks_ - 1}));
  if (any_copy) {
    std::vector<cudaStream_t> cs;
    for (void* c : fork_copy_streams(s, streams)) cs.push_back(static_cast<cudaStream_t>(c));  // behind the barrier
    const int64_t my_row0 = static_cast<int64_t>(rank_) * max_src_tokens;  // our block in every peer's area
    auto stream_of = [&](int r) { return cs[copy_stream_of(rank_, r, num_ranks_, streams)]; };
    if (topk_weights) {  // ahead of the peer's first chunk on its stream: every flag then covers the weights too
      const int64_t w_row = static_cast<int64_t>(topk) * sizeof(float);
      for (int r = 0; r < num_ranks_; ++r)
        if (r != rank_ && rows_from[r] > 0)
          check(cudaMemcpyAsync(data_of(peers_[r]) + area.weights + my_row0 * w_row,
                                reinterpret_cast<const char*>(topk_weights) + start[r] * w_row, rows_from[r] * w_row,
                                cudaMemcpyDeviceToDevice, stream_of(r)),
                "cudaMemcpyAsync (combine weights)");
    }
    // Chunks round-robin over the peers (the host queues them in that order), so every source's reduce makes
    // progress from the first chunk on.
    for (int64_t c0 = 0; c0 < max_rows; c0 += chunk_rows) {
      for (int r = 0; r < num_ranks_; ++r) {
        if (r == rank_ || c0 >= rows_from[r]) continue;
        const int64_t c1 = std::min(rows_from[r], c0 + chunk_rows);
        check(cudaMemcpyAsync(data_of(peers_[r]) + area.x + (my_row0 + c0) * row_bytes,
                              src + (start[r] + c0) * row_bytes, (c1 - c0) * row_bytes, cudaMemcpyDeviceToDevice,
                              stream_of(r)),
              "cudaMemcpyAsync (combine rows)");
        // A stream memory operation: no SM to wait for. Its implicit memory barrier orders it after the chunk.
        write_value64(stream_of(r), copy_flags_of(peers_[r]) + rank_, static_cast<uint64_t>(c1));
      }
    }
  }
  if (num_tokens > 0) {
    const bool f32 = elem_size == 4;
    auto kernel = f32 ? combine_reduce_blocks_kernel<true> : combine_reduce_blocks_kernel<false>;
    const int grid = local_grid(f32 ? kLocalReduceBlocksF32 : kLocalReduceBlocksBf16, local_sms);
    kernel<<<grid, kThreads, 0, s>>>(
        local_, rank_, num_ranks_, reinterpret_cast<const bool*>(is_token_in_rank),
        reinterpret_cast<const int*>(send_pos), reinterpret_cast<const int4*>(src + start[rank_] * row_bytes),
        topk_weights ? reinterpret_cast<const float*>(topk_weights) + start[rank_] * topk : nullptr, num_tokens,
        hidden, topk, reinterpret_cast<int4*>(out_x), reinterpret_cast<float*>(out_topk_weights), max_src_tokens,
        error_dev_, timeout_ns_);
    check(cudaGetLastError(), "combine_reduce_blocks_kernel launch");
  }
  if (any_copy) join_copy_streams(s, streams);
  // Our reduce waited for the last value each peer writes into its flag this call (every row a peer sends is some
  // token's), so clearing the flags here, before our next barrier, leaves no stale "landed" for its next combine.
  check(cudaMemsetAsync(copy_flags_of(local_), 0, sizeof(uint64_t) * kMaxRanks, s),
        "cudaMemsetAsync (combine flags)");
}

std::vector<void*> Context::fork_copy_streams(void* stream, int n) {
  ensure_copy_streams();
  check(cudaEventRecord(static_cast<cudaEvent_t>(copy_fork_), static_cast<cudaStream_t>(stream)), "cudaEventRecord");
  for (int i = 0; i < n; ++i)
    check(cudaStreamWaitEvent(static_cast<cudaStream_t>(copy_streams_[i]), static_cast<cudaEvent_t>(copy_fork_), 0),
          "cudaStreamWaitEvent");
  return std::vector<void*>(copy_streams_.begin(), copy_streams_.begin() + n);
}

void Context::join_copy_streams(void* stream, int n) {
  for (int i = 0; i < n; ++i) {
    auto join = static_cast<cudaEvent_t>(copy_joins_[i]);
    check(cudaEventRecord(join, static_cast<cudaStream_t>(copy_streams_[i])), "cudaEventRecord");
    check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), join, 0), "cudaStreamWaitEvent");
  }
}

void Context::write_value64(void* stream, uint64_t* address, uint64_t value) {
#if defined(UCCL_EP_HIP)
  check(hipStreamWriteValue64(static_cast<hipStream_t>(stream), address, value, 0), "hipStreamWriteValue64");
#else
  using WriteValue64 = int (*)(cudaStream_t, unsigned long long, unsigned long long, unsigned int);
  const int rc = reinterpret_cast<WriteValue64>(write_value64_)(static_cast<cudaStream_t>(stream),
                                                                 reinterpret_cast<uintptr_t>(address), value, 0);
  if (rc != 0) throw std::runtime_error("uccl-ep intranode: cuStreamWriteValue64 failed with CUresult " +
                                        std::to_string(rc));
#endif
}

void Context::ensure_copy_streams() {
  if (copy_fork_) return;
  for (int i = 0; i < kMaxCopyStreams; ++i) {
    cudaStream_t cs;
    cudaEvent_t join;
    check(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    copy_streams_.push_back(cs);
    check(cudaEventCreateWithFlags(&join, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    copy_joins_.push_back(join);
  }
#if defined(UCCL_EP_HIP)
  write_value64_ = reinterpret_cast<void*>(&hipStreamWriteValue64);
#else
  // Through the runtime's entry-point query: the driver library is not linked directly.
  cudaDriverEntryPointQueryResult found;
  void* fn = nullptr;
  if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess || fn == nullptr)
    throw std::runtime_error("uccl-ep intranode: the CUDA driver has no cuStreamWriteValue64, which the copy-engine "
                             "copy-engine paths need: set UCCL_EP_COMBINE_COPY_ENGINE=0 and UCCL_EP_DISPATCH_COPY_ENGINE=0");
  write_value64_ = fn;
#endif
  cudaEvent_t e;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  copy_fork_ = e;  // last: its presence says every member above exists
}

int64_t dispatch_rows_capacity(int64_t data_bytes, int hidden_bytes, int num_scales, int topk) {
  const int64_t per_row = hidden_bytes + 4 * num_scales + 12 * topk + 4;
  int64_t cap = (data_bytes - 5 * 16) / per_row;
  while (cap > 0 && RecvArea(cap, hidden_bytes, num_scales, topk).end > data_bytes) --cap;
  return cap > 0 ? cap : 0;
}

int64_t combine_tokens_capacity(int64_t data_bytes, int num_ranks, int hidden, int topk) {
  // `hidden` in bf16 units: a float32 row counts as 2 * hidden.
  const int64_t per_token = static_cast<int64_t>(num_ranks) * (2 * hidden + 4 * topk);
  int64_t cap = (data_bytes - 2 * 16) / per_token;
  while (cap > 0 && CombineArea(cap, num_ranks, hidden, topk).end > data_bytes) --cap;
  return cap > 0 ? cap : 0;
}

int64_t max_experts_in_control() { return kMaxExpertCountInts; }

std::vector<int64_t> dispatch_area_offsets(int64_t rows_capacity, int hidden_bytes, int num_scales, int topk) {
  const RecvArea a(rows_capacity, hidden_bytes, num_scales, topk);
  return {static_cast<int64_t>(kControlBytes) + a.x, static_cast<int64_t>(kControlBytes) + a.scales};
}

}  // namespace uccl_ep::intranode
