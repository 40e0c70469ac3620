// GPU producer for `uccl-ep-train bench proxy --producer gpu`: one block per FIFO pushes commands through the
// device-side FIFO path (uccl_ep/fifo_device.cuh) while the host proxy drains them.
#pragma once

#include <cstdint>

#include "uccl_ep/fifo_device.cuh"

namespace uccl_ep {

// Each FIFO gets `commands_per_fifo` 16-byte write+signal commands to rank `dst_rank` (slot = FIFO index), then a
// quiet that the kernel waits for. Blocks the calling host thread until the kernel ends; returns elapsed seconds
// (CUDA events), or throws ProxyError on a launch failure or a device-side deadline.
double launch_fifo_bench(const DeviceFifo* fifos, int num_fifos, uint64_t commands_per_fifo, int dst_rank,
                         uint64_t timeout_ns);

}  // namespace uccl_ep
