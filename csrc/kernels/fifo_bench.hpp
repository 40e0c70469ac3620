// GPU producers for `uccl-ep-train bench proxy --producer gpu`: kernels push commands through the device-side FIFO
// path (uccl_ep/fifo_device.cuh) while the host proxy drains them and applies the signals they carry.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "uccl_ep/fifo_device.cuh"

namespace uccl_ep {

// How the bench kernels push (see fifo_device.cuh). Every variant orders its commands' payload with one system fence
// per 32 commands or fewer, as a kernel that writes data and then pushes would.
enum class PushVariant : int {
  kPush = 0,    // fifo_push: shared head, one atomicAdd and one release store per command
  kWarp,        // fifo_push_warp: shared head, one atomicAdd and one fence per 32 commands
  kWriter,      // FifoWriter, one thread owning the FIFO: fence per 32 commands, relaxed stores
  kWriterWarp,  // FifoWriter, one warp owning the FIFO: one fence per call of 32 commands
};
constexpr int kPushVariantCount = 4;
inline const char* push_variant_name(PushVariant v) {
  static const char* const names[kPushVariantCount] = {"push", "warp", "writer", "writer-warp"};
  return names[int(v)];
}
// The default of the bench: the fastest variant that keeps the FIFO guarantees (docs/host-core.md).
constexpr PushVariant kDefaultPushVariant = PushVariant::kWriterWarp;
// Throws std::invalid_argument listing the names when `name` is none of them.
PushVariant parse_push_variant(const std::string& name);

// Each FIFO gets `commands_per_fifo` 16-byte write+signal commands to rank `dst_rank` (slot = FIFO index) from one
// warp, then a quiet that the kernel waits for. Blocks the calling host thread until the kernel ends; returns elapsed
// seconds (CUDA events), or throws ProxyError on a launch failure and TimeoutError on a device-side deadline.
double launch_fifo_bench(const DeviceFifo* fifos, int num_fifos, uint64_t commands_per_fifo, int dst_rank,
                         uint64_t timeout_ns, PushVariant variant = kDefaultPushVariant);

// Push-to-completion latency through the proxy, timed on the GPU: `samples` times, one write+signal (increment 1 on
// `slot` of rank `dst_rank`) is pushed onto `fifo` and the kernel spins until this rank's counter `signals[slot]`
// (host memory; registered with the GPU for the call) shows it. With dst_rank = this rank that is the full round trip
// producer -> proxy -> transport -> receiving proxy -> signal. Returns nanoseconds per sample.
// `poll_warps` warps watch the counter, their loads staggered over a PCIe round trip (1: one thread polls, as a
// kernel waiting on one counter usually does).
std::vector<uint64_t> launch_fifo_latency(const DeviceFifo& fifo, int64_t* signals, uint32_t num_slots, uint32_t slot,
                                          int samples, int dst_rank, uint64_t timeout_ns,
                                          PushVariant variant = kDefaultPushVariant, int poll_warps = 1);

// The floor under the latency above: a kernel stores a word into host memory, a spinning host thread copies it back,
// and `poll_warps` warps watch for it as launch_fifo_latency does. Nanoseconds per round trip.
std::vector<uint64_t> launch_pcie_echo(int samples, uint64_t timeout_ns, int poll_warps = 1);

}  // namespace uccl_ep
