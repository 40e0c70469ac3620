// An arrival gate: lets a kernel that reads a receive area (unpack the dispatch's records, add the combine's partial
// sums) start while the hop is still running, reading each row as soon as the chunk that carries it has landed
// instead of after the whole hop (docs/internode.md, "Gated arrivals"). Plain C++: the bindings
// compile it with the host compiler.
//
// What makes it possible: a sender cuts each block into chunks of `per_chunk` records and sends chunk c through lane
// (hint + c) % lanes, and every lane's counter is fed by one FIFO, so it moves in that lane's order (the proxy's
// sequencer restores it when the NIC reorders). Chunks before c on c's lane are whole, so row i of a block has landed
// once counter[first_slot + lane] >= base[lane] + (c / lanes) * per_chunk + min(per_chunk, records - c * per_chunk),
// base being the counter's value before this call. uccl_ep_train/internode/plan.py (`gate_threshold`) is the
// definition the tests hold this to.
//
// Who polls: the counters live in host memory, and a gated kernel has hundreds of blocks. Each polling over PCIe made
// the loopback hop 10x slower on 2x H200 (session 10: 14.8 ms instead of 2.4 ms per dispatch), so block 0 of a gated
// launch is a watcher: one thread per (block, lane) copies its counter into `mirror` (device memory) as it moves,
// until the lane's last chunk is in, and the other blocks poll the mirror in L2. A mirror value is a value the
// counter had, so it never claims more than has landed; it needs no reset between calls (counters only grow).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/step_failure.hpp"  // ErrorWord, StopFlag
#include "kernels/timeline.hpp"      // TimelineField

namespace uccl_ep::internode {

// Columns of one gate-table row (int64, one row per block of arrivals), followed by `lanes` counter bases.
enum GateColumn : int {
  kGateFirstRow = 0,  // the block's first row in the consumer's row space
  kGateRecords = 1,   // rows in the block
  kGateSlot = 2,      // the counter of lane 0 (lane f counts into kGateSlot + f)
  kGateHint = 3,      // the sender's FIFO hint: chunk c went through lane (hint + c) % lanes
  kGateBase = 4,      // lanes counter values from before this call
};

struct ArrivalGate {
  const unsigned long long* signals = nullptr;  // the proxy's counters, device-mapped
  unsigned long long* mirror = nullptr;         // device memory, one per counter: lower bounds of the counters
  const long long* table = nullptr;             // device int64 [blocks][kGateBase + lanes]
  int blocks = 0;
  int lanes = 1;
  long long per_chunk = 1;
  unsigned long long timeout_ns = 0;
  ErrorWord* err = nullptr;
  StopFlag stop{nullptr, 0};
  int rank = -1;
  int phase = 0;
  // Most blocks of the gated reader's grid, watcher aside (0: its own rule): set when ranks share the GPU, whose
  // loopback copies are kernels that a full grid of spinning blocks would starve (Context::set_spin_blocks).
  int max_grid = 0;
  // The timeline row of this hop's pack_and_push launch (TimelineField), when the kernel timeline is on: the reader
  // stamps its start, the landing of the hop's last chunk and its end into it. nullptr: off.
  unsigned long long* stamps = nullptr;
};

// A gated reader's grid: `blocks`, at most the gate's max_grid when it has one.
inline int gated_grid(int blocks, const ArrivalGate* g) {
  return g && g->max_grid > 0 && blocks > g->max_grid ? g->max_grid : blocks;
}

// Host check before a gated launch (nullptr: no gate, nothing to check).
inline void check_gate(const ArrivalGate* g, const char* who) {
  if (!g) return;
  if (g->blocks < 0 || g->lanes < 1 || g->per_chunk < 1 || (g->blocks > 0 && (!g->table || !g->signals || !g->mirror)))
    throw std::invalid_argument(std::string(who) + ": malformed arrival gate (" + std::to_string(g->blocks) +
                                " blocks, " + std::to_string(g->lanes) + " lanes, " + std::to_string(g->per_chunk) +
                                " records per chunk)");
}

}  // namespace uccl_ep::internode
