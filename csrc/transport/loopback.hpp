// Loopback transport: peers on one host, in this process or in others. Registered host memory must come from
// SharedHostMemory (proxy/host_memory.hpp) so peers can map it; a "write" is a memcpy into the peer's mapping and an
// immediate travels through a single-producer ring in the receiving endpoint's shared control segment.
// It can emulate a NIC: reordering within a window (caps().in_order becomes false), a delivery delay and a
// bandwidth cap. A peer process that dies is detected (pid check) and reported as a failed completion.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "transport/transport.hpp"

namespace uccl_ep {

class CopyAgentSegment;

// A stretch of time the emulated wire was busy without a pause: [start_ns, end_ns) on the steady clock
// (CLOCK_MONOTONIC, as the proxies' and Python's time.monotonic_ns), and what crossed it.
struct WireRun {
  uint64_t start_ns = 0;
  uint64_t end_ns = 0;
  uint64_t bytes = 0;
  uint64_t writes = 0;
};

// The emulated NIC's wire under a bandwidth cap: every write claims the next free stretch of it, so a write posted
// while the wire is busy queues behind the earlier ones, and one posted to an idle wire starts at once. The gaps
// between busy stretches are the time the wire had nothing to carry -- what a benchmark needs to tell a call that
// was slow because the senders fed the wire late from one slowed by the cap itself. The log is off unless asked
// for; while it is on, claims take a mutex so that the runs are recorded in the order the wire grants them.
class LoopbackWire {
 public:
  // The time the write of `cost_ns` posted at `now_ns` is off the wire.
  uint64_t claim(uint64_t now_ns, uint64_t cost_ns, uint64_t bytes);
  // Start recording busy runs afresh, keeping at most `capacity` (later ones are counted as dropped).
  void start_log(size_t capacity);
  // The runs recorded since start_log, and how many did not fit; stops recording.
  std::vector<WireRun> stop_log(uint64_t* dropped);

 private:
  std::atomic<uint64_t> busy_{0};
  std::atomic<bool> logging_{false};
  std::mutex mu_;
  std::vector<WireRun> runs_;
  size_t capacity_ = 0;
  uint64_t dropped_ = 0;
  uint64_t dropped_end_ = 0;  // where the last run that found no room ends (its later writes are the same run)
};

struct LoopbackOptions {
  int rank = 0;
  int world = 1;
  int thread_index = 0;       // endpoints connect thread t <-> thread t
  int reorder = 0;            // 0/1: in order; k: deliver shuffled in groups of up to k
  uint64_t delay_us = 0;      // added to every delivery
  double bandwidth_gbps = 0;  // GB/s of the wire (0: uncapped)
  // When set, the endpoints holding it share one wire (the proxy's threads share the GPU's NIC, as QPs share a real
  // one): each write is scheduled after every earlier write of any of them, at bandwidth_gbps. Unset: the endpoint
  // makes a wire of its own.
  std::shared_ptr<LoopbackWire> wire;
  uint64_t seed = 0;
  uint32_t ring_capacity = 4096;  // immediates buffered per (receiver endpoint, sender rank)
  // When set, every write's bytes are moved by the copy agent of this segment (another process: see
  // loopback_copy_agent.hpp), on lane thread_index, and the endpoint makes no CUDA call after connect().
  // Unset: this process copies (cudaMemcpyAsync on the proxy thread; memcpy for host memory).
  std::shared_ptr<CopyAgentSegment> copy_agent;
};

std::unique_ptr<Transport> make_loopback_transport(const LoopbackOptions& options);

}  // namespace uccl_ep
