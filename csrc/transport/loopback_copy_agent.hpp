// The loopback's copy agent: a process of its own that moves the bytes of the loopback's writes, as a NIC's DMA
// engine moves them beside the host, so that nothing the training process does can hold a write back.
//
// Why a process: in-process, a proxy thread's cudaMemcpyAsync takes the CUDA driver's process-wide locks, and the
// caller's own CUDA calls hold those locks while they wait for our kernels (a pageable copy on the legacy default
// stream, a cudaFree, a module's first load). Our kernels spin until the very bytes that copy carries land: the
// write stalls until the GPU deadline (docs/internode.md, "Drains" and "The copy agent"). A copy made by another
// process takes none of the caller's locks, so the proxies then make no CUDA call after setup, as over verbs.
//
// Protocol: one POSIX shared-memory segment per training rank. The training process makes it (CopyAgentSegment),
// starts the agent with its name (python -m uccl_ep_train.loopback_copy_agent), and each loopback endpoint (proxy
// thread t) feeds lane t: a single-producer ring of copy requests, answered by the count of requests whose bytes
// landed (copies of a lane complete in order). Memory is named by slots: a region (a CUDA IPC handle, or a
// SharedHostMemory object and an offset) the agent maps at its first use. Host-only copies go through the agent too,
// so the whole protocol runs, and is tested, on machines without a GPU.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace uccl_ep {

// State of the agent, in the segment's header.
enum class CopyAgentState : uint32_t { kStarting = 0, kReady = 1, kClosing = 2, kFailed = 3 };

struct CopyAgentSegmentLayout;  // (the shared memory's layout: loopback_copy_agent.cpp)
class SharedHostMemory;

// The shared segment, from either side: made by the training process (create), mapped by the agent and by every
// loopback endpoint (open). Thread-safe where several endpoints share it: slots are added under a lock.
class CopyAgentSegment {
 public:
  static constexpr uint32_t kLaneCapacity = 1024;  // requests in flight per lane (a power of two)
  static constexpr uint32_t kMaxSlots = 512;       // regions, over every rank and endpoint of the group
  static constexpr size_t kIpcHandleBytes = 64;

  // A segment for `lanes` endpoints (proxy threads) of the rank whose device is `device` (-1: host memory only).
  static std::shared_ptr<CopyAgentSegment> create(int lanes, int device);
  // Map a segment made by another process (or this one) by name; throws ProxyError naming it.
  static std::shared_ptr<CopyAgentSegment> open(const std::string& name);
  ~CopyAgentSegment();

  const std::string& name() const { return name_; }
  int lanes() const;
  int device() const;
  int client_pid() const;
  int agent_pid() const;
  CopyAgentState state() const;
  std::string agent_message() const;  // why the agent failed, when state() is kFailed
  // Client: ask the agent to finish its copies and exit.
  void request_close();

  // Slots (client side): the index the agent knows a region by, the same one for the same region.
  int device_slot(const std::vector<uint8_t>& ipc_handle, uint64_t bytes);
  int host_slot(const std::string& shm_name, uint64_t offset, uint64_t object_bytes, uint64_t bytes);
  // Whether the agent has mapped every one of `slots` (it maps each as soon as it is added).
  bool slots_mapped(const std::vector<int>& slots) const;

  CopyAgentSegmentLayout* layout() const { return layout_; }

 private:
  CopyAgentSegment() = default;
  CopyAgentSegmentLayout* layout_ = nullptr;
  size_t bytes_ = 0;
  std::string name_;
  std::shared_ptr<SharedHostMemory> keep_;  // the creator's allocation (its name, until the process unlinks it)
};

// One endpoint's lane (the producer side). Not thread-safe: one proxy thread uses it.
class CopyAgentLane {
 public:
  CopyAgentLane(std::shared_ptr<CopyAgentSegment> segment, int lane);
  ~CopyAgentLane();

  // Queue a copy of `bytes` from (src_slot, src_offset) to (dst_slot, dst_offset). Returns its ticket (landed once
  // landed() reaches it), or 0 when the lane is full (post again after some landed).
  uint64_t post(int src_slot, uint64_t src_offset, int dst_slot, uint64_t dst_offset, uint64_t bytes);
  bool has_room(uint64_t requests = 1) const;
  // How many of this lane's requests have landed: ticket t landed iff landed() >= t.
  uint64_t landed() const;
  uint64_t posted() const { return head_; }
  // Non-empty when the agent failed the copy of ticket `t` or an earlier one (then no later one moves), or when the
  // agent is gone: what happened, naming the lane and the agent's pid.
  std::string failure(uint64_t t) const;
  std::string describe() const;  // for debug_state: posted, landed, agent pid and state

 private:
  std::shared_ptr<CopyAgentSegment> segment_;
  int lane_;
  uint64_t head_ = 0;
  mutable uint64_t liveness_checked_ns_ = 0;
  mutable bool agent_dead_ = false;
};

// The agent's main loop (run in its own process): serve every lane of segment `name` until the client asks it to
// close (returns 0 once every copy landed) or the client process is gone (returns 1). Startup failures (no device,
// a bad segment) are written into the segment (state kFailed) and returned as 2.
int run_copy_agent(const std::string& name);

// Whether pid names a live process (a zombie, or one inside exit(), is not): the loopback's peers and agent checks.
bool loopback_process_alive(int pid);

}  // namespace uccl_ep
