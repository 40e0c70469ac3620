// The kernel timeline (docs/internode.md, "Kernel timeline"; `bench internode --timeline`): GPU global-timer stamps
// (ns) of one network hop -- its pack_and_push launch, and the gated reader of the arrivals that launch's call
// consumes -- so that where a call's time goes before and after its wire is read from the GPU itself rather than
// inferred from host laps. Plain C++: the bindings and the gate (arrival_gate.hpp) name the fields.
#pragma once

namespace uccl_ep::internode {

// Columns of one timeline row. kTlStart, kTlFirstReady, kTlFirstPush and kTlReaderStart start at UINT64_MAX
// (earliest wins); the others at 0 (latest wins). A field nobody stamped keeps its start value: kTlRowsIn when the
// launch waits for no count row, the reader's when the call's arrivals were read without a gate.
enum TimelineField {
  kTlStart = 0,        // the first block of the pack_and_push launch began
  kTlRowsIn = 1,       // every count row was in (pushed during notify only)
  kTlFirstReady = 2,   // the first chunk's records were all written (stamped by the packer that wrote its last)
  kTlFirstPush = 3,    // the first command was in a FIFO
  kTlLastPush = 4,     // the last command was
  kTlPackersDone = 5,  // the last packer block finished
  kTlChunks = 6,       // commands pushed (a count, not a time)
  kTlReaderStart = 7,  // the gated reader's first block began (its watcher included)
  kTlAllIn = 8,        // the reader's watcher saw every lane's last chunk of the hop land
  kTlReaderEnd = 9,    // the reader's last block finished its rows
  kTimelineFields = 10,
};

}  // namespace uccl_ep::internode
