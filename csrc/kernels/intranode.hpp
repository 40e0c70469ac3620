// Host API of the intranode (NVLink / xGMI) kernels. Plain C++: no CUDA or HIP types cross this header, so the
// pybind11 bindings compile with the host compiler. Pointers are device addresses as integers; `stream` is a
// cudaStream_t / hipStream_t as an integer (0 = legacy default stream).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace uccl_ep::intranode {

// Largest rank count of one NVLink/xGMI domain we size control structures for (NVL72 fits).
constexpr int kMaxRanks = 128;
// Widest top-k the kernels take (per-warp shared lists of a token's expert slots).
constexpr int kMaxTopk = 32;
// Bytes at the head of every rank's buffer reserved for flags and count exchange.
constexpr size_t kControlBytes = 1 << 20;

// What a GPU spin reports when it passes its deadline (host-mapped, read by the host after each wait).
struct ErrorWord {
  int32_t code;       // 0 = fine, 1 = timeout, 2 = receive buffer overflow
  int32_t rank;
  int32_t channel;    // block that gave up; for overflow: the rank whose receive area is too small
  int32_t peer;       // rank whose flag was awaited
  int64_t observed;   // counter value seen (overflow: rows needed)
  int64_t expected;   // value waited for (overflow: rows available)
  char what[32];      // name of the wait
};

// Where dispatch puts the rows a rank sends to itself (dispatch_send / dispatch_recv's `own_rows`).
enum OwnRows : int { kOwnInArea = 0, kOwnInOutput = 1 };

// Results of notify mirrored to host-mapped memory for the CPU sync of the normal mode.
struct HostCounts {
  volatile int32_t ready;          // sequence number of the notify that wrote the rest
  int32_t num_recv_tokens;
  int32_t overflow_rows_needed;    // > 0 when some rank's receive area is too small
  int32_t num_local_experts;
  int32_t rows_from[kMaxRanks];    // received rows from each source rank (the copy-engine combine's block sizes)
  int32_t per_expert[1];           // num_local_experts entries follow (raw counts, not aligned)
};

