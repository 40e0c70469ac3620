// Internode (hierarchical) path: the GPU side of the network hop and the NVLink row scatter. docs/internode.md.
//
// The GPU packs per-node blocks of records into its RDMA region (stream-ordered copies done by the caller), then
// `push_chunks` turns every block into WRITE_SIGNAL commands for the CPU proxy; the receiver's `wait_signals` spins on
// the proxy-maintained counters (host memory, device-mapped) and `scatter_rows` forwards rows to the GPUs of the node.
#include "kernels/internode.hpp"

#include <algorithm>
#include <cstdio>
#include <chrono>
#include <thread>
#include <cstring>
#include <stdexcept>
#include <string>

#include "uccl_ep/cuda_errors.cuh"
#include "uccl_ep/portability.cuh"
#include "uccl_ep/command.hpp"
#include "uccl_ep/fifo_device.cuh"
#include "uccl_ep/row_sum.cuh"

#include "kernels/arrival_gate.cuh"
#include "kernels/gpu_wait.cuh"
#include "kernels/record_copy.cuh"

#include "proxy/errors.hpp"
#include "proxy/proxy.hpp"
#include "proxy/transport_factory.hpp"
#include "transport/loopback_copy_agent.hpp"

#if defined(UCCL_EP_WITH_CUDA) && !defined(UCCL_EP_HIP)
#define UCCL_EP_INTERNODE_PROXY 1
#endif

