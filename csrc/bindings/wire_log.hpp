// The Python face of a LoopbackWire's log, shared by the proxy and internode bindings: one (start_ns, end_ns, bytes,
// writes) tuple per busy run and the runs that did not fit (uccl_ep_train/wire_timeline.py reads it).
#pragma once

#include <pybind11/pybind11.h>

#include <vector>

#include "transport/loopback.hpp"

namespace uccl_ep::bindings {

inline pybind11::dict wire_log_dict(const std::vector<WireRun>& runs, uint64_t dropped) {
  pybind11::list out;
  for (const WireRun& r : runs) out.append(pybind11::make_tuple(r.start_ns, r.end_ns, r.bytes, r.writes));
  pybind11::dict d;
  d["runs"] = out;
  d["dropped"] = dropped;
  return d;
}

}  // namespace uccl_ep::bindings