class Context {
 public:
  Context(int rank, int num_ranks, int64_t num_bytes, int device, double timeout_secs);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  std::string ipc_handle() const;                          // cudaIpcMemHandle_t bytes
  void open_peers(const std::vector<std::string>& handles);  // handles[r] of every rank (own ignored)
  void destroy();                                           // closes peer mappings, frees memory (idempotent)

  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }
  int64_t num_bytes() const { return num_bytes_; }
  int64_t data_bytes() const { return num_bytes_; }
  uintptr_t buffer_ptr() const { return reinterpret_cast<uintptr_t>(local_); }

  // Error word checks: returns "" when fine, else the message; clear() resets it.
  std::string error_message() const;
  void clear_error();

  // ---- host-side wait of the normal mode
  void reset_host_counts();
  // Waits (deadline = timeout) for notify's counts; returns {num_recv_tokens, overflow_rows_needed, per_expert[L]...,
  // rows_from[R]...}.
  std::vector<int64_t> wait_host_counts(int num_local_experts) const;

  // ---- launches (all asynchronous on `stream`)
  void barrier(uintptr_t stream);

  // notify: exchange counts, fill rank_prefix_matrix[R][R] (inclusive prefix over source ranks of tokens per
  // destination), recv_info = {num_recv_tokens, rows_capacity_overflow, per-local-expert counts [L]}, and send_pos[T][R].
  void notify(uintptr_t num_tokens_per_rank, uintptr_t num_tokens_per_expert, uintptr_t is_token_in_rank,
              int num_tokens, int num_experts, int64_t rows_capacity, uintptr_t rank_prefix_matrix,
              uintptr_t recv_info, uintptr_t send_pos, uintptr_t stream);

  // Sender side: write every (token, destination) to its final row of the destination's receive area. Skipped when
  // recv_info[1] > 0: on every rank when some receive area is too small (all ranks computed the same counts), on
  // this rank when its notify barrier ran past the deadline (stale counts; the host then raises).
  // `own_rows` (OwnRows) says where the rows this rank sends to itself go:
  //   kOwnInArea: into its own receive area, like every peer's (expert-major reads them from there);
  //   kOwnInOutput: their payload and scales straight into self_x / self_scales (`self_rows` long), the output that
  //     already exists (self-direct); dispatch_recv then copies only their metadata.
  void dispatch_send(uintptr_t x, uintptr_t x_scales, uintptr_t topk_idx, uintptr_t topk_weights,
                     uintptr_t send_pos, uintptr_t rank_prefix_matrix, uintptr_t recv_info, int num_tokens,
                     int hidden_bytes, int num_scales, int topk, int num_experts, int64_t rows_capacity,
                     int own_rows, uintptr_t self_x, uintptr_t self_scales, int64_t self_rows, int num_sms,
                     uintptr_t stream);

  // Receiver side: rows [0, num_recv) of the receive area into the outputs (num_recv from recv_info on the device);
  // rows [num_recv, out_rows) get topk_idx = -1, weights = 0, src_idx = -1 (sync-free padding). `own_rows` as the
  // send's. `rows_from` (rows received from each source rank, as notify mirrors them to the host; empty when the
  // host does not know them, or to have the kernel copy everything): when given (self-direct receives only,
  // own_rows == kOwnInOutput), the peers' payload and scales are copied by the copy engine (one cudaMemcpyAsync per
  // contiguous block, on a copy stream joined before return) while the kernel copies the metadata.
  void dispatch_recv(uintptr_t recv_x, uintptr_t recv_scales, uintptr_t recv_topk_idx, uintptr_t recv_topk_weights,
                     uintptr_t recv_src_idx, uintptr_t recv_info, uintptr_t rank_prefix_matrix, int own_rows,
                     const std::vector<int64_t>& rows_from, int64_t out_rows, int hidden_bytes, int num_scales,
                     int topk, int64_t rows_capacity, int local_sms, uintptr_t stream);

  // Expert-major expansion (reference.py's layout): every (row, local expert) pair once, grouped by expert in
  // rank-major row order, expert e's segment starting at the aligned prefix of the counts, zero padding rows, the
  // tail after the last segment cleared. src_x/src_scales: rank-major rows (the receive area itself works).
  // Outputs em_token/em_slot/em_expert int64 [expert_rows], em_weights f32 (optional), slot_of int32 [rows, K]
  // (required). The payload is copied on local_sms SMs (0: the whole GPU).
  void expert_major(uintptr_t src_x, uintptr_t src_scales, uintptr_t recv_topk_idx, uintptr_t recv_topk_weights,
                    uintptr_t recv_info, int64_t out_rows, int64_t expert_rows, int num_local_experts, int alignment,
                    int hidden_bytes, int num_scales, int topk, uintptr_t out_x, uintptr_t out_scales,
                    uintptr_t em_token, uintptr_t em_slot, uintptr_t em_expert, uintptr_t em_weights,
                    uintptr_t slot_of, int local_sms, uintptr_t stream);

  // combine of expert-major rows, local half (no communication; on local_sms SMs, 0: the whole GPU): for
  // every rank-major row i < min(num_rows, recv_info[0]), partials[i] = the sum of x[slot_of[i][k]] over the k with
  // slot_of[i][k] >= 0, in k order, in fp32, rounded once to x's dtype; with topk_weights (expert-major, one float
  // per row), out_topk_weights[i][k] = that row's weight, 0 where slot_of[i][k] < 0. Rows from recv_info[0] on are
  // left untouched. The partials and weights are then an ordinary rank-major input of combine_send.
  void expert_major_partials(uintptr_t x, uintptr_t topk_weights, uintptr_t slot_of, uintptr_t recv_info,
                             int num_rows, int hidden, int elem_size, int topk, uintptr_t partials,
                             uintptr_t out_topk_weights, int local_sms, uintptr_t stream);

  // combine: every rank writes each received (rank-major) row i < min(num_rows, recv_info[0]) back to row
  // (src_idx, me) of the source rank's combine area, in x's dtype, with its weights [num_rows, topk] ...
  void combine_send(uintptr_t x, uintptr_t topk_weights, uintptr_t recv_src_idx, uintptr_t rank_prefix_matrix,
                    uintptr_t recv_info, int num_rows, int hidden, int elem_size, int topk,
                    int64_t max_src_tokens, int num_sms, uintptr_t stream);
  // ... and the source sums the copies of each token in rank order, in fp32.
  void combine_reduce(uintptr_t is_token_in_rank, int num_tokens, int hidden, int elem_size, int topk,
                      uintptr_t out_x, uintptr_t out_topk_weights, int64_t max_src_tokens,
                      int local_sms, uintptr_t stream);

  // The same combine with the transfers on copy engines (normal and cached modes, where the host knows
  // rows_from[r], the rows x holds from each source rank r, contiguous in rank order): a barrier, then one memcpy per
  // chunk of `chunk_bytes` into row send_pos of r's combine area, each followed by a flag, on one copy stream per
  // peer (peers share streams beyond `num_streams`, at most 8); the reduce on `stream` waits for the rows each token
  // needs, so it overlaps the copies. Bit-identical to combine_send + combine_reduce. Needs send_pos [T][R] of the
  // dispatch (-1 where not sent).
  void combine_copy_engine(uintptr_t x, uintptr_t topk_weights, const std::vector<int64_t>& rows_from,
                           uintptr_t is_token_in_rank, uintptr_t send_pos, int num_tokens, int hidden, int elem_size,
                           int topk, uintptr_t out_x, uintptr_t out_topk_weights, int64_t max_src_tokens,
                           int64_t chunk_bytes, int num_streams, int local_sms, uintptr_t stream);

 private:
  int rank_, num_ranks_, device_;
  int64_t num_bytes_;
  uint64_t timeout_ns_;
  void* local_ = nullptr;               // control region followed by the data region
  std::vector<void*> peers_;            // peers_[r]: rank r's buffer mapped here (own = local_)
  void** peers_dev_ = nullptr;          // the same table on the device
  ErrorWord* error_ = nullptr;          // host-mapped
  ErrorWord* error_dev_ = nullptr;
  HostCounts* host_counts_ = nullptr;   // host-mapped
  HostCounts* host_counts_dev_ = nullptr;
  bool opened_ = false;
  int host_seq_ = 0;                    // notify's sequence number the host waits for in host_counts_->ready
  // The kernels that touch only this rank's memory (the receive copy, combine's reduce, the expert-major sum) run
  // on `local_sms` SMs, 0 meaning the whole GPU: blocks per SM from the occupancy API, asked once in the
  // constructor because a launch may be under CUDA-graph capture.
  enum LocalKernel { kLocalRecv, kLocalReduceBf16, kLocalReduceF32, kLocalPartialsBf16, kLocalPartialsF32,
                     kLocalReduceBlocksBf16, kLocalReduceBlocksF32, kLocalExpertCopy, kLocalKernels };
  int whole_gpu_grid_[kLocalKernels] = {1, 1, 1, 1, 1, 1, 1, 1};
  // The copy-engine combine's stream and fork/join events (cudaStream_t / cudaEvent_t, kept opaque so this header
  // stays free of CUDA/HIP types), made on first use.
  std::vector<void*> copy_streams_, copy_joins_;  // kMaxCopyStreams (8) each
  void* copy_fork_ = nullptr;           // the caller's stream -> the copy streams
  void* write_value64_ = nullptr;       // cuStreamWriteValue64 (hipStreamWriteValue64): the flag after a chunk
  void ensure_copy_streams();
  // The first n copy streams, ordered behind the work queued so far on `stream` (void*: a cudaStream_t / hipStream_t;
  // no CUDA type crosses this header) ...
  std::vector<void*> fork_copy_streams(void* stream, int n);
  // ... and `stream` ordered behind everything queued on them since.
  void join_copy_streams(void* stream, int n);
  void write_value64(void* stream, uint64_t* address, uint64_t value);
  int sms_ = 1;  // the device's SMs (blocks that clear the sync-free tail of the expert-major output)
  int local_grid(LocalKernel k, int local_sms) const;
};

// get_dispatch_layout: per-rank, per-node and per-expert token counts and is_token_in_rank from topk_idx (int64,
// -1 = dropped). Outputs are int32 (counts) and bool (is_token_in_rank); num_tokens_per_node may be 0 (skipped).
// Rows of dispatch's receive area / source tokens of combine's area that fit in `data_bytes` for these shapes.
int64_t dispatch_rows_capacity(int64_t data_bytes, int hidden_bytes, int num_scales, int topk);
int64_t combine_tokens_capacity(int64_t data_bytes, int num_ranks, int hidden, int topk);
int64_t max_experts_in_control();
// Byte offsets, from the buffer start, of the payload and scales of dispatch's receive area.
std::vector<int64_t> dispatch_area_offsets(int64_t rows_capacity, int hidden_bytes, int num_scales, int topk);

void dispatch_layout(uintptr_t topk_idx, int num_tokens, int topk, int num_experts, int num_ranks,
                     int ranks_per_node, uintptr_t num_tokens_per_rank, uintptr_t num_tokens_per_node,
                     uintptr_t num_tokens_per_expert, uintptr_t is_token_in_rank, uintptr_t stream);

}  // namespace uccl_ep::intranode