namespace uccl_ep::internode {
namespace {

void check(cudaError_t e, const std::string& what) { throw_on_cuda_error(e, "internode", what); }

// A rank whose wait failed (timed out, or aborted by the host) must not go on sending or forwarding: the rows it
// would pass on were never received. Without this, a step launched behind the failed wait (nothing stops the
// stream) scattered stale records into its node peers' final rows and pushed its barrier, and the peers returned
// wrong rows without an error of their own. Skipping instead leaves the peers' waits to time out naming this rank.
// Every failure sets the stop flag: report() does, a wait that sees the host's abort does, and abort_waits() does.

// Records [first, first + count) of a push table row as one WRITE_SIGNAL through FIFO `lane` (its slot: the row's
// first slot + lane), `remote_shift` bytes past the row's remote offset. False, after reporting, when the command does
// not encode or the FIFO stays full past the deadline. fifo_push releases at system scope, so the records this thread
// wrote or observed go out before it.
__device__ bool push_chunk(const DeviceFifo& f, const long long* row, int lane, long long first, long long count,
                           long long remote_shift, int rank, int phase, unsigned long long timeout_ns, ErrorWord* err,
                           StopFlag stop) {
  const long long stride = row[kPushStride];
  Command c;
  const int e = encode_write_signal(&c, uint32_t(row[kPushDstRank]), uint64_t(count * stride),
                                    uint64_t(row[kPushLocalOffset] + first * stride),
                                    uint64_t(row[kPushRemoteOffset] + remote_shift + first * stride),
                                    uint32_t(row[kPushSlot] + lane), uint32_t(count));
  if (e != kCmdOk) {
    report(err, stop, kErrEncode, rank, int(row[kPushDstRank]), e, phase, first, row[kPushRecords]);
    return false;
  }
  if (fifo_push(f, c, timeout_ns) == kFifoPushTimedOut) {
    report(err, stop, kErrPushTimeout, rank, f.fifo_id, int(row[kPushDstRank]), phase, first, row[kPushRecords]);
    return false;
  }
  return true;
}

// Lane `lane`'s chunks of push-table row i, in order (what the receivers' waits and gates rely on): chunk c goes
// through lane (hint + c) % num_fifos, so this lane takes its first chunk, then every num_fifos-th. One thread per
// (row, lane) lets the lanes push side by side: each command pays a system-scope fence (~2 us), and one thread per
// row pushed slower than an uncapped wire takes the chunks. With `ready` (pack_and_push), chunk c is pushed once
// its counter ready[first_chunk + c] holds its record count, and the counter is set back to zero. `send` false: the
// counters are waited for and reset, and nothing is pushed (a destination whose receive area is too small).
__device__ bool push_lane(const DeviceFifo* fifos, int num_fifos, const long long* row, int i, int lane,
                          long long chunk_records, long long remote_shift, int* ready, long long first_chunk, int rank,
                          int phase, unsigned long long timeout_ns, ErrorWord* err, StopFlag stop, bool send = true,
                          unsigned long long* stamps = nullptr) {
  const long long records = row[kPushRecords];
  const long long hint = row[kPushFifo] < 0 ? i : row[kPushFifo];
  for (long long chunk = ((lane - hint) % num_fifos + num_fifos) % num_fifos; chunk * chunk_records < records;
       chunk += num_fifos) {
    const long long first = chunk * chunk_records, count = min(chunk_records, records - first);
    if (ready) {
      int* counter = ready + first_chunk + chunk;
      const uint64_t start = now_ns();
      for (unsigned spins = 0;; ++spins) {
        const int seen = ld_acquire_sys(counter);
        if (seen >= count) break;
        if (now_ns() - start > timeout_ns) {
          report(err, stop, kErrRecordsUnwritten, rank, int(first_chunk + chunk), int(row[kPushDstRank]), phase,
                 seen, count);
          return false;
        }
        if ((spins & 63) == 0 && stopped(stop)) return false;
      }
      *counter = 0;
    }
    if (send && !push_chunk(fifos[lane], row, lane, first, count, remote_shift, rank, phase, timeout_ns, err, stop))
      return false;
    if (send && stamps) {
      stamp_earliest(stamps, kTlFirstPush);
      stamp_latest(stamps, kTlLastPush);
      atomicAdd(stamps + kTlChunks, 1ULL);
    }
  }
  return true;
}

// CountRowOffsets on the device. rows == nullptr: the table's offsets are final.
struct CountRowShift {
  const unsigned long long* signals;
  long long slot, expected;
  const long long* rows;
  long long row_words;
  int num_ranks, ranks_per_node;
  long long receive_bytes;
  long long send_limit;  // >= 0: the rows' records and local offsets come from our own count row (rows_from_own_row)
  const long long* own_row_pushes;  // pushed first (CountRowOffsets::own_row_pushes); nullptr: none
  int own_row_push_rows, own_row_push_phase;
};

// CountRowOffsets for a launch; none (at == nullptr): rows nullptr, send_limit -1.
CountRowShift count_row_shift(const CountRowOffsets* at, const void* signals, int world) {
  CountRowShift shift{};
  shift.send_limit = -1;
  if (at) {
    shift.signals = static_cast<const unsigned long long*>(signals);
    shift.slot = at->slot;
    shift.expected = at->expected;
    shift.rows = reinterpret_cast<const long long*>(at->rows);
    shift.row_words = at->row_words;
    shift.num_ranks = world;
    shift.ranks_per_node = at->ranks_per_node;
    shift.receive_bytes = at->receive_bytes;
    shift.send_limit = at->send_limit;
    shift.own_row_pushes = reinterpret_cast<const long long*>(at->own_row_pushes);
    shift.own_row_push_rows = at->own_row_push_rows;
    shift.own_row_push_phase = at->own_row_push_phase;
  }
  return shift;
}

// Where row `row`'s block goes in its destination's receive area, past the row's remote offset (bytes), once the
// count rows are in; -1: the destination's arrivals exceed the area, so nothing goes (the host raises after notify,
// on every rank alike, from the same counts). The caller has acquired the counter that proves the rows landed.
__device__ long long block_shift(const CountRowShift& at, const long long* row, int rank) {
  const int G = at.ranks_per_node, dst = int(row[kPushDstRank]);
  const int m = dst / G, local = dst % G, node = rank / G;
  long long before = 0, total = 0;
  for (int n = 0; n < at.num_ranks / G; ++n) {
    // written by the peers' proxies into our memory: read past the L1, after the acquire
    const long long c = *reinterpret_cast<const volatile long long*>(at.rows + (n * G + local) * at.row_words +
                                                                     at.num_ranks + m);
    total += c;
    if (n < node) before += c;
  }
  return total * row[kPushStride] > at.receive_bytes ? -1 : before * row[kPushStride];
}

// Row `row` of a table made before our own counts were read (push_after_counts with a send limit): its node's
// records and its block's place in our send area (records by node, as send_plan lists them) from our own count row,
// into `out`. False: push nothing -- the records for every node together pass send_limit bytes (the pack skipped
// them by the same rule), or none go to this row's node. Our row was written by count_row earlier on this stream.
__device__ bool rows_from_own_row(const CountRowShift& at, const long long* row, int rank, long long* out) {
  const long long* own = at.rows + rank * at.row_words + at.num_ranks;
  const int m = int(row[kPushDstRank]) / at.ranks_per_node;
  long long before;
  const long long total = records_by_node(own, at.num_ranks / at.ranks_per_node, m, &before);
  for (int c = 0; c < kPushColumns; ++c) out[c] = row[c];
  out[kPushRecords] = own[m];
  out[kPushLocalOffset] += before * row[kPushStride];
  return total * row[kPushStride] <= at.send_limit && own[m] > 0;
}

__device__ bool counted_on_device(const CountRowShift& at) { return at.rows && at.send_limit >= 0; }

__global__ void push_chunks_kernel(const DeviceFifo* fifos, int num_fifos, const long long* table, int n,
                                   long long chunk_records, CountRowShift at, int rank, int phase,
                                   unsigned long long timeout_ns, ErrorWord* err, StopFlag stop) {
  const long long p = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (at.rows) {  // pushed during notify: one thread of the block waits for every count row, the others with it
    __shared__ bool s_rows_in;
    if (threadIdx.x == 0)
      s_rows_in = !stopped(stop) && wait_counter(at.signals, at.slot, at.expected, timeout_ns, err, stop, rank, phase);
    __syncthreads();
    if (!s_rows_in) return;
  }
  if (p >= static_cast<long long>(n) * num_fifos || stopped(stop)) return;
  const int i = int(p / num_fifos), lane = int(p % num_fifos);
  const long long* row = table + i * kPushColumns;
  long long shift = 0, own_row[kPushColumns];
  if (at.rows) {
    if (counted_on_device(at)) {
      if (!rows_from_own_row(at, row, rank, own_row)) return;
      row = own_row;
    }
    (void)load_counter(at.signals + at.slot);  // this thread's own acquire: the rows it reads next landed before it
    shift = block_shift(at, row, rank);
    if (shift < 0) return;
  }
  push_lane(fifos, num_fifos, row, i, lane, chunk_records, shift, nullptr, 0, rank, phase, timeout_ns, err, stop);
}

// Records and their commands in one launch (docs/internode.md, "Pack and push"): blocks 1.. write the records as
// pack_records does (a block per record), and count each record they write into its chunk's `ready` counter; block 0
// pushes the chunks with the commands push_chunks makes, each as soon as its counter says every record of it is
// written. A pusher thread per (row, lane) keeps each lane's chunks of a row in order (what the receivers' waits and
// gates rely on) and lets the lanes push side by side (one thread per row paid a system fence per command in turn,
// ~2 us, slower than an uncapped wire takes a chunk). The wire starts after the first chunks are written instead of
// after a launch per part, and later records are written while earlier chunks move. The records of our own node
// (own_first.. own_first + own_count, which cross no network) are written last. The pusher resets each counter it
// used to zero: nothing adds to it again in this launch, and the next launch on the stream starts from zeros (after
// a failure the host drops the counters instead).
struct PackPushJob {
  char* send;             // record r at send + r * stride (send_offset bytes into our RDMA region) ...
  char* own_dst;          // ... except our own node's, at own_dst + (r - own_first) * stride
  long long send_offset;
  long long own_first, own_count, stride, num_records;
  const long long* hop1_token;  // row of every record; nullptr: record r carries row r
  const long long* dest_rows;   // [num_records, G] final rows (G = 0: none)
  int G;
  long long src_idx_offset;     // < 0: no source index field
  long long dest_rows_offset;
  PackArgs args;
  // ExpertSums (internode.hpp): sums_x set, the records are combine rows summed from expert-major rows
  const int4* sums_x;
  const int* sums_slot_of;
  const float* sums_weights;
  long long sums_row_bytes, sums_weights_offset;
  int sums_topk;
  // NodeSums (internode.hpp): node_gather set, record r is the node sum of arrival r's copies in our gather blocks
  const char* node_gather;
  const int* node_rows_of;
  const int* node_flags;
  long long node_tile_rows;
  int node_G, node_units, node_weights, node_epoch;
};

// Record `rec` of an expert-major combine (ExpertSums): combine row r's local experts' rows summed, by the whole
// block. Each warp sums a slice of the row's 16-byte units with warp_sum_rows, whose per-unit order (k order, fp32,
// one rounding) does not depend on the slice: the bytes equal expert_major_partials_kernel's. Every thread of the
// block calls it (it synchronizes); s_slots holds kExpertSumsMaxTopk ints of shared memory.
template <bool kF32>
__device__ void write_expert_sum_record(char* rec, long long r, const PackPushJob& job, int* s_slots, int* s_n) {
  const int* slots_of_row = job.sums_slot_of + r * job.sums_topk;
  if (threadIdx.x == 0) {
    int m = 0;
    for (int k = 0; k < job.sums_topk; ++k) {
      const int slot = slots_of_row[k];
      if (slot >= 0) s_slots[m++] = slot;
    }
    *s_n = m;
  }
  __syncthreads();
  const int n = *s_n;
  const int units = int(job.sums_row_bytes / 16);
  const int warps = blockDim.x / kWarpSize, warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int per_warp = (units + warps - 1) / warps;
  const int lo = min(units, warp * per_warp), count = min(units, lo + per_warp) - lo;
  int4* dst = reinterpret_cast<int4*>(rec) + lo;
  warp_sum_rows<kF32>(
      n, count, lane, [&](int j) { return job.sums_x + static_cast<long long>(s_slots[j]) * units + lo; },
      [&](int u, const int4& v) { dst[u] = v; });
  if (job.sums_weights) {
    float* w = reinterpret_cast<float*>(rec + job.sums_weights_offset);
    for (int k = threadIdx.x; k < job.sums_topk; k += blockDim.x) {
      const int slot = slots_of_row[k];
      w[k] = slot >= 0 ? job.sums_weights[slot] : 0.0f;
    }
  }
  __syncthreads();  // s_slots and s_n are rewritten for the block's next record
}

// Record `rec` of a pipelined combine (NodeSums): once every local GPU has flagged the tile of r, the copies summed in
// fp32 in ascending local GPU and rounded once -- sum_node_partials' order, so the bytes equal its -- and the weights
// likewise. Every GPU, not only those holding a copy: a GPU flags a tile after everything earlier on its stream (the
// last dispatch's unpack), so a pushed chunk proves the whole node is past it, as the group barrier before the node
// sum did; a cached dispatch's skipped entry barrier rests on that (docs/internode.md, "Areas and entry barriers").
// Every thread of the block calls it (it synchronizes); s_rows holds kNodeSumsMaxRanksPerNode ints of shared memory.
// False for every thread: a flag did not come (reported, or the rank stopped) and the record is not written.
template <bool kF32>
__device__ bool write_node_sum_record(char* rec, long long r, const PackPushJob& job, int* s_rows, int* s_n,
                                      bool* s_ok, int rank, int phase, unsigned long long timeout_ns, ErrorWord* err,
                                      StopFlag stop) {
  if (threadIdx.x == 0) {
    int m = 0;
    for (int j = 0; j < job.node_G; ++j) {
      const int row = job.node_rows_of[j * job.num_records + r];
      if (row >= 0) s_rows[m++] = row;
    }
    *s_n = m;
    *s_ok = true;
  }
  __syncthreads();
  if (threadIdx.x < job.node_G) {
    const long long tile = r / job.node_tile_rows;
    if (!wait_flag(job.node_flags + threadIdx.x * kGatherMaxTiles + tile, job.node_epoch, timeout_ns, err, stop, rank,
                   phase, int(threadIdx.x), int(tile)))
      *s_ok = false;
  }
  __syncthreads();
  if (!*s_ok) return false;
  const int n = *s_n, units = job.node_units;
  const int warps = blockDim.x / kWarpSize, warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int per_warp = (units + warps - 1) / warps;
  const int lo = min(units, warp * per_warp), count = min(units, lo + per_warp) - lo;
  int4* dst = reinterpret_cast<int4*>(rec) + lo;
  // (L2 loads: a peer wrote the copies over NVLink while this kernel ran)
  warp_sum_rows<kF32, 4, 4, true>(
      n, count, lane,
      [&](int j) { return reinterpret_cast<const int4*>(job.node_gather + s_rows[j] * job.stride) + lo; },
      [&](int u, const int4& v) { dst[u] = v; });
  for (int k = threadIdx.x; k < job.node_weights; k += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < n; ++j)
      acc += ld_cg_f32(reinterpret_cast<const float*>(job.node_gather + s_rows[j] * job.stride + 16LL * units) + k);
    reinterpret_cast<float*>(rec + 16LL * units)[k] = acc;
  }
  __syncthreads();  // s_rows, s_n and s_ok are rewritten for the block's next record
  return true;
}

// What the packers write into a record: its columns (write_record), an expert-major combine row summed in bf16 or
// fp32 (write_expert_sum_record), or a node sum of a pipelined combine (write_node_sum_record). A template argument,
// so the column copy keeps its own register budget: the sums' loads in flight take twice the registers and would
// halve the copy's resident blocks.
enum RecordSource { kColumns = 0, kSumsBf16 = 1, kSumsF32 = 2, kNodeSumsBf16 = 3, kNodeSumsF32 = 4 };
template <int kSource>
constexpr bool kIsNodeSums = kSource == kNodeSumsBf16 || kSource == kNodeSumsF32;

template <int kSource>
__global__ void __launch_bounds__(kPackThreads) pack_and_push_kernel(
    const DeviceFifo* fifos, int num_fifos, const long long* table, int n_rows, long long chunk_records,
    PackPushJob job, CountRowShift at, int* ready, int rank, int phase, unsigned long long timeout_ns, ErrorWord* err,
    StopFlag stop, unsigned long long* stamps) {
  // Every block first: each row's block in our region and where its chunk counters start (rows past kPackPushMaxRows
  // are refused by the host). Counted on the device (at.send_limit >= 0, pushed during notify): the rows' records
  // and blocks, and the records themselves, come from our own count row, and nothing is done past the send limit.
  __shared__ long long s_records[kPackPushMaxRows], s_lo[kPackPushMaxRows], s_hi[kPackPushMaxRows],
      s_chunk0[kPackPushMaxRows];
  __shared__ long long s_n, s_own_first, s_own_count;
  __shared__ bool s_go;
  if (blockIdx.x == 0 && at.own_row_push_rows > 0 && !stopped(stop)) {
    // our count row to every peer, before anything else: the pusher below waits for theirs
    for (int p = threadIdx.x; p < at.own_row_push_rows * num_fifos; p += blockDim.x)
      if (!push_lane(fifos, num_fifos, at.own_row_pushes + (p / num_fifos) * kPushColumns, p / num_fifos,
                     p % num_fifos, 1, 0, nullptr, 0, rank, at.own_row_push_phase, timeout_ns, err, stop))
        break;
  }
  if (threadIdx.x == 0) {
    stamp_earliest(stamps, kTlStart);
    bool go = !stopped(stop);
    long long chunks = 0;
    for (int i = 0; i < n_rows; ++i) {
      const long long* row = table + i * kPushColumns;
      long long filled[kPushColumns];
      if (counted_on_device(at)) {
        rows_from_own_row(at, row, rank, filled);
        row = filled;
      }
      const long long records = row[kPushRecords] > 0 ? row[kPushRecords] : 0;
      s_records[i] = records;
      s_lo[i] = row[kPushLocalOffset];
      s_hi[i] = row[kPushLocalOffset] + records * row[kPushStride];
      s_chunk0[i] = chunks;
      chunks += (records + chunk_records - 1) / chunk_records;
    }
    s_n = job.num_records;
    s_own_first = job.own_first;
    s_own_count = job.own_count;
    if (counted_on_device(at)) {
      const long long* own = at.rows + rank * at.row_words + at.num_ranks;
      const int node = rank / at.ranks_per_node;
      const long long total = records_by_node(own, at.num_ranks / at.ranks_per_node, node, &s_own_first);
      go = go && total * job.stride <= at.send_limit;
      s_n = min(total, job.num_records);  // num_records: the tables' capacity
      s_own_count = own[node];
    }
    s_go = go;
  }
  __syncthreads();
  if (!s_go) return;
  if (blockIdx.x == 0) {  // the pusher: a thread per (row, lane), each pushing that lane's chunks of the row in order
    if (at.rows) {  // pushed during notify: one thread waits for every count row, the others with it
      __shared__ bool s_rows_in;
      if (threadIdx.x == 0) {
        s_rows_in = wait_counter(at.signals, at.slot, at.expected, timeout_ns, err, stop, rank, phase);
        if (stamps) stamps[kTlRowsIn] = now_ns();
      }
      __syncthreads();
      if (!s_rows_in) return;
    }
    for (int p = threadIdx.x; p < n_rows * num_fifos; p += blockDim.x) {
      const int i = p / num_fifos, lane = p % num_fifos;
      long long row[kPushColumns];
      for (int c = 0; c < kPushColumns; ++c) row[c] = table[i * kPushColumns + c];
      row[kPushRecords] = s_records[i];
      row[kPushLocalOffset] = s_lo[i];
      long long shift = 0;
      bool send = true;
      if (at.rows) {
        (void)load_counter(at.signals + at.slot);  // this thread's own acquire: the rows it reads landed before it
        shift = block_shift(at, row, rank);
        send = shift >= 0;  // else the destination's area is too small: its counters are still reset
        shift = send ? shift : 0;
      }
      if (!push_lane(fifos, num_fifos, row, i, lane, chunk_records, shift, ready, s_chunk0[i], rank, phase, timeout_ns,
                     err, stop, send, stamps))
        return;
    }
    return;
  }
  // the packers. A block per record, the records in order: the blocks resident at once (about a thousand on an
  // H100/H200) write the first ones together, so the first chunks are complete after a fraction of the whole copy
  // and the wire starts then. (A group of 32 threads per record, as in pack_records, has every record of a call in
  // flight at once: each finishes near the end of the copy, and the first push waited for ~all of it.) Our own
  // node's records go last, and nowhere without own_dst (counted on the device: they are written after notify).
  const long long n = s_n, own_first = s_own_first, own_end = own_first + s_own_count, sent = n - s_own_count;
  const long long last = job.own_dst ? n : sent;
  __shared__ int s_sum_slots[kSource == kColumns ? 1 : kIsNodeSums<kSource> ? kNodeSumsMaxRanksPerNode
                                                                              : kExpertSumsMaxTopk], s_sum_n;
  __shared__ bool s_sum_ok;
  for (long long w = blockIdx.x - 1; w < last; w += gridDim.x - 1) {
    // the records that are sent first, in order (so the first chunks fill first), our own node's last
    const long long r = w < own_first ? w : (w < sent ? w + s_own_count : own_first + (w - sent));
    const bool own = r >= own_first && r < own_end;
    char* rec = own ? job.own_dst + (r - own_first) * job.stride : job.send + r * job.stride;
    if constexpr (kSource == kColumns)
      write_record(rec, job.hop1_token ? job.hop1_token[r] : r, job.args, job.src_idx_offset,
                   job.dest_rows + r * job.G, job.G, job.dest_rows_offset, threadIdx.x, blockDim.x);
    else if constexpr (kIsNodeSums<kSource>) {
      if (!write_node_sum_record<kSource == kNodeSumsF32>(rec, r, job, s_sum_slots, &s_sum_n, &s_sum_ok, rank, phase,
                                                          timeout_ns, err, stop))
        return;  // (the pusher gives up on the chunk at its deadline, or sees the stop flag first)
    } else
      write_expert_sum_record<kSource == kSumsF32>(rec, r, job, s_sum_slots, &s_sum_n);
    if (own) continue;
    __threadfence();  // every thread's stores of the record, device-wide, before thread 0 counts it
    __syncthreads();
    if (threadIdx.x == 0) {
      const long long at_byte = job.send_offset + r * job.stride;
      for (int i = 0; i < n_rows; ++i)
        if (at_byte >= s_lo[i] && at_byte < s_hi[i]) {
          const long long c = (at_byte - s_lo[i]) / (chunk_records * job.stride);
          const int written = atomicAdd(ready + s_chunk0[i] + c, 1) + 1;
          // the packer that completes a chunk stamps it: the pusher may see it later (it waits for the count rows)
          if (stamps && written == min(chunk_records, s_records[i] - c * chunk_records))
            stamp_earliest(stamps, kTlFirstReady);
          break;
        }
    }
  }
  if (threadIdx.x == 0) stamp_latest(stamps, kTlPackersDone);
}

// The (slot, expected) pairs of one launch, passed by value: a wait then needs no table uploaded before it (an
// upload cost ~10-18 us of host time per wait on 2x H200, session 12). 1 KiB of kernel parameters.
struct WaitTargets {
  int n;
  long long slot_expected[2 * kWaitTargetsPerLaunch];
};

__global__ void wait_signals_kernel(const unsigned long long* signals, WaitTargets t, int rank, int phase,
                                    unsigned long long timeout_ns, ErrorWord* err, StopFlag stop) {
  const int i = threadIdx.x;
  if (i >= t.n) return;
  wait_counter(signals, t.slot_expected[2 * i], t.slot_expected[2 * i + 1], timeout_ns, err, stop, rank, phase);
}

template <typename V>
__global__ void scatter_rows_kernel(char* dst, long long dst_stride, const long long* dst_idx, const char* src,
                                    long long src_stride, const long long* src_idx, long long n,
                                    long long row_bytes, long long dst_rows, ErrorWord* err, StopFlag stop,
                                    int rank, int phase, int target) {
  __shared__ bool s_stopped;  // one flag read per block, not per thread
  if (threadIdx.x == 0) s_stopped = stopped(stop);
  __syncthreads();
  if (s_stopped) return;
  const long long words = row_bytes / static_cast<long long>(sizeof(V));
  for (long long r = blockIdx.x; r < n; r += gridDim.x) {
    const long long d = dst_idx ? dst_idx[r] : r;
    const long long s = src_idx ? src_idx[r] : r;
    if (d < 0 || s < 0) continue;
    if (dst_rows >= 0 && d >= dst_rows) {  // a corrupt index: never write outside the destination area
      if (threadIdx.x == 0) report(err, stop, kErrScatterRange, rank, target, int(r), phase, d, dst_rows);
      continue;
    }
    V* out = reinterpret_cast<V*>(dst + d * dst_stride);
    const V* in = reinterpret_cast<const V*>(src + s * src_stride);
    for (long long w = threadIdx.x; w < words; w += blockDim.x) out[w] = in[w];
  }
}

// Where row r goes at local GPU j: the address of row d of dsts[j]'s area, 0 for none (d < 0). A row past the area
// (a corrupt index or record) is reported, never written; any row to write sets *any.
__device__ __forceinline__ unsigned long long forward_target(const unsigned long long* dsts, long long dst_stride,
                                                             const long long* dst_rows, int j, long long d,
                                                             long long r, bool* any, ErrorWord* err, StopFlag stop,
                                                             int rank, int phase) {
  if (d >= dst_rows[j]) {
    report(err, stop, kErrScatterRange, rank, j, int(r), phase, d, dst_rows[j]);
    return 0;
  }
  if (d < 0) return 0;
  *any = true;
  return dsts[j] + static_cast<unsigned long long>(d * dst_stride);
}

// Dispatch forward over NVLink: arrival row r goes to every local GPU j with dst_idx[r * targets + j] >= 0, at that
// row of dsts[j]'s final rows. One launch for the node's GPUs, each row read once: scatter_rows per GPU took G
// launches and G reads of each row. The targets' addresses go to shared memory (any number of GPUs per node).
template <typename V>
__global__ void forward_rows_kernel(const unsigned long long* dsts, long long dst_stride, const long long* dst_idx,
                                    int targets, const char* src, long long src_stride, long long n,
                                    long long row_bytes, const long long* dst_rows, ErrorWord* err, StopFlag stop,
                                    int rank, int phase) {
  extern __shared__ unsigned long long s_out[];  // per target: this row's destination address, 0 = none
  __shared__ bool s_stopped, s_any;
  if (threadIdx.x == 0) s_stopped = stopped(stop);
  __syncthreads();
  if (s_stopped) return;
  const long long words = row_bytes / static_cast<long long>(sizeof(V));
  for (long long r = blockIdx.x; r < n; r += gridDim.x) {
    if (threadIdx.x == 0) s_any = false;
    __syncthreads();
    for (int j = threadIdx.x; j < targets; j += blockDim.x)
      s_out[j] = forward_target(dsts, dst_stride, dst_rows, j, dst_idx[r * targets + j], r, &s_any, err, stop, rank,
                                phase);
    __syncthreads();
    if (s_any) {  // (a row no GPU needs is not read)
      const V* in = reinterpret_cast<const V*>(src + r * src_stride);
      for (long long w = threadIdx.x; w < words; w += blockDim.x) {
        const V v = in[w];
        for (int j = 0; j < targets; ++j)
          if (s_out[j]) reinterpret_cast<V*>(s_out[j])[w] = v;
      }
    }
    __syncthreads();  // (s_out and s_any are rewritten for the next row)
  }
}

// The row of the block table (forward_block_bases: per block the end of its rows, then a base per target) that
// arrival r falls in: the first block whose end passes r (first_end_past), the last block past every end.
__device__ __forceinline__ const long long* block_of_arrival(const long long* blocks, long long cols,
                                                             long long num_blocks, long long r) {
  return blocks + min(first_end_past(blocks, cols, num_blocks, r), num_blocks - 1) * cols;
}

// Dispatch forward over NVLink as the forwarder's reader of its arrivals: arrival r goes to every local GPU j whose
// dest row in the record is >= 0, at that row plus its block's base for j (block_of_arrival), and that final row is
// written to dst_idx_out[r][j] (-1: GPU j does not need it) for the combine. The copies carry r in the record's
// arrival field, patched in registers (a second store of the field to a peer would race the row's own over NVLink);
// the arrival area gets it too. kGated: the kernel runs during the hop: block 0 watches the counters and each row
// first waits for the chunk that carries it, then is read through L2. Rows go from first_row to the end, then from
// 0: our own node's block is in before the hop starts. With `ready` (ReadyWords), each final row's ready word at its
// GPU is released to the epoch after the row's stores, so that GPU's unpack reads it during the hop.
template <typename V, bool kGated>
__global__ void forward_arrivals_kernel(const unsigned long long* dsts, long long dst_stride, int targets, char* src,
                                        long long src_stride, long long n, long long row_bytes,
                                        const long long* dst_rows, const long long* blocks, long long num_blocks,
                                        long long dest_rows_offset,
                                        long long arrival_offset, long long* dst_idx_out, long long first_row,
                                        ErrorWord* err, StopFlag stop, int rank, int phase, ArrivalGate gate,
                                        ReadyWords ready, const long long* dims) {
  extern __shared__ unsigned long long s_out[];  // per target: this row's destination address, 0 = none
  __shared__ bool s_stopped, s_any, s_ok;
  if (dims) {  // launched before the host read the counts: the rows, first row and gate rows come from the device
    if (!dims[kReadGo]) return;
    n = dims[kReadRows];
    first_row = dims[kReadFirstRow];
    if constexpr (kGated) gate.blocks = int(dims[kReadBlocks]);
  }
  if constexpr (kGated) {
    reader_begins(gate);
    if (blockIdx.x == 0) {  // the watcher (arrival_gate.hpp); the rows go to the other blocks
      gate_watch(gate);
      return;
    }
  }
  if (threadIdx.x == 0) s_stopped = stopped(stop);
  __syncthreads();
  if (s_stopped) return;
  const long long block = blockIdx.x - (kGated ? 1 : 0), grid = gridDim.x - (kGated ? 1 : 0);
  const long long words = row_bytes / static_cast<long long>(sizeof(V));
  constexpr long long kWord = sizeof(V);
  const long long stamp_word = arrival_offset / kWord;  // the first word holding the arrival field
  for (long long k = block; k < n; k += grid) {
    const long long r = (first_row + k) % n;
    if constexpr (kGated) {
      if (!block_gate_rows(gate, r, r, &s_ok)) return;  // reported by the wait: the host raises
    }
    char* rec = src + r * src_stride;
    if (threadIdx.x == 0) s_any = false;
    __syncthreads();
    const long long* base = block_of_arrival(blocks, 1 + targets, num_blocks, r) + 1;
    for (int j = threadIdx.x; j < targets; j += blockDim.x) {
      const int rel = load_word<kGated>(reinterpret_cast<const int*>(rec + dest_rows_offset) + j);
      const long long d = rel < 0 ? -1 : rel + base[j];
      dst_idx_out[r * targets + j] = d;
      s_out[j] = forward_target(dsts, dst_stride, dst_rows, j, d, r, &s_any, err, stop, rank, phase);
    }
    __syncthreads();
    if (threadIdx.x == 0) *reinterpret_cast<int*>(rec + arrival_offset) = int(r);
    if (s_any) {  // (a row no GPU needs is not read)
      const V* in = reinterpret_cast<const V*>(rec);
      for (long long w = threadIdx.x; w < words; w += blockDim.x) {
        V v = load_word<kGated>(in + w);
        if (w >= stamp_word && w * kWord < arrival_offset + 4) {  // the arrival field's bytes, little endian
          unsigned char* b = reinterpret_cast<unsigned char*>(&v);
          for (long long i = 0; i < kWord; ++i) {
            const long long at = w * kWord + i - arrival_offset;
            if (at >= 0 && at < 4) b[i] = static_cast<unsigned char>(static_cast<unsigned>(r) >> (8 * at));
          }
        }
        for (int j = 0; j < targets; ++j)
          if (s_out[j]) reinterpret_cast<V*>(s_out[j])[w] = v;
      }
      if (ready.words) {  // every thread's stores of the row, system-wide, before its ready words
        drain_stores_before_release();
        __syncthreads();
        if (threadIdx.x < targets && s_out[threadIdx.x] && !stopped(stop)) {
          const long long d = dst_idx_out[r * targets + threadIdx.x];
          if (d < ready.rows) st_release_sys(reinterpret_cast<int*>(ready.words[threadIdx.x]) + d, ready.epoch);
        }
      }
    }
    __syncthreads();  // (s_out and s_any are rewritten for the next row)
  }
  if constexpr (kGated) reader_ends(gate);
}

// The local side of the pipelined combine gather (gather_tiles, internode.hpp): a block per (tile, forwarder), every
// forwarder's tile 0 first, then tile 1, ..., so that each forwarder can sum and push its first records early; a warp
// per arrival row. Each thread's copies are made visible system-wide (the forwarder's GPU reads them) before the block
// meets, and then one thread releases the tile's flag. The grid is small (UCCL_EP_GATHER_BLOCKS) and strides over the
// tiles in order: with a block for every tile all of them ran at once and each was flagged only near the end of the
// whole copy, so a pack beside it waited for ~all of it (session 43); now the tiles are flagged in order, a grid's
// worth of tiles at a time.
constexpr int kGatherThreads = 256;
constexpr int kGatherUnroll = 4;  // loads in flight per lane: a few blocks then keep NVLink busy

// The k-th of a forwarder's `tiles` tiles in the order its pack sums them (pack_and_push: the records for other nodes
// first, those before its own node's block [own_first, own_end) and then those after it, the block itself last). A
// tile across a block edge holds records of both kinds: it goes with the earlier.
__device__ long long tile_in_pack_order(long long k, long long tiles, long long tile_rows, long long own_first,
                                        long long own_end) {
  const long long before = (own_first + tile_rows - 1) / tile_rows;  // tiles with an arrival before the block
  const long long after = max(before, own_end / tile_rows);           // the first tile with one after it
  if (k < before) return k;
  if (k < before + (tiles - after)) return after + (k - before);
  return before + (k - before - (tiles - after));
}

template <typename V>
__global__ void __launch_bounds__(kGatherThreads) gather_tiles_kernel(
    const unsigned long long* dsts, const unsigned long long* flags, int targets, const int* by_arrival,
    long long max_arrivals, const long long* arrivals, const long long* own_ranges, long long tile_rows,
    const char* x, long long payload_bytes, const float* w, int num_weights, long long num_rows, long long dst_stride,
    int epoch, ErrorWord* err, StopFlag stop, int rank, int phase) {
  __shared__ bool s_stopped;
  if (threadIdx.x == 0) s_stopped = stopped(stop);
  __syncthreads();
  if (s_stopped) return;
  const int warps = blockDim.x / kWarpSize, warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const long long tiles = (max_arrivals + tile_rows - 1) / tile_rows;
  const long long words = payload_bytes / static_cast<long long>(sizeof(V));
  for (long long p = blockIdx.x; p < tiles * targets; p += gridDim.x) {
    const long long k = p / targets;
    const int f = int(p % targets);
    const long long n = arrivals[f], its_tiles = (n + tile_rows - 1) / tile_rows;
    if (k >= its_tiles) continue;
    long long t = k;
    if (own_ranges) {  // (a range past the arrivals is clamped: the order changes, never the tiles copied)
      const long long own_first = min(max(own_ranges[f], 0LL), n);
      t = tile_in_pack_order(k, its_tiles, tile_rows, own_first, min(max(own_ranges[targets + f], own_first), n));
    }
    const long long lo = t * tile_rows;
    const long long hi = lo + tile_rows < n ? lo + tile_rows : n;
    char* block = reinterpret_cast<char*>(dsts[f]);
    for (long long a = lo + warp; a < hi; a += warps) {
      const int r = by_arrival[f * max_arrivals + a];
      if (r < 0) continue;
      if (r >= num_rows) {  // a corrupt index: never read outside our rows
        if (lane == 0) report(err, stop, kErrScatterRange, rank, f, int(a), phase, r, num_rows);
        continue;
      }
      V* out = reinterpret_cast<V*>(block + a * dst_stride);
      const V* in = reinterpret_cast<const V*>(x + static_cast<long long>(r) * payload_bytes);
      long long u = lane;
      for (; u + (kGatherUnroll - 1) * kWarpSize < words; u += kGatherUnroll * kWarpSize) {
        V v[kGatherUnroll];
#pragma unroll
        for (int i = 0; i < kGatherUnroll; ++i) v[i] = in[u + i * kWarpSize];
#pragma unroll
        for (int i = 0; i < kGatherUnroll; ++i) out[u + i * kWarpSize] = v[i];
      }
      for (; u < words; u += kWarpSize) out[u] = in[u];
      float* out_w = reinterpret_cast<float*>(block + a * dst_stride + payload_bytes);
      for (int k = lane; k < num_weights; k += kWarpSize) out_w[k] = w[static_cast<long long>(r) * num_weights + k];
    }
    drain_stores_before_release();  // this thread's copies, system-wide, before the block meets
    __syncthreads();
    // a stopped rank (a corrupt index here, or any failure of this rank) flags nothing: the forwarder must time out
    // naming us rather than sum a tile with copies missing
    if (threadIdx.x == 0 && !stopped(stop)) st_release_sys(reinterpret_cast<int*>(flags[f]) + t, epoch);
  }
}

// raise_flags: a thread per flag. The stores before it on the stream are complete (they are earlier kernels); the
// drain makes this thread's view of them system-wide before its release.
__global__ void raise_flags_kernel(const unsigned long long* flags, int n, int epoch, StopFlag stop,
                                   const long long* go) {
  const int i = threadIdx.x;
  if (i >= n || stopped(stop) || (go && !*go)) return;
  drain_stores_before_release();
  st_release_sys(reinterpret_cast<int*>(flags[i]), epoch);
}

// Context::wait_node_flags: one block, a thread per (local GPU, flag) in turn.
__global__ void wait_node_flags_kernel(const int* flags, int ranks_per_node, long long tiles, int epoch,
                                         unsigned long long timeout_ns, ErrorWord* err, StopFlag stop, int rank,
                                         int phase, const long long* go) {
  if (go && !*go) return;  // (a forward before the counts that did not forward: the host's barrier follows)
  for (long long p = threadIdx.x; p < ranks_per_node * tiles; p += blockDim.x) {
    const int j = int(p / tiles);
    const long long t = p % tiles;
    if (!wait_flag(flags + j * kGatherMaxTiles + t, epoch, timeout_ns, err, stop, rank, phase, j, int(t))) return;
  }
}

// Source side of combine: token t's result is the sum, in fp32 and in ascending node m, of its partial sums
// row_of[m * num_tokens + t] (-1: node m had none; the zero row stands in, which adds nothing) of the receive area,
// rounded once to x's dtype; the fp32 weights behind the payload likewise. One warp per token, a block per tile of
// kSumTile tokens. Replaces a zeroed fp32 output, one index_add per node and a cast (~0.5 ms per call at DeepSeek-V3
// shape on H200, session 7). With a gate, a tile starts as soon as the chunks holding its partial sums have landed
// (a node's partial sums sit in token order, so a tile needs a short row range per node), while later chunks are
// still on the wire; the loads then go through L2 (the rows were written by another engine during this kernel).
constexpr int kSumThreads = 256;
constexpr int kSumTile = kSumThreads / kWarpSize;

template <bool kF32, bool kGated>
__global__ void __launch_bounds__(kSumThreads) sum_node_partials_kernel(
    char* __restrict__ out_x, long long out_x_stride, char* __restrict__ out_w, long long out_w_stride,
    const char* __restrict__ src, long long src_stride, const int* __restrict__ row_of, const int4* __restrict__ zero,
    int num_nodes, long long num_tokens, int payload_units, int num_weights, ArrivalGate gate) {
  __shared__ bool s_ok;
  if constexpr (kGated) reader_begins(gate);
  if (kGated && blockIdx.x == 0) {  // the watcher (arrival_gate.hpp); the tiles go to the other blocks
    gate_watch(gate);
    return;
  }
  const long long block = blockIdx.x - (kGated ? 1 : 0), grid = gridDim.x - (kGated ? 1 : 0);
  const int lane = threadIdx.x % kWarpSize;
  for (long long t0 = block * kSumTile; t0 < num_tokens; t0 += grid * kSumTile) {
    if constexpr (kGated) {
      // wait for each node's row range of the tile (rows of one node ascend with the token); on failure the output
      // keeps whatever it held (reported: the host raises)
      const bool ok = block_wait(&s_ok, [&] {
        const long long t1 = t0 + kSumTile < num_tokens ? t0 + kSumTile : num_tokens;
        for (int m = 0; m < num_nodes; ++m) {
          long long lo = -1, hi = -1;
          for (long long t = t0; t < t1; ++t) {
            const int r = row_of[m * num_tokens + t];
            if (r < 0) continue;
            if (lo < 0 || r < lo) lo = r;
            if (r > hi) hi = r;
          }
          if (lo >= 0 && !gate_wait_rows(gate, lo, hi)) return false;
        }
        return true;
      });
      if (!ok) return;
    }
    const long long t = t0 + threadIdx.x / kWarpSize;
    if (t >= num_tokens) continue;
    auto row = [&](int m) -> const int4* {
      const int r = row_of[m * num_tokens + t];
      return r < 0 ? zero : reinterpret_cast<const int4*>(src + r * src_stride);
    };
    int4* ox = reinterpret_cast<int4*>(out_x + t * out_x_stride);
    warp_sum_rows<kF32, 4, 4, kGated>(num_nodes, payload_units, lane, row, [&](int u, const int4& v) { ox[u] = v; });
    for (int k = lane; k < num_weights; k += kWarpSize) {
      float acc = 0.0f;
      for (int m = 0; m < num_nodes; ++m) {
        const int r = row_of[m * num_tokens + t];
        if (r < 0) continue;
        const float* w = reinterpret_cast<const float*>(src + r * src_stride + 16LL * payload_units) + k;
        acc += kGated ? ld_cg_f32(w) : *w;
      }
      reinterpret_cast<float*>(out_w + t * out_w_stride)[k] = acc;
    }
  }
  if constexpr (kGated) reader_ends(gate);
}

}  // namespace

