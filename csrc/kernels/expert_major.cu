// Expert-major rows: the receive grouped by local expert (the plan, then the payload copy) and the combine's partial
// sums back from them. Both intranode and internode receive rank-major rows first; these kernels turn them into
// expert-major rows and back (docs/intranode.md, "Modes" and "Combine of expert-major rows"; docs/internode.md,
// "Expert-major rows").
#include <stdexcept>
#include <string>

#include "expert_major.hpp"
#include "uccl_ep/block_lists.cuh"
#include "uccl_ep/cuda_errors.cuh"
#include "uccl_ep/portability.cuh"
#include "uccl_ep/row_sum.cuh"

namespace uccl_ep::expert_major {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarpSize;

// Expert-major input, local half: rank-major row i (i < min(num_rows, recv_info[0])) becomes the sum of its local
// experts' rows slot_of[i][k], k in increasing order, in fp32, rounded once to x's dtype; with weights, the
// expert-major weight of each (row, k) goes back to its slot (0 where k is not local). One partial sum per (token,
// rank) then crosses the link, as with DeepEP behind Megatron's flex dispatcher (docs/intranode.md, "Combine of
// expert-major rows"). Why a kernel of its own and not part of combine_send: this pass reads every expert-major row
// (~470 MB per call at DeepSeek-V3 shape) and is bound by HBM and load latency, so it wants the whole GPU, while the
// communication kernel is held to `num_sms` SMs; fused, the reduction ran on those few SMs only. Rows past
// recv_info[0] (sync-free padding) are not touched: combine_send never reads them either.
template <bool kF32>
__global__ void __launch_bounds__(kThreads) expert_major_partials_kernel(
    const int4* __restrict__ x, const float* __restrict__ topk_weights, const int* __restrict__ slot_of,
    const int* __restrict__ recv_info, int num_rows, int hidden, int topk, int4* __restrict__ partials,
    float* __restrict__ out_weights) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  __shared__ int s_scratch[kWarps][kMaxTopk];
  __shared__ int s_slots[kWarps][kMaxTopk];
  const int units = hidden / (kF32 ? 4 : 8);
  const int rows = min(num_rows, recv_info[0]);
  const int total_warps = gridDim.x * kWarps;
  for (int i = blockIdx.x * kWarps + warp; i < rows; i += total_warps) {
    const int* slots_of_row = slot_of + static_cast<int64_t>(i) * topk;
    const int n = warp_compact<kWarps>(topk, lane, s_scratch[warp], s_slots[warp], [&](int k) { return slots_of_row[k]; });
    const int* slots = s_slots[warp];
    int4* dst = partials + static_cast<int64_t>(i) * units;
    // Plain stores: combine_send, next on the stream, reads the partials back (some may still be in L2).
    warp_sum_rows<kF32>(n, units, lane, [&](int j) { return x + static_cast<int64_t>(slots[j]) * units; },
                        [&](int u, const int4& v) { dst[u] = v; });
    if (out_weights)
      for (int k = lane; k < topk; k += kWarpSize) {
        const int slot = slots_of_row[k];  // expert-major weights are one per row: each goes back to its slot
        out_weights[static_cast<int64_t>(i) * topk + k] = slot >= 0 ? topk_weights[slot] : 0.0f;
      }
    warp_sync();  // s_slots is reused by the next row
  }
}

