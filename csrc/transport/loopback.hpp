// Loopback transport: peers on one host, in this process or in others. Registered host memory must come from
// SharedHostMemory (proxy/host_memory.hpp) so peers can map it; a "write" is a memcpy into the peer's mapping and an
// immediate travels through a single-producer ring in the receiving endpoint's shared control segment.
// It can emulate a NIC: reordering within a window (caps().in_order becomes false), a delivery delay and a
// bandwidth cap. A peer process that dies is detected (pid check) and reported as a failed completion.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "transport/transport.hpp"

namespace uccl_ep {

struct LoopbackOptions {
  int rank = 0;
  int world = 1;
  int thread_index = 0;       // endpoints connect thread t <-> thread t
  int reorder = 0;            // 0/1: in order; k: deliver shuffled in groups of up to k
  uint64_t delay_us = 0;      // added to every delivery
  double bandwidth_gbps = 0;  // GB/s of the wire (0: uncapped)
  // When set, the endpoints holding it share one wire (the proxy's threads share the GPU's NIC, as QPs share a real
  // one): each write is scheduled after every earlier write of any of them, at bandwidth_gbps. Unset: the endpoint
  // makes a wire of its own. Holds the time (ns) the wire is busy until.
  std::shared_ptr<std::atomic<uint64_t>> wire;
  uint64_t seed = 0;
  uint32_t ring_capacity = 4096;  // immediates buffered per (receiver endpoint, sender rank)
};

std::unique_ptr<Transport> make_loopback_transport(const LoopbackOptions& options);

}  // namespace uccl_ep
