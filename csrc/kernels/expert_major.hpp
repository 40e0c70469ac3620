// Host API of the expert-major kernels: the receive grouped by local expert and the combine's partial sums from it.
// Shared by the intranode Context and the internode backend (bound as _C.internode.expert_major_*): both receive
// rank-major rows first and turn them into expert-major rows on the device, and back. Plain C++ like intranode.hpp:
// pointers are device addresses as integers, `stream` a cudaStream_t / hipStream_t as an integer.
#pragma once

#include <cstdint>

namespace uccl_ep::expert_major {

// Widest top-k the kernels take (per-warp shared lists of a row's slots).
constexpr int kMaxTopk = 32;

// The kernels whose grid fills the GPU (whole_gpu_grid).
enum Kernel : int { kCopy = 0, kPartialsBf16, kPartialsF32, kKernels };

// Blocks of `kernel` that fill the current device: resident blocks per SM (occupancy API) x SMs.
int whole_gpu_grid(Kernel kernel);
// The kernel's address, for a caller that asks the occupancy API itself (intranode's table of local kernels).
const void* kernel_address(Kernel kernel);

// The plan: rank-major received row i (i < min(recv_info[0], out_rows)) that chose local expert e in slot k
// (recv_topk_idx[i][k] == e, local ids, -1 elsewhere) goes to the next row of e's segment; segments follow each
// other in expert order, each padded to `alignment` (recv_info[2 + e]: e's raw count). Writes, per expert-major row
// p < expert_rows, em_token (the rank-major row), em_slot (k), em_expert (e) and em_weights (recv_topk_weights[i][k],
// optional), -1 / 0 on padding and on the tail after the last segment; and slot_of[i][k] = p (int32, -1 where not
// local: set by a memset first). `tail_blocks` blocks clear the tail (its length is known on the device only in
// sync-free mode).
void layout(uintptr_t recv_topk_idx, uintptr_t recv_topk_weights, uintptr_t recv_info, int64_t out_rows,
            int64_t expert_rows, int num_local_experts, int alignment, int topk, uintptr_t em_token, uintptr_t em_slot,
            uintptr_t em_expert, uintptr_t em_weights, uintptr_t slot_of, int tail_blocks, uintptr_t stream);

// The payload: rank-major row i (at src_x + i * src_x_stride bytes, hidden_bytes long) goes to every expert-major row
// slot_of[i][k] >= 0, its scales (num_scales floats at src_scales + i * src_scales_stride) likewise; expert-major rows
// without a token (em_token == -1) are zeroed. Strides let the source be the rows of an area of records.
void copy(uintptr_t src_x, int64_t src_x_stride, uintptr_t src_scales, int64_t src_scales_stride, uintptr_t recv_info,
          int64_t out_rows, int64_t expert_rows, int hidden_bytes, int num_scales, int topk, uintptr_t slot_of,
          uintptr_t em_token, uintptr_t out_x, uintptr_t out_scales, int grid, uintptr_t stream);

// The combine's input: rank-major row i (i < min(num_rows, recv_info[0])) becomes the sum of the expert-major rows
// slot_of[i][k], k in increasing order, in fp32, rounded once to x's dtype (elem_size 2: bf16, 4: fp32); with
// weights, the expert-major weight of each (i, k) goes back to its slot (0 where k is not local).
void partials(uintptr_t x, uintptr_t topk_weights, uintptr_t slot_of, uintptr_t recv_info, int num_rows, int hidden,
              int elem_size, int topk, uintptr_t partials, uintptr_t out_topk_weights, int grid, uintptr_t stream);

// The sender's half of an expert-major receive made by the reader itself (docs/internode.md, "Expert-major rows in
// the reader"): for each (token t, slot k) of topk_idx (int64 [num_tokens, topk], global ids) naming expert e in
// [0, num_experts), ranks[t][k] (int32) = how many (token, slot) pairs before it, in (token, slot) order, name e; -1
// on dropped slots. A receiver adds where source s's pairs of e start among its expert-major rows and has the row.
// `workspace` (device, workspace_bytes >= pair_ranks_workspace_bytes(...) > 0): three short launches over chunks of
// pairs instead of one that reads the ids once per four experts; 0 (or more than kChunkMaxExperts experts): that one.
constexpr int kChunkMaxExperts = 1024;  // the chunked launches' shared memory: (warps + 1) int32 per expert
int64_t pair_ranks_workspace_bytes(int64_t num_tokens, int topk, int num_experts);
void pair_ranks(uintptr_t topk_idx, int64_t num_tokens, int topk, int num_experts, uintptr_t ranks, uintptr_t stream,
                uintptr_t workspace = 0, int64_t workspace_bytes = 0);

// The rows of an expert-major receive that no token fills: each segment's padding up to the alignment and the tail
// after the last segment (recv_info: int32 [received rows, 0, raw count per local expert]), up to expert_rows. Their
// payload (hidden_bytes, a multiple of 16, then num_scales floats) is zeroed; the plan's columns (em_token, em_slot,
// em_expert: -1; em_weights: 0) are set where given (0: not written, e.g. a cached dispatch that keeps its plan).
// `go` (device int64; 0: none): nothing is done when it holds 0 (a reader launched before the count read that hands
// back: its sizes in recv_info were never written).
void pad(uintptr_t recv_info, int num_local_experts, int alignment, int64_t expert_rows, int hidden_bytes,
         int num_scales, uintptr_t out_x, uintptr_t out_scales, uintptr_t em_token, uintptr_t em_slot,
         uintptr_t em_expert, uintptr_t em_weights, int grid, uintptr_t stream, uintptr_t go = 0);

}  // namespace uccl_ep::expert_major