// Two kernels. The plan (one block per local expert) scans the received rows in order and gives each (row, k) with
// recv_topk_idx == expert the next row of the expert's segment (segments start at the aligned prefix of the
// counts): em_token / em_slot / em_expert / em_weights per expert-major row, slot_of per (row, k); -1 on padding
// rows. Blocks past the experts share the metadata of the sync-free tail (every row after the last segment): in
// sync-free mode it can be half the output (65536 worst-case rows for 32768 real ones at DeepSeek-V3 shape on 2
// ranks). The copy (the local SMs, the whole GPU by default) then moves the payload: each received row is read once and stored to every
// slot it took, and every row with em_token == -1 is zeroed. It was one kernel whose expert blocks also copied
// their own segment: ~one block per SM, each source row read once per expert it went to; the expansion took
// 287 us at DeepSeek-V3 shape on H200 (470 MB written).
__global__ void __launch_bounds__(kThreads) expert_major_plan_kernel(
    const int64_t* __restrict__ recv_topk_idx, const float* __restrict__ recv_topk_weights,
    const int* __restrict__ recv_info, int64_t out_rows, int64_t expert_rows, int num_local_experts, int alignment,
    int topk, int64_t* __restrict__ em_token, int64_t* __restrict__ em_slot, int64_t* __restrict__ em_expert,
    float* __restrict__ em_weights, int* __restrict__ slot_of) {
  const int expert = blockIdx.x;
  __shared__ int64_t s_begin;
  __shared__ int s_sum[kThreads];
  if (threadIdx.x == 0) {  // an expert's segment start; for a tail block, the end of the last segment
    int64_t begin = 0;
    for (int l = 0; l < num_local_experts; ++l) {
      const int64_t padded = (static_cast<int64_t>(recv_info[2 + l]) + alignment - 1) / alignment * alignment;
      if (l < expert) begin += padded;
    }
    s_begin = begin;
  }
  __syncthreads();
  if (expert >= num_local_experts) {  // tail block t of T: rows tail + t*blockDim + thread, strided by T*blockDim
    const int64_t t = expert - num_local_experts, T = gridDim.x - num_local_experts;
    for (int64_t p = s_begin + t * blockDim.x + threadIdx.x; p < expert_rows; p += T * blockDim.x) {
      em_token[p] = -1;
      em_slot[p] = -1;
      em_expert[p] = -1;
      if (em_weights) em_weights[p] = 0.0f;
    }
    return;
  }
  const int64_t num_recv = min(static_cast<int64_t>(recv_info[0]), out_rows);
  const int64_t count = recv_info[2 + expert];
  const int64_t padded = (count + alignment - 1) / alignment * alignment;
  const int64_t begin = s_begin;
  int64_t carry = 0;  // rows of this expert found in earlier chunks (the same value in every thread)
  for (int64_t chunk = 0; chunk < num_recv; chunk += blockDim.x) {
    const int64_t row = chunk + threadIdx.x;
    int hit_k = -1;
    if (row < num_recv)
      for (int k = 0; k < topk; ++k)
        if (recv_topk_idx[row * topk + k] == expert) {
          hit_k = k;
          break;
        }
    int chunk_hits;
    const int64_t p = begin + carry + block_exclusive_scan(hit_k >= 0 ? 1 : 0, s_sum, &chunk_hits);
    const bool hit = hit_k >= 0;
    if (hit && p < expert_rows) {
      if (slot_of) slot_of[row * topk + hit_k] = static_cast<int>(p);
      em_token[p] = row;
      em_slot[p] = hit_k;
      em_expert[p] = expert;
      if (em_weights) em_weights[p] = recv_topk_weights[row * topk + hit_k];
    }
    carry += chunk_hits;
  }
  // Padding rows of this segment (the tail blocks clear what follows the last one).
  const int64_t pad_end = min(begin + padded, expert_rows);
  for (int64_t p = begin + count + threadIdx.x; p < pad_end; p += blockDim.x) {
    em_token[p] = -1;
    em_slot[p] = -1;
    em_expert[p] = -1;
    if (em_weights) em_weights[p] = 0.0f;
  }
}

