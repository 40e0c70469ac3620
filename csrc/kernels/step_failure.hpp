// How a GPU step of the internode path records that it failed: what failed (ErrorCode), in which step (Phase), the
// error word the host reads, and the stop flag the later kernels test. Plain C++ (no CUDA types), shared by the host
// API (internode.hpp), the arrival gate and the device code (gpu_wait.cuh).
#pragma once

#include <cstdint>

namespace uccl_ep::internode {

// What failed (ErrorWord::code); the first failure of a rank wins, later ones are dropped.
enum ErrorCode : int32_t {
  kErrNone = 0,
  kErrWaitTimeout = 1,    // wait_signals: slot, observed, expected
  kErrPushTimeout = 2,    // push_chunks: FIFO full past the deadline; slot = FIFO, aux = destination rank,
                          // observed = first record of the chunk, expected = records of the block
  kErrEncode = 3,         // push_chunks: a command does not encode; slot = destination rank, aux = command error
  kErrScatterRange = 4,   // scatter_rows: a destination row outside the area; slot = target (local GPU), aux = list
                          // position, observed = row, expected = rows the area holds
  kErrAborted = 5,        // the host aborted the GPU waits (its proxy failed; the host names the proxy error)
  kErrRecordsUnwritten = 6,  // pack_and_push: a chunk's records not all written past the deadline; slot = chunk,
                             // aux = destination rank, observed = records counted, expected = records of the chunk
  kErrNodeFlagTimeout = 7,  // an NVLink flag of a local GPU not raised past the deadline (a tile of the pipelined
                            // combine gather, or the end of its dispatch forward); slot = that local GPU, aux = the
                            // flag (tile; 0 for the forward), observed = its value, expected = the epoch
  kErrRowNotReady = 8,  // a final row's ready word not released past the deadline (the unpack beside the dispatch
                        // forward); aux = the row, observed = the word, expected = the epoch
};

// Which step was running (ErrorWord::phase); passed by the host with each launch.
enum Phase : int32_t {
  kPhaseUnknown = 0,
  kPhaseDispatchNetwork = 1,  // dispatch: records pushed to / awaited from the rail peers of other nodes
  kPhaseCombineNetwork = 2,   // combine: partial sums pushed back to / awaited from the forwarders
  kPhaseDispatchForward = 3,  // dispatch: forwarder -> final rows of the node's GPUs (NVLink scatter)
  kPhaseCombineGather = 4,    // combine: received rows -> the forwarder's gather block (NVLink scatter)
  kPhaseBarrier = 5,          // group barrier between steps: zero-byte signals through the proxies
  kPhaseNotify = 6,           // count exchange: every rank's count row to every other rank through the proxies
};
const char* phase_name(int phase);

// What a GPU-side failure leaves in host-mapped memory (read by the host after each phase).
struct ErrorWord {
  int32_t code;      // ErrorCode
  int32_t rank;
  int32_t slot;      // see ErrorCode
  int32_t aux;       // see ErrorCode
  int32_t phase;     // Phase
  int32_t reserved;
  int64_t observed;  // counter value seen / offending index
  int64_t expected;  // value waited for / limit
};

// A rank's stop flag as the kernels see it: `flag` (device memory) equal to `generation` means a failure of this
// generation was recorded, so push_chunks and scatter_rows do nothing. Context::clear_error() starts a new
// generation; kernels still queued from the failed one keep stopping. flag == nullptr: never stopped.
struct StopFlag {
  int32_t* flag;
  int32_t generation;
};

}  // namespace uccl_ep::internode
