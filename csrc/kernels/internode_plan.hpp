// Host API of the internode planning kernels: the per-call tables of uccl_ep_train/internode/plan.py (the notify
// count row, the send plan, the wire records) and, at the receiver, the records' columns back out of the final rows,
// each in one launch instead of a dozen torch operations. The torch
// functions stay the definition; tests/internode/test_internode_plan_kernels_gpu.py compares both on random routings.
// Plain C++: pointers are device addresses as integers, `stream` a cudaStream_t as an integer.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/arrival_gate.hpp"

namespace uccl_ep::internode {

// The widest count row count_row counts (its shared-memory bins: per rank, per node).
constexpr int kCountRowMaxBins = 12288;

// The tables of a send plan (internode.plan.send_plan): dest_row_all (int64 [T, R], -1 = not sent), hop1_token (int64
// [S1], by node then token), dest_rows (int64 [S1, G]) and row_of (int32 [N, T], -1 = not sent to that node).
struct SendPlanTables {
  uintptr_t dest_row_all = 0, hop1_token = 0, dest_rows = 0, row_of = 0;
};

// This rank's notify row, int64, at `out` (local_count_row): [tokens per destination rank (R) | per destination node
// (N = R / G) | per expert (E, copied from tokens_per_expert: int32, or int64 with tpe_int64; E = 0: none)].
// is_token_in_rank: bool [T, R], contiguous. One block; with `plan`, one more per node, which write our send plan
// as send_plan does with no node_base (the send plan of packing during notify; tables sized for T x N
// records), in the same launch.
void count_row(uintptr_t out, uintptr_t is_token_in_rank, int64_t num_tokens, int num_ranks, int ranks_per_node,
               uintptr_t tokens_per_expert, bool tpe_int64, int num_experts, uintptr_t stream,
               const SendPlanTables* plan = nullptr);

// The device part of send_plan: from is_token_in_rank (bool [T, R]) and node_base (int64 [N]: first send record of
// each node; 0: counted from is_token_in_rank, the send list running by node), write the tables. One block per node.
void send_plan(uintptr_t is_token_in_rank, int64_t num_tokens, int num_ranks, int ranks_per_node, uintptr_t node_base,
               const SendPlanTables& tables, uintptr_t stream);

// One column of the wire records: its rows (contiguous, `bytes` each) sit at byte `offset` of a record. pack_records
// reads `rows` (row t goes into every record that carries token t); unpack_records writes them (row r from final
// row r).
struct PackColumn {
  uintptr_t rows = 0;
  int64_t bytes = 0;
  int64_t offset = 0;
};
constexpr int kMaxPackColumns = 8;

// pack_records: record r (of num_records, `stride` bytes each) gets every column's row hop1_token[r], then src_idx
// (int32 token) at src_idx_offset and dest_rows[r, 0..G) as int32 at dest_rows_offset. Records
// [own_first, own_first + own_count) -- this rank's own node, which never crosses the network -- go to own_dst
// (the own block of the receive area) instead of `send`, which saves the copy between the two.
//
// With DeviceNodeCounts (packing during notify, before the host read our counts): the record list's sizes come from
// our own count row on the device, num_records is only the tables' capacity, the records of node skip_node (our own,
// which need the others' counts) are not written, and none is when all of them together pass send_limit bytes (the
// host applies the same rule after notify to learn what was packed).
struct DeviceNodeCounts {
  uintptr_t counts = 0;  // device int64 [num_nodes]; 0: the host's num_records and own range hold
  int num_nodes = 0;
  int skip_node = -1;
  int64_t send_limit = -1;
  // device int64 [kReadDims]: forward_from_count_rows' forward words; then only our own node's records are written,
  // to own_dst's row of the words' first row on (its block among our arrivals), and none when go is 0
  uintptr_t own_dims = 0;
};
void pack_records(uintptr_t send, uintptr_t own_dst, int64_t own_first, int64_t own_count, int64_t stride,
                  uintptr_t hop1_token, uintptr_t dest_rows, int ranks_per_node, int64_t num_records,
                  const std::vector<PackColumn>& columns, int64_t src_idx_offset, int64_t dest_rows_offset,
                  uintptr_t stream, const DeviceNodeCounts& counted = {});

// The receiver's side: rows [0, num_rows) of the final rows at `src` (row r at src + r * src_stride) are split into
// the column outputs (row r of a column at dst + r * bytes, from byte `offset` of the final row); rows
// [num_rows, out_rows) of every column output are zeroed (num_worst_tokens padding). With ids_out: the num_topk
// global expert ids (int64 at ids_offset) become local ids (id - expert_lo when in [expert_lo, expert_lo +
// experts_per_rank), else -1), and with weights_out the fp32 weights at weights_offset are kept where the id is
// local, else 0 (padding rows: -1 and 0). src_idx_out / arrival_out (int64 [num_rows], 0: skipped): the int32 fields
// at src_idx_offset / arrival_offset; arrival_offset < 0: the row index itself (the final rows are the arrivals).
// gate (nullptr: none): the rows are arrivals still landing; each tile of rows waits for the chunks that carry it
// (arrival_gate.hpp; the gate's row space is the rows of `src`).
struct UnpackTopk {
  uintptr_t ids_out = 0;
  uintptr_t weights_out = 0;
  int64_t ids_offset = 0;
  int64_t weights_offset = 0;
  int num_topk = 0;
  int64_t expert_lo = 0;
  int64_t experts_per_rank = 0;
};
//
// Read before the counts (`before`, docs/internode.md "Reading before the count read"): the rows, the first row,
// the gate's blocks and where our own node's records lie come from the words gate_from_count_rows wrote on the
// device, not from the host, which has not read the counts yet. num_rows and out_rows are then the outputs'
// capacity: the reader unpacks only when the words say go (else does nothing), and pads up to out_rows only with
// `pad` (num_worst_tokens), else stops at the rows. Our own node's rows were never packed: the reader takes them
// from the columns (`own`, below), its place in the rows from the words.
struct ReadBeforeCounts {
  uintptr_t dims = 0;  // device int64 [kReadDims] (ReadDim); 0: not read before the counts
  bool pad = false;
};
//
// The unpack during the dispatch forward (several GPUs per node; docs/internode.md, "The unpack beside the forward"):
// each forwarder releases final row d's ready word at its GPU, words[d], to the forward's epoch after the row's
// stores (ReadyWords, forward_arrivals), and that GPU's unpack reads row d once its word holds the epoch (RowReady),
// instead of after a node barrier behind every forwarder's whole forward. Rows at or past `rows` have no word.
struct ReadyWords {
  const unsigned long long* words = nullptr;  // device uint64 [targets]: each local GPU's int32 word array
  long long rows = 0;
  int epoch = 0;
};
struct RowReady {
  const int* words = nullptr;  // our int32 word array (nullptr: the rows are in already)
  int epoch = 0;
  unsigned long long timeout_ns = 0;
  ErrorWord* err = nullptr;
  StopFlag stop{nullptr, 0};
  int rank = -1;
  int phase = 0;
  int max_grid = 0;  // most blocks (0: the unpack's own rule): the forward beside it needs room
};
//
// Our own node's rows read from the columns (`own`, one GPU per node: docs/internode.md, "Own rows from the columns"):
// final rows [first_row, first_row + count) are our send list's records first_record.., which were never packed, so
// each field is read from the column holding it (columns as pack_records takes them) at the record's token,
// tokens[first_record + i] (the send plan's hop1_token), and the row's src_idx is that token. Read before the
// counts, first_row, count and first_record come from the device words instead.
struct OwnRows {
  int64_t first_row = 0, count = 0, first_record = 0;
  uintptr_t tokens = 0;  // device int64
  std::vector<PackColumn> columns;
};
void unpack_records(uintptr_t src, int64_t src_stride, int64_t num_rows, int64_t out_rows,
                    const std::vector<PackColumn>& columns, const UnpackTopk& topk, int64_t src_idx_offset,
                    uintptr_t src_idx_out, int64_t arrival_offset, uintptr_t arrival_out, uintptr_t stream,
                    const ArrivalGate* gate = nullptr, int64_t first_row = 0, const ReadBeforeCounts& before = {},
                    const OwnRows& own = {}, const RowReady& ready = {});

// The words a reader launched before the host read the counts takes from the device (one GPU per node).
enum ReadDim : int {
  kReadGo = 0,        // 1: read; 0: the reader does nothing, and the host unpacks after notify as before
  kReadRows = 1,      // our arrival rows: every rank's records for us, our own included
  kReadFirstRow = 2,  // our own block's first row (the reader starts there: those rows are in already)
  kReadBlocks = 3,    // gate table rows: the other nodes' blocks with records
  kReadOwnFirst = 4,  // our own records' first index in our send list (where the pack during notify wrote them)
  kReadOwnCount = 5,
  kReadDims = 8,
};
// From every rank's count row (rank r's at count_rows + 8 * r * row_words: tokens per destination rank, then per
// destination node) after they all landed, one GPU per node: the dispatch's gate table (gate_rows: a row per other
// rank sending us records, its counters' bases from counter_bases: every counter's value before this call, lane f
// of source s at s * num_lanes + f) and the ReadDim words. Go when the pack during notify packed (our records fit
// send_limit bytes), the others pushed (our arrivals fit receive_bytes) and they fit capacity_rows outputs: the
// host applies the same rule to the same counts afterwards. One thread. Up to kReadMaxCounters bases (source ranks x
// lanes) travel as kernel arguments (no upload before the launch); more come as counter_bases_table, a device int64
// array uploaded before notify's wait (counter_bases then empty).
constexpr int kReadMaxCounters = 128;
void gate_from_count_rows(uintptr_t count_rows, int64_t row_words, int num_ranks, int rank, int num_lanes,
                          const std::vector<int64_t>& counter_bases, int64_t stride, int64_t send_limit,
                          int64_t receive_bytes, int64_t capacity_rows, uintptr_t table_out, uintptr_t dims_out,
                          uintptr_t stream, uintptr_t counter_bases_table = 0);

// Several GPUs per node, the forward dispatch's forwarder launched before the host read the counts (docs/internode.md,
// "The forward before the count read"): from every rank's count row (tokens per destination rank, then per
// destination node), our arrivals' gate table (a row per other node sending us records, its counters' bases from
// counter_bases, node-major: counter n * num_lanes + f), the forward's block table (forward_block_bases: per source
// node, its block's end among our arrivals, then the rows the sources before it fill at each local GPU), each local
// GPU's final rows (limits_out, int64 [ranks_per_node]) and kForwardDims words: the forward's ReadDim words (rows: our
// arrivals; first row: our own node's block; own first / count: our own records in our send list) and then the
// unpack's (go, rows: our final rows; the rest 0). The forward goes when our records were packed and pushed during
// notify (they fit send_limit bytes), our arrivals fit receive_bytes and every local GPU's final rows fit final_limit
// bytes of final_bytes each; the unpack when the forward goes, our final rows fit capacity_rows and, with ready_rows
// (the unpack beside the forward: final rows with a ready word; 0: none), every local GPU's final rows have a word.
// The host applies the same rule (internode.plan.forward_before_counts). One thread. Counter bases as in
// gate_from_count_rows: by value up to kReadMaxCounters, else counter_bases_table.
constexpr int kForwardDims = 2 * kReadDims;
void forward_from_count_rows(uintptr_t count_rows, int64_t row_words, int num_ranks, int ranks_per_node, int rank,
                             int num_lanes, const std::vector<int64_t>& counter_bases, int64_t stride,
                             int64_t final_bytes, int64_t send_limit, int64_t receive_bytes, int64_t final_limit,
                             int64_t capacity_rows, int64_t ready_rows, uintptr_t table_out, uintptr_t blocks_out,
                             uintptr_t limits_out, uintptr_t dims_out, uintptr_t stream, uintptr_t counter_bases_table = 0);

// The pipelined combine gather's table (gather_tiles' by_arrival) at a handle's first combine, in one call: out
// (int32 [targets, max_arrivals]) set to -1, then out[f, arrival[r]] = r for each received row r, f being the local
// index of row r's source (internode.plan.source_local_of_rows: the source s is the first with row_ends[s] > r, int64
// [num_sources] cumulative, and f = s % targets). An arrival outside [0, max_arrivals) is reported (kErrScatterRange:
// slot f, aux r, observed the arrival, expected max_arrivals) and not written. Torch took ~7 launches and an upload
// for it: ~200 us of a forward combine's host time before its push on 4x H200 (session 43).
void gather_rows_by_arrival(uintptr_t out, int targets, int64_t max_arrivals, uintptr_t row_ends, int num_sources,
                            uintptr_t arrival, int64_t num_rows, uintptr_t stream, uintptr_t err = 0,
                            uintptr_t stop_flag = 0, int stop_generation = 0, int rank = -1, int phase = 0);

// The forwarder's node-sum rows (the combine's _forward_sum_rows) in one launch: out (int32 [targets, num_arrivals])
// [j, a] = j * rows_per_block + a where fwd_dest_rows (int64 [num_arrivals, targets]) [a, j] >= 0, else -1.
void forward_sum_rows(uintptr_t out, int targets, int64_t num_arrivals, int64_t rows_per_block,
                      uintptr_t fwd_dest_rows, uintptr_t stream);

}  // namespace uccl_ep::internode
