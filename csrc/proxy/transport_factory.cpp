#include "proxy/transport_factory.hpp"

#include <atomic>
#include <memory>
#include <stdexcept>

namespace uccl_ep {

Proxy::TransportFactory make_transport_factory(const TransportSpec& spec, int rank, int world, int num_threads,
                                               const std::string& who) {
  if (spec.name == "verbs") {
    VerbsConfig vc = spec.verbs;
    if (vc.devices.empty())
      throw std::invalid_argument(who + ": transport 'verbs' needs at least one RDMA device (ib_devices); "
                                  "uccl_ep_train.comm.proxy_options and "
                                  "internode.transport.resolve_internode_transport pick them with topology.plan() "
                                  "(UCCL_IB_HCA narrows the choice)");
    if (!vc.gid_index.empty() && vc.gid_index.size() != vc.devices.size())
      throw std::invalid_argument(who + ": the GID indices must name one per device in ib_devices (" +
                                  std::to_string(vc.devices.size()) + " devices, " +
                                  std::to_string(vc.gid_index.size()) + " indices; -1 chooses automatically)");
    vc.rank = rank;
    vc.world_size = world;
    return [vc](int) -> std::unique_ptr<Transport> { return make_verbs_transport(vc); };
  }
  if (spec.name == "loopback") {
    LoopbackOptions base = spec.loopback;
    base.rank = rank;
    base.world = world;
    // The cap is the GPU's NIC: one wire that every thread of this proxy writes through. Splitting it evenly over
    // the threads instead (until session 8) charged a thread with more chunks than the others at its share of the
    // cap while the others idled: 0.84 of the cap on 2x H200 for 114 chunks over 4 threads.
    if (base.bandwidth_gbps > 0 && !base.wire) base.wire = std::make_shared<LoopbackWire>();
    (void)num_threads;  // shared whatever the thread count
    return [base](int t) -> std::unique_ptr<Transport> {
      LoopbackOptions o = base;
      o.thread_index = t;
      return make_loopback_transport(o);
    };
  }
  throw std::invalid_argument(who + ": transport must be 'loopback' or 'verbs', got '" + spec.name + "'");
}

}  // namespace uccl_ep
