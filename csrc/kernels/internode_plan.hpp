// Host API of the internode planning kernels: the per-call tables of uccl_ep_train/internode_plan.py (the notify
// count row, the send plan, the wire records), each in one launch instead of a dozen torch operations. The torch
// functions stay the definition; tests/internode/test_internode_plan_kernels_gpu.py compares both on random routings.
// Plain C++: pointers are device addresses as integers, `stream` a cudaStream_t as an integer.
#pragma once

#include <cstdint>
#include <vector>

namespace uccl_ep::internode {

// The widest count row count_row writes (its shared-memory bins: per rank, per node, per (rank, slot)).
constexpr int kCountRowMaxBins = 12288;

// This rank's notify row, int64, at `out` (local_count_row): [tokens per destination rank (R) | per destination node
// (N = R / G) | per expert (E, copied from tokens_per_expert: int32, or int64 with tpe_int64; E = 0: none) | per
// (destination rank, top-k slot) (R x K from topk_idx, int64 [T, K], -1 and ids >= E count nowhere; K = 0: none)].
// is_token_in_rank: bool [T, R], contiguous. One block.
void count_row(uintptr_t out, uintptr_t is_token_in_rank, int64_t num_tokens, int num_ranks, int ranks_per_node,
               uintptr_t tokens_per_expert, bool tpe_int64, int num_experts, uintptr_t topk_idx, int num_topk,
               uintptr_t stream);

// The device part of send_plan: from is_token_in_rank (bool [T, R]), prefix (int64 [R]: rows of lower ranks at each
// destination) and node_base (int64 [N]: first send record of each node), write dest_row_all (int64 [T, R], -1 = not
// sent), hop1_token (int64 [S1], by node then token), dest_rows (int64 [S1, G]) and row_of (int32 [N, T], -1 = not
// sent). One block per node.
void send_plan(uintptr_t is_token_in_rank, int64_t num_tokens, int num_ranks, int ranks_per_node, uintptr_t prefix,
               uintptr_t node_base, uintptr_t dest_row_all, uintptr_t hop1_token, uintptr_t dest_rows,
               uintptr_t row_of, uintptr_t stream);

// One payload column of the wire records: row t of the source (contiguous rows of `bytes`) goes to byte `offset` of
// every record that carries token t.
struct PackColumn {
  uintptr_t src = 0;
  int64_t bytes = 0;
  int64_t offset = 0;
};
constexpr int kMaxPackColumns = 8;

// pack_records: record r (of num_records, `stride` bytes each) gets every column's row hop1_token[r], then src_idx
// (int32 token) at src_idx_offset and dest_rows[r, 0..G) as int32 at dest_rows_offset. Records
// [own_first, own_first + own_count) -- this rank's own node, which never crosses the network -- go to own_dst
// (the own block of the receive area) instead of `send`, which saves the copy between the two.
void pack_records(uintptr_t send, uintptr_t own_dst, int64_t own_first, int64_t own_count, int64_t stride,
                  uintptr_t hop1_token, uintptr_t dest_rows, int ranks_per_node, int64_t num_records,
                  const std::vector<PackColumn>& columns, int64_t src_idx_offset, int64_t dest_rows_offset,
                  uintptr_t stream);

}  // namespace uccl_ep::internode
