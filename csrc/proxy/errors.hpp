// Exceptions the host core throws; the bindings map them to Python (TimeoutError, uccl_ep_train._C.ProxyError).
#pragma once

#include <stdexcept>
#include <string>

namespace uccl_ep {

// A wait passed its deadline. The message names rank, thread/FIFO, the counter and the value waited for.
struct TimeoutError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A proxy thread or transport failed (peer died, malformed command, transport error).
struct ProxyError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace uccl_ep