void sum_node_partials(uintptr_t out_x, uintptr_t out_w, uintptr_t src, int64_t src_stride, uintptr_t row_of,
                       uintptr_t zero, int num_nodes, int64_t num_tokens, int64_t payload_bytes, int num_weights,
                       bool fp32, uintptr_t stream, int64_t out_x_stride, int64_t out_w_stride,
                       const ArrivalGate* gate) {
  if (num_tokens <= 0) return;
  if (out_x_stride <= 0) out_x_stride = payload_bytes;
  if (out_w_stride <= 0) out_w_stride = 4LL * num_weights;
  if (payload_bytes <= 0 || payload_bytes % 16 || src_stride % 16 || src % 16 || out_x % 16 || zero % 16 ||
      out_x_stride % 16)
    throw std::invalid_argument("sum_node_partials: payload bytes, strides and pointers must be multiples of 16");
  if (num_weights > 0 && (!out_w || out_w % 4 || out_w_stride % 4))
    throw std::invalid_argument("sum_node_partials: weights need a 4-byte aligned output");
  check_gate(gate, "sum_node_partials");
  const int blocks = gated_grid(int(std::min<int64_t>((num_tokens + kSumTile - 1) / kSumTile, 2048)), gate);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  auto* ox = reinterpret_cast<char*>(out_x);
  auto* ow = reinterpret_cast<char*>(out_w);
  auto* sp = reinterpret_cast<const char*>(src);
  auto* ro = reinterpret_cast<const int*>(row_of);
  auto* z = reinterpret_cast<const int4*>(zero);
  const int units = int(payload_bytes / 16);
  const ArrivalGate g = gate ? *gate : ArrivalGate{};
  auto launch = [&](auto kernel) {
    kernel<<<blocks + (gate ? 1 : 0), kSumThreads, 0, s>>>(ox, out_x_stride, ow, out_w_stride, sp, src_stride, ro, z, num_nodes,
                                          num_tokens, units, num_weights, g);
  };
  if (fp32)
    gate ? launch(sum_node_partials_kernel<true, true>) : launch(sum_node_partials_kernel<true, false>);
  else
    gate ? launch(sum_node_partials_kernel<false, true>) : launch(sum_node_partials_kernel<false, false>);
  check(cudaGetLastError(), "sum_node_partials launch");
}

