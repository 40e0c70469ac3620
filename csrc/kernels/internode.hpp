// Host API of the internode (hierarchical) path: a rank's RDMA and NVL regions, its CPU proxy (loopback or verbs),
// and the three kernels the staged data path needs (docs/internode.md). Plain C++: no CUDA types cross this header,
// so the pybind11 bindings compile with the host compiler. Pointers are device addresses as integers; `stream` is a
// cudaStream_t as an integer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/arrival_gate.hpp"
#include "kernels/expert_major.hpp"  // kMaxTopk: the top-k of the slots ExpertSums reads
#include "kernels/timeline.hpp"
#include "kernels/internode_plan.hpp"  // PackColumn
#include "kernels/step_failure.hpp"
#include "proxy/proxy.hpp"  // Proxy, ProxyThreadStats (host-only header)
#include "transport/loopback.hpp"  // LoopbackWire

namespace uccl_ep::internode {

// Columns of one row of the push table (int64, row-major [n][kPushColumns]): one row per destination block.
enum PushColumn : int {
  kPushDstRank = 0,      // destination rank (rail-aligned rank of the destination node)
  kPushLocalOffset = 1,  // block start in our RDMA region (bytes, multiple of 16)
  kPushRemoteOffset = 2, // block start in the destination's RDMA region (bytes, multiple of 16)
  kPushStride = 3,       // bytes per record (multiple of 16)
  kPushRecords = 4,      // records in the block (0: nothing is pushed)
  kPushSlot = 5,         // first of num_fifos signal slots on the destination: a chunk pushed into FIFO f adds its
                         // record count to slot + f, so each counter is fed by one FIFO (one proxy thread's lane)
  kPushFifo = 6,         // FIFO hint (the destination node): chunk c of the row goes to FIFO (hint + c) % num_fifos,
                         // so one block's chunks travel every proxy thread at once
  kPushColumns = 7,
};

// The most push table rows (destination blocks) pack_and_push takes: its packers keep the rows in shared memory.
constexpr int kPackPushMaxRows = 256;

// The records pack_and_push writes: those of pack_records (internode_plan.hpp) -- record r of num_records at
// send + r * stride, our own node's [own_first, own_first + own_count) at own_dst instead (own_dst 0: not written, the
// reader taking them from the columns, internode_plan.hpp OwnRows) -- with two more cases for
// combine's rows: hop1_token 0 (record r carries row r of every column) and src_idx_offset < 0 (no index fields;
// ranks_per_node 0: no final rows either). `send` must lie in this rank's RDMA region: the push table's offsets
// name the records by their place there.
//
// Expert-major combine (ExpertSums with x set, docs/internode.md, "Expert-major sums in the pack"): no columns; record
// r's payload is the sum of combine row r's local experts' rows, x[slot_of[r][k]] for k = 0.. topk - 1 where the slot
// is >= 0, added in fp32 in k order and rounded once to x's dtype (exactly what expert_major_partials writes), and,
// with weights, its topk fp32 weights (weights[slot], 0 where the expert is not local) at weights_offset. Why in the
// pack: the sum read every expert-major row (~470 MB per call at DeepSeek-V3 shape) in a launch of its own before
// the pack, and the wire waited for all of it; here each chunk leaves once its own rows are summed.
struct ExpertSums {
  uintptr_t x = 0;            // expert-major rows of row_bytes bytes (0: the record copies the columns)
  int64_t row_bytes = 0;
  bool f32 = false;           // x is float32, else bfloat16
  uintptr_t slot_of = 0;      // int32 [records, topk]
  int topk = 0;
  uintptr_t weights = 0;      // fp32, one per expert-major row (0: no weights in the record)
  int64_t weights_offset = 0;
};

// Pipelined combine gather, several GPUs per node (docs/internode.md, "Pipelined combine gather"). Each local GPU
// copies its rows for a forwarder into its gather block there in tiles of `tile_rows` of the forwarder's arrivals
// (gather_tiles), and after each tile raises its flag of that tile in the forwarder's NVL region to the call's epoch.
// The forwarder's pack_and_push (NodeSums with gather set) writes record r as the node sum of arrival r once every
// local GPU flagged its tile, and pushes each chunk once its records are summed: the hop starts with the
// first tiles instead of after the whole gather and a barrier. The flags are never reset: each combine raises them to
// a higher epoch (int32, counted by every rank of the group alike).
constexpr int kGatherMaxTiles = 1024;  // flags per (forwarder, local GPU); tile_rows grows with the arrivals
constexpr int kNodeSumsMaxRanksPerNode = 256;  // a packer block's threads wait for a record's flags, one GPU each

struct NodeSums {
  uintptr_t gather = 0;      // row 0 of our gather area (NVL): GPU j's copy of arrival r at row rows_of[j][r]
  uintptr_t rows_of = 0;     // int32 [ranks_per_node][num_records]; -1: GPU j holds no copy of arrival r
  int ranks_per_node = 0;
  int64_t payload_bytes = 0; // rows of the record stride: the payload, then num_weights fp32 weights
  int num_weights = 0;
  bool f32 = false;          // payload in float32, else bfloat16
  uintptr_t flags = 0;       // int32 [ranks_per_node][kGatherMaxTiles] in our NVL region: GPU j's flag of tile t
  int64_t tile_rows = 0;
  int32_t epoch = 0;
};

struct RecordJob {
  uintptr_t send = 0, own_dst = 0;
  int64_t own_first = 0, own_count = 0, stride = 0, num_records = 0;
  uintptr_t hop1_token = 0, dest_rows = 0;
  int ranks_per_node = 0;
  std::vector<PackColumn> columns;
  int64_t src_idx_offset = -1, dest_rows_offset = 0;
  ExpertSums sums;
  NodeSums node_sums;
};

// The most top-k an ExpertSums record takes: that of the expert-major kernels whose slots it reads (its packer keeps
// a record's slots in shared memory).
constexpr int kExpertSumsMaxTopk = expert_major::kMaxTopk;

// A push made before the host knows the counts (docs/internode.md, "Push during notify"): the kernel waits until
// every rank's count row is in our notify area (signal[slot] >= expected), then adds to each push-table row's remote
// offset the records that the source nodes before ours send to that destination (its block's place there), read
// from the rows: columns num_ranks + m of rank n * G + local hold node n's tokens for node m. A destination whose
// arrivals would exceed `receive_bytes` gets nothing: every rank raises from the same counts after notify.
struct CountRowOffsets {
  int64_t slot = 0, expected = 0;
  uintptr_t rows = 0;      // the notify area (device): rank r's row at rows + 8 * r * row_words
  int64_t row_words = 0;
  int ranks_per_node = 1;
  int64_t receive_bytes = 0;
  // -1: the table's records and local offsets are final. >= 0: the table was made before our own counts were read
  // (one row per other node, records 0, local offsets from the send area's start); each row's records and block
  // come from our own count row, and nothing is pushed when all our records together pass send_limit bytes.
  int64_t send_limit = -1;
  // Our own count row's pushes (pack_and_push_after_counts only): a push table of one-record rows, each a write of
  // our row into a peer's notify area, made by the launch before anything else. The row then leaves with the launch
  // that waits for the others' rows instead of a push_chunks launch of its own before it. 0 rows: pushed already.
  uintptr_t own_row_pushes = 0;
  int own_row_push_rows = 0;
  int own_row_push_phase = 0;
};

// (slot, expected) pairs one wait_signals launch carries as kernel arguments (more go in further launches).
constexpr int kWaitTargetsPerLaunch = 64;

struct ProxyParams {
  int num_threads = 1;
  int fifos_per_thread = 1;
  uint32_t fifo_depth = 1024;
  std::vector<int> cpus;
  int idle_backoff_us = 0;
  double timeout_secs = 100.0;
  uint64_t max_inflight_writes = 8;
  uint64_t max_inflight_bytes = 2ull << 20;
  int reorder_window = 256;
  uint32_t num_signal_slots = 512;
  int loopback_reorder = 0;
  uint64_t loopback_delay_us = 0;
  double loopback_bandwidth_gbps = 0;  // GB/s of the whole proxy, split over its threads
  uint64_t loopback_seed = 0;
  // A copy agent's segment (uccl_ep_train/loopback_copy_agent.py): its process moves the loopback's bytes. Empty:
  // the proxy threads copy.
  std::string loopback_copy_agent;
  std::string dump_trigger;  // UCCL_EP_PROXY_DUMP_FILE (ProxyConfig::dump_trigger)
  // "loopback" (ranks on one host: shared memory and CUDA IPC) or "verbs" (RDMA NICs). Python decides which
  // (internode.resolve_internode_transport) and which NICs (topology.plan()).
  std::string transport = "loopback";
  std::vector<std::string> ib_devices;  // verbs: the RDMA devices of this rank's GPU
  int ib_port = 1;
  std::vector<int> gid_index;           // verbs: empty or one per device; -1 chooses (choose_gid, UCCL_IB_GID_INDEX)
  int sl = -1;                          // verbs: -1 is 3 on IB/RoCE, 8 on EFA (UCCL_IB_SL)
  int tc = -1;                          // verbs: -1 is 104 on IB/RoCE, 0 on EFA (UCCL_IB_TC)
};

class Context {
 public:
  Context(int rank, int world, int device, int64_t rdma_bytes, int64_t nvl_bytes, const ProxyParams& params,
          double gpu_timeout_secs);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  int64_t rdma_bytes() const { return rdma_bytes_; }
  int64_t nvl_bytes() const { return nvl_bytes_; }
  uintptr_t rdma_ptr() const { return reinterpret_cast<uintptr_t>(rdma_); }
  uintptr_t nvl_ptr() const { return reinterpret_cast<uintptr_t>(nvl_); }
  uintptr_t signals_host_ptr() const;
  int num_fifos() const;
  uint32_t num_signal_slots() const { return num_slots_; }
  std::string transport_name() const;
  bool transport_in_order() const;