// Payload of the expansion: rank-major row i goes to each of its slots slot_of[i][k] >= 0 (loaded once, stored to
// all), then every expert-major row the plan left without a token (em_token == -1: segment padding and the sync-free
// tail) is zeroed. The source rows are src_x_stride bytes apart: a dense output, or the records of an area.
__global__ void __launch_bounds__(kThreads) expert_major_copy_kernel(
    const char* __restrict__ src_x, int64_t src_x_stride, const char* __restrict__ src_scales,
    int64_t src_scales_stride, const int* __restrict__ recv_info, int64_t out_rows, int64_t expert_rows,
    int hidden_bytes, int num_scales, int topk, const int* __restrict__ slot_of, const int64_t* __restrict__ em_token,
    int4* __restrict__ out_x, float* __restrict__ out_scales) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  __shared__ int s_scratch[kWarps][kMaxTopk];
  __shared__ int s_slots[kWarps][kMaxTopk];
  const int units = hidden_bytes / 16;
  const int64_t num_recv = min(static_cast<int64_t>(recv_info[0]), out_rows);
  const int64_t total_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int4 zero = make_int4(0, 0, 0, 0);
  for (int64_t i = blockIdx.x * kWarps + warp; i < num_recv; i += total_warps) {
    const int* slots_of_row = slot_of + i * topk;
    const int n = warp_compact<kWarps>(topk, lane, s_scratch[warp], s_slots[warp], [&](int k) { return slots_of_row[k]; });
    const int* slots = s_slots[warp];
    warp_copy_v4_to_each<4>(reinterpret_cast<const int4*>(src_x + i * src_x_stride), units, lane, n,
                            [&](int j) { return out_x + static_cast<int64_t>(slots[j]) * units; });
    for (int sc = lane; src_scales != nullptr && sc < num_scales; sc += kWarpSize) {
      const float v = reinterpret_cast<const float*>(src_scales + i * src_scales_stride)[sc];
      for (int j = 0; j < n; ++j) out_scales[static_cast<int64_t>(slots[j]) * num_scales + sc] = v;
    }
    warp_sync();  // s_slots is reused by the next row
  }
  for (int64_t p = blockIdx.x * kWarps + warp; p < expert_rows; p += total_warps) {
    if (em_token[p] >= 0) continue;
    for (int u = lane; u < units; u += kWarpSize) out_x[p * units + u] = zero;
    for (int sc = lane; out_scales != nullptr && sc < num_scales; sc += kWarpSize) out_scales[p * num_scales + sc] = 0.0f;
  }
}

// The sender's pair ranks (expert_major.hpp, pair_ranks). Each block owns kRankExperts experts and reads topk_idx
// once for all of them: one block per expert read the ids 256 times at DeepSeek-V3 shape. Each thread takes a run of
// consecutive pairs, counts its hits, and a block scan per expert gives each run its first rank.
constexpr int kRankExperts = 4;

__global__ void __launch_bounds__(kThreads) pair_ranks_kernel(const int64_t* __restrict__ topk_idx, int64_t pairs,
                                                              int num_experts, int* __restrict__ ranks) {
  __shared__ int s_sum[kThreads];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kRankExperts;
  const int64_t per = (pairs + blockDim.x - 1) / blockDim.x;
  const int64_t lo = min(pairs, threadIdx.x * per), hi = min(pairs, lo + per);
  const auto mine = [&](int64_t e) { return e >= first && e < first + kRankExperts && e < num_experts; };
  int next[kRankExperts];
#pragma unroll
  for (int x = 0; x < kRankExperts; ++x) next[x] = 0;
  for (int64_t j = lo; j < hi; ++j) {
    const int64_t e = topk_idx[j];
#pragma unroll
    for (int x = 0; x < kRankExperts; ++x) next[x] += mine(e) && e - first == x;
  }
  int total;
#pragma unroll
  for (int x = 0; x < kRankExperts; ++x) next[x] = block_exclusive_scan(next[x], s_sum, &total);
  for (int64_t j = lo; j < hi; ++j) {
    const int64_t e = topk_idx[j];
    if (mine(e)) {
#pragma unroll
      for (int x = 0; x < kRankExperts; ++x)
        if (e - first == x) ranks[j] = next[x]++;
    } else if (blockIdx.x == 0 && (e < 0 || e >= num_experts)) {
      ranks[j] = -1;  // a dropped slot: written by one block, so the record carries no stale bytes
    }
  }
}

// The same ranks in three launches over chunks of kChunkPairs pairs, a thread per pair, each reading the ids once,
// coalesced: the chunks' expert counts, each expert's exclusive prefix over the chunks, then each pair's rank = its
// expert's pairs in the chunks before, in the warps of its chunk before, in the lanes of its warp before. The one
// launch above reads the ids twice per block of four experts, each thread a run of its own (uncoalesced): 40 us at
// DeepSeek-V3 shape on an H200, on the critical path of an expert-major forward dispatch, before its wire starts.
constexpr int kChunkPairs = 256;
constexpr int kChunkWarps = kChunkPairs / kWarpSize;

__device__ __forceinline__ int expert_of(const int64_t* __restrict__ topk_idx, int64_t pairs, int64_t j,
                                         int num_experts) {
  if (j >= pairs) return -1;
  const int64_t e = topk_idx[j];
  return e >= 0 && e < num_experts ? static_cast<int>(e) : -1;
}