const char* phase_name(int phase) {
  switch (phase) {
    case kPhaseDispatchNetwork: return "dispatch network hop (push_chunks / wait_signals)";
    case kPhaseCombineNetwork: return "combine network hop (push_chunks / wait_signals)";
    case kPhaseDispatchForward: return "dispatch forward over NVLink (forward_rows)";
    case kPhaseCombineGather: return "combine gather over NVLink (forward_rows, scatter_rows)";
    case kPhaseBarrier: return "group barrier through the proxies (push_chunks / wait_signals)";
    case kPhaseNotify: return "notify: count exchange through the proxies (push_chunks / wait_signals)";
    default: return "unknown phase";
  }
}

// Calls `launch` with a value of the widest word (uint4, uint32_t, uint8_t) that `all` -- the OR of every address,
// stride and size a row copy uses -- is a multiple of: the row kernels' word size.
template <typename Launch>
void by_word_size(uint64_t all, Launch launch) {
  if (all % 16 == 0)
    launch(uint4{});
  else if (all % 4 == 0)
    launch(uint32_t{});
  else
    launch(uint8_t{});
}

void gather_tiles(uintptr_t dsts, uintptr_t flags, int targets, uintptr_t by_arrival, int64_t max_arrivals,
                  uintptr_t arrivals, int64_t tile_rows, uintptr_t x, int64_t payload_bytes, uintptr_t w,
                  int num_weights, int64_t num_rows, int64_t dst_stride, int32_t epoch, uintptr_t stream,
                  uintptr_t err, uintptr_t stop_flag, int stop_generation, int rank, int phase, int blocks,
                  uintptr_t own_ranges) {
  if (blocks < 0) throw std::invalid_argument("gather_tiles: blocks must be >= 0 (0: one per tile, up to 1024)");
  if (max_arrivals <= 0 || targets <= 0) return;
  if (!dsts || !flags || !by_arrival || !arrivals || (!x && num_rows > 0))
    throw std::invalid_argument("gather_tiles: null pointer");
  if (tile_rows < 1 || (max_arrivals + tile_rows - 1) / tile_rows > kGatherMaxTiles)
    throw std::invalid_argument("gather_tiles: " + std::to_string(max_arrivals) + " arrivals in tiles of " +
                                std::to_string(tile_rows) + " rows need more than " +
                                std::to_string(kGatherMaxTiles) + " flags");
  if (payload_bytes <= 0 || payload_bytes % 4 || dst_stride % 16 ||
      dst_stride < payload_bytes + 4 * int64_t(num_weights) ||
      (num_weights > 0 && num_rows > 0 && (!w || w % 4)))
    throw std::invalid_argument("gather_tiles: the payload (a multiple of 4 bytes) and the 4-byte aligned fp32 "
                                "weights must fit a row of dst_stride (a multiple of 16) bytes");
  if (epoch < 1) throw std::invalid_argument("gather_tiles: epochs start at 1 (the flags start at 0)");
  const int64_t tiles = (max_arrivals + tile_rows - 1) / tile_rows;
  const int grid = int(std::min<int64_t>(tiles * targets, blocks > 0 ? blocks : 1024));
  // the payload's word size: the rows' addresses (our gather blocks are 16-byte aligned; x, a caller's tensor, may
  // not be)
  by_word_size(uint64_t(x) | uint64_t(payload_bytes) | uint64_t(dst_stride), [&](auto word) {
    gather_tiles_kernel<decltype(word)><<<grid, kGatherThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        reinterpret_cast<const unsigned long long*>(dsts), reinterpret_cast<const unsigned long long*>(flags), targets,
        reinterpret_cast<const int*>(by_arrival), max_arrivals, reinterpret_cast<const long long*>(arrivals),
        reinterpret_cast<const long long*>(own_ranges), tile_rows, reinterpret_cast<const char*>(x), payload_bytes,
        reinterpret_cast<const float*>(w), num_weights,
        num_rows, dst_stride, epoch, reinterpret_cast<ErrorWord*>(err),
        StopFlag{reinterpret_cast<int32_t*>(stop_flag), stop_generation}, rank, phase);
  });
  check(cudaGetLastError(), "gather_tiles launch");
}