  // ---- NVL region sharing inside the node
  std::string nvl_ipc_handle() const;
  // handles[i] of the node's ranks (own entry: own index); returns the mapped base of each (own: nvl_ptr()).
  std::vector<uintptr_t> open_nvl_peers(const std::vector<std::string>& handles, int own_index);

  // ---- proxy bootstrap (infos[thread][rank] = that rank's proxy_local_info(thread))
  std::string proxy_local_info(int thread);
  void proxy_connect(const std::vector<std::vector<std::string>>& infos);
  void proxy_start();
  void proxy_stop();
  // Wait until this rank's proxy took every command its kernels pushed and every write it posted completed (for
  // loopback: the peer's immediate is published). Call after the pushing kernels finished (the stream drained).
  // Teardown needs it: a combine returns when its *incoming* data arrived, while its own outgoing writes may still
  // be queued or in flight; stopping the proxy then drops them and the peer waits until its GPU deadline.
  // Throws TimeoutError / ProxyError (Proxy::wait_idle).
  void proxy_wait_idle(double timeout_secs);
  std::string proxy_error() const;  // "" while healthy
  ProxyThreadStats proxy_totals() const;  // every proxy thread together (Proxy::totals)
  // The largest single write the transport takes (TransportCaps::max_write_bytes; EFA: efadv max_rdma_size).
  // Chunks must not exceed it: a WRITE_SIGNAL is one write, never split (the signal rides on it).
  uint64_t max_write_bytes() const;
  // Host read of a signal counter (tests, diagnostics).
  int64_t signal_value(uint32_t slot) const;
  // How far the counters are from their targets: the sum over (slot, target) of max(0, target - signal[slot]), e.g.
  // the records of a hop still to land. One read of each host counter, no GPU call.
  int64_t signals_short(const std::vector<std::pair<int64_t, int64_t>>& targets) const;
  // Per FIFO, for error messages: how many slots kernels reserved (the head in GPU memory), how far the proxy got
  // (published tail), and what the ring holds beyond it (Fifo::Snapshot). head > tail with the slot at the tail
  // empty is a lost push; head == tail means the proxy took every command kernels pushed.
  struct FifoState {
    int fifo = 0;
    int64_t device_head = -1;  // -1: could not be read
    uint64_t tail = 0;
    uint32_t full = 0;
    int64_t first_full = -1, last_full = -1;
  };
  std::vector<FifoState> fifo_states() const;
  // The proxy threads' published counters (queued, in flight, outstanding per FIFO, held for order); never asks the
  // transport (Proxy::describe(false)).
  std::string proxy_counters() const;
  // Most blocks of the grids that spin (pack_and_push's packers, the gated readers through their gate); 0: no cap.
  // For ranks that share a GPU: their loopback copies are kernels there, which a full grid of spinning blocks starves.
  void set_spin_blocks(int blocks) {
    if (blocks < 0) throw std::invalid_argument("set_spin_blocks: blocks must be >= 0 (0: no cap)");
    spin_blocks_ = blocks;
  }
  int spin_blocks() const { return spin_blocks_; }
  // The kernel timeline (TimelineField): each later pack_and_push launch stamps the next row of `stamps` (device
  // uint64 [capacity][kTimelineFields], initialised by the caller), until `capacity` rows are used, and so does the
  // gated reader of the same hop (the next arrival_gate after the launch). 0: off.
  void set_timeline(uintptr_t stamps, int capacity);
  int timeline_launches() const { return timeline_used_; }  // rows stamped since set_timeline
  // The emulated NIC's busy runs (LoopbackWire): only over the loopback with a bandwidth cap; throws otherwise.
  void start_wire_log(size_t capacity);
  std::vector<WireRun> stop_wire_log(uint64_t* dropped);
  // Device address of the error word (every kernel's failure report).
  uintptr_t error_word_ptr() const { return reinterpret_cast<uintptr_t>(error_dev_); }
  // The stop flag (StopFlag) every kernel tests: its device address and the generation to launch with.
  uintptr_t stop_flag_ptr() const { return reinterpret_cast<uintptr_t>(stop_dev_); }
  int32_t stop_generation() const { return stop_generation_; }

