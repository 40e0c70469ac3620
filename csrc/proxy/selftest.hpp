// A self-contained check of the host core that `uccl-ep-train doctor` runs: two proxies in this process, connected
// over the loopback transport with reordering injected, exchange write+signal commands; every byte and counter is
// verified against what was sent.
#pragma once

#include <cstdint>
#include <string>

namespace uccl_ep {

struct SelftestOptions {
  uint64_t commands = 4096;  // write+signal commands each of the two ranks sends to the other
  int reorder = 8;           // loopback delivers shuffled in groups of this many (> 1: the ordering emulation runs)
  uint64_t seed = 1;
  double timeout_secs = 30;  // every wait, and the watchdog
  // Tests only: damage what rank 1 received before verifying ("byte": one payload byte, "signal": one counter), to
  // prove the verification catches it. Empty: no damage.
  std::string inject_fault;
};

struct SelftestResult {
  uint64_t commands = 0;       // both ranks together
  uint64_t bytes = 0;          // payload bytes verified
  uint64_t signals = 0;        // immediates applied (more than commands: large increments are split)
  uint64_t max_reorder_held = 0;
  double seconds = 0;          // first push until the last counter reached its value
  std::string summary;         // one line for doctor
};

// Throws ProxyError naming the first wrong byte or counter, TimeoutError when a wait passes its deadline.
SelftestResult loopback_selftest(const SelftestOptions& options);

}  // namespace uccl_ep