__global__ void __launch_bounds__(kChunkPairs) pair_chunk_counts_kernel(const int64_t* __restrict__ topk_idx,
                                                                        int64_t pairs, int num_experts,
                                                                        int* __restrict__ counts) {
  extern __shared__ int s_count[];  // [num_experts]
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) s_count[e] = 0;
  __syncthreads();
  const int e = expert_of(topk_idx, pairs, static_cast<int64_t>(blockIdx.x) * kChunkPairs + threadIdx.x, num_experts);
  if (e >= 0) atomicAdd(&s_count[e], 1);
  __syncthreads();
  for (int x = threadIdx.x; x < num_experts; x += blockDim.x)
    counts[static_cast<int64_t>(blockIdx.x) * num_experts + x] = s_count[x];
}

// Block e: counts[c][e] becomes the pairs of e in the chunks before c.
__global__ void __launch_bounds__(kChunkPairs) pair_chunk_prefix_kernel(int* __restrict__ counts, int chunks,
                                                                        int num_experts) {
  __shared__ int s_sum[kChunkPairs];
  const int e = blockIdx.x;
  int carry = 0;
  for (int base = 0; base < chunks; base += blockDim.x) {
    const int c = base + threadIdx.x;
    int* at = counts + static_cast<int64_t>(c) * num_experts + e;
    const int v = c < chunks ? *at : 0;
    int total;
    const int before = block_exclusive_scan(v, s_sum, &total);
    if (c < chunks) *at = carry + before;
    carry += total;
  }
}

__global__ void __launch_bounds__(kChunkPairs) pair_chunk_ranks_kernel(const int64_t* __restrict__ topk_idx,
                                                                       int64_t pairs, int num_experts,
                                                                       const int* __restrict__ before,
                                                                       int* __restrict__ ranks) {
  extern __shared__ int s_mem[];
  int* s_warp = s_mem;                                 // [kChunkWarps][num_experts]: pairs of e in each warp
  int* s_expert = s_mem + kChunkWarps * num_experts;  // [kChunkPairs]: each thread's expert
  for (int i = threadIdx.x; i < kChunkWarps * num_experts; i += blockDim.x) s_warp[i] = 0;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kChunkPairs + threadIdx.x;
  const int e = expert_of(topk_idx, pairs, j, num_experts);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  s_expert[threadIdx.x] = e;
  __syncthreads();
  int lanes_before = 0, in_warp = 0;
  if (e >= 0) {
    for (int i = 0; i < kWarpSize; ++i) {
      if (s_expert[warp * kWarpSize + i] != e) continue;
      ++in_warp;
      lanes_before += i < lane;
    }
    if (lanes_before == 0) s_warp[warp * num_experts + e] = in_warp;  // the warp's first pair of e
  }
  __syncthreads();
  for (int x = threadIdx.x; x < num_experts; x += blockDim.x) {  // exclusive prefix over the warps, per expert
    int run = 0;
    for (int w = 0; w < kChunkWarps; ++w) {
      const int v = s_warp[w * num_experts + x];
      s_warp[w * num_experts + x] = run;
      run += v;
    }
  }
  __syncthreads();
  if (j < pairs)
    ranks[j] = e < 0 ? -1
                     : before[static_cast<int64_t>(blockIdx.x) * num_experts + e] + s_warp[warp * num_experts + e] +
                           lanes_before;
}