  // ---- kernels (asynchronous on `stream`)
  // Push one WRITE_SIGNAL per chunk of every block of the push table (device int64 [n][kPushColumns]); chunk c of a
  // row goes to FIFO (row[kPushFifo] + c) % num_fifos and signals slot row[kPushSlot] + that FIFO; chunks hold at
  // most `chunk_records` records. `phase` only labels errors.
  void push_chunks(uintptr_t table, int n, int64_t chunk_records, int phase, uintptr_t stream);
  // push_chunks once the count rows are in, each row's remote offset moved to its block's place (CountRowOffsets).
  void push_after_counts(uintptr_t table, int n, int64_t chunk_records, const CountRowOffsets& at, int phase,
                         uintptr_t stream);
  // pack_records and push_chunks in one launch: every record of `job` written, and each chunk of the table pushed
  // as soon as its records are (docs/internode.md, "Pack and push"). `ready`: device int32 counters, one per chunk
  // of the table (rows in order, chunks of a row in order), zero at launch and left zero.
  void pack_and_push(uintptr_t table, int n, int64_t chunk_records, const RecordJob& job, uintptr_t ready, int phase,
                     uintptr_t stream);
  // pack_and_push during notify (docs/internode.md, "Push during notify"): the records counted from our own count row
  // (at.send_limit >= 0: job.num_records is the tables' capacity; our own node's records are not written), and the
  // chunks pushed once every count row is in, each block placed as push_after_counts places it.
  void pack_and_push_after_counts(uintptr_t table, int n, int64_t chunk_records, const RecordJob& job,
                                  const CountRowOffsets& at, uintptr_t ready, int phase, uintptr_t stream);
  // Wait on the GPU for NVLink flags among the node's GPUs (int32 rows of kGatherMaxTiles at `flags`, one row per
  // local GPU): until GPU j's flag t is at `epoch` for every j < ranks_per_node and t < tiles. Two users: the
  // pipelined combine gather's tile flags where no pack_and_push waits for them (a forwarder with no record for
  // another node), and the dispatch forward's node barrier (tiles = 1). A flag still below it at the GPU deadline is
  // reported (kErrNodeFlagTimeout).
  void wait_node_flags(uintptr_t flags, int ranks_per_node, int64_t tiles, int32_t epoch, int phase,
                       uintptr_t stream, uintptr_t go = 0);
  // Wait until signal[slot] >= expected for every (slot, expected) pair; deadline: the GPU timeout. The pairs go
  // as kernel arguments, kWaitTargetsPerLaunch per launch. A wait also ends early when the error word is set (by
  // another kernel of this rank, or by abort_waits()).
  void wait_signals(const std::vector<std::pair<int64_t, int64_t>>& targets, int phase, uintptr_t stream);
  // The gate for a consumer of this call's arrivals (arrival_gate.hpp): `table` (device int64 [blocks][kGateBase +
  // num_fifos]) names the blocks, `chunk_records` is the senders' chunk size; the waits get this rank's counters,
  // deadline, error word and stop flag. The table must outlive the gated launch. With the kernel timeline on, the
  // gate carries the row of the last pack_and_push launch since the last push_chunks (the hop it reads), once.
  ArrivalGate arrival_gate(uintptr_t table, int blocks, int64_t chunk_records, int phase);