void raise_flags(uintptr_t flags, int n, int32_t epoch, uintptr_t stream, uintptr_t stop_flag,
                 int stop_generation, uintptr_t go) {
  if (n <= 0) return;
  if (!flags || n > 1024 || epoch < 1)
    throw std::invalid_argument("raise_flags: 1..1024 flag addresses and an epoch >= 1");
  raise_flags_kernel<<<1, 1024, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const unsigned long long*>(flags), n, epoch,
      StopFlag{reinterpret_cast<int32_t*>(stop_flag), stop_generation}, reinterpret_cast<const long long*>(go));
  check(cudaGetLastError(), "raise_flags launch");
}

void scatter_rows(uintptr_t dst, int64_t dst_stride, uintptr_t dst_idx, uintptr_t src, int64_t src_stride,
                  uintptr_t src_idx, int64_t n, int64_t row_bytes, uintptr_t stream, int64_t dst_rows,
                  uintptr_t err, uintptr_t stop_flag, int stop_generation, int rank, int phase, int target) {
  if (n <= 0 || row_bytes <= 0) return;
  if (!dst || !src) throw std::invalid_argument("scatter_rows: null pointer");
  const uint64_t all = uint64_t(dst) | uint64_t(src) | uint64_t(dst_stride) | uint64_t(src_stride) |
                       uint64_t(row_bytes);
  const int blocks = int(std::min<int64_t>(n, 2048));
  auto s = reinterpret_cast<cudaStream_t>(stream);
  auto* d = reinterpret_cast<char*>(dst);
  auto* sp = reinterpret_cast<const char*>(src);
  auto* di = reinterpret_cast<const long long*>(dst_idx);
  auto* si = reinterpret_cast<const long long*>(src_idx);
  auto* ew = reinterpret_cast<ErrorWord*>(err);
  const StopFlag stop{reinterpret_cast<int32_t*>(stop_flag), stop_generation};
  by_word_size(all, [&](auto word) {
    scatter_rows_kernel<decltype(word)><<<blocks, 256, 0, s>>>(d, dst_stride, di, sp, src_stride, si, n, row_bytes,
                                                                dst_rows, ew, stop, rank, phase, target);
  });
  check(cudaGetLastError(), "scatter_rows launch");
}

void forward_rows(uintptr_t dsts, uint64_t dst_bases_or, int64_t dst_stride, uintptr_t dst_idx, int targets,
                  uintptr_t src, int64_t src_stride, int64_t n, int64_t row_bytes, uintptr_t dst_rows,
                  uintptr_t stream, uintptr_t err, uintptr_t stop_flag, int stop_generation, int rank, int phase) {
  if (n <= 0 || row_bytes <= 0) return;
  if (!dsts || !dst_idx || !src || !dst_rows) throw std::invalid_argument("forward_rows: null pointer");
  if (targets <= 0 || targets > kMaxForwardTargets)
    throw std::invalid_argument("forward_rows: " + std::to_string(targets) + " local GPUs; 1 to " +
                                std::to_string(kMaxForwardTargets) + " are supported");
  // the word size: every address the kernel forms is aligned to it (the bases are on the device, so the caller
  // passes their OR)
  const uint64_t all = dst_bases_or | uint64_t(src) | uint64_t(dst_stride) | uint64_t(src_stride) |
                       uint64_t(row_bytes);
  const int blocks = int(std::min<int64_t>(n, 2048));
  const size_t shared = size_t(targets) * sizeof(unsigned long long);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  auto* d = reinterpret_cast<const unsigned long long*>(dsts);
  auto* di = reinterpret_cast<const long long*>(dst_idx);
  auto* sp = reinterpret_cast<const char*>(src);
  auto* rows = reinterpret_cast<const long long*>(dst_rows);
  auto* ew = reinterpret_cast<ErrorWord*>(err);
  const StopFlag stop{reinterpret_cast<int32_t*>(stop_flag), stop_generation};
  by_word_size(all, [&](auto word) {
    forward_rows_kernel<decltype(word)><<<blocks, 256, shared, s>>>(d, dst_stride, di, targets, sp, src_stride, n,
                                                                    row_bytes, rows, ew, stop, rank, phase);
  });
  check(cudaGetLastError(), "forward_rows launch");
}

void forward_arrivals(uintptr_t dsts, uint64_t dst_bases_or, int64_t dst_stride, int targets, uintptr_t src,
                      int64_t src_stride, int64_t n, int64_t row_bytes, uintptr_t dst_rows, uintptr_t blocks,
                      int64_t num_blocks, int64_t dest_rows_offset, int64_t arrival_offset, uintptr_t dst_idx_out,
                      uintptr_t stream, const ArrivalGate* gate, int64_t first_row, uintptr_t err, uintptr_t stop_flag,
                      int stop_generation, int rank, int phase, uintptr_t ready_words, int64_t ready_rows,
                      int32_t ready_epoch, uintptr_t dims) {
  if (n <= 0) return;
  if (dims && first_row)
    throw std::invalid_argument("forward_arrivals: read before the counts (dims), n is the capacity and the first row "
                                "comes from the device");
  if (!dsts || !src || !dst_rows || !blocks || !dst_idx_out)
    throw std::invalid_argument("forward_arrivals: null pointer");
  if (ready_words && (ready_rows < 0 || ready_epoch < 1))
    throw std::invalid_argument("forward_arrivals: ready words need rows >= 0 and an epoch >= 1");
  if (num_blocks <= 0) throw std::invalid_argument("forward_arrivals: the block table needs at least one block");
  if (targets <= 0 || targets > kMaxForwardTargets)
    throw std::invalid_argument("forward_arrivals: " + std::to_string(targets) + " local GPUs; 1 to " +
                                std::to_string(kMaxForwardTargets) + " are supported");
  if (row_bytes <= 0 || row_bytes > src_stride || arrival_offset % 4 || arrival_offset < 0 ||
      arrival_offset + 4 > row_bytes || dest_rows_offset % 4 || dest_rows_offset < 0 ||
      dest_rows_offset + 4LL * targets > src_stride)
    throw std::invalid_argument("forward_arrivals: the record layout (row bytes " + std::to_string(row_bytes) +
                                ", arrival at " + std::to_string(arrival_offset) + ", dest rows at " +
                                std::to_string(dest_rows_offset) + ", stride " + std::to_string(src_stride) +
                                ") does not hold the arrival in the forwarded bytes and the dest rows in the record");
  if (first_row < 0 || first_row >= n) throw std::invalid_argument("forward_arrivals: first_row outside the rows");
  check_gate(gate, "forward_arrivals");
  const uint64_t all = dst_bases_or | uint64_t(src) | uint64_t(dst_stride) | uint64_t(src_stride) |
                       uint64_t(row_bytes);
  const int grid = gated_grid(int(std::min<int64_t>(n, 2048)), gate) + (gate ? 1 : 0);
  const size_t shared = size_t(targets) * sizeof(unsigned long long);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  auto* d = reinterpret_cast<const unsigned long long*>(dsts);
  auto* sp = reinterpret_cast<char*>(src);
  auto* rows = reinterpret_cast<const long long*>(dst_rows);
  auto* b = reinterpret_cast<const long long*>(blocks);
  auto* out = reinterpret_cast<long long*>(dst_idx_out);
  auto* ew = reinterpret_cast<ErrorWord*>(err);
  const StopFlag stop{reinterpret_cast<int32_t*>(stop_flag), stop_generation};
  const ArrivalGate g = gate ? *gate : ArrivalGate{};
  by_word_size(all, [&](auto word) {
    using V = decltype(word);
    auto kernel = gate ? forward_arrivals_kernel<V, true> : forward_arrivals_kernel<V, false>;
    kernel<<<grid, 256, shared, s>>>(d, dst_stride, targets, sp, src_stride, n, row_bytes, rows, b, num_blocks,
                                     dest_rows_offset, arrival_offset, out, first_row, ew, stop, rank, phase, g,
                                     ReadyWords{reinterpret_cast<const unsigned long long*>(ready_words), ready_rows,
                                                ready_epoch},
                                     reinterpret_cast<const long long*>(dims));
  });
  check(cudaGetLastError(), "forward_arrivals launch");
}

#if defined(UCCL_EP_INTERNODE_PROXY)

Context::Context(int rank, int world, int device, int64_t rdma_bytes, int64_t nvl_bytes, const ProxyParams& p,
                 double gpu_timeout_secs)
    : rank_(rank), world_(world), device_(device), rdma_bytes_(rdma_bytes), nvl_bytes_(nvl_bytes),
      timeout_ns_(uint64_t(gpu_timeout_secs * 1e9)), num_slots_(p.num_signal_slots) {
  if (rdma_bytes <= 0 || rdma_bytes % 16 || uint64_t(rdma_bytes) > cmd::kMaxOffset + cmd::kUnit)
    throw std::invalid_argument("internode: RDMA region of " + std::to_string(rdma_bytes) +
                                " bytes must be a positive multiple of 16 and at most 4 GiB (28-bit offsets in "
                                "16-byte units)");
  if (nvl_bytes <= 0) throw std::invalid_argument("internode: NVL region must be > 0 bytes");
  if (p.num_signal_slots % 512)
    throw std::invalid_argument("internode: num_signal_slots must be a multiple of 512 (whole pages of counters)");
  check(cudaSetDevice(device), "cudaSetDevice");
  try {
    check(cudaMalloc(&rdma_, size_t(rdma_bytes)), "cudaMalloc of the RDMA region");
    check(cudaMalloc(&nvl_, size_t(nvl_bytes)), "cudaMalloc of the NVL region");
    check(cudaMemset(rdma_, 0, size_t(rdma_bytes)), "cudaMemset");
    check(cudaMemset(nvl_, 0, size_t(nvl_bytes)), "cudaMemset");
    check(cudaHostAlloc(reinterpret_cast<void**>(&error_), sizeof(ErrorWord), cudaHostAllocMapped),
          "cudaHostAlloc of the error word");
    std::memset(error_, 0, sizeof(ErrorWord));
    check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_dev_), error_, 0), "cudaHostGetDevicePointer");
    check(cudaMalloc(reinterpret_cast<void**>(&stop_dev_), sizeof(int32_t)), "cudaMalloc of the stop flag");
    check(cudaMemset(stop_dev_, 0, sizeof(int32_t)), "cudaMemset of the stop flag");
    const auto new_stream = [](const char* what) {  // non-blocking: never ordered behind the legacy stream
      cudaStream_t stream = nullptr;
      check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), what);
      return static_cast<void*>(stream);
    };
    const auto new_event = [](const char* what) {
      cudaEvent_t event = nullptr;
      check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), what);
      return static_cast<void*>(event);
    };
    abort_stream_ = new_stream("cudaStreamCreate for abort_waits");
    drain_event_ = new_event("cudaEventCreate for the drains");
    side_stream_ = new_stream("cudaStreamCreate for the side stream");
    order_event_ = new_event("cudaEventCreate for stream_wait");

    ProxyConfig cfg;
    cfg.rank = rank;
    cfg.world = world;
    cfg.num_threads = p.num_threads;
    cfg.fifos_per_thread = p.fifos_per_thread;
    cfg.fifo_depth = p.fifo_depth;
    cfg.cpus = p.cpus;
    cfg.idle_backoff_us = p.idle_backoff_us;
    cfg.timeout_secs = p.timeout_secs;
    cfg.max_inflight_writes = p.max_inflight_writes;
    cfg.max_inflight_bytes = p.max_inflight_bytes;
    cfg.reorder_window = p.reorder_window;
    cfg.num_signal_slots = p.num_signal_slots;
    cfg.dump_trigger = p.dump_trigger;
    TransportSpec spec;
    spec.name = p.transport;
    spec.loopback.reorder = p.loopback_reorder;
    spec.loopback.delay_us = p.loopback_delay_us;
    spec.loopback.bandwidth_gbps = p.loopback_bandwidth_gbps;
    spec.loopback.seed = p.loopback_seed;
    if (spec.name == "loopback" && !p.loopback_copy_agent.empty())
      spec.loopback.copy_agent = CopyAgentSegment::open(p.loopback_copy_agent);
    spec.verbs.devices = p.ib_devices;
    spec.verbs.port = p.ib_port;
    spec.verbs.gid_index = p.gid_index;
    spec.verbs.sl = p.sl;
    spec.verbs.tc = p.tc;
    // Every write-with-immediate in flight holds a send WR here and a receive WR at its target: queues shallower
    // than the proxy's in-flight cap would refuse posts the cap allows (comm.proxy_options sizes them the same way).
    const int depth = int(std::max<uint64_t>(1024, p.max_inflight_writes));
    spec.verbs.sq_depth = spec.verbs.rq_depth = depth;
    if (spec.name == "loopback" && spec.loopback.bandwidth_gbps > 0)
      spec.loopback.wire = wire_ = std::make_shared<LoopbackWire>();
    const Proxy::TransportFactory factory = make_transport_factory(spec, rank, world, p.num_threads, "internode");
    proxy_ = std::make_unique<Proxy>(cfg, factory, rdma_, size_t(rdma_bytes), MemoryKind::kDevice);

    void* sig = proxy_->signals();
    check(cudaHostRegister(sig, size_t(num_slots_) * sizeof(int64_t), cudaHostRegisterMapped |
                           cudaHostRegisterPortable), "cudaHostRegister of the proxy's signal counters");
    signals_registered_ = true;
    check(cudaHostGetDevicePointer(&signals_dev_, sig, 0), "cudaHostGetDevicePointer of the signal counters");
    check(cudaMalloc(&mirror_dev_, size_t(num_slots_) * sizeof(uint64_t)), "cudaMalloc of the counter mirror");
    check(cudaMemset(mirror_dev_, 0, size_t(num_slots_) * sizeof(uint64_t)), "cudaMemset of the counter mirror");

    std::vector<DeviceFifo> views;
    for (int i = 0; i < proxy_->num_fifos(); ++i) views.push_back(proxy_->fifo(i).device_view());
    check(cudaMalloc(&fifos_dev_, views.size() * sizeof(DeviceFifo)), "cudaMalloc of the FIFO table");
    for (const DeviceFifo& v : views) fifo_heads_dev_.push_back(v.head);
    check(cudaHostAlloc(reinterpret_cast<void**>(&heads_host_), views.size() * sizeof(unsigned long long),
                        cudaHostAllocDefault), "cudaHostAlloc of the FIFO head mirror");
    check(cudaMemcpy(fifos_dev_, views.data(), views.size() * sizeof(DeviceFifo), cudaMemcpyHostToDevice),
          "cudaMemcpy of the FIFO table");
  } catch (...) {
    destroy();
    throw;
  }
}

