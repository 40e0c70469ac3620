// The Python face of ProxyThreadStats, shared by the proxy and internode bindings so both report the same keys.
#pragma once

#include <pybind11/pybind11.h>

#include "proxy/proxy.hpp"

namespace uccl_ep::bindings {

inline pybind11::dict proxy_stats_dict(const ProxyThreadStats& s) {
  pybind11::dict d;
  d["commands"] = s.commands;
  d["writes_posted"] = s.writes_posted;
  d["signals_applied"] = s.signals_applied;
  d["max_inflight_writes"] = s.max_inflight_writes;
  d["max_inflight_bytes"] = s.max_inflight_bytes;
  d["max_reorder_held"] = s.max_reorder_held;
  return d;
}

}  // namespace uccl_ep::bindings