// The padding rows of an expert-major receive (expert_major.hpp, pad). Every block first lays out the segments in
// shared memory (a block scan of the aligned counts); then each warp takes one padding row: item i < L * (A - 1) is
// expert i / (A - 1)'s (i % (A - 1))-th padding row when it has one, the items after it are the tail's rows, whose
// length is known on the device only (sync-free mode: the counts never reach the host).
__global__ void __launch_bounds__(kThreads) expert_major_pad_kernel(
    const int* __restrict__ recv_info, int num_local_experts, int alignment, int64_t expert_rows, int units,
    int num_scales, int4* __restrict__ out_x, float* __restrict__ out_scales, int64_t* __restrict__ em_token,
    int64_t* __restrict__ em_slot, int64_t* __restrict__ em_expert, float* __restrict__ em_weights,
    const long long* __restrict__ go) {
  if (go != nullptr && *go == 0) return;  // the reader launched before the count read hands back: nothing to pad
  extern __shared__ int64_t s_begin[];  // [L + 1]: each segment's first row, then the end of the last segment
  __shared__ int s_sum[kThreads];
  const int L = num_local_experts;
  int64_t carry = 0;
  for (int base = 0; base < L; base += blockDim.x) {
    const int e = base + threadIdx.x;
    const int padded = e < L ? (recv_info[2 + e] + alignment - 1) / alignment * alignment : 0;
    int total;
    const int before = block_exclusive_scan(padded, s_sum, &total);
    if (e < L) s_begin[e] = carry + before;
    carry += total;
  }
  if (threadIdx.x == 0) s_begin[L] = carry;
  __syncthreads();
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t per_expert = alignment - 1, expert_items = static_cast<int64_t>(L) * per_expert;
  const int64_t items = expert_items + (expert_rows > s_begin[L] ? expert_rows - s_begin[L] : 0);
  const int4 zero = make_int4(0, 0, 0, 0);
  for (int64_t i = blockIdx.x * kWarps + warp; i < items; i += static_cast<int64_t>(gridDim.x) * kWarps) {
    int64_t p;
    if (i < expert_items) {
      const int e = static_cast<int>(i / per_expert);
      p = s_begin[e] + recv_info[2 + e] + i % per_expert;
      if (p >= s_begin[e + 1]) continue;  // this expert has fewer padding rows
    } else {
      p = s_begin[L] + (i - expert_items);
    }
    if (p >= expert_rows) continue;
    for (int u = lane; u < units; u += kWarpSize) out_x[p * units + u] = zero;
    for (int sc = lane; out_scales != nullptr && sc < num_scales; sc += kWarpSize)
      out_scales[p * num_scales + sc] = 0.0f;
    if (lane == 0) {
      if (em_token) em_token[p] = -1;
      if (em_slot) em_slot[p] = -1;
      if (em_expert) em_expert[p] = -1;
      if (em_weights) em_weights[p] = 0.0f;
    }
  }
}

void check(cudaError_t err, const char* what) { uccl_ep::throw_on_cuda_error(err, "uccl-ep expert-major", what); }

}  // namespace

const void* kernel_address(Kernel kernel) {
  switch (kernel) {
    case kCopy: return reinterpret_cast<const void*>(expert_major_copy_kernel);
    case kPartialsBf16: return reinterpret_cast<const void*>(expert_major_partials_kernel<false>);
    case kPartialsF32: return reinterpret_cast<const void*>(expert_major_partials_kernel<true>);
    default: throw std::invalid_argument("expert_major: no kernel " + std::to_string(int(kernel)));
  }
}

int whole_gpu_grid(Kernel kernel) {
  int device = 0, sms = 0, per_sm = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel_address(kernel), kThreads, 0),
        "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  const int grid = sms * (per_sm > 0 ? per_sm : 1);
  return grid > 0 ? grid : 1;
}

void layout(uintptr_t recv_topk_idx, uintptr_t recv_topk_weights, uintptr_t recv_info, int64_t out_rows,
            int64_t expert_rows, int num_local_experts, int alignment, int topk, uintptr_t em_token, uintptr_t em_slot,
            uintptr_t em_expert, uintptr_t em_weights, uintptr_t slot_of, int tail_blocks, uintptr_t stream) {
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (topk > kMaxTopk) throw std::invalid_argument("expert_major: top-k above " + std::to_string(kMaxTopk));
  if (alignment < 1) throw std::invalid_argument("expert_major: alignment must be >= 1");
  // The copy reads the slots of every row from slot_of (and the combine of this layout reads them too).
  // (An empty tensor's address is 0: a rank that received nothing passes no slot_of.)
  if (slot_of == 0 && out_rows > 0) throw std::invalid_argument("expert_major: slot_of is required");
  if (out_rows > 0)
    check(cudaMemsetAsync(reinterpret_cast<void*>(slot_of), 0xff, sizeof(int) * out_rows * topk, s), "memset");
  if (num_local_experts == 0 || expert_rows == 0) return;
  // Blocks for the tail after the last segment: its length is known on the device only (sync-free mode: the real
  // row count never reaches the host). Where there is no tail they return at once.
  expert_major_plan_kernel<<<num_local_experts + (tail_blocks > 0 ? tail_blocks : 1), kThreads, 0, s>>>(
      reinterpret_cast<const int64_t*>(recv_topk_idx), reinterpret_cast<const float*>(recv_topk_weights),
      reinterpret_cast<const int*>(recv_info), out_rows, expert_rows, num_local_experts, alignment, topk,
      reinterpret_cast<int64_t*>(em_token), reinterpret_cast<int64_t*>(em_slot), reinterpret_cast<int64_t*>(em_expert),
      reinterpret_cast<float*>(em_weights), reinterpret_cast<int*>(slot_of));
  check(cudaGetLastError(), "expert_major_plan_kernel launch");
}

