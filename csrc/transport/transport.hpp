// The transport interface: what a proxy needs from a NIC, and nothing more.
//
// Read it like NCCL's network plugin: a new NIC implements this one header in one file (loopback.cpp, verbs.cpp)
// without touching the proxies. Version the interface: bump kTransportApiVersion when a method changes meaning.
//
// Lifecycle (per proxy thread; one Transport object per thread so no locking is needed on the hot path):
//   1. register_memory() for every buffer peers may write into (and every buffer we write from).
//   2. local_info() -> bytes; the bootstrap (torch.distributed all_gather) exchanges them; connect(all_infos).
//   3. post_writes() / post_atomics() from the proxy loop; poll() returns completions of both kinds:
//      local (our write finished, the source buffer may be reused) and remote (a peer's write-with-immediate
//      landed in our memory; `imm` is its immediate, `src_rank` who sent it).
//   4. Destruction deregisters everything and closes the endpoints.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace uccl_ep {

constexpr int kTransportApiVersion = 2;  // 2: debug_state()

enum class MemoryKind : uint8_t { kHost = 0, kDevice = 1 };

// Capabilities change what the proxy does, not whether it works:
//  - in_order: writes to one peer land in posting order (RC on IB/RoCE). If false (EFA SRD, loopback with reordering
//    injected) the proxy carries per-counter sequence numbers in the immediate and reorders on receipt.
//  - native_atomics: fetch-add on remote memory. If false an atomic becomes a zero-length write-with-immediate
//    that the receiving proxy applies.
struct TransportCaps {
  bool in_order = true;
  bool native_atomics = false;
  int imm_bits = 32;                    // usable bits of immediate data
  uint64_t max_write_bytes = 1ull << 30;
  int max_writes_per_post = 64;         // longest work-request chain one post may carry
  std::string name;                     // "loopback", "verbs-rc", "verbs-srd"
};

// A registered region. `id` is the index peers use to address it (offsets are relative to its base).
struct MemoryRegion {
  int id = -1;
  void* base = nullptr;
  size_t bytes = 0;
  MemoryKind kind = MemoryKind::kHost;
};

// One write (optionally carrying an immediate) from a local region to a remote region.
struct WriteRequest {
  int dst_rank = 0;
  int local_region = 0;
  uint64_t local_offset = 0;
  int remote_region = 0;
  uint64_t remote_offset = 0;
  uint64_t bytes = 0;               // 0 is allowed with has_imm: a pure signal
  bool has_imm = false;
  uint32_t imm = 0;
  uint64_t wr_id = 0;               // returned in the local completion
};

// A remote fetch-add on a 64-bit word (only posted when caps().native_atomics).
struct AtomicRequest {
  int dst_rank = 0;
  int remote_region = 0;
  uint64_t remote_offset = 0;
  int64_t add = 0;
  uint64_t wr_id = 0;
};

struct Completion {
  enum class Kind : uint8_t { kLocalWrite, kLocalAtomic, kRemoteImm } kind = Kind::kLocalWrite;
  uint64_t wr_id = 0;       // local completions
  int src_rank = -1;        // remote completions
  uint32_t imm = 0;         // remote completions
  int status = 0;           // 0 ok; otherwise transport-specific error code
  std::string error;        // set when status != 0: what failed, on which peer
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual TransportCaps caps() const = 0;

  // Registration: must happen before local_info() so the info carries every region's remote key.
  virtual MemoryRegion register_memory(void* base, size_t bytes, MemoryKind kind) = 0;

  // Opaque connection info of this endpoint (addresses, QP numbers, region keys), exchanged by the bootstrap.
  virtual std::vector<uint8_t> local_info() = 0;
  // infos[r] is rank r's local_info(); infos[my_rank] is our own.
  virtual void connect(const std::vector<std::vector<uint8_t>>& infos) = 0;

  // Post a batch as one chain per destination. Returns how many were accepted (the rest must be re-posted later,
  // e.g. when a send queue is full). Never blocks.
  virtual size_t post_writes(const WriteRequest* reqs, size_t n) = 0;
  virtual size_t post_atomics(const AtomicRequest* reqs, size_t n) = 0;

  // Append up to `max` completions to `out`; returns how many. Never blocks. A completion with status != 0 may also
  // report a failure no request owns (verbs: a fatal asynchronous NIC event); the proxy fails on any of them.
  virtual size_t poll(std::vector<Completion>& out, size_t max) = 0;

  // One line on what the endpoint still holds (posted, copying, oldest age), for watchdog and timeout messages:
  // when a wait passes its deadline the first question is whether the NIC side is the one that is stuck.
  virtual std::string debug_state() const { return {}; }
};

}  // namespace uccl_ep
