// Where the GPU's global timer stands against the host's steady clock: what puts the kernel timeline's stamps (GPU
// timer) on the wire timeline's clock (the host's std::chrono::steady_clock), so that a call's reader can be placed
// beside the wire's last byte and the host's return (docs/internode.md, "Kernel timeline").
#pragma once

#include <cstdint>

namespace uccl_ep::internode {

struct ClockOffset {
  int64_t gpu_minus_host_ns = 0;  // add to a steady-clock time to get the GPU timer's reading at that moment
  int64_t error_ns = 0;           // the true offset lies within +- this
};

// A one-block kernel on `device` stamps the timer the moment it sees a flag that the host sets between two reads of
// its clock; of `rounds` tries the one with the narrowest window counts, and half the window is the error. Every
// wait on either side is bounded (a second: a busy GPU that never runs the probe raises std::runtime_error). Run it
// with the device idle.
ClockOffset gpu_timer_minus_steady_ns(int device, int rounds);

}  // namespace uccl_ep::internode