Context::~Context() {
  try {
    destroy();
  } catch (...) {
  }
}

void Context::destroy() {
  // Diagnostics (fifo_states, signal_value, ...) may run on another thread, e.g. a test harness asking a rank for
  // its state while it tears down: they wait for the teardown, then see destroyed_.
  std::lock_guard<std::mutex> g(diag_mu_);
  if (destroyed_) return;
  destroyed_ = true;
  if (proxy_) proxy_->stop();
  cudaSetDevice(device_);
  for (void* p : opened_peers_) (void)cudaIpcCloseMemHandle(p);
  opened_peers_.clear();
  const bool leak = proxy_ && proxy_->detached_threads();
  if (leak) {
    // A proxy thread stuck in a transport call was detached (Proxy::stop): the call may still return into the
    // proxy, its signal buffer and the RDMA region, so all three stay allocated and registered.
    (void)proxy_.release();
    rdma_ = nullptr;
    signals_registered_ = false;
  }
  if (signals_registered_ && proxy_) (void)cudaHostUnregister(proxy_->signals());
  signals_registered_ = false;
  proxy_.reset();  // closes the transports before the memory they registered goes away
  if (fifos_dev_) (void)cudaFree(fifos_dev_);
  if (heads_host_) (void)cudaFreeHost(heads_host_);
  heads_host_ = nullptr;
  fifo_heads_dev_.clear();
  if (rdma_) (void)cudaFree(rdma_);
  if (nvl_) (void)cudaFree(nvl_);
  if (error_) (void)cudaFreeHost(error_);
  if (stop_dev_) (void)cudaFree(stop_dev_);
  if (mirror_dev_) (void)cudaFree(mirror_dev_);
  mirror_dev_ = nullptr;
  if (abort_stream_) (void)cudaStreamDestroy(static_cast<cudaStream_t>(abort_stream_));
  if (drain_event_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(drain_event_));
  drain_event_ = nullptr;
  if (side_stream_) (void)cudaStreamDestroy(static_cast<cudaStream_t>(side_stream_));
  if (order_event_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(order_event_));
  side_stream_ = order_event_ = nullptr;
  fifos_dev_ = rdma_ = nvl_ = nullptr;
  error_ = error_dev_ = nullptr;
  stop_dev_ = nullptr;
  abort_stream_ = nullptr;
}

uintptr_t Context::signals_host_ptr() const { return reinterpret_cast<uintptr_t>(proxy_->signals()); }
int Context::num_fifos() const { return proxy_->num_fifos(); }
std::string Context::transport_name() const { return proxy_->caps().name; }
bool Context::transport_in_order() const { return proxy_->caps().in_order; }

std::string Context::nvl_ipc_handle() const {
  cudaIpcMemHandle_t h;
  check(cudaIpcGetMemHandle(&h, nvl_), "cudaIpcGetMemHandle of the NVL region");
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

std::vector<uintptr_t> Context::open_nvl_peers(const std::vector<std::string>& handles, int own_index) {
  std::vector<uintptr_t> out;
  cudaSetDevice(device_);
  for (size_t i = 0; i < handles.size(); ++i) {
    if (int(i) == own_index) {
      out.push_back(nvl_ptr());
      continue;
    }
    if (handles[i].size() != sizeof(cudaIpcMemHandle_t))
      throw std::invalid_argument("open_nvl_peers: handle " + std::to_string(i) + " is malformed");
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handles[i].data(), sizeof(h));
    void* p = nullptr;
    check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
          "cudaIpcOpenMemHandle of node peer " + std::to_string(i) + " (rank " + std::to_string(rank_) + ")");
    opened_peers_.push_back(p);
    out.push_back(reinterpret_cast<uintptr_t>(p));
  }
  return out;
}

std::string Context::proxy_local_info(int thread) {
  auto v = proxy_->local_info(thread);
  return std::string(v.begin(), v.end());
}

void Context::proxy_connect(const std::vector<std::vector<std::string>>& infos) {
  std::vector<std::vector<std::vector<uint8_t>>> conv;
  for (auto& per_thread : infos) {
    conv.emplace_back();
    for (auto& s : per_thread) conv.back().emplace_back(s.begin(), s.end());
  }
  cudaSetDevice(device_);
  proxy_->connect(conv);
}

void Context::proxy_start() { proxy_->start(); }
void Context::proxy_stop() {
  if (proxy_) proxy_->stop();
}
void Context::proxy_wait_idle(double timeout_secs) {
  if (proxy_) proxy_->wait_idle(timeout_secs);
}
std::string Context::proxy_error() const {
  // Under diag_mu_ like the other diagnostics: a harness thread may ask while the main thread tears down.
  std::lock_guard<std::mutex> g(diag_mu_);
  return !destroyed_ && proxy_ && proxy_->failed() ? proxy_->error() : std::string();
}

ProxyThreadStats Context::proxy_totals() const {
  std::lock_guard<std::mutex> g(diag_mu_);
  return destroyed_ || !proxy_ ? ProxyThreadStats{} : proxy_->totals();
}
uint64_t Context::max_write_bytes() const { return proxy_ ? proxy_->caps().max_write_bytes : 0; }

int64_t Context::signal_value(uint32_t slot) const {
  if (slot >= num_slots_) throw std::invalid_argument("signal_value: slot out of range");
  std::lock_guard<std::mutex> g(diag_mu_);
  if (destroyed_ || !proxy_) throw std::runtime_error("signal_value: the internode context was destroyed");
  return __atomic_load_n(proxy_->signals() + slot, __ATOMIC_ACQUIRE);
}

int64_t Context::signals_short(const std::vector<std::pair<int64_t, int64_t>>& targets) const {
  std::lock_guard<std::mutex> g(diag_mu_);
  if (destroyed_ || !proxy_) throw std::runtime_error("signals_short: the internode context was destroyed");
  int64_t left = 0;
  for (const auto& [slot, target] : targets) {
    if (slot < 0 || uint64_t(slot) >= num_slots_) throw std::invalid_argument("signals_short: slot out of range");
    const int64_t v = int64_t(__atomic_load_n(proxy_->signals() + slot, __ATOMIC_ACQUIRE));
    if (target > v) left += target - v;
  }
  return left;
}

std::vector<Context::FifoState> Context::fifo_states() const {
  std::lock_guard<std::mutex> g(diag_mu_);
  std::vector<FifoState> out;
  if (destroyed_ || !proxy_) return out;
  const int n = proxy_->num_fifos();
  // Host side first, heads second: a kernel still pushing can only make the heads larger, so a head below the tail
  // cannot appear; a head above it may still be a push in progress while kernels run.
  std::vector<Fifo::Snapshot> snaps;
  for (int i = 0; i < n; ++i) snaps.push_back(proxy_->fifo(i).snapshot());
  int prev_device = -1;
  (void)cudaGetDevice(&prev_device);
  // The heads live in GPU memory. Read them into pinned memory on a stream of our own that does not wait for the
  // legacy default stream, so a wait kernel still spinning there cannot block the diagnosis of why it spins; and
  // give up after a second (a wedged GPU): the heads then read as unknown.
  cudaStream_t s = nullptr;
  bool ok = cudaSetDevice(device_) == cudaSuccess && cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess;
  for (int i = 0; ok && i < n; ++i)
    ok = cudaMemcpyAsync(heads_host_ + i, fifo_heads_dev_[size_t(i)], sizeof(unsigned long long),
                         cudaMemcpyDeviceToHost, s) == cudaSuccess;
  const auto t0 = std::chrono::steady_clock::now();
  cudaError_t q = cudaErrorNotReady;
  while (ok && (q = cudaStreamQuery(s)) == cudaErrorNotReady &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1))
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  ok = ok && q == cudaSuccess;
  if (s) (void)cudaStreamDestroy(s);  // a copy still pending finishes into heads_host_, which outlives it
  if (!ok) (void)cudaGetLastError();
  if (prev_device >= 0) (void)cudaSetDevice(prev_device);
  for (int i = 0; i < n; ++i) {
    const Fifo::Snapshot& snap = snaps[size_t(i)];
    FifoState f;
    f.fifo = i;
    f.device_head = ok ? int64_t(heads_host_[i]) : -1;
    f.tail = snap.tail;
    f.full = snap.full;
    f.first_full = snap.first_full;
    f.last_full = snap.last_full;
    out.push_back(f);
  }
  return out;
}

std::string Context::proxy_counters() const {
  std::lock_guard<std::mutex> g(diag_mu_);
  return destroyed_ || !proxy_ ? std::string("proxy stopped") : proxy_->describe(false);
}

void Context::push_chunks(uintptr_t table, int n, int64_t chunk_records, int phase, uintptr_t stream) {
  launch_push(table, n, chunk_records, nullptr, phase, stream);
}

void Context::check_count_rows(const CountRowOffsets& at, const std::string& what) const {
  if (at.slot < 0 || uint64_t(at.slot) >= num_slots_)
    throw std::invalid_argument(what + ": slot " + std::to_string(at.slot) + " outside 0.." +
                                std::to_string(num_slots_ - 1));
  if (at.ranks_per_node < 1 || world_ % at.ranks_per_node)
    throw std::invalid_argument(what + ": ranks_per_node must divide the " + std::to_string(world_) + " ranks");
  if (at.row_words < world_ + world_ / at.ranks_per_node)
    throw std::invalid_argument(what + ": a count row has at least ranks + nodes words");
  const int64_t rows_offset = int64_t(at.rows) - int64_t(reinterpret_cast<uintptr_t>(rdma_));
  if (!at.rows || rows_offset < 0 || rows_offset % 8 || rows_offset + 8 * world_ * at.row_words > rdma_bytes_)
    throw std::invalid_argument(what + ": the count rows must lie in this rank's RDMA region");
  if (at.receive_bytes < 0) throw std::invalid_argument(what + ": negative receive_bytes");
}

