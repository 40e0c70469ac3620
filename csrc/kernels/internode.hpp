// Host API of the internode (hierarchical) path: a rank's RDMA and NVL regions, its CPU proxy (loopback transport),
// and the three kernels the staged data path needs (docs/internode.md). Plain C++: no CUDA types cross this header,
// so the pybind11 bindings compile with the host compiler. Pointers are device addresses as integers; `stream` is a
// cudaStream_t as an integer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace uccl_ep {
class Proxy;
}

namespace uccl_ep::internode {

// Columns of one row of the push table (int64, row-major [n][kPushColumns]): one row per destination block.
enum PushColumn : int {
  kPushDstRank = 0,      // destination rank (rail-aligned rank of the destination node)
  kPushLocalOffset = 1,  // block start in our RDMA region (bytes, multiple of 16)
  kPushRemoteOffset = 2, // block start in the destination's RDMA region (bytes, multiple of 16)
  kPushStride = 3,       // bytes per record (multiple of 16)
  kPushRecords = 4,      // records in the block (0: nothing is pushed)
  kPushSlot = 5,         // signal slot on the destination; each chunk adds its record count
  kPushColumns = 6,
};

// What a GPU-side failure leaves in host-mapped memory (read by the host after each phase).
struct ErrorWord {
  int32_t code;      // 0 fine, 1 signal wait timed out, 2 FIFO push timed out, 3 command does not encode
  int32_t rank;
  int32_t slot;      // signal slot (1), FIFO index (2), destination rank (3)
  int32_t aux;       // command error code (3)
  int64_t observed;  // counter value seen
  int64_t expected;  // value waited for
};

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
  double loopback_bandwidth_gbps = 0;
  uint64_t loopback_seed = 0;
};

struct ProxyTotals {
  uint64_t commands = 0, writes_posted = 0, signals_applied = 0, max_inflight_writes = 0, max_inflight_bytes = 0,
           max_reorder_held = 0;
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
  std::string proxy_error() const;  // "" while healthy
  ProxyTotals proxy_totals() const;
  // Host read of a signal counter (tests, diagnostics).
  int64_t signal_value(uint32_t slot) const;

  // ---- kernels (asynchronous on `stream`)
  // Push one WRITE_SIGNAL per chunk of every block of the push table (device int64 [n][kPushColumns]); row i goes
  // to FIFO i % num_fifos, chunks hold at most `chunk_records` records.
  void push_chunks(uintptr_t table, int n, int64_t chunk_records, uintptr_t stream);
  // Wait until signal[slot_i] >= expected_i (device int64 [n][2] = slot, expected); deadline: the GPU timeout.
  void wait_signals(uintptr_t slot_expected, int n, uintptr_t stream);

  std::string error_message() const;  // "" when fine
  void clear_error();
  void destroy();  // stops the proxy, unmaps peers, frees memory (idempotent)

 private:
  int rank_, world_, device_;
  int64_t rdma_bytes_, nvl_bytes_;
  uint64_t timeout_ns_;
  uint32_t num_slots_;
  void* rdma_ = nullptr;
  void* nvl_ = nullptr;
  std::unique_ptr<Proxy> proxy_;
  void* signals_dev_ = nullptr;      // device view of the proxy's signal counters
  bool signals_registered_ = false;
  void* fifos_dev_ = nullptr;        // DeviceFifo[num_fifos] in device memory
  ErrorWord* error_ = nullptr;       // host-mapped
  ErrorWord* error_dev_ = nullptr;
  std::vector<void*> opened_peers_;
  bool destroyed_ = false;
};

// Copy `n` rows of `row_bytes`: row i goes from src + (src_idx ? src_idx[i] : i) * src_stride to
// dst + (dst_idx ? dst_idx[i] : i) * dst_stride; a negative index skips the row. dst may be a peer's IPC-mapped
// memory (NVLink). Index arrays are device int64. Asynchronous on `stream`.
void scatter_rows(uintptr_t dst, int64_t dst_stride, uintptr_t dst_idx, uintptr_t src, int64_t src_stride,
                  uintptr_t src_idx, int64_t n, int64_t row_bytes, uintptr_t stream);

}  // namespace uccl_ep::internode