void copy(uintptr_t src_x, int64_t src_x_stride, uintptr_t src_scales, int64_t src_scales_stride, uintptr_t recv_info,
          int64_t out_rows, int64_t expert_rows, int hidden_bytes, int num_scales, int topk, uintptr_t slot_of,
          uintptr_t em_token, uintptr_t out_x, uintptr_t out_scales, int grid, uintptr_t stream) {
  if (topk > kMaxTopk) throw std::invalid_argument("expert_major: top-k above " + std::to_string(kMaxTopk));
  if (hidden_bytes % 16 || src_x % 16 || src_x_stride % 16 || src_x_stride < hidden_bytes)
    throw std::invalid_argument("expert_major: payload rows must be 16-byte aligned, a stride of at least their bytes");
  if (num_scales > 0 && src_scales && (src_scales % 4 || src_scales_stride % 4 || src_scales_stride < 4 * num_scales))
    throw std::invalid_argument("expert_major: scale rows must be 4-byte aligned, a stride of at least their bytes");
  if (expert_rows == 0) return;
  expert_major_copy_kernel<<<grid > 0 ? grid : 1, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const char*>(src_x), src_x_stride, reinterpret_cast<const char*>(src_scales),
      src_scales_stride, reinterpret_cast<const int*>(recv_info), out_rows, expert_rows, hidden_bytes, num_scales, topk,
      reinterpret_cast<const int*>(slot_of), reinterpret_cast<const int64_t*>(em_token),
      reinterpret_cast<int4*>(out_x), reinterpret_cast<float*>(out_scales));
  check(cudaGetLastError(), "expert_major_copy_kernel launch");
}

int64_t pair_ranks_workspace_bytes(int64_t num_tokens, int topk, int num_experts) {
  if (num_tokens < 0 || topk < 0 || num_experts < 1 || num_experts > kChunkMaxExperts) return 0;
  const int64_t chunks = (num_tokens * topk + kChunkPairs - 1) / kChunkPairs;
  return chunks * num_experts * static_cast<int64_t>(sizeof(int));
}

void pair_ranks(uintptr_t topk_idx, int64_t num_tokens, int topk, int num_experts, uintptr_t ranks, uintptr_t stream,
                uintptr_t workspace, int64_t workspace_bytes) {
  if (num_tokens < 0 || topk < 0 || num_experts < 1)
    throw std::invalid_argument("expert_major_pair_ranks: needs num_tokens >= 0, topk >= 0 and num_experts >= 1");
  const int64_t pairs = num_tokens * topk;
  if (pairs == 0) return;
  if (!topk_idx || !ranks) throw std::invalid_argument("expert_major_pair_ranks: null topk_idx or ranks");
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const auto* idx = reinterpret_cast<const int64_t*>(topk_idx);
  auto* out = reinterpret_cast<int*>(ranks);
  const int64_t need = pair_ranks_workspace_bytes(num_tokens, topk, num_experts);
  if (workspace && need > 0) {  // the chunked launches
    if (workspace_bytes < need)
      throw std::invalid_argument("expert_major_pair_ranks: the workspace has " + std::to_string(workspace_bytes) +
                                  " bytes, the chunks' counts need " + std::to_string(need) +
                                  " (pair_ranks_workspace_bytes)");
    const int64_t chunks = (pairs + kChunkPairs - 1) / kChunkPairs;
    if (chunks > INT32_MAX) throw std::invalid_argument("expert_major_pair_ranks: too many pairs");
    auto* counts = reinterpret_cast<int*>(workspace);
    const size_t warp_bytes = (size_t(kChunkWarps) * num_experts + kChunkPairs) * sizeof(int);
    pair_chunk_counts_kernel<<<unsigned(chunks), kChunkPairs, size_t(num_experts) * sizeof(int), s>>>(
        idx, pairs, num_experts, counts);
    pair_chunk_prefix_kernel<<<num_experts, kChunkPairs, 0, s>>>(counts, int(chunks), num_experts);
    pair_chunk_ranks_kernel<<<unsigned(chunks), kChunkPairs, warp_bytes, s>>>(idx, pairs, num_experts, counts, out);
    check(cudaGetLastError(), "pair_chunk_*_kernel launch");
    return;
  }
  const int blocks = (num_experts + kRankExperts - 1) / kRankExperts;
  pair_ranks_kernel<<<blocks, kThreads, 0, s>>>(idx, pairs, num_experts, out);
  check(cudaGetLastError(), "pair_ranks_kernel launch");
}