  std::string error_message() const;  // "" when fine
  ErrorWord error_fields() const;     // the raw error word (code 0 when fine)
  void clear_error();  // also starts a new stop generation
  // Host side: make every running and future wait_signals of this rank return at once (code kErrAborted), e.g.
  // because the proxy failed and the data will never come, and set the stop flag. No effect on the error word when
  // an error is already recorded.
  void abort_waits();
  // The host's drains (a wait with a deadline instead of a synchronize): mark the end of what `stream` holds now,
  // then ask whether the GPU got there. One event of the context's, recorded on the raw handle: a torch Event and
  // torch.cuda.current_stream() cost ~15 us of host time per drain beside busy proxy threads (session 12).
  void record_drain_mark(uintptr_t stream);
  bool drain_mark_reached() const;
  // A second stream of the context's (non-blocking), for work that must run beside a kernel of the caller's stream
  // instead of before it: the pipelined combine gather's copies beside the forwarder's node sum and push, which
  // waits for their tiles (docs/internode.md, "Pipelined combine gather"). stream_wait orders the two: `waiter` waits
  // on the GPU for what `signaller` holds now (one event of the context's; the wait takes its state at the call).
  uintptr_t side_stream() const { return reinterpret_cast<uintptr_t>(side_stream_); }
  void stream_wait(uintptr_t waiter, uintptr_t signaller);
  // `bytes` from pinned host memory at `src` to device memory at `dst`, queued on `stream` (cudaMemcpyAsync): the
  // backend's small tables, from a staging area allocated at setup, never a pageable copy the driver may stage
  // synchronously (uccl_ep_train/upload_staging.py).
  void copy_to_device(uintptr_t dst, uintptr_t src, int64_t bytes, uintptr_t stream);
  void destroy();  // stops the proxy, unmaps peers, frees memory (idempotent)

