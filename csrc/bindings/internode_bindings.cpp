// Bindings of the internode (hierarchical) path: uccl_ep_train._C.internode. Torch-free: device pointers and streams
// are integers. Wired from module.cpp by `bind_internode(m)` (declared there next to the other layers).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#if defined(UCCL_EP_WITH_CUDA) || defined(UCCL_EP_WITH_HIP)
#include "../kernels/clock_probe.hpp"
#include "../kernels/expert_major.hpp"
#include "../kernels/expert_major_receive.hpp"
#include "../kernels/internode.hpp"
#include "../kernels/internode_plan.hpp"
#include "bindings/proxy_stats_dict.hpp"
#include "bindings/wire_log.hpp"
#endif

namespace py = pybind11;

namespace uccl_ep::bindings {

#if defined(UCCL_EP_WITH_CUDA) || defined(UCCL_EP_WITH_HIP)
namespace {

namespace in = uccl_ep::internode;
using Columns = std::vector<std::tuple<uintptr_t, int64_t, int64_t>>;  // (rows, row bytes, offset in the record)
// internode_plan.hpp OwnRows as Python gives it: (first row, count, first record, tokens, columns); None: none
using OwnRowsArg = std::optional<std::tuple<int64_t, int64_t, int64_t, uintptr_t, Columns>>;

in::OwnRows own_rows(const OwnRowsArg& arg) {
  in::OwnRows own;
  if (!arg) return own;
  const auto& [first_row, count, first_record, tokens, columns] = *arg;
  own.first_row = first_row;
  own.count = count;
  own.first_record = first_record;
  own.tokens = tokens;
  if (!tokens) throw std::invalid_argument("own rows: give the send list's tokens");
  for (const auto& [rows, bytes, offset] : columns) own.columns.push_back(in::PackColumn{rows, bytes, offset});
  return own;
}

// A reader's ready words as Python gives them (unpack_records, expert_major_receive: the read beside the dispatch
// forward); words 0: none.
in::RowReady row_ready(uintptr_t words, int epoch, double timeout_secs, int max_grid, uintptr_t err,
                       uintptr_t stop_flag, int stop_generation, int rank, int phase) {
  return in::RowReady{reinterpret_cast<const int*>(words), epoch, static_cast<unsigned long long>(timeout_secs * 1e9),
                      reinterpret_cast<in::ErrorWord*>(err),
                      in::StopFlag{reinterpret_cast<int32_t*>(stop_flag), stop_generation}, rank, phase, max_grid};
}

// pack_and_push's expert_sums: (x, row_bytes, f32, slot_of, topk, weights, weights_offset), in::ExpertSums.
using ExpertSumsArg = std::tuple<uintptr_t, int64_t, bool, uintptr_t, int, uintptr_t, int64_t>;
// pack_and_push's node_sums: (gather, rows_of, ranks_per_node, payload_bytes, num_weights, f32, flags, tile_rows,
// epoch), in::NodeSums.
using NodeSumsArg = std::tuple<uintptr_t, uintptr_t, int, int64_t, int, bool, uintptr_t, int64_t, int32_t>;

in::RecordJob record_job(uintptr_t send, uintptr_t own_dst, int64_t own_first, int64_t own_count, int64_t stride,
                         uintptr_t hop1_token, uintptr_t dest_rows, int ranks_per_node, int64_t num_records,
                         const Columns& columns, int64_t src_idx_offset, int64_t dest_rows_offset) {
  in::RecordJob job;
  job.send = send;
  job.own_dst = own_dst;
  job.own_first = own_first;
  job.own_count = own_count;
  job.stride = stride;
  job.num_records = num_records;
  job.hop1_token = hop1_token;
  job.dest_rows = dest_rows;
  job.ranks_per_node = ranks_per_node;
  for (const auto& [src, bytes, offset] : columns) job.columns.push_back(in::PackColumn{src, bytes, offset});
  job.src_idx_offset = src_idx_offset;
  job.dest_rows_offset = dest_rows_offset;
  return job;
}

in::CountRowOffsets count_row_offsets(int64_t slot, int64_t expected, uintptr_t count_rows, int64_t row_words,
                                      int ranks_per_node, int64_t receive_bytes, int64_t send_limit) {
  in::CountRowOffsets at;
  at.slot = slot;
  at.expected = expected;
  at.rows = count_rows;
  at.row_words = row_words;
  at.ranks_per_node = ranks_per_node;
  at.receive_bytes = receive_bytes;
  at.send_limit = send_limit;
  return at;
}

}  // namespace
#endif

void bind_internode(py::module_& m) {
#if defined(UCCL_EP_WITH_CUDA) || defined(UCCL_EP_WITH_HIP)
  namespace in = uccl_ep::internode;
  auto k = m.def_submodule("internode", "internode (hierarchical) dispatch/combine: regions, proxy, kernels");
  k.attr("PUSH_COLUMNS") = int(in::kPushColumns);
  k.attr("PACK_PUSH_MAX_ROWS") = int(in::kPackPushMaxRows);
  // the kernel timeline's fields in their column order (TimelineField), and the row width
  k.attr("TIMELINE_FIELDS") = py::make_tuple("start", "rows_in", "first_ready", "first_push", "last_push",
                                             "packers_done", "chunks", "reader_start", "all_in", "reader_end");
  k.attr("TIMELINE_WIDTH") = int(in::kTimelineFields);
  k.def(
      "gpu_timer_minus_steady_ns",
      [](int device, int rounds) {  // (a std::pair: no Python object is made while the GIL is released)
        const in::ClockOffset o = in::gpu_timer_minus_steady_ns(device, rounds);
        return std::make_pair(o.gpu_minus_host_ns, o.error_ns);
      },
      py::arg("device"), py::arg("rounds") = 8, py::call_guard<py::gil_scoped_release>(),
      "(GPU global timer - host steady clock, error), ns: what puts the kernel timeline on the wire timeline's "
      "clock; run with the device idle");
  py::dict phases;
  phases["dispatch_network"] = int(in::kPhaseDispatchNetwork);
  phases["combine_network"] = int(in::kPhaseCombineNetwork);
  phases["dispatch_forward"] = int(in::kPhaseDispatchForward);
  phases["combine_gather"] = int(in::kPhaseCombineGather);
  phases["barrier"] = int(in::kPhaseBarrier);
  phases["notify"] = int(in::kPhaseNotify);
  k.attr("PHASES") = phases;
  py::dict codes;
  codes["wait_timeout"] = int(in::kErrWaitTimeout);
  codes["push_timeout"] = int(in::kErrPushTimeout);
  codes["encode"] = int(in::kErrEncode);
  codes["scatter_range"] = int(in::kErrScatterRange);
  codes["aborted"] = int(in::kErrAborted);
  codes["records_unwritten"] = int(in::kErrRecordsUnwritten);
  codes["node_flag_timeout"] = int(in::kErrNodeFlagTimeout);
  codes["row_not_ready"] = int(in::kErrRowNotReady);
  k.attr("ERROR_CODES") = codes;
  k.def("phase_name", [](int p) { return std::string(in::phase_name(p)); }, py::arg("phase"));
  k.def("scatter_rows", &in::scatter_rows, py::arg("dst"), py::arg("dst_stride"), py::arg("dst_idx"), py::arg("src"),
        py::arg("src_stride"), py::arg("src_idx"), py::arg("n"), py::arg("row_bytes"), py::arg("stream"),
        py::arg("dst_rows") = -1, py::arg("err") = 0, py::arg("stop_flag") = 0, py::arg("stop_generation") = 0,
        py::arg("rank") = -1, py::arg("phase") = 0, py::arg("target") = -1,
        "copy rows (dst may be a peer's NVLink mapping); dst_rows >= 0: rows at or past it are not written and "
        "the first is recorded in the error word `err` (InternodeContext.error_word_ptr); nothing is copied while "
        "the stop flag (InternodeContext.stop_flag_ptr) holds stop_generation (InternodeContext.stop_generation)");

  k.attr("FORWARD_MAX_TARGETS") = in::kMaxForwardTargets;
  k.def("forward_rows", &in::forward_rows, py::arg("dsts"), py::arg("dst_bases_or"), py::arg("dst_stride"),
        py::arg("dst_idx"),
        py::arg("targets"), py::arg("src"), py::arg("src_stride"), py::arg("n"), py::arg("row_bytes"),
        py::arg("dst_rows"), py::arg("stream"), py::arg("err") = 0, py::arg("stop_flag") = 0,
        py::arg("stop_generation") = 0, py::arg("rank") = -1, py::arg("phase") = 0,
        "dispatch forward: each arrival row to every local GPU its index row names (dst_idx [n, targets], -1: none), "
        "read once; dst_bases_or: the OR of the dsts entries (they are on the device); range check, error word and "
        "stop flag as scatter_rows, target j's rows in dst_rows[j]");
  k.def("forward_arrivals", &in::forward_arrivals, py::arg("dsts"), py::arg("dst_bases_or"), py::arg("dst_stride"),
        py::arg("targets"), py::arg("src"), py::arg("src_stride"), py::arg("n"), py::arg("row_bytes"),
        py::arg("dst_rows"), py::arg("blocks"), py::arg("num_blocks"), py::arg("dest_rows_offset"),
        py::arg("arrival_offset"), py::arg("dst_idx_out"), py::arg("stream"), py::arg("gate") = nullptr,
        py::arg("first_row") = 0,
        py::arg("err") = 0, py::arg("stop_flag") = 0, py::arg("stop_generation") = 0, py::arg("rank") = -1,
        py::arg("phase") = 0, py::arg("ready_words") = 0, py::arg("ready_rows") = 0, py::arg("ready_epoch") = 0,
        py::arg("dims") = 0,
        "dispatch forward as the forwarder's reader: each arrival's final rows (its record's dest rows plus its "
        "block's bases: blocks [num_blocks, 1 + targets], each row its end then a base per target; -1: none) into "
        "dst_idx_out [n, targets], its first row_bytes with its arrival index stamped "
        "to each of them; gate (InternodeContext.arrival_gate): each row waits for its chunk, so it runs during the "
        "hop, from first_row on; range check, error word and stop flag as forward_rows; ready_words (device uint64 "
        "[targets]: each GPU's int32 ready words): final row d < ready_rows's word released to ready_epoch after "
        "the row's stores; dims (forward_from_count_rows' forward words): launched before the counts, n being "
        "dst_idx_out's capacity, the rows, first row and gate rows from the words, nothing when their go is 0");

  k.attr("GATHER_MAX_TILES") = in::kGatherMaxTiles;
  k.attr("NODE_SUMS_MAX_RANKS_PER_NODE") = in::kNodeSumsMaxRanksPerNode;
  k.def("gather_tiles", &in::gather_tiles, py::arg("dsts"), py::arg("flags"), py::arg("targets"),
        py::arg("by_arrival"), py::arg("max_arrivals"), py::arg("arrivals"), py::arg("tile_rows"), py::arg("x"),
        py::arg("payload_bytes"), py::arg("w"), py::arg("num_weights"), py::arg("num_rows"), py::arg("dst_stride"),
        py::arg("epoch"), py::arg("stream"), py::arg("err") = 0, py::arg("stop_flag") = 0,
        py::arg("stop_generation") = 0, py::arg("rank") = -1, py::arg("phase") = 0, py::arg("blocks") = 0,
        py::arg("own_ranges") = 0,
        "pipelined combine gather, the local side: our rows by_arrival[f, a] (int32 [targets, max_arrivals], -1: "
        "none) of x (and the fp32 weights w) to row a of our gather block at forwarder f (dsts[f]), a tile of "
        "tile_rows arrivals at a time, each tile's int32 flag (flags[f] + 4 t) then raised to epoch; blocks: the "
        "grid, which takes the tiles in order (0: a block per tile, up to 1024); own_ranges (int64 [2, targets]: "
        "each forwarder's own node's arrivals, first and end; 0: none): the tiles in its pack's order, those last");
  k.def("raise_flags", &in::raise_flags, py::arg("flags"), py::arg("n"), py::arg("epoch"), py::arg("stream"),
        py::arg("stop_flag") = 0, py::arg("stop_generation") = 0, py::arg("go") = 0,
        "the int32 at each of the n addresses in flags (device uint64 [n]) set to epoch, released at system scope "
        "after everything earlier on the stream; nothing while the stop flag holds stop_generation, nor when go "
        "(a device int64 word; 0: none) is 0");
  k.def("sum_node_partials", &in::sum_node_partials, py::arg("out_x"), py::arg("out_w"), py::arg("src"),
        py::arg("src_stride"), py::arg("row_of"), py::arg("zero"), py::arg("num_nodes"), py::arg("num_tokens"),
        py::arg("payload_bytes"), py::arg("num_weights"), py::arg("fp32"), py::arg("stream"),
        py::arg("out_x_stride") = 0, py::arg("out_w_stride") = 0, py::arg("gate") = nullptr,
        "each token's partial sums (rows row_of[m, t] of src) added in fp32 in order of m, rounded once; output "
        "rows out_x_stride / out_w_stride bytes apart (0: back to back); gate (InternodeContext.arrival_gate): "
        "each tile of tokens first waits for the chunks holding its rows");

  k.attr("COUNT_ROW_MAX_BINS") = int(in::kCountRowMaxBins);
  k.def(
      "count_row",
      [](uintptr_t out, uintptr_t itr, int64_t num_tokens, int num_ranks, int ranks_per_node, uintptr_t tpe,
         bool tpe_int64, int num_experts, uintptr_t stream,
         std::optional<std::tuple<uintptr_t, uintptr_t, uintptr_t, uintptr_t>> send_plan) {
        in::SendPlanTables t;
        if (send_plan) std::tie(t.dest_row_all, t.hop1_token, t.dest_rows, t.row_of) = *send_plan;
        in::count_row(out, itr, num_tokens, num_ranks, ranks_per_node, tpe, tpe_int64, num_experts, stream,
                      send_plan ? &t : nullptr);
      },
      py::arg("out"), py::arg("is_token_in_rank"), py::arg("num_tokens"), py::arg("num_ranks"),
      py::arg("ranks_per_node"), py::arg("tokens_per_expert"), py::arg("tpe_int64"), py::arg("num_experts"),
      py::arg("stream"), py::arg("send_plan") = py::none(),
      "this rank's notify row (internode.plan.local_count_row) as int64 at `out`, one launch; send_plan "
      "(dest_row_all, hop1_token, dest_rows, row_of addresses): the same launch also writes our send plan as "
      "send_plan does with node_base 0");
  k.def(
      "send_plan",
      [](uintptr_t itr, int64_t num_tokens, int num_ranks, int ranks_per_node, uintptr_t node_base,
         uintptr_t dest_row_all, uintptr_t hop1_token, uintptr_t dest_rows, uintptr_t row_of, uintptr_t stream) {
        in::send_plan(itr, num_tokens, num_ranks, ranks_per_node, node_base,
                      in::SendPlanTables{dest_row_all, hop1_token, dest_rows, row_of}, stream);
      },
      py::arg("is_token_in_rank"), py::arg("num_tokens"), py::arg("num_ranks"), py::arg("ranks_per_node"),
      py::arg("node_base"), py::arg("dest_row_all"), py::arg("hop1_token"), py::arg("dest_rows"),
      py::arg("row_of"), py::arg("stream"),
      "the device tables of internode.plan.send_plan, one launch; node_base 0: each node's first "
      "record counted from is_token_in_rank (the send list running by node)");
  k.def(
      "pack_records",
      [](uintptr_t send, uintptr_t own_dst, int64_t own_first, int64_t own_count, int64_t stride, uintptr_t hop1_token,
         uintptr_t dest_rows, int ranks_per_node, int64_t num_records,
         const std::vector<std::tuple<uintptr_t, int64_t, int64_t>>& columns, int64_t src_idx_offset,
         int64_t dest_rows_offset, uintptr_t stream, uintptr_t node_counts, int num_nodes, int skip_node,
         int64_t send_limit, uintptr_t own_dims) {
        std::vector<in::PackColumn> cols;
        for (const auto& [src, bytes, offset] : columns) cols.push_back(in::PackColumn{src, bytes, offset});
        in::pack_records(send, own_dst, own_first, own_count, stride, hop1_token, dest_rows, ranks_per_node,
                         num_records, cols, src_idx_offset, dest_rows_offset, stream,
                         in::DeviceNodeCounts{node_counts, num_nodes, skip_node, send_limit, own_dims});
      },
      py::arg("send"), py::arg("own_dst"), py::arg("own_first"), py::arg("own_count"), py::arg("stride"),
      py::arg("hop1_token"), py::arg("dest_rows"), py::arg("ranks_per_node"), py::arg("num_records"),
      py::arg("columns"), py::arg("src_idx_offset"), py::arg("dest_rows_offset"), py::arg("stream"),
      py::arg("node_counts") = 0, py::arg("num_nodes") = 0, py::arg("skip_node") = -1, py::arg("send_limit") = -1,
      py::arg("own_dims") = 0,
      "the wire records of internode.plan.pack_records, one launch; columns: (src, row bytes, record offset); "
      "records [own_first, own_first + own_count) go to own_dst. node_counts (device int64 [num_nodes]): the "
      "records are counted on the device instead (num_records: the tables' capacity), node skip_node's are not "
      "written, and none is when all pass send_limit bytes; own_dims (forward_from_count_rows' forward words): "
      "only our own node's records, to own_dst from the words' first row on (num_records: the capacity)");

  k.def(
      "unpack_records",
      [](uintptr_t src, int64_t src_stride, int64_t num_rows, int64_t out_rows,
         const std::vector<std::tuple<uintptr_t, int64_t, int64_t>>& columns, uintptr_t ids_out,
         uintptr_t weights_out, int64_t ids_offset, int64_t weights_offset, int num_topk, int64_t expert_lo,
         int64_t experts_per_rank, int64_t src_idx_offset, uintptr_t src_idx_out, int64_t arrival_offset,
         uintptr_t arrival_out, uintptr_t stream, const in::ArrivalGate* gate, int64_t first_row, uintptr_t dims,
         bool pad, const OwnRowsArg& own, uintptr_t ready_words, int ready_epoch, double ready_timeout_secs,
         int ready_blocks, uintptr_t err, uintptr_t stop_flag, int stop_generation, int rank, int phase) {
        std::vector<in::PackColumn> cols;
        for (const auto& [dst, bytes, offset] : columns) cols.push_back(in::PackColumn{dst, bytes, offset});
        const in::RowReady ready = row_ready(ready_words, ready_epoch, ready_timeout_secs, ready_blocks, err,
                                             stop_flag, stop_generation, rank, phase);
        in::unpack_records(src, src_stride, num_rows, out_rows, cols,
                           in::UnpackTopk{ids_out, weights_out, ids_offset, weights_offset, num_topk, expert_lo,
                                          experts_per_rank},
                           src_idx_offset, src_idx_out, arrival_offset, arrival_out, stream, gate, first_row,
                           in::ReadBeforeCounts{dims, pad}, own_rows(own), ready);
      },
      py::arg("src"), py::arg("src_stride"), py::arg("num_rows"), py::arg("out_rows"), py::arg("columns"),
      py::arg("ids_out"), py::arg("weights_out"), py::arg("ids_offset"), py::arg("weights_offset"),
      py::arg("num_topk"), py::arg("expert_lo"), py::arg("experts_per_rank"), py::arg("src_idx_offset"),
      py::arg("src_idx_out"), py::arg("arrival_offset"), py::arg("arrival_out"), py::arg("stream"),
      py::arg("gate") = nullptr, py::arg("first_row") = 0, py::arg("dims") = 0, py::arg("pad") = false,
      py::arg("own") = py::none(), py::arg("ready_words") = 0, py::arg("ready_epoch") = 0,
      py::arg("ready_timeout_secs") = 0.0, py::arg("ready_blocks") = 0, py::arg("err") = 0, py::arg("stop_flag") = 0,
      py::arg("stop_generation") = 0, py::arg("rank") = -1, py::arg("phase") = 0,
      "the final rows' columns into their outputs, one launch; columns: (output, row bytes, row offset); rows "
      "past num_rows up to out_rows zeroed (ids -1); global expert ids made local, foreign weights zeroed; gate "
      "(InternodeContext.arrival_gate): each tile of rows first waits for the chunks that carry it; first_row: the "
      "rows are read from there to the end first, then from 0 (a gated reader starts with the rows already in); "
      "dims (gate_from_count_rows' words): read before the counts, num_rows / out_rows being the outputs' "
      "capacity, padded to out_rows only with pad; own (first row, count, first record, the send list's tokens, "
      "columns as pack_records takes them): our own node's rows, never packed, read from the columns (read before "
      "the counts, where they lie comes from dims); ready_words (our int32 word per final row): each row read once "
      "its word reaches ready_epoch (the unpack beside the dispatch forward), else reported after "
      "ready_timeout_secs as row_not_ready on err / stop_flag with rank and phase, the grid held to ready_blocks");

  k.attr("READ_DIMS") = int(in::kReadDims);
  k.attr("READ_MAX_COUNTERS") = int(in::kReadMaxCounters);
  k.def("gate_from_count_rows", &in::gate_from_count_rows, py::arg("count_rows"), py::arg("row_words"),
        py::arg("num_ranks"), py::arg("rank"), py::arg("num_lanes"), py::arg("counter_bases"), py::arg("stride"),
        py::arg("send_limit"), py::arg("receive_bytes"), py::arg("capacity_rows"), py::arg("table_out"),
        py::arg("dims_out"), py::arg("stream"), py::arg("counter_bases_table") = 0,
        "one GPU per node, after every count row landed: the dispatch's gate table (a row per other rank sending "
        "us records; counter_bases: every counter's value before the call, source-major, at most READ_MAX_COUNTERS; "
        "more: empty, and counter_bases_table their device int64 array) "
        "and the words (go, rows, first row, gate rows, our "
        "own records' first index and count) of a reader launched before the host read the counts; go when our "
        "records were packed (fit send_limit bytes), our arrivals were pushed (fit receive_bytes) and fit "
        "capacity_rows");
  k.attr("FORWARD_DIMS") = int(in::kForwardDims);
  k.def("forward_from_count_rows", &in::forward_from_count_rows, py::arg("count_rows"), py::arg("row_words"),
        py::arg("num_ranks"), py::arg("ranks_per_node"), py::arg("rank"), py::arg("num_lanes"),
        py::arg("counter_bases"), py::arg("stride"), py::arg("final_bytes"), py::arg("send_limit"),
        py::arg("receive_bytes"), py::arg("final_limit"), py::arg("capacity_rows"), py::arg("ready_rows"),
        py::arg("table_out"),
        py::arg("blocks_out"), py::arg("limits_out"), py::arg("dims_out"), py::arg("stream"),
        py::arg("counter_bases_table") = 0,
        "several GPUs per node, after every count row landed: the forward dispatch's gate table (a row per other node "
        "sending us records; counter_bases: every counter's value before the call, node-major, as in "
        "gate_from_count_rows), block table "
        "[nodes, 1 + ranks_per_node], each local GPU's final rows (limits_out) and FORWARD_DIMS words (the "
        "forward's, then the unpack's) of a forwarder launched before the host read the counts "
        "(internode.plan.forward_before_counts); ready_rows: the final rows with a ready word (the unpack beside the "
        "forward), 0: none");

  k.def("gather_rows_by_arrival", &in::gather_rows_by_arrival, py::arg("out"), py::arg("targets"),
        py::arg("max_arrivals"), py::arg("row_ends"), py::arg("num_sources"), py::arg("arrival"), py::arg("num_rows"),
        py::arg("stream"), py::arg("err") = 0, py::arg("stop_flag") = 0, py::arg("stop_generation") = 0,
        py::arg("rank") = -1, py::arg("phase") = 0,
        "gather_tiles' by_arrival table (int32 [targets, max_arrivals]) in one call: -1, then out[f, arrival[r]] = r "
        "for each received row r, f the local index of its source (the first s with row_ends[s] > r, int64; f = s "
        "% targets); an arrival out of range is reported (error word) and not written");
  k.def("forward_sum_rows", &in::forward_sum_rows, py::arg("out"), py::arg("targets"), py::arg("num_arrivals"),
        py::arg("rows_per_block"), py::arg("fwd_dest_rows"), py::arg("stream"),
        "the forwarder's node-sum rows in one launch: out (int32 [targets, num_arrivals]) [j, a] = j * "
        "rows_per_block + a where fwd_dest_rows (int64 [num_arrivals, targets]) [a, j] >= 0, else -1");

  namespace em = uccl_ep::expert_major;
  k.attr("EXPERT_MAJOR_MAX_TOPK") = em::kMaxTopk;
  k.def("expert_major_grid", [](const std::string& kernel) {
        if (kernel == "copy") return em::whole_gpu_grid(em::kCopy);
        if (kernel == "partials_bf16") return em::whole_gpu_grid(em::kPartialsBf16);
        if (kernel == "partials_f32") return em::whole_gpu_grid(em::kPartialsF32);
        throw std::invalid_argument("expert_major_grid: kernel is copy, partials_bf16 or partials_f32, not " + kernel);
      }, py::arg("kernel"), "blocks of that expert-major kernel that fill the current device");
  k.def("expert_major_layout", &em::layout, py::arg("recv_topk_idx"), py::arg("recv_topk_weights"),
        py::arg("recv_info"), py::arg("out_rows"), py::arg("expert_rows"), py::arg("num_local_experts"),
        py::arg("alignment"), py::arg("topk"), py::arg("em_token"), py::arg("em_slot"), py::arg("em_expert"),
        py::arg("em_weights"), py::arg("slot_of"), py::arg("tail_blocks"), py::arg("stream"),
        "the expert-major plan of rank-major received rows (local expert ids, -1 elsewhere; recv_info: int32 "
        "[received rows, 0, raw count per local expert]): per expert-major row its token, slot, expert and weight, "
        "and slot_of (int32 [rows, topk]) per (row, k); segments padded to alignment (csrc/kernels/expert_major.hpp)");
  k.def("expert_major_copy", &em::copy, py::arg("src_x"), py::arg("src_x_stride"), py::arg("src_scales"),
        py::arg("src_scales_stride"), py::arg("recv_info"), py::arg("out_rows"), py::arg("expert_rows"),
        py::arg("hidden_bytes"), py::arg("num_scales"), py::arg("topk"), py::arg("slot_of"), py::arg("em_token"),
        py::arg("out_x"), py::arg("out_scales"), py::arg("grid"), py::arg("stream"),
        "the payload of the plan: each rank-major row (strides in bytes) to its expert-major rows, rows without a "
        "token zeroed");
  k.def("expert_major_partials", &em::partials, py::arg("x"), py::arg("topk_weights"), py::arg("slot_of"),
        py::arg("recv_info"), py::arg("num_rows"), py::arg("hidden"), py::arg("elem_size"), py::arg("topk"),
        py::arg("partials"), py::arg("out_topk_weights"), py::arg("grid"), py::arg("stream"),
        "per rank-major row the sum of its expert-major rows in slot order (fp32, rounded once to x's dtype), and "
        "the expert-major weights back to their slots");

  k.def("expert_major_pair_ranks", &em::pair_ranks, py::arg("topk_idx"), py::arg("num_tokens"), py::arg("topk"),
        py::arg("num_experts"), py::arg("ranks"), py::arg("stream"), py::arg("workspace") = 0,
        py::arg("workspace_bytes") = 0,
        "the sender's half of an expert-major receive made by the reader: per (token, slot) naming expert e, how "
        "many (token, slot) pairs before it name e (int32 [tokens, topk]; -1 on dropped slots); with a workspace of "
        "expert_major_pair_ranks_workspace_bytes, three short launches over chunks of pairs");
  k.def("expert_major_pair_ranks_workspace_bytes", &em::pair_ranks_workspace_bytes, py::arg("num_tokens"),
        py::arg("topk"), py::arg("num_experts"),
        "bytes of device workspace expert_major_pair_ranks' chunked launches need (0: they do not apply)");
  k.def("expert_major_pad", &em::pad, py::arg("recv_info"), py::arg("num_local_experts"), py::arg("alignment"),
        py::arg("expert_rows"), py::arg("hidden_bytes"), py::arg("num_scales"), py::arg("out_x"),
        py::arg("out_scales"), py::arg("em_token"), py::arg("em_slot"), py::arg("em_expert"), py::arg("em_weights"),
        py::arg("grid"), py::arg("stream"), py::arg("go") = 0,
        "the expert-major rows no token fills (segment padding, the tail up to expert_rows): payload zeroed, the "
        "plan's columns -1 / 0 where given (0: not written); go (device int64): nothing when it holds 0");
  k.def(
      "expert_major_receive",
      [](uintptr_t src, int64_t src_stride, int64_t num_rows, int64_t x_offset, int64_t x_bytes,
         int64_t scales_offset, int64_t num_scales, uintptr_t out_x, uintptr_t out_scales, int64_t expert_rows,
         int topk, bool slots_given, uintptr_t slot_of, int64_t ids_offset, int64_t weights_offset,
         int64_t ranks_offset, int64_t expert_lo, int num_local_experts, int num_sources, uintptr_t source_rows,
         uintptr_t places, uintptr_t em_token, uintptr_t em_slot, uintptr_t em_expert, uintptr_t em_weights,
         int64_t src_idx_offset, uintptr_t src_idx_out, int64_t arrival_offset, uintptr_t arrival_out,
         uintptr_t stream, const in::ArrivalGate* gate, int64_t first_row, const OwnRowsArg& own, uintptr_t dims,
         uintptr_t ready_words, int ready_epoch, double ready_timeout_secs, int ready_blocks, uintptr_t err,
         uintptr_t stop_flag, int stop_generation, int rank, int phase) {
        in::ExpertMajorReceive a;
        a.src = src;
        a.src_stride = src_stride;
        a.num_rows = num_rows;
        a.x_offset = x_offset;
        a.x_bytes = x_bytes;
        a.scales_offset = scales_offset;
        a.num_scales = num_scales;
        a.out_x = out_x;
        a.out_scales = out_scales;
        a.expert_rows = expert_rows;
        a.topk = topk;
        a.slots_given = slots_given;
        a.slot_of = slot_of;
        a.ids_offset = ids_offset;
        a.weights_offset = weights_offset;
        a.ranks_offset = ranks_offset;
        a.expert_lo = expert_lo;
        a.num_local_experts = num_local_experts;
        a.num_sources = num_sources;
        a.source_rows = source_rows;
        a.places = places;
        a.em_token = em_token;
        a.em_slot = em_slot;
        a.em_expert = em_expert;
        a.em_weights = em_weights;
        a.src_idx_offset = src_idx_offset;
        a.src_idx_out = src_idx_out;
        a.arrival_offset = arrival_offset;
        a.arrival_out = arrival_out;
        a.dims = dims;
        in::expert_major_receive(a, stream, gate, first_row, own_rows(own),
                                 row_ready(ready_words, ready_epoch, ready_timeout_secs, ready_blocks, err, stop_flag,
                                           stop_generation, rank, phase));
      },
      py::arg("src"), py::arg("src_stride"), py::arg("num_rows"), py::arg("x_offset"), py::arg("x_bytes"),
      py::arg("scales_offset"), py::arg("num_scales"), py::arg("out_x"), py::arg("out_scales"),
      py::arg("expert_rows"), py::arg("topk"), py::arg("slots_given"), py::arg("slot_of"), py::arg("ids_offset"),
      py::arg("weights_offset"), py::arg("ranks_offset"), py::arg("expert_lo"), py::arg("num_local_experts"),
      py::arg("num_sources"), py::arg("source_rows"), py::arg("places"), py::arg("em_token"), py::arg("em_slot"),
      py::arg("em_expert"), py::arg("em_weights"), py::arg("src_idx_offset"), py::arg("src_idx_out"),
      py::arg("arrival_offset"), py::arg("arrival_out"), py::arg("stream"), py::arg("gate") = nullptr,
      py::arg("first_row") = 0, py::arg("own") = py::none(), py::arg("dims") = 0, py::arg("ready_words") = 0,
      py::arg("ready_epoch") = 0, py::arg("ready_timeout_secs") = 0.0, py::arg("ready_blocks") = 0,
      py::arg("err") = 0, py::arg("stop_flag") = 0, py::arg("stop_generation") = 0, py::arg("rank") = -1,
      py::arg("phase") = 0,
      "the final rows straight into expert-major rows, one launch (csrc/kernels/expert_major_receive.hpp): each "
      "row's payload to the rows of its local experts, from the record's ids and pair ranks (and the plan's columns "
      "and slot_of written) or, slots_given, from slot_of; gate, first_row, own, dims and the ready words "
      "(the receive beside the dispatch forward) as unpack_records'");

  k.def("expert_major_places", &in::expert_major_places, py::arg("count_rows"), py::arg("row_words"),
        py::arg("num_ranks"), py::arg("num_nodes"), py::arg("rank"), py::arg("num_local_experts"),
        py::arg("alignment"), py::arg("places"), py::arg("info"), py::arg("stream"), py::arg("dims") = 0,
        py::arg("capacity_rows") = -1,
        "the uncached expert-major reader's table (internode.plan.expert_major_places' layout, int64) and the plan's "
        "sizes (int32 [rows, 0, pairs per local expert]) made on the device from notify's count rows, one launch; "
        "dims (gate_from_count_rows' words): their go cleared when the expert-major rows pass capacity_rows");

  k.attr("GATE_COLUMNS") = int(in::kGateBase);
  py::class_<in::ArrivalGate>(k, "ArrivalGate",
                              "what a gated kernel waits on (InternodeContext.arrival_gate); opaque")
      .def_readonly("blocks", &in::ArrivalGate::blocks)
      .def_readonly("lanes", &in::ArrivalGate::lanes)
      .def_readonly("per_chunk", &in::ArrivalGate::per_chunk);

  py::class_<in::Context>(k, "InternodeContext")
      .def(py::init([](int rank, int world, int device, int64_t rdma_bytes, int64_t nvl_bytes, int num_threads,
                       int fifos_per_thread, uint32_t fifo_depth, std::vector<int> cpus, int idle_backoff_us,
                       double timeout_secs, uint64_t max_inflight_writes, uint64_t max_inflight_bytes,
                       int reorder_window, uint32_t num_signal_slots, int loopback_reorder,
                       uint64_t loopback_delay_us, double loopback_bandwidth_gbps, uint64_t loopback_seed,
                       double gpu_timeout_secs, std::string transport, std::vector<std::string> ib_devices,
                       int ib_port, std::variant<int, std::vector<int>> gid_index, int sl, int tc,
                       std::string dump_trigger, std::string loopback_copy_agent) {
             in::ProxyParams p;
             p.num_threads = num_threads;
             p.fifos_per_thread = fifos_per_thread;
             p.fifo_depth = fifo_depth;
             p.cpus = cpus;
             p.idle_backoff_us = idle_backoff_us;
             p.timeout_secs = timeout_secs;
             p.max_inflight_writes = max_inflight_writes;
             p.max_inflight_bytes = max_inflight_bytes;
             p.reorder_window = reorder_window;
             p.num_signal_slots = num_signal_slots;
             p.loopback_reorder = loopback_reorder;
             p.loopback_delay_us = loopback_delay_us;
             p.loopback_bandwidth_gbps = loopback_bandwidth_gbps;
             p.loopback_seed = loopback_seed;
             p.loopback_copy_agent = loopback_copy_agent;
             p.transport = transport;
             p.ib_devices = ib_devices;
             p.ib_port = ib_port;
             // One int stands for every device (UCCL_IB_GID_INDEX is a single setting); a list is per device.
             if (const int* one = std::get_if<int>(&gid_index))
               p.gid_index.assign(ib_devices.size(), *one);
             else
               p.gid_index = std::get<std::vector<int>>(gid_index);
             p.sl = sl;
             p.tc = tc;
             p.dump_trigger = dump_trigger;
             return std::make_unique<in::Context>(rank, world, device, rdma_bytes, nvl_bytes, p, gpu_timeout_secs);
           }),
           py::arg("rank"), py::arg("world"), py::arg("device"), py::arg("rdma_bytes"), py::arg("nvl_bytes"),
           py::arg("num_threads"), py::arg("fifos_per_thread"), py::arg("fifo_depth"), py::arg("cpus"),
           py::arg("idle_backoff_us"), py::arg("timeout_secs"), py::arg("max_inflight_writes"),
           py::arg("max_inflight_bytes"), py::arg("reorder_window"), py::arg("num_signal_slots"),
           py::arg("loopback_reorder"), py::arg("loopback_delay_us"), py::arg("loopback_bandwidth_gbps"),
           py::arg("loopback_seed"), py::arg("gpu_timeout_secs"), py::arg("transport") = "loopback",
           py::arg("ib_devices") = std::vector<std::string>{}, py::arg("ib_port") = 1, py::arg("gid_index") = -1,
           py::arg("sl") = -1, py::arg("tc") = -1, py::arg("dump_trigger") = "", py::arg("loopback_copy_agent") = "",
           "loopback_copy_agent: a copy agent's segment name (its process moves the loopback's bytes; empty: the proxy "
           "threads copy). dump_trigger: UCCL_EP_PROXY_DUMP_FILE. transport: 'loopback' (one host) or 'verbs' (ib_devices: this GPU's RDMA devices; gid_index: one int for "
           "every device or a list, -1 chooses; sl / tc: -1 is the NIC family's default)")
      .def_property_readonly("rank", &in::Context::rank)
      .def_property_readonly("world", &in::Context::world)
      .def_property_readonly("rdma_bytes", &in::Context::rdma_bytes)
      .def_property_readonly("nvl_bytes", &in::Context::nvl_bytes)
      .def_property_readonly("rdma_ptr", &in::Context::rdma_ptr)
      .def_property_readonly("nvl_ptr", &in::Context::nvl_ptr)
      .def_property_readonly("num_fifos", &in::Context::num_fifos)
      .def_property_readonly("max_write_bytes", &in::Context::max_write_bytes)
      .def_property_readonly("num_signal_slots", &in::Context::num_signal_slots)
      .def_property_readonly("transport_name", &in::Context::transport_name)
      .def_property_readonly("transport_in_order", &in::Context::transport_in_order)
      .def("nvl_ipc_handle", [](const in::Context& c) { return py::bytes(c.nvl_ipc_handle()); })
      .def("open_nvl_peers", &in::Context::open_nvl_peers, py::arg("handles"), py::arg("own_index"))
      .def("proxy_local_info", [](in::Context& c, int t) { return py::bytes(c.proxy_local_info(t)); })
      .def("proxy_connect", &in::Context::proxy_connect, py::arg("infos"),
           "infos[thread][rank] = that rank's proxy_local_info(thread)")
      .def("proxy_start", &in::Context::proxy_start)
      .def("proxy_stop", &in::Context::proxy_stop, py::call_guard<py::gil_scoped_release>())
      .def("proxy_wait_idle", &in::Context::proxy_wait_idle, py::arg("timeout_secs"),
           py::call_guard<py::gil_scoped_release>(),
           "wait until the proxy took every pushed command and every write it posted completed (before teardown)")
      .def("proxy_error", &in::Context::proxy_error)
      .def("proxy_totals", [](const in::Context& c) { return proxy_stats_dict(c.proxy_totals()); })
      .def("signal_value", &in::Context::signal_value, py::arg("slot"))
      .def("signals_short", &in::Context::signals_short, py::arg("targets"),
           "sum over (slot, target) of max(0, target - signal[slot]): e.g. a hop's records still to land")
      .def("proxy_counters", &in::Context::proxy_counters,
           "the proxy threads' published counters, one line per thread (never asks the transport)")
      .def_property_readonly("side_stream", &in::Context::side_stream,
                             "a second stream of the context's (non-blocking, as an integer handle): work that runs "
                             "beside a kernel of the caller's stream instead of before it")
      .def("stream_wait", &in::Context::stream_wait, py::arg("waiter"), py::arg("signaller"),
           "the stream `waiter` waits on the GPU for everything queued on `signaller` so far (no host wait)")
      .def_property("spin_blocks", &in::Context::spin_blocks, &in::Context::set_spin_blocks,
                    "most blocks of the grids that spin (pack_and_push's packers, the gated readers); 0: no cap. "
                    "Set when ranks share a GPU, where the loopback's copies are kernels")
      .def("set_timeline", &in::Context::set_timeline, py::arg("stamps"), py::arg("capacity"),
           "stamp each later pack_and_push launch into the next row of stamps (device uint64 [capacity][TIMELINE_WIDTH], "
           "the caller's initial values: UINT64_MAX in start, first_ready and first_push, 0 elsewhere); 0: off")
      .def("timeline_launches", &in::Context::timeline_launches, "rows stamped since set_timeline")
      .def("start_wire_log", &in::Context::start_wire_log, py::arg("capacity"),
           "record the emulated wire's busy runs afresh (at most capacity); loopback with a bandwidth cap only")
      .def("stop_wire_log", [](in::Context& c) {
        uint64_t dropped = 0;
        std::vector<WireRun> runs = c.stop_wire_log(&dropped);
        return wire_log_dict(runs, dropped);
      }, "stop recording: {'runs': [(start_ns, end_ns, bytes, writes)], 'dropped': n}, on the steady clock")
      .def("fifo_states", [](const in::Context& c) {
        py::list out;
        for (const auto& f : c.fifo_states()) {
          py::dict d;
          d["fifo"] = f.fifo;
          d["device_head"] = f.device_head;
          d["tail"] = f.tail;
          d["full"] = f.full;
          d["first_full"] = f.first_full;
          d["last_full"] = f.last_full;
          out.append(d);
        }
        return out;
      }, "per FIFO: slots kernels reserved (device_head), published tail, non-empty slots past it (diagnostics)")
      .def_property_readonly("error_word_ptr", &in::Context::error_word_ptr)
      .def_property_readonly("stop_flag_ptr", &in::Context::stop_flag_ptr)
      .def_property_readonly("stop_generation", &in::Context::stop_generation)
      .def("push_chunks", &in::Context::push_chunks, py::arg("table"), py::arg("n"), py::arg("chunk_records"),
           py::arg("phase"), py::arg("stream"))
      .def(
          "push_after_counts",
          [](in::Context& cx, uintptr_t table, int n, int64_t chunk_records, int64_t slot, int64_t expected,
             uintptr_t count_rows, int64_t row_words, int ranks_per_node, int64_t receive_bytes, int phase,
             uintptr_t stream, int64_t send_limit) {
            cx.push_after_counts(table, n, chunk_records,
                                 count_row_offsets(slot, expected, count_rows, row_words, ranks_per_node,
                                                   receive_bytes, send_limit),
                                 phase, stream);
          },
          py::arg("table"), py::arg("n"), py::arg("chunk_records"), py::arg("slot"), py::arg("expected"),
          py::arg("count_rows"), py::arg("row_words"), py::arg("ranks_per_node"), py::arg("receive_bytes"),
          py::arg("phase"), py::arg("stream"), py::arg("send_limit") = -1,
          "push_chunks once signal[slot] >= expected (every count row in), each row's remote offset moved past the "
          "records the source nodes before ours send its destination (read from the count rows at count_rows, "
          "row_words int64 each); a destination whose arrivals exceed receive_bytes gets nothing. send_limit >= 0: "
          "each row's records and local offset from our own count row, nothing when all pass send_limit bytes")
      .def(
          "pack_and_push",
          [](in::Context& cx, uintptr_t table, int n, int64_t chunk_records, uintptr_t send, uintptr_t own_dst,
             int64_t own_first, int64_t own_count, int64_t stride, uintptr_t hop1_token, uintptr_t dest_rows,
             int ranks_per_node, int64_t num_records, const Columns& columns, int64_t src_idx_offset,
             int64_t dest_rows_offset, uintptr_t ready, int phase, uintptr_t stream,
             std::optional<ExpertSumsArg> expert_sums, std::optional<NodeSumsArg> node_sums) {
            in::RecordJob job = record_job(send, own_dst, own_first, own_count, stride, hop1_token, dest_rows,
                                           ranks_per_node, num_records, columns, src_idx_offset, dest_rows_offset);
            if (expert_sums) {
              auto& [x, row_bytes, f32, slot_of, topk, weights, weights_offset] = *expert_sums;
              job.sums = in::ExpertSums{x, row_bytes, f32, slot_of, topk, weights, weights_offset};
            }
            if (node_sums) {
              auto& [gather, rows_of, g, payload_bytes, num_weights, f32, flags, tile_rows, epoch] = *node_sums;
              job.node_sums = in::NodeSums{gather, rows_of, g, payload_bytes, num_weights, f32, flags, tile_rows,
                                           epoch};
            }
            cx.pack_and_push(table, n, chunk_records, job, ready, phase, stream);
          },
          py::arg("table"), py::arg("n"), py::arg("chunk_records"), py::arg("send"), py::arg("own_dst"),
          py::arg("own_first"), py::arg("own_count"), py::arg("stride"), py::arg("hop1_token"), py::arg("dest_rows"),
          py::arg("ranks_per_node"), py::arg("num_records"), py::arg("columns"), py::arg("src_idx_offset"),
          py::arg("dest_rows_offset"), py::arg("ready"), py::arg("phase"), py::arg("stream"),
          py::arg("expert_sums") = py::none(), py::arg("node_sums") = py::none(),
          "pack_records and push_chunks in one launch: each chunk pushed once its records are written; "
          "hop1_token 0: record r carries row r; src_idx_offset < 0: no index fields; ready: int32 zeros, one per "
          "chunk, left zero. expert_sums = (x, row_bytes, f32, slot_of, topk, weights, weights_offset): no columns; "
          "record r is combine row r summed from its local experts' expert-major rows (ExpertSums, internode.hpp). "
          "node_sums = (gather, rows_of, ranks_per_node, payload_bytes, num_weights, f32, flags, tile_rows, epoch): "
          "no columns; record r is arrival r's node sum, read once its copies' tile flags reach epoch (NodeSums)")
      .def(
          "pack_and_push_after_counts",
          [](in::Context& cx, uintptr_t table, int n, int64_t chunk_records, uintptr_t send, int64_t stride,
             uintptr_t hop1_token, uintptr_t dest_rows, int ranks_per_node, int64_t capacity, const Columns& columns,
             int64_t src_idx_offset, int64_t dest_rows_offset, int64_t slot, int64_t expected, uintptr_t count_rows,
             int64_t row_words, int64_t receive_bytes, int64_t send_limit, uintptr_t ready, int phase,
             uintptr_t stream, uintptr_t own_row_pushes, int own_row_push_rows, int own_row_push_phase) {
            in::CountRowOffsets at = count_row_offsets(slot, expected, count_rows, row_words, ranks_per_node,
                                                       receive_bytes, send_limit);
            at.own_row_pushes = own_row_pushes;
            at.own_row_push_rows = own_row_push_rows;
            at.own_row_push_phase = own_row_push_phase;
            cx.pack_and_push_after_counts(table, n, chunk_records,
                                          record_job(send, 0, 0, 0, stride, hop1_token, dest_rows, ranks_per_node,
                                                     capacity, columns, src_idx_offset, dest_rows_offset),
                                          at, ready, phase, stream);
          },
          py::arg("table"), py::arg("n"), py::arg("chunk_records"), py::arg("send"), py::arg("stride"),
          py::arg("hop1_token"), py::arg("dest_rows"), py::arg("ranks_per_node"), py::arg("capacity"),
          py::arg("columns"), py::arg("src_idx_offset"), py::arg("dest_rows_offset"), py::arg("slot"),
          py::arg("expected"), py::arg("count_rows"), py::arg("row_words"), py::arg("receive_bytes"),
          py::arg("send_limit"), py::arg("ready"), py::arg("phase"), py::arg("stream"),
          py::arg("own_row_pushes") = 0, py::arg("own_row_push_rows") = 0, py::arg("own_row_push_phase") = 0,
          "pack_and_push during notify: the records counted from our own count row (capacity: the tables' size; our "
          "own node's not written, none past send_limit bytes), each chunk pushed once its records are written and "
          "signal[slot] >= expected (every count row in), placed as push_after_counts places it. own_row_pushes: "
          "a push table of own_row_push_rows one-record rows (our count row to each peer), pushed first by the same "
          "launch (phase own_row_push_phase labels its errors)")
      .def("arrival_gate", &in::Context::arrival_gate, py::arg("table"), py::arg("blocks"),
           py::arg("chunk_records"), py::arg("phase"),
           "a gate for sum_node_partials / unpack_records over this call's arrivals; table: device int64 "
           "[blocks][GATE_COLUMNS + num_fifos] (first row, records, first slot, FIFO hint, counter bases), kept "
           "alive until the gated launch ran")
      .def("wait_node_flags", &in::Context::wait_node_flags, py::arg("flags"), py::arg("ranks_per_node"),
           py::arg("tiles"), py::arg("epoch"), py::arg("phase"), py::arg("stream"), py::arg("go") = 0,
           "wait on `stream` until every local GPU's flags 0..tiles-1 (int32 [ranks_per_node, GATHER_MAX_TILES] at "
           "flags) are at epoch: the pipelined gather's tiles, or the dispatch forward's node barrier (tiles 1); no "
           "wait when go (a device int64 word; 0: none) is 0")
      .def("wait_signals", &in::Context::wait_signals, py::arg("targets"), py::arg("phase"), py::arg("stream"),
           "wait on `stream` until signal[slot] >= expected for every (slot, expected) in targets")
      .def("record_drain_mark", &in::Context::record_drain_mark, py::arg("stream"),
           "record the context's drain event on `stream` (the end of what it holds now)")
      .def("drain_mark_reached", &in::Context::drain_mark_reached, "whether the GPU passed the last drain mark")
      .def("copy_to_device", &in::Context::copy_to_device, py::arg("dst"), py::arg("src"), py::arg("bytes"),
           py::arg("stream"), "bytes from pinned host memory (src) to the device (dst), queued on stream")
      .def("error_message", &in::Context::error_message)
      .def("error_fields", [](const in::Context& c) {
        const in::ErrorWord e = c.error_fields();
        py::dict d;
        d["code"] = e.code;
        d["rank"] = e.rank;
        d["slot"] = e.slot;
        d["aux"] = e.aux;
        d["phase"] = e.phase;
        d["observed"] = e.observed;
        d["expected"] = e.expected;
        return d;
      }, "the raw GPU error word (code 0: no error); see ERROR_CODES and PHASES")
      .def("clear_error", &in::Context::clear_error)
      .def("abort_waits", &in::Context::abort_waits,
           "make this rank's running and future GPU waits return now (the host calls it when the proxy failed)")
      .def("destroy", &in::Context::destroy, py::call_guard<py::gil_scoped_release>());
#else
  (void)m;  // built without a GPU toolchain: no `internode` submodule
#endif
}

}  // namespace uccl_ep::bindings