void Context::push_after_counts(uintptr_t table, int n, int64_t chunk_records, const CountRowOffsets& at, int phase,
                                uintptr_t stream) {
  check_count_rows(at, "push_after_counts");
  if (at.own_row_push_rows)
    throw std::invalid_argument("push_after_counts: push our own count row before it (push_chunks); only "
                                "pack_and_push_after_counts makes those pushes itself");
  launch_push(table, n, chunk_records, &at, phase, stream);
}

void Context::launch_push(uintptr_t table, int n, int64_t chunk_records, const CountRowOffsets* at, int phase,
                          uintptr_t stream) {
  if (n <= 0) return;
  if (chunk_records < 1 || uint64_t(chunk_records) > cmd::kMaxValue)
    throw std::invalid_argument("push_chunks: chunk_records must be 1.." + std::to_string(cmd::kMaxValue) +
                                " (18-bit signal value)");
  hop_stamps_ = nullptr;  // a hop pushed by push_chunks has no timeline row: its reader stamps none
  const CountRowShift shift = count_row_shift(at, signals_dev_, world_);
  const int threads = 64;
  const int64_t blocks = (int64_t(n) * proxy_->num_fifos() + threads - 1) / threads;
  push_chunks_kernel<<<unsigned(blocks), threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      static_cast<const DeviceFifo*>(fifos_dev_), proxy_->num_fifos(), reinterpret_cast<const long long*>(table), n,
      chunk_records, shift, rank_, phase, timeout_ns_, error_dev_, StopFlag{stop_dev_, stop_generation_});
  check(cudaGetLastError(), "push_chunks launch");
}

void Context::pack_and_push(uintptr_t table, int n, int64_t chunk_records, const RecordJob& job, uintptr_t ready,
                            int phase, uintptr_t stream) {
  launch_pack_and_push(table, n, chunk_records, job, nullptr, ready, phase, stream);
}

void Context::pack_and_push_after_counts(uintptr_t table, int n, int64_t chunk_records, const RecordJob& job,
                                         const CountRowOffsets& at, uintptr_t ready, int phase, uintptr_t stream) {
  check_count_rows(at, "pack_and_push_after_counts");
  if (at.send_limit < 0)
    throw std::invalid_argument("pack_and_push_after_counts: give send_limit (the records are counted from our row)");
  if (job.own_dst || job.own_first || job.own_count)
    throw std::invalid_argument("pack_and_push_after_counts: our own node's records are written after notify "
                                "(no own_dst)");
  if (at.own_row_push_rows < 0 || (at.own_row_push_rows > 0 && !at.own_row_pushes))
    throw std::invalid_argument("pack_and_push_after_counts: own_row_push_rows must be >= 0, with a table when > 0");
  if (job.num_records <= 0) {  // no launch: the row still has to leave, or the peers wait for it in vain
    if (at.own_row_push_rows > 0) launch_push(at.own_row_pushes, at.own_row_push_rows, 1, nullptr,
                                              at.own_row_push_phase, stream);
    return;
  }
  launch_pack_and_push(table, n, chunk_records, job, &at, ready, phase, stream);
}

void Context::launch_pack_and_push(uintptr_t table, int n, int64_t chunk_records, const RecordJob& job,
                                   const CountRowOffsets* at, uintptr_t ready, int phase, uintptr_t stream) {
  if (job.num_records <= 0) return;
  if (n <= 0 || n > kPackPushMaxRows)
    throw std::invalid_argument("pack_and_push: 1.." + std::to_string(kPackPushMaxRows) + " push table rows, got " +
                                std::to_string(n) + " (use pack_records and push_chunks)");
  if (chunk_records < 1 || uint64_t(chunk_records) > cmd::kMaxValue)
    throw std::invalid_argument("pack_and_push: chunk_records must be 1.." + std::to_string(cmd::kMaxValue) +
                                " (18-bit signal value)");
  if (!ready) throw std::invalid_argument("pack_and_push: no chunk counters");
  if (job.columns.size() > size_t(kMaxPackColumns))
    throw std::invalid_argument("pack_and_push: at most " + std::to_string(kMaxPackColumns) + " columns");
  if (job.stride % 16 || (job.src_idx_offset >= 0 && job.src_idx_offset % 4) || job.dest_rows_offset % 4)
    throw std::invalid_argument("pack_and_push: misaligned record layout");
  if (job.own_first < 0 || job.own_count < 0 || job.own_first + job.own_count > job.num_records)
    throw std::invalid_argument("pack_and_push: our own node's records must lie within the records");
  // (own_count > 0 without own_dst: our own node's records are not written; the reader takes those rows from the
  // columns, internode_plan.hpp OwnRows)
  if (job.ranks_per_node > 0 && !job.dest_rows) throw std::invalid_argument("pack_and_push: no final rows");
  const int64_t send_offset = int64_t(job.send) - int64_t(reinterpret_cast<uintptr_t>(rdma_));
  // counted on the device, nothing is written past the send limit (num_records is only the tables' capacity)
  const int64_t extent = at ? at->send_limit : job.num_records * job.stride;
  if (send_offset < 0 || send_offset + extent > rdma_bytes_)
    throw std::invalid_argument("pack_and_push: the records do not lie in this rank's RDMA region");
  PackPushJob j{};
  j.send = reinterpret_cast<char*>(job.send);
  j.own_dst = reinterpret_cast<char*>(job.own_dst);
  j.send_offset = send_offset;
  j.own_first = job.own_first;
  j.own_count = job.own_count;
  j.stride = job.stride;
  j.num_records = job.num_records;
  j.hop1_token = reinterpret_cast<const long long*>(job.hop1_token);
  j.dest_rows = reinterpret_cast<const long long*>(job.dest_rows);
  j.G = job.ranks_per_node;
  j.src_idx_offset = job.src_idx_offset;
  j.dest_rows_offset = job.dest_rows_offset;
  j.args.num_columns = int(job.columns.size());
  for (size_t i = 0; i < job.columns.size(); ++i) {
    const PackColumn& c = job.columns[i];
    const int64_t end = job.src_idx_offset >= 0 ? job.src_idx_offset : job.stride;
    if (c.offset < 0 || c.offset + c.bytes > end)
      throw std::invalid_argument("pack_and_push: column " + std::to_string(i) + " overlaps the record's index "
                                  "fields or its end");
    j.args.columns[i] = c;
  }
  const ExpertSums& sums = job.sums;
  if (sums.x) {
    const uintptr_t aligned = sums.x | uintptr_t(sums.row_bytes) | job.send | job.own_dst | uintptr_t(job.stride);
    if (!job.columns.empty() || job.hop1_token || job.ranks_per_node || job.src_idx_offset >= 0)
      throw std::invalid_argument("pack_and_push: expert sums take no columns, tokens, final rows or index fields "
                                  "(record r is combine row r)");
    if (sums.row_bytes <= 0 || aligned % 16 || sums.row_bytes > job.stride)
      throw std::invalid_argument("pack_and_push: expert sums need rows of a multiple of 16 bytes within the "
                                  "record, and 16-byte aligned rows and records");
    if (sums.topk < 1 || sums.topk > kExpertSumsMaxTopk || !sums.slot_of)
      throw std::invalid_argument("pack_and_push: expert sums need slot_of and a top-k of 1.." +
                                  std::to_string(kExpertSumsMaxTopk) + ", got " + std::to_string(sums.topk));
    if (sums.weights && (sums.weights_offset < sums.row_bytes || sums.weights_offset % 4 ||
                         sums.weights_offset + 4 * sums.topk > job.stride))
      throw std::invalid_argument("pack_and_push: the expert sums' weights must lie in the record behind the payload");
  }
  j.sums_x = reinterpret_cast<const int4*>(sums.x);
  j.sums_slot_of = reinterpret_cast<const int*>(sums.slot_of);
  j.sums_weights = reinterpret_cast<const float*>(sums.weights);
  j.sums_row_bytes = sums.row_bytes;
  j.sums_weights_offset = sums.weights_offset;
  j.sums_topk = sums.topk;
  const NodeSums& ns = job.node_sums;
  if (ns.gather) {
    if (sums.x || !job.columns.empty() || job.hop1_token || job.ranks_per_node || job.src_idx_offset >= 0)
      throw std::invalid_argument("pack_and_push: node sums take no columns, expert sums, tokens, final rows or index "
                                  "fields (record r is arrival r's node sum)");
    if (ns.payload_bytes <= 0 || (ns.gather | uintptr_t(ns.payload_bytes) | job.send | job.own_dst |
                                  uintptr_t(job.stride)) % 16 ||
        ns.num_weights < 0 || ns.payload_bytes + 4 * int64_t(ns.num_weights) > job.stride)
      throw std::invalid_argument("pack_and_push: node sums need a payload of a multiple of 16 bytes and the fp32 "
                                  "weights within the record, and 16-byte aligned rows and records");
    if (ns.ranks_per_node < 1 || ns.ranks_per_node > kNodeSumsMaxRanksPerNode || !ns.rows_of || !ns.flags)
      throw std::invalid_argument("pack_and_push: node sums need rows_of, flags and 1.." +
                                  std::to_string(kNodeSumsMaxRanksPerNode) + " GPUs per node");
    if (ns.tile_rows < 1 || (job.num_records + ns.tile_rows - 1) / ns.tile_rows > kGatherMaxTiles || ns.epoch < 1)
      throw std::invalid_argument("pack_and_push: node sums' tiles must cover the records with at most " +
                                  std::to_string(kGatherMaxTiles) + " flags, at an epoch >= 1");
  }
  j.node_gather = reinterpret_cast<const char*>(ns.gather);
  j.node_rows_of = reinterpret_cast<const int*>(ns.rows_of);
  j.node_flags = reinterpret_cast<const int*>(ns.flags);
  j.node_tile_rows = ns.tile_rows;
  j.node_G = ns.ranks_per_node;
  j.node_units = int(ns.payload_bytes / 16);
  j.node_weights = ns.num_weights;
  j.node_epoch = ns.epoch;
  const int blocks = 1 + int(std::min<int64_t>(job.num_records, spin_blocks_ > 0 ? spin_blocks_ : 1024));
  unsigned long long* stamps = nullptr;
  if (timeline_ && timeline_used_ < timeline_capacity_) stamps = timeline_ + int64_t(kTimelineFields) * timeline_used_++;
  hop_stamps_ = stamps;
  const auto kernel = ns.gather ? (ns.f32 ? pack_and_push_kernel<kNodeSumsF32> : pack_and_push_kernel<kNodeSumsBf16>)
                     : !sums.x  ? pack_and_push_kernel<kColumns>
                     : sums.f32 ? pack_and_push_kernel<kSumsF32>
                                : pack_and_push_kernel<kSumsBf16>;
  kernel<<<blocks, kPackThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      static_cast<const DeviceFifo*>(fifos_dev_), proxy_->num_fifos(), reinterpret_cast<const long long*>(table), n,
      chunk_records, j, count_row_shift(at, signals_dev_, world_), reinterpret_cast<int*>(ready), rank_, phase,
      timeout_ns_, error_dev_, StopFlag{stop_dev_, stop_generation_}, stamps);
  check(cudaGetLastError(), "pack_and_push launch");
}

void Context::wait_node_flags(uintptr_t flags, int ranks_per_node, int64_t tiles, int32_t epoch, int phase,
                                uintptr_t stream, uintptr_t go) {
  if (tiles <= 0 || ranks_per_node <= 0) return;
  if (!flags || tiles > kGatherMaxTiles || epoch < 1)
    throw std::invalid_argument("wait_node_flags: flags, 1.." + std::to_string(kGatherMaxTiles) +
                                " tiles and an epoch >= 1");
  wait_node_flags_kernel<<<1, 256, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const int*>(flags), ranks_per_node, tiles, epoch, timeout_ns_, error_dev_,
      StopFlag{stop_dev_, stop_generation_}, rank_, phase, reinterpret_cast<const long long*>(go));
  check(cudaGetLastError(), "wait_node_flags launch");
}

void Context::set_timeline(uintptr_t stamps, int capacity) {
  if (capacity < 0 || (stamps && !capacity))
    throw std::invalid_argument("set_timeline: capacity must be >= 1 with stamps (0 stamps: off)");
  timeline_ = stamps ? reinterpret_cast<unsigned long long*>(stamps) : nullptr;
  timeline_capacity_ = stamps ? capacity : 0;
  timeline_used_ = 0;
  hop_stamps_ = nullptr;  // a gate made later must not stamp a row the caller may have freed
}

