// The one place that turns a transport name and its options into the per-thread factory a Proxy takes. Every binding
// that builds proxies (the standalone Proxy of proxy_bindings.cpp, the internode Context of kernels/internode.cu)
// goes through it, so "loopback" and "verbs" mean the same thing, with the same checks, in both.
// Torch-free and CUDA-free: part of the host core.
#pragma once

#include <string>

#include "proxy/proxy.hpp"
#include "transport/loopback.hpp"
#include "transport/verbs.hpp"

namespace uccl_ep {

struct TransportSpec {
  std::string name = "loopback";  // "loopback" | "verbs"
  // Loopback: reorder, delay_us, seed as given. bandwidth_gbps is the cap of the whole proxy (one GPU's NIC): every
  // thread's endpoint writes through one shared wire, `wire` when the caller gave one (to read its log), else a new
  // one. rank, world and thread_index are filled in by make_transport_factory.
  LoopbackOptions loopback;
  // Verbs: devices (at least one), gid_index (empty, or one per device), port, sl, tc, queue depths. rank and
  // world_size are filled in by make_transport_factory.
  VerbsConfig verbs;
};

// Validates the spec (std::invalid_argument naming the field and the fix; `who` prefixes the message, e.g. "Proxy"
// or "internode") and returns a factory that makes one endpoint per proxy thread: thread t of this rank talks to
// thread t of every rank. Building a verbs transport into a module compiled without it throws from the factory
// (make_verbs_transport says how to rebuild).
Proxy::TransportFactory make_transport_factory(const TransportSpec& spec, int rank, int world, int num_threads,
                                               const std::string& who);

}  // namespace uccl_ep
