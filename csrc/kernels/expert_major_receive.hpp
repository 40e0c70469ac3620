// Host API of the internode reader that writes an expert-major receive as the rows land (docs/internode.md,
// "Expert-major rows in the reader"): instead of unpacking rank-major rows and copying them into expert-major rows
// after the hop (expert_major.hpp: plan, then copy), each final row's payload goes straight to the expert-major rows
// of its local experts. Plain C++ like internode_plan.hpp: pointers are device addresses as integers.
#pragma once

#include <cstdint>

#include "kernels/arrival_gate.hpp"
#include "kernels/internode_plan.hpp"  // OwnRows

namespace uccl_ep::internode {

// Where row r's (token, slot k) pair goes. Uncached (`slots_given` false): the record carries the pair's global
// expert id (int64 at ids_offset + 8k) and its rank among its source's pairs of that expert (int32 at ranks_offset +
// 4k, expert_major::pair_ranks); row r came from source s, source_rows[s] <= r < source_rows[s + 1] (device int64
// [num_sources + 1]: final rows run by source rank), and places[(s * L + e) * 2] is the expert-major row of source s's
// first pair of local expert e, places[... + 1] how many pairs s sends e (ranks past it are not written). Cached
// (`slots_given`): slot_of[r][k] holds the row already (the handle's), and the record carries the payload only.
struct ExpertMajorReceive {
  uintptr_t src = 0;  // final row r at src + r * src_stride
  int64_t src_stride = 0, num_rows = 0;
  int64_t x_offset = 0, x_bytes = 0;            // payload: a multiple of 16 bytes at a 16-byte aligned offset
  int64_t scales_offset = 0, num_scales = 0;    // fp32 scales (0: none)
  uintptr_t out_x = 0, out_scales = 0;          // expert-major rows [expert_rows, ...]
  int64_t expert_rows = 0;
  int topk = 0;
  bool slots_given = false;
  uintptr_t slot_of = 0;                        // int32 [num_rows, topk]: read when given, else written (-1: none)
  int64_t ids_offset = -1, weights_offset = -1, ranks_offset = -1;
  int64_t expert_lo = 0;                        // our first global expert
  int num_local_experts = 0, num_sources = 0;
  uintptr_t source_rows = 0, places = 0;
  uintptr_t em_token = 0, em_slot = 0, em_expert = 0, em_weights = 0;  // the plan, written when not given
  int64_t src_idx_offset = -1, arrival_offset = -1;  // as unpack_records: int32 fields; arrival < 0: the row index
  uintptr_t src_idx_out = 0, arrival_out = 0;
  // Read before the counts (internode_plan.hpp ReadBeforeCounts, docs/internode.md "Reading before the count
  // read"): device int64 [kReadDims], 0: not. The rows, the first row, the gate's rows and where our own rows lie
  // come from these words (num_rows is then the outputs' capacity), and nothing is done unless they say go.
  uintptr_t dims = 0;
};

// One launch, asynchronous on `stream`; with `gate`, each tile of rows first waits for the chunks that carry it and
// rows are read from `first_row` to the end first, then from 0 (unpack_records' order). The padding rows are
// expert_major::pad's; the reader writes only rows that a pair fills. `own` (one GPU per node): our own node's rows
// were never packed, and each field of theirs is read from our columns (internode_plan.hpp, OwnRows).
// `ready` (the receive beside the dispatch forward, several GPUs per node: internode_plan.hpp RowReady): each row is
// read once its ready word holds the epoch, the grid held to the threads of ready.max_grid unpack_records blocks.
void expert_major_receive(const ExpertMajorReceive& job, uintptr_t stream, const ArrivalGate* gate = nullptr,
                          int64_t first_row = 0, const OwnRows& own = {}, const RowReady& ready = {});

// The receiver's table of the uncached reader, made on the device from every rank's count row (rank s's at
// count_rows + 8 * s * row_words: tokens per destination rank, then per destination node, then per expert, the
// count rows of notify) instead of uploaded from the host's copy: `places` (int64, internode.plan.expert_major_places'
// layout: [num_ranks + 1] source rows, then [num_ranks, L, 2]) and `info` (int32 [2 + L]: rows received, 0, pairs per
// local expert: the plan's sizes), each expert's segment padded to `alignment`. One block; L <= kPlacesMaxExperts.
// With `dims` (a reader launched before the count read: gate_from_count_rows' words, written before on the stream)
// their go is cleared when the padded segments together pass capacity_rows (the outputs allocated before the counts).
constexpr int kPlacesMaxExperts = 4096;
void expert_major_places(uintptr_t count_rows, int64_t row_words, int num_ranks, int num_nodes, int rank,
                         int num_local_experts, int alignment, uintptr_t places, uintptr_t info, uintptr_t stream,
                         uintptr_t dims = 0, int64_t capacity_rows = -1);

}  // namespace uccl_ep::internode