void Context::start_wire_log(size_t capacity) {
  if (!wire_)
    throw std::invalid_argument("start_wire_log: no emulated wire (the loopback transport with a bandwidth cap, "
                                "UCCL_EP_LOOPBACK_BW_GBPS > 0)");
  wire_->start_log(capacity);
}

std::vector<WireRun> Context::stop_wire_log(uint64_t* dropped) {
  if (!wire_) throw std::invalid_argument("stop_wire_log: no emulated wire");
  return wire_->stop_log(dropped);
}

void Context::wait_signals(const std::vector<std::pair<int64_t, int64_t>>& targets, int phase, uintptr_t stream) {
  for (const auto& [slot, expected] : targets)
    if (slot < 0 || uint64_t(slot) >= num_slots_)
      throw std::invalid_argument("wait_signals: slot " + std::to_string(slot) + " outside 0.." +
                                  std::to_string(num_slots_ - 1));
  // More pairs than one launch carries: consecutive launches on the stream, each waiting for its share.
  for (size_t first = 0; first < targets.size(); first += kWaitTargetsPerLaunch) {
    WaitTargets t{};
    t.n = int(std::min<size_t>(kWaitTargetsPerLaunch, targets.size() - first));
    for (int i = 0; i < t.n; ++i) {
      t.slot_expected[2 * i] = targets[first + i].first;
      t.slot_expected[2 * i + 1] = targets[first + i].second;
    }
    wait_signals_kernel<<<1, kWaitTargetsPerLaunch, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        static_cast<const unsigned long long*>(signals_dev_), t, rank_, phase, timeout_ns_, error_dev_,
        StopFlag{stop_dev_, stop_generation_});
    check(cudaGetLastError(), "wait_signals launch");
  }
}

ArrivalGate Context::arrival_gate(uintptr_t table, int blocks, int64_t chunk_records, int phase) {
  ArrivalGate g;
  g.stamps = hop_stamps_;  // the hop this gate reads was pushed by that launch
  hop_stamps_ = nullptr;
  g.signals = static_cast<const unsigned long long*>(signals_dev_);
  g.mirror = static_cast<unsigned long long*>(mirror_dev_);
  g.table = reinterpret_cast<const long long*>(table);
  g.blocks = blocks;
  g.lanes = proxy_->num_fifos();
  g.per_chunk = chunk_records;
  g.timeout_ns = timeout_ns_;
  g.err = error_dev_;
  g.stop = StopFlag{stop_dev_, stop_generation_};
  g.rank = rank_;
  g.max_grid = spin_blocks_;
  g.phase = phase;
  check_gate(&g, "arrival_gate");
  return g;
}

ErrorWord Context::error_fields() const {
  ErrorWord e{};
  if (!error_) return e;
  e.code = __atomic_load_n(&error_->code, __ATOMIC_ACQUIRE);  // the GPU writes the code last
  if (e.code == 0) return e;
  std::memcpy(&e, error_, sizeof(e));
  return e;
}

std::string Context::error_message() const {
  if (!error_) return "internode context destroyed";
  const ErrorWord e = error_fields();
  if (e.code == 0) return "";
  const double secs = double(timeout_ns_) / 1e9;
  const std::string who = "rank " + std::to_string(e.rank) + ", " + phase_name(e.phase) + ": ";
  switch (e.code) {
    case kErrWaitTimeout:
      return who + "wait_signals: GPU waited " + std::to_string(secs) + " s (UCCL_EP_GPU_TIMEOUT_SECS) for signal "
             "slot " + std::to_string(e.slot) + " to reach " + std::to_string(e.expected) + ", saw " +
             std::to_string(e.observed) + " (a peer rank or its proxy stopped sending)";
    case kErrPushTimeout:
      return who + "push_chunks: GPU could not push into FIFO " + std::to_string(e.slot) + " for " +
             std::to_string(secs) + " s (ring full: is the proxy thread running?); block for rank " +
             std::to_string(e.aux) + ", record " + std::to_string(e.observed) + " of " + std::to_string(e.expected);
    case kErrEncode:
      return who + "push_chunks: a command to rank " + std::to_string(e.slot) + " does not encode: " +
             command_error_name(e.aux);
    case kErrScatterRange:
      return who + "forward_rows / scatter_rows: destination row " + std::to_string(e.observed) +
             " (list position " + std::to_string(e.aux) + ", target local GPU " + std::to_string(e.slot) +
             ") is outside the " +
             std::to_string(e.expected) + " rows of the area; the row was not written (a record arrived corrupt, "
             "or was read before its bytes landed)";
    case kErrAborted:
      return who + "GPU waits aborted by the host (the proxy failed)";
    case kErrRecordsUnwritten:
      return who + "pack_and_push: the records of chunk " + std::to_string(e.slot) + " (for rank " +
             std::to_string(e.aux) + ") were not all written within " + std::to_string(secs) + " s: " +
             std::to_string(e.observed) + " of " + std::to_string(e.expected) + " (a packer block never ran?)";
    case kErrNodeFlagTimeout:
      return who + "NVLink flags: local GPU " + std::to_string(e.slot) + " did not raise flag " +
             std::to_string(e.aux) + " (a tile of our combine arrivals, or 0: its dispatch forward) within " +
             std::to_string(secs) + " s: the flag is at " + std::to_string(e.observed) + ", waited for epoch " +
             std::to_string(e.expected) + " (that rank stopped, or never reached this call)";
    case kErrRowNotReady:
      return who + "the dispatch forward did not mark final row " + std::to_string(e.aux) + " ready within " +
             std::to_string(secs) + " s: its ready word is at " + std::to_string(e.observed) +
             ", waited for epoch " + std::to_string(e.expected) + " (the forwarder of its source stopped, or never "
             "reached this call)";
    default:
      return who + "unknown GPU error code " + std::to_string(e.code);
  }
}

void Context::clear_error() {
  if (error_) std::memset(error_, 0, sizeof(ErrorWord));
  ++stop_generation_;  // kernels launched from now on run; those queued behind the failure keep stopping
}

void Context::abort_waits() {
  if (!error_) return;
  int32_t zero = 0;
  if (__atomic_compare_exchange_n(&error_->reserved, &zero, 1, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    error_->rank = rank_;
    error_->phase = kPhaseUnknown;
    __atomic_store_n(&error_->code, int32_t(kErrAborted), __ATOMIC_RELEASE);
  }
  // The copy kernels test the stop flag, not the error word (see stopped()). A non-blocking stream: the kernels on
  // the caller's stream may be spinning in a wait right now.
  // Bounded like every host wait here: after a second (a wedged GPU) the copy is left to finish on its own, from a
  // member that outlives it; the waits still end through the error word, which they poll.
  if (stop_dev_ && abort_stream_) {
    abort_value_ = stop_generation_;
    auto st = static_cast<cudaStream_t>(abort_stream_);
    cudaError_t q = cudaMemcpyAsync(stop_dev_, &abort_value_, sizeof(abort_value_), cudaMemcpyHostToDevice, st);
    const auto t0 = std::chrono::steady_clock::now();
    while (q == cudaSuccess && (q = cudaStreamQuery(st)) == cudaErrorNotReady &&
           std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1))
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    if (q != cudaSuccess) {
      std::fprintf(stderr, "uccl-ep: rank %d: abort_waits: setting the stop flag (device int) to generation %d did "
                   "not complete within 1 s (%s); the send and forward kernels may still run\n", rank_, abort_value_,
                   q == cudaErrorNotReady ? "still pending" : cudaGetErrorString(q));
      (void)cudaGetLastError();
    }
  }
}

void Context::record_drain_mark(uintptr_t stream) {
  if (!drain_event_) throw std::runtime_error("record_drain_mark: the internode context was destroyed");
  check(cudaEventRecord(static_cast<cudaEvent_t>(drain_event_), reinterpret_cast<cudaStream_t>(stream)),
        "cudaEventRecord of the drain mark");
}

void Context::stream_wait(uintptr_t waiter, uintptr_t signaller) {
  if (!order_event_) throw std::runtime_error("stream_wait: the internode context was destroyed");
  check(cudaEventRecord(static_cast<cudaEvent_t>(order_event_), reinterpret_cast<cudaStream_t>(signaller)),
        "cudaEventRecord for stream_wait");
  check(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(waiter), static_cast<cudaEvent_t>(order_event_), 0),
        "cudaStreamWaitEvent for stream_wait");
}

void Context::copy_to_device(uintptr_t dst, uintptr_t src, int64_t bytes, uintptr_t stream) {
  if (bytes < 0 || (bytes > 0 && (!dst || !src)))
    throw std::invalid_argument("copy_to_device: a null address or a negative size");
  if (bytes == 0) return;
  check(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), size_t(bytes),
                        cudaMemcpyHostToDevice, reinterpret_cast<cudaStream_t>(stream)),
        "cudaMemcpyAsync of a " + std::to_string(bytes) + "-byte table");
}

bool Context::drain_mark_reached() const {
  if (!drain_event_) throw std::runtime_error("drain_mark_reached: the internode context was destroyed");
  const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(drain_event_));
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  check(e, "cudaEventQuery of the drain mark");
  return true;
}

#else  // HIP builds: the loopback transport maps device memory through CUDA IPC only

Context::Context(int, int, int, int64_t, int64_t, const ProxyParams&, double) {
  throw std::runtime_error("internode: this build has no CUDA loopback transport for device memory (HIP build)");
}
Context::~Context() = default;
void Context::destroy() {}
uintptr_t Context::signals_host_ptr() const { return 0; }
int Context::num_fifos() const { return 0; }
std::string Context::transport_name() const { return ""; }
bool Context::transport_in_order() const { return true; }
std::string Context::nvl_ipc_handle() const { return ""; }
std::vector<uintptr_t> Context::open_nvl_peers(const std::vector<std::string>&, int) { return {}; }
std::string Context::proxy_local_info(int) { return ""; }
void Context::proxy_connect(const std::vector<std::vector<std::string>>&) {}
void Context::proxy_start() {}
void Context::proxy_stop() {}
void Context::proxy_wait_idle(double) {}
std::string Context::proxy_error() const { return ""; }
ProxyThreadStats Context::proxy_totals() const { return {}; }
uint64_t Context::max_write_bytes() const { return 0; }
int64_t Context::signal_value(uint32_t) const { return 0; }
int64_t Context::signals_short(const std::vector<std::pair<int64_t, int64_t>>&) const { return 0; }
std::vector<Context::FifoState> Context::fifo_states() const { return {}; }
std::string Context::proxy_counters() const { return ""; }
void Context::push_chunks(uintptr_t, int, int64_t, int, uintptr_t) {}
void Context::push_after_counts(uintptr_t, int, int64_t, const CountRowOffsets&, int, uintptr_t) {}
void Context::launch_push(uintptr_t, int, int64_t, const CountRowOffsets*, int, uintptr_t) {}
void Context::pack_and_push(uintptr_t, int, int64_t, const RecordJob&, uintptr_t, int, uintptr_t) {}
void Context::pack_and_push_after_counts(uintptr_t, int, int64_t, const RecordJob&, const CountRowOffsets&, uintptr_t,
                                         int, uintptr_t) {}
void Context::launch_pack_and_push(uintptr_t, int, int64_t, const RecordJob&, const CountRowOffsets*, uintptr_t, int,
                                   uintptr_t) {}
void Context::check_count_rows(const CountRowOffsets&, const std::string&) const {}
void Context::wait_node_flags(uintptr_t, int, int64_t, int32_t, int, uintptr_t, uintptr_t) {}
void Context::set_timeline(uintptr_t, int) {}
void Context::wait_signals(const std::vector<std::pair<int64_t, int64_t>>&, int, uintptr_t) {}
ArrivalGate Context::arrival_gate(uintptr_t, int, int64_t, int) { return ArrivalGate{}; }
std::string Context::error_message() const { return ""; }
ErrorWord Context::error_fields() const { return ErrorWord{}; }
void Context::clear_error() {}
void Context::abort_waits() {}
void Context::record_drain_mark(uintptr_t) {}
bool Context::drain_mark_reached() const { return true; }
void Context::copy_to_device(uintptr_t, uintptr_t, int64_t, uintptr_t) {
  throw std::runtime_error("copy_to_device: the internode path needs a CUDA build");
}

#endif

}  // namespace uccl_ep::internode
