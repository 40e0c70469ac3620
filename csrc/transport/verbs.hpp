// The verbs transport (RC on InfiniBand/RoCE, SRD on AWS EFA): its configuration and factory.
//
// This header needs no rdma-core headers, so the proxy bindings can build a verbs transport without knowing whether
// the module was compiled with verbs support: without it, make_verbs_transport() throws and says how to rebuild.
// The ibv_* function table the implementation calls through (and the recording fake of the tests) is ibv_api.hpp.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport/transport.hpp"

namespace uccl_ep {

struct VerbsConfig {
  int rank = 0;
  int world_size = 1;
  std::vector<std::string> devices;  // RDMA devices this transport drives (several NICs per GPU); chosen in Python
  int port = 1;
  std::vector<int> gid_index;        // per device; -1 (or missing): choose with choose_gid(); UCCL_IB_GID_INDEX
  int sl = -1;                       // -1: 3 on IB/RoCE, 8 on EFA (UCCL_IB_SL)
  int tc = -1;                       // -1: 104 on IB/RoCE, 0 on EFA (UCCL_IB_TC)
  int sq_depth = 1024;               // send WRs outstanding per QP
  int rq_depth = 1024;               // receive WRs kept posted per QP (write-with-imm consumes one each)
  int cq_depth = 8192;
  int max_chain = 64;                // writes per ibv_post_send chain
  int timeout = 20;                  // IB local ACK timeout exponent (4.096 us * 2^timeout)
  int retry_cnt = 7;
};

// Extras of the verbs transport beyond the Transport interface.
class VerbsTransport : public Transport {
 public:
  // Device memory exported as a dmabuf by the caller (e.g. torch's allocator); `offset` is base's offset inside it.
  virtual MemoryRegion register_dmabuf(void* base, size_t bytes, int fd, uint64_t offset) = 0;
  // Per-device description: name, GID index and why, SL/TC, link layer (doctor and error messages print it).
  virtual std::vector<std::string> describe() const = 0;
};

// True when this build contains the verbs transport (rdma-core headers were found at build time).
bool verbs_transport_built();

// Throws std::runtime_error when the build lacks verbs, libibverbs cannot be loaded, or a device cannot be set up.
std::unique_ptr<VerbsTransport> make_verbs_transport(const VerbsConfig& cfg);

}  // namespace uccl_ep
