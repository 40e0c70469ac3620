// get_dispatch_layout: how many tokens go to each rank, node and expert, and which ranks each token visits.
#include <stdexcept>
#include <string>

#include "intranode.hpp"
#include "uccl_ep/cuda_errors.cuh"
#include "uccl_ep/portability.cuh"

namespace uccl_ep::intranode {
namespace {

constexpr int kLayoutThreads = 256;

// One thread per token. Counts are aggregated per block in shared memory (experts and ranks are few) and then
// added to the global counters, so the global atomics scale with blocks, not tokens.
__global__ void layout_kernel(const int64_t* __restrict__ topk_idx, int num_tokens, int topk, int num_experts,
                              int num_ranks, int ranks_per_node, int* __restrict__ per_rank, int* __restrict__ per_node,
                              int* __restrict__ per_expert, bool* __restrict__ in_rank) {
  extern __shared__ int smem[];
  int* s_expert = smem;                 // [num_experts]
  int* s_rank = smem + num_experts;     // [num_ranks]
  int* s_node = s_rank + num_ranks;     // [num_nodes]
  const int num_nodes = per_node ? (num_ranks + ranks_per_node - 1) / ranks_per_node : 0;
  for (int i = threadIdx.x; i < num_experts + num_ranks + num_nodes; i += blockDim.x) smem[i] = 0;
  __syncthreads();

  const int experts_per_rank = num_experts / num_ranks;
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < num_tokens) {
    bool* row = in_rank + static_cast<int64_t>(t) * num_ranks;
    for (int r = 0; r < num_ranks; ++r) row[r] = false;
    const int64_t* idx = topk_idx + static_cast<int64_t>(t) * topk;
    for (int k = 0; k < topk; ++k) {
      const int64_t e = idx[k];
      if (e < 0 || e >= num_experts) continue;
      atomicAdd(&s_expert[e], 1);
      const int r = static_cast<int>(e / experts_per_rank);
      if (!row[r]) {
        row[r] = true;
        atomicAdd(&s_rank[r], 1);
      }
    }
    if (per_node) {
      // A token counts once per node it visits.
      for (int n = 0; n < num_nodes; ++n) {
        bool visits = false;
        for (int r = n * ranks_per_node; r < min(num_ranks, (n + 1) * ranks_per_node); ++r) visits |= row[r];
        if (visits) atomicAdd(&s_node[n], 1);
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < num_experts; i += blockDim.x)
    if (s_expert[i]) atomicAdd(&per_expert[i], s_expert[i]);
  for (int i = threadIdx.x; i < num_ranks; i += blockDim.x)
    if (s_rank[i]) atomicAdd(&per_rank[i], s_rank[i]);
  for (int i = threadIdx.x; i < num_nodes; i += blockDim.x)
    if (s_node[i]) atomicAdd(&per_node[i], s_node[i]);
}

void check(cudaError_t err, const char* what) { uccl_ep::throw_on_cuda_error(err, "uccl-ep layout", what); }

}  // namespace

void dispatch_layout(uintptr_t topk_idx, int num_tokens, int topk, int num_experts, int num_ranks, int ranks_per_node,
                     uintptr_t num_tokens_per_rank, uintptr_t num_tokens_per_node, uintptr_t num_tokens_per_expert,
                     uintptr_t is_token_in_rank, uintptr_t stream_handle) {
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  if (num_ranks <= 0 || num_experts % num_ranks != 0)
    throw std::invalid_argument("dispatch_layout: num_experts must be a positive multiple of num_ranks");
  const int num_nodes = num_tokens_per_node ? (num_ranks + ranks_per_node - 1) / ranks_per_node : 0;
  check(cudaMemsetAsync(reinterpret_cast<void*>(num_tokens_per_rank), 0, sizeof(int) * num_ranks, stream), "memset");
  check(cudaMemsetAsync(reinterpret_cast<void*>(num_tokens_per_expert), 0, sizeof(int) * num_experts, stream), "memset");
  if (num_nodes)
    check(cudaMemsetAsync(reinterpret_cast<void*>(num_tokens_per_node), 0, sizeof(int) * num_nodes, stream), "memset");
  if (num_tokens == 0) return;
  const int blocks = (num_tokens + kLayoutThreads - 1) / kLayoutThreads;
  const size_t smem = sizeof(int) * (num_experts + num_ranks + num_nodes);
  layout_kernel<<<blocks, kLayoutThreads, smem, stream>>>(
      reinterpret_cast<const int64_t*>(topk_idx), num_tokens, topk, num_experts, num_ranks, ranks_per_node,
      reinterpret_cast<int*>(num_tokens_per_rank), num_tokens_per_node ? reinterpret_cast<int*>(num_tokens_per_node) : nullptr,
      reinterpret_cast<int*>(num_tokens_per_expert), reinterpret_cast<bool*>(is_token_in_rank));
  check(cudaGetLastError(), "layout_kernel launch");
}

}  // namespace uccl_ep::intranode