// Local experts a pad launch lays out in shared memory (8 bytes each, within the default 48 KiB).
constexpr int kPadMaxExperts = 4096;

void pad(uintptr_t recv_info, int num_local_experts, int alignment, int64_t expert_rows, int hidden_bytes,
         int num_scales, uintptr_t out_x, uintptr_t out_scales, uintptr_t em_token, uintptr_t em_slot,
         uintptr_t em_expert, uintptr_t em_weights, int grid, uintptr_t stream, uintptr_t go) {
  if (alignment < 1) throw std::invalid_argument("expert_major_pad: alignment must be >= 1");
  if (num_local_experts < 0 || num_local_experts > kPadMaxExperts)
    throw std::invalid_argument("expert_major_pad: 0.." + std::to_string(kPadMaxExperts) + " local experts, not " +
                                std::to_string(num_local_experts));
  if (hidden_bytes % 16 || out_x % 16)
    throw std::invalid_argument("expert_major_pad: payload rows must be 16-byte aligned");
  if (expert_rows == 0) return;
  if (!out_x || !recv_info) throw std::invalid_argument("expert_major_pad: null out_x or recv_info");
  const size_t shared = sizeof(int64_t) * (num_local_experts + 1);
  expert_major_pad_kernel<<<grid > 0 ? grid : 1, kThreads, shared, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const int*>(recv_info), num_local_experts, alignment, expert_rows, hidden_bytes / 16,
      num_scales, reinterpret_cast<int4*>(out_x), reinterpret_cast<float*>(out_scales),
      reinterpret_cast<int64_t*>(em_token), reinterpret_cast<int64_t*>(em_slot),
      reinterpret_cast<int64_t*>(em_expert), reinterpret_cast<float*>(em_weights),
      reinterpret_cast<const long long*>(go));
  check(cudaGetLastError(), "expert_major_pad_kernel launch");
}

void partials(uintptr_t x, uintptr_t topk_weights, uintptr_t slot_of, uintptr_t recv_info, int num_rows, int hidden,
              int elem_size, int topk, uintptr_t partials, uintptr_t out_topk_weights, int grid, uintptr_t stream) {
  if (hidden % 8) throw std::invalid_argument("expert_major_partials: hidden must be a multiple of 8");
  if (elem_size != 2 && elem_size != 4)
    throw std::invalid_argument("expert_major_partials: x must be bfloat16 or float32");
  if (topk > kMaxTopk) throw std::invalid_argument("expert_major_partials: top-k above " + std::to_string(kMaxTopk));
  if ((topk_weights == 0) != (out_topk_weights == 0))
    throw std::invalid_argument("expert_major_partials: give both topk_weights and out_topk_weights, or neither");
  if (num_rows == 0) return;
  auto kernel = elem_size == 4 ? expert_major_partials_kernel<true> : expert_major_partials_kernel<false>;
  kernel<<<grid > 0 ? grid : 1, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const int4*>(x), reinterpret_cast<const float*>(topk_weights),
      reinterpret_cast<const int*>(slot_of), reinterpret_cast<const int*>(recv_info), num_rows, hidden, topk,
      reinterpret_cast<int4*>(partials), reinterpret_cast<float*>(out_topk_weights));
  check(cudaGetLastError(), "expert_major_partials_kernel launch");
}

}  // namespace uccl_ep::expert_major