 private:
  // push_chunks' kernel, with the count rows' offsets when `at` is given (push_after_counts)
  void launch_push(uintptr_t table, int n, int64_t chunk_records, const CountRowOffsets* at, int phase,
                   uintptr_t stream);
  void launch_pack_and_push(uintptr_t table, int n, int64_t chunk_records, const RecordJob& job,
                            const CountRowOffsets* at, uintptr_t ready, int phase, uintptr_t stream);
  void check_count_rows(const CountRowOffsets& at, const std::string& what) const;  // push_after_counts' argument checks

  int rank_, world_, device_;
  int64_t rdma_bytes_, nvl_bytes_;
  uint64_t timeout_ns_;
  uint32_t num_slots_;
  int spin_blocks_ = 0;
  unsigned long long* timeline_ = nullptr;
  int timeline_capacity_ = 0, timeline_used_ = 0;
  unsigned long long* hop_stamps_ = nullptr;  // the last pack_and_push launch's timeline row, for its hop's reader
  void* rdma_ = nullptr;
  void* nvl_ = nullptr;
  std::unique_ptr<Proxy> proxy_;
  std::shared_ptr<LoopbackWire> wire_;  // the loopback's capped wire (its log), else null
  void* signals_dev_ = nullptr;      // device view of the proxy's signal counters
  void* mirror_dev_ = nullptr;       // device memory: the counters as a gated kernel's watcher last saw them
  bool signals_registered_ = false;
  void* fifos_dev_ = nullptr;        // DeviceFifo[num_fifos] in device memory
  std::vector<unsigned long long*> fifo_heads_dev_;  // each FIFO's head in GPU memory (fifo_states reads them)
  unsigned long long* heads_host_ = nullptr;         // pinned mirror the heads are copied into
  ErrorWord* error_ = nullptr;       // host-mapped
  ErrorWord* error_dev_ = nullptr;
  int32_t* stop_dev_ = nullptr;      // StopFlag::flag, device memory
  int32_t stop_generation_ = 1;
  void* abort_stream_ = nullptr;     // cudaStream_t (non-blocking): abort_waits() sets the flag while kernels spin
  void* drain_event_ = nullptr;      // cudaEvent_t of record_drain_mark (timing disabled)
  void* side_stream_ = nullptr;      // cudaStream_t (non-blocking): side_stream()
  void* order_event_ = nullptr;      // cudaEvent_t of stream_wait (timing disabled)
  int32_t abort_value_ = 0;          // the source of that copy, alive as long as the stream
  std::vector<void*> opened_peers_;
  bool destroyed_ = false;
  mutable std::mutex diag_mu_;  // serializes destroy() with the diagnostic reads (another thread may ask)
};

// Copy `n` rows of `row_bytes`: row i goes from src + (src_idx ? src_idx[i] : i) * src_stride to
// dst + (dst_idx ? dst_idx[i] : i) * dst_stride; a negative index skips the row. dst may be a peer's IPC-mapped
// memory (NVLink). Index arrays are device int64. Asynchronous on `stream`.
// Range check (dst_rows >= 0): a destination row >= dst_rows is not written; the first one is recorded in the
// error word `err` (device address of an ErrorWord, e.g. Context::error_word_ptr(); 0: not recorded) as
// kErrScatterRange with `rank`, `phase` and `target` (the destination's local GPU index).
// Stop (stop_flag != 0, Context::stop_flag_ptr() and stop_generation()): nothing is copied when the rank's stop flag
// holds `stop_generation`, and a range error sets it.
void scatter_rows(uintptr_t dst, int64_t dst_stride, uintptr_t dst_idx, uintptr_t src, int64_t src_stride,
                  uintptr_t src_idx, int64_t n, int64_t row_bytes, uintptr_t stream, int64_t dst_rows = -1,
                  uintptr_t err = 0, uintptr_t stop_flag = 0, int stop_generation = 0, int rank = -1, int phase = 0,
                  int target = -1);

// Dispatch forward over NVLink (asynchronous on `stream`): arrival row r of `src` (rows of `src_stride` bytes, the
// first `row_bytes` moved) goes to each local GPU j with dst_idx[r * targets + j] >= 0 (device int64 [n, targets]),
// at that row of dsts[j] (device uint64 [targets]: the GPUs' areas, rows of `dst_stride` bytes; `dst_bases_or`: the
// bitwise OR of its entries, which picks the word size with the strides). Each row is read once for all targets.
// Range check, error word and stop flag as scatter_rows, with dst_rows[j] (device int64 [targets]) the rows of
// target j's area and the target in the report. Up to kMaxForwardTargets local GPUs.
constexpr int kMaxForwardTargets = 1024;
void forward_rows(uintptr_t dsts, uint64_t dst_bases_or, int64_t dst_stride, uintptr_t dst_idx, int targets,
                  uintptr_t src, int64_t src_stride, int64_t n, int64_t row_bytes, uintptr_t dst_rows,
                  uintptr_t stream, uintptr_t err = 0, uintptr_t stop_flag = 0, int stop_generation = 0, int rank = -1,
                  int phase = 0);

// The dispatch forward as the forwarder's reader (asynchronous on `stream`): for each arrival r of `src` (wire
// records of `src_stride` bytes), its final row at local GPU j is d = (int32 dest row j of the record, at
// dest_rows_offset) + the base of r's block for j, -1 where the dest row is negative. The arrivals run in
// num_blocks blocks (one per source node); blocks (device int64 [num_blocks, 1 + targets], forward_block_bases)
// holds per block the end of its rows (exclusive, counted from arrival 0; the last is n) and then its base for each
// target. d goes to dst_idx_out[r * targets + j] (device int64 [n, targets], every entry written), and the
// record's first `row_bytes` bytes, with r in its int32 arrival field (also written into the record), to row d of
// dsts[j] wherever d >= 0. Range check, error word and stop flag as forward_rows. gate (nullptr: none; the rows
// must be in): each row first waits for the chunk that carries it (arrival_gate.hpp), so the forward runs during
// the hop; rows are taken from first_row to the end, then from 0.
void forward_arrivals(uintptr_t dsts, uint64_t dst_bases_or, int64_t dst_stride, int targets, uintptr_t src,
                      int64_t src_stride, int64_t n, int64_t row_bytes, uintptr_t dst_rows, uintptr_t blocks,
                      int64_t num_blocks, int64_t dest_rows_offset, int64_t arrival_offset, uintptr_t dst_idx_out,
                      uintptr_t stream, const ArrivalGate* gate = nullptr, int64_t first_row = 0, uintptr_t err = 0,
                      uintptr_t stop_flag = 0, int stop_generation = 0, int rank = -1, int phase = 0,
                      uintptr_t ready_words = 0, int64_t ready_rows = 0, int32_t ready_epoch = 0,
                      uintptr_t dims = 0);

// The local side of the pipelined combine gather (NodeSums; asynchronous on `stream`): for each forwarder f < targets
// and each tile t of its arrivals[f] arrivals (device int64 [targets]; tile_rows each), our rows
// by_arrival[f * max_arrivals + a] (device int32 [targets, max_arrivals]; -1: the arrival is not ours) of x
// (payload_bytes each, rows back to back) and of w (num_weights fp32 each; 0: none) go to row a of dsts[f] (device
// uint64 [targets]: our gather block at forwarder f, rows of dst_stride bytes, the weights behind the payload); then
// flag t of flags[f] (device uint64 [targets]: our int32 flag row at forwarder f) is raised to `epoch`, released at
// system scope after every copy of the tile. A row index >= num_rows is reported (kErrScatterRange) and not copied.
// Nothing is copied or flagged once the rank is stopped (a failure during the launch stops the flags after it).
// Payload bytes and w must be multiples of 4, dst_stride of 16. `blocks`: the grid, which takes the tiles in order
// (UCCL_EP_GATHER_BLOCKS; 0: a block per tile and forwarder, up to 1024, every tile at once). `own_ranges` (device
// int64 [2, targets]: each forwarder's own node's block of arrivals, first and end; 0: none): the tiles then go in
// the order the forwarder's pack sums them, that block's last.
void gather_tiles(uintptr_t dsts, uintptr_t flags, int targets, uintptr_t by_arrival, int64_t max_arrivals,
                  uintptr_t arrivals, int64_t tile_rows, uintptr_t x, int64_t payload_bytes, uintptr_t w,
                  int num_weights, int64_t num_rows, int64_t dst_stride, int32_t epoch, uintptr_t stream,
                  uintptr_t err = 0, uintptr_t stop_flag = 0, int stop_generation = 0, int rank = -1, int phase = 0,
                  int blocks = 0, uintptr_t own_ranges = 0);

// Raise `n` NVLink flags (asynchronous on `stream`): the int32 at flags[i] (device uint64 [n]: addresses, e.g. our
// flag row in each local GPU's NVL region) set to `epoch`, released at system scope after everything earlier on the
// stream -- the node barrier after the dispatch forward (docs/internode.md, "The dispatch forward's node barrier").
// Nothing is raised once the rank is stopped: a failed forward must not let the node's GPUs read its rows.
void raise_flags(uintptr_t flags, int n, int32_t epoch, uintptr_t stream, uintptr_t stop_flag = 0,
                 int stop_generation = 0, uintptr_t go = 0);

// Source side of combine (asynchronous on `stream`): out_x[t] (x's dtype: bf16, or fp32 with `fp32`; [num_tokens,
// payload_bytes]) = the fp32 sum in ascending node m of the payloads of rows row_of[m * num_tokens + t] (device int32
// [num_nodes, num_tokens], -1: none) of `src` (rows of `src_stride` bytes), rounded once; out_w[t] (fp32
// [num_tokens, num_weights]) the same sum of the num_weights fp32 values that follow each payload. `zero`: a device
// buffer of payload_bytes zero bytes. Payload bytes, strides and pointers must be multiples of 16.
// out_x_stride / out_w_stride (bytes, <= 0: rows back to back): output rows may sit inside wider rows, e.g. the
// forwarder writes its node sums straight into the combine send records (payload, then weights).
// gate (nullptr: none): each tile of tokens waits until the chunks holding its partial sums (row_of's rows, the
// gate's row space) have landed, so the sum overlaps the network hop (arrival_gate.hpp).
void sum_node_partials(uintptr_t out_x, uintptr_t out_w, uintptr_t src, int64_t src_stride, uintptr_t row_of,
                       uintptr_t zero, int num_nodes, int64_t num_tokens, int64_t payload_bytes, int num_weights,
                       bool fp32, uintptr_t stream, int64_t out_x_stride = 0, int64_t out_w_stride = 0,
                       const ArrivalGate* gate = nullptr);

}  // namespace uccl_ep::internode
