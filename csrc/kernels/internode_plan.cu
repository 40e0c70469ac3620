// Internode planning on the GPU: the notify count row, the send plan and the wire records of a dispatch, one launch
// each (internode_plan.hpp). As torch operations they cost ~20-40 us of host time per launch and a dozen launches per
// step, while the GPU waited: ~0.8 ms of the 3.7 ms dispatch on 2x H200 (session 7 profile). The torch functions of
// uccl_ep_train/internode/plan.py remain the definition the tests hold these kernels to.
#include "kernels/internode_plan.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "uccl_ep/cuda_errors.cuh"
#include "uccl_ep/portability.cuh"

#include "kernels/arrival_gate.cuh"
#include "kernels/gpu_wait.cuh"
#include "kernels/record_copy.cuh"

namespace uccl_ep::internode {
namespace {

constexpr int kPlanThreads = 1024;

void check_launch(const char* kernel) { uccl_ep::check_launch("internode", kernel); }

// Shared-memory histograms, then one write of the int64 row. Contention is on few bins only when R is small, where
// the loops are short too (T x R items). One block.
__device__ void count_row_block(long long* __restrict__ out, const bool* __restrict__ itr, long long T, int R, int G,
                                const void* __restrict__ tpe, bool tpe_int64, int E,
                                int* bins /* [R ranks | N nodes] */) {
  const int N = R / G;
  const int nbins = R + N;
  for (int i = threadIdx.x; i < nbins; i += blockDim.x) bins[i] = 0;
  __syncthreads();
  for (long long i = threadIdx.x; i < T * R; i += blockDim.x)
    if (itr[i]) atomicAdd(&bins[i % R], 1);
  for (long long i = threadIdx.x; i < T * N; i += blockDim.x) {
    const bool* row = itr + (i / N) * R + (i % N) * G;
    bool hit = false;
    for (int g = 0; g < G; ++g) hit |= row[g];
    if (hit) atomicAdd(&bins[R + i % N], 1);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < R + N; i += blockDim.x) out[i] = bins[i];
  for (int i = threadIdx.x; i < E; i += blockDim.x)
    out[R + N + i] = tpe_int64 ? static_cast<const long long*>(tpe)[i] : static_cast<const int*>(tpe)[i];
}

struct CountRowArgs {
  long long* out;
  const bool* itr;
  long long T;
  int R, G;
  const void* tpe;
  bool tpe_int64;
  int E;
};

// Exclusive prefix of one int per thread over the block (Hillis-Steele in shared memory). Every thread of the block
// must call it.
__device__ int block_exclusive_scan(int v, int* scratch) {
  const int tid = threadIdx.x, n = blockDim.x;
  scratch[tid] = v;
  __syncthreads();
  for (int d = 1; d < n; d <<= 1) {
    const int x = tid >= d ? scratch[tid - d] : 0;
    __syncthreads();
    scratch[tid] += x;
    __syncthreads();
  }
  const int incl = scratch[tid];
  __syncthreads();  // scratch is reused by the next call
  return incl - v;
}

// Does token t go to node m (to any of its G ranks)?
__device__ __forceinline__ bool hits_node(const bool* itr, long long t, int R, int G, int m) {
  bool hit = false;
  for (int g = 0; g < G; ++g) hit |= itr[t * R + m * G + g];
  return hit;
}

// The tokens that go to nodes 0 .. m-1, counted by the block: node m's first send record when the send list runs by
// node (what count_row's node columns add up to). `scratch[0]` holds the sum. Every thread of the block must call it.
__device__ long long records_before_node(const bool* itr, long long T, int R, int G, int m, int* scratch) {
  if (threadIdx.x == 0) scratch[0] = 0;
  __syncthreads();
  int mine = 0;
  for (long long t = threadIdx.x; t < T; t += blockDim.x)
    for (int n = 0; n < m; ++n) mine += hits_node(itr, t, R, G, n);
  if (mine) atomicAdd(scratch, mine);
  __syncthreads();
  const long long before = scratch[0];
  __syncthreads();  // scratch is reused next
  return before;
}

struct SendPlanArgs {
  const bool* itr;
  long long T;
  int R, G;
  const long long* node_base;  // [N] first send record of each node; null: counted from itr (records_before_node)
  long long* dest_row_all;
  long long* hop1_token;
  long long* dest_rows;
  int* row_of;
};

// Destination node m's part of the send plan, by one block. Each thread owns a contiguous run of tokens, so a token's
// ordinal in a column is the run's prefix (one block scan per column) plus its place in the run: the same ordinals as
// the torch cumsum. Columns: the G ranks of node m (rows among our tokens there; the forwarder adds the other sources'
// rows), then "the token goes to node m" (its send record).
// `scratch`: shared memory for blockDim.x ints.
__device__ void send_plan_block(const SendPlanArgs& a, int m, int* scratch) {
  const long long T = a.T;
  const int R = a.R, G = a.G;
  const long long base = a.node_base ? a.node_base[m] : records_before_node(a.itr, T, R, G, m, scratch);
  const long long run = (T + blockDim.x - 1) / blockDim.x;
  const long long first = min(T, run * threadIdx.x), last = min(T, first + run);
  for (int g = 0; g < G; ++g) {
    const int r = m * G + g;
    int mine = 0;
    for (long long t = first; t < last; ++t) mine += a.itr[t * R + r];
    long long row = block_exclusive_scan(mine, scratch);
    for (long long t = first; t < last; ++t) a.dest_row_all[t * R + r] = a.itr[t * R + r] ? row++ : -1;
  }
  int mine = 0;
  for (long long t = first; t < last; ++t) mine += hits_node(a.itr, t, R, G, m);
  long long pos = base + block_exclusive_scan(mine, scratch);
  for (long long t = first; t < last; ++t) {
    if (!hits_node(a.itr, t, R, G, m)) {
      a.row_of[m * T + t] = -1;
      continue;
    }
    a.row_of[m * T + t] = int(pos);
    a.hop1_token[pos] = t;
    for (int g = 0; g < G; ++g) a.dest_rows[pos * G + g] = a.dest_row_all[t * R + m * G + g];  // this thread's stores
    ++pos;
  }
}

__global__ void __launch_bounds__(kPlanThreads) send_plan_kernel(SendPlanArgs a) {
  __shared__ int scratch[kPlanThreads];
  send_plan_block(a, blockIdx.x, scratch);
}

// Block 0: the count row; with `plan`, block 1 + m: node m's send plan, each node's base counted from the tokens (the
// send plan of packing during notify, one launch fewer before its wire). The dynamic shared memory holds the count
// row's bins, or a send-plan block's scratch.
__global__ void __launch_bounds__(kPlanThreads) count_row_kernel(CountRowArgs c, SendPlanArgs p, bool plan) {
  extern __shared__ int shared[];
  if (blockIdx.x == 0)
    count_row_block(c.out, c.itr, c.T, c.R, c.G, c.tpe, c.tpe_int64, c.E, shared);
  else if (plan)
    send_plan_block(p, blockIdx.x - 1, shared);
}

// A group of 32 threads per record.
__global__ void __launch_bounds__(kPackThreads) pack_records_kernel(
    char* __restrict__ send, char* __restrict__ own_dst, long long own_first, long long own_count, long long stride,
    const long long* __restrict__ hop1_token, const long long* __restrict__ dest_rows, int G, long long n,
    PackArgs args, long long src_idx_offset, long long dest_rows_offset, DeviceNodeCounts counted) {
  const int lane = threadIdx.x % kPackGroup;
  const long long groups = static_cast<long long>(gridDim.x) * (blockDim.x / kPackGroup);
  const long long group = blockIdx.x * (blockDim.x / kPackGroup) + threadIdx.x / kPackGroup;
  if (counted.own_dims) {  // our own node's records, to their block among our arrivals (forward before the counts)
    const long long* d = reinterpret_cast<const long long*>(counted.own_dims);
    if (!d[kReadGo]) return;
    own_first = d[kReadOwnFirst];
    own_count = d[kReadOwnCount];
    own_dst += d[kReadFirstRow] * stride;
    for (long long i = group; i < own_count; i += groups) {
      const long long r = own_first + i;
      write_record(own_dst + i * stride, hop1_token[r], args, src_idx_offset, dest_rows + r * G, G, dest_rows_offset,
                   lane);
    }
    return;
  }
  if (counted.counts) {  // sizes from our own count row (written earlier on this stream); n is the capacity
    const long long* c = reinterpret_cast<const long long*>(counted.counts);
    const long long total = records_by_node(c, counted.num_nodes, counted.skip_node, &own_first);
    if (total * stride > counted.send_limit) return;
    own_count = c[counted.skip_node];
    n = min(n, total);
  }
  for (long long r = group; r < n; r += groups) {
    const bool own = r >= own_first && r < own_first + own_count;
    if (own && !own_dst) continue;  // counted on the device: our own node's records are written later
    char* rec = own ? own_dst + (r - own_first) * stride : send + r * stride;
    write_record(rec, hop1_token[r], args, src_idx_offset, dest_rows + r * G, G, dest_rows_offset, lane);
  }
}

// The inverse at the receiver, one group of 32 threads per output row, a block per tile of rows. With a gate, a
// tile waits for the chunks that carry its rows and is unpacked while later chunks are still on the wire.
template <bool kGated, bool kReady>
__global__ void __launch_bounds__(kPackThreads) unpack_records_kernel(
    const char* __restrict__ src, long long src_stride, long long n, long long out_rows, PackArgs args,
    UnpackTopk topk, long long src_idx_offset, long long* __restrict__ src_idx_out, long long arrival_offset,
    long long* __restrict__ arrival_out, ArrivalGate gate, long long first_row, const long long* dims,
    OwnRowsArgs own, bool pad, RowReady ready) {
  constexpr int kTile = kPackThreads / kPackGroup;
  constexpr bool kL2 = kGated || kReady;  // the rows are written by another GPU or engine during the kernel
  __shared__ bool s_ok;
  // our own rows [own_lo, own_hi) come from our columns, at the tokens of our send list's records own_rec.. (they
  // were never packed); read before the counts, where they lie comes from the words
  long long own_lo = own.first_row, own_hi = own.first_row + own.count, own_rec = own.first_record;
  if (dims) {
    if (!dims[kReadGo]) return;  // the host unpacks after notify instead
    n = dims[kReadRows];
    first_row = own_lo = dims[kReadFirstRow];
    own_hi = own_lo + dims[kReadOwnCount];
    own_rec = dims[kReadOwnFirst];
    gate.blocks = int(dims[kReadBlocks]);
    if (!pad) out_rows = n;
  }
  if constexpr (kGated) reader_begins(gate);
  if (kGated && blockIdx.x == 0) {  // the watcher (arrival_gate.hpp); the tiles go to the other blocks
    gate_watch(gate);
    return;
  }
  const long long block = blockIdx.x - (kGated ? 1 : 0), grid = gridDim.x - (kGated ? 1 : 0);
  const int lane = threadIdx.x % kPackGroup;
  // The tiles in reading order: rows [first_row, n), then [0, first_row), then the padding rows [n, out_rows). The
  // grid sweeps them in that order, so a gated reader given the first row of rows that are already in (the own
  // node's records) reads those first instead of after every row before them has landed.
  const long long tiles_a = (n - first_row + kTile - 1) / kTile, tiles_b = (first_row + kTile - 1) / kTile;
  const long long tiles = tiles_a + tiles_b + (out_rows - n + kTile - 1) / kTile;
  for (long long t = block; t < tiles; t += grid) {
    long long lo, end;
    if (t < tiles_a) {
      lo = first_row + t * kTile;
      end = lo + kTile < n ? lo + kTile : n;
    } else if (t < tiles_a + tiles_b) {
      lo = (t - tiles_a) * kTile;
      end = lo + kTile < first_row ? lo + kTile : first_row;
    } else {
      lo = n + (t - tiles_a - tiles_b) * kTile;
      end = lo + kTile < out_rows ? lo + kTile : out_rows;
    }
    if constexpr (kGated) {
      if (lo < n && !block_gate_rows(gate, lo, end - 1, &s_ok)) return;
    }
    const long long r = lo + threadIdx.x / kPackGroup;
    if (r >= end) continue;
    const bool real = r < n, own_row = r >= own_lo && r < own_hi;
    // every thread of the row's group acquires the row's ready word itself (the forwarder released it after its
    // stores), so each one's reads of the row come after; no block-wide sync follows, so a group may leave alone. Any
    // thread that gives up reports (the first one wins, and the rank stops): a row some threads copied and others did
    // not never passes for written.
    if (kReady && real &&
        !wait_flag(ready.words + r, ready.epoch, ready.timeout_ns, ready.err, ready.stop, ready.rank, ready.phase, -1,
                   int(r), kErrRowNotReady))
      return;
    const long long token = own_row ? own.tokens[own_rec + r - own_lo] : 0;
    const char* row = src + r * src_stride;
    // byte `off` of row r's record: in the arrivals, or (our own) in the column holding it, at the row's token
    const auto field = [&](long long off) -> const char* {
      return own_row ? own.field(token, off, row + off) : row + off;
    };
    for (int c = 0; c < args.num_columns; ++c) {
      const PackColumn& col = args.columns[c];
      char* dst = reinterpret_cast<char*>(col.rows) + r * col.bytes;
      if (!real) {
        for (long long b = lane; b < col.bytes; b += kPackGroup) dst[b] = 0;
        continue;
      }
      copy_row<kL2>(dst, field(col.offset), col.bytes, lane);
    }
    for (int k = lane; k < topk.num_topk; k += kPackGroup) {
      long long id = -1;
      float w = 0.0f;
      if (real) {
        const long long g = load_word<kL2>(reinterpret_cast<const long long*>(field(topk.ids_offset)) + k);
        if (g >= topk.expert_lo && g < topk.expert_lo + topk.experts_per_rank) {
          id = g - topk.expert_lo;
          if (topk.weights_out)
            w = load_word<kL2>(reinterpret_cast<const float*>(field(topk.weights_offset)) + k);
        }
      }
      if (topk.ids_out) reinterpret_cast<long long*>(topk.ids_out)[r * topk.num_topk + k] = id;
      if (topk.weights_out) reinterpret_cast<float*>(topk.weights_out)[r * topk.num_topk + k] = w;
    }
    if (real && lane == 0) {
      if (src_idx_out)
        src_idx_out[r] = own_row ? token : load_word<kL2>(reinterpret_cast<const int*>(row + src_idx_offset));
      if (arrival_out)
        arrival_out[r] = arrival_offset < 0 ? r : load_word<kL2>(reinterpret_cast<const int*>(row + arrival_offset));
    }
  }
  if constexpr (kGated) reader_ends(gate);
}


// gate_from_count_rows (internode_plan.hpp): one thread; the rows are small (ranks + nodes words read per rank).
struct ReadBases {
  long long v[kReadMaxCounters];
  const long long* table;  // non-null: the bases are here (more than kReadMaxCounters of them), not in v
  __device__ long long at(int i) const { return table ? table[i] : v[i]; }
};

// A gate-table row (arrival_gate.cuh): the block of `records` from source node `source` at our arrival row `first`,
// its lanes' counters from source * lanes on, their bases before this call; the senders' FIFO hint is our node.
__device__ void write_gate_row(long long* row, long long first, long long records, int source, int our_node, int lanes,
                               const ReadBases& bases) {
  row[kGateFirstRow] = first;
  row[kGateRecords] = records;
  row[kGateSlot] = static_cast<long long>(source) * lanes;
  row[kGateHint] = our_node;
  for (int f = 0; f < lanes; ++f) row[kGateBase + f] = bases.at(source * lanes + f);
}

__global__ void gate_from_count_rows_kernel(const long long* rows, long long row_words, int R, int rank, int lanes,
                                            ReadBases bases, long long stride, long long send_limit,
                                            long long receive_bytes, long long capacity_rows, long long* table,
                                            long long* dims) {
  const long long* own = rows + rank * row_words;
  long long sent = 0, own_first = 0;
  for (int m = 0; m < R; ++m) {  // our records by node (= rank: one GPU per node), in send-list order
    if (m < rank) own_first += own[R + m];
    sent += own[R + m];
  }
  long long n = 0, first_row = 0;
  int blocks = 0;
  const int width = kGateBase + lanes;
  for (int s = 0; s < R; ++s) {  // arrivals: blocks by source rank, back to back
    const long long c = rows[s * row_words + rank];
    if (s == rank) first_row = n;
    if (s != rank && c > 0)  // (one GPU per node: the source node is the source rank, our node our rank)
      write_gate_row(table + static_cast<long long>(blocks++) * width, n, c, s, rank, lanes, bases);
    n += c;
  }
  dims[kReadGo] = sent * stride <= send_limit && n * stride <= receive_bytes && n <= capacity_rows;
  dims[kReadRows] = n;
  dims[kReadFirstRow] = first_row;
  dims[kReadBlocks] = blocks;
  dims[kReadOwnFirst] = own_first;
  dims[kReadOwnCount] = own[rank];
}

__global__ void forward_from_count_rows_kernel(const long long* rows, long long row_words, int R, int G, int rank,
                                               int lanes, ReadBases bases, long long stride, long long final_bytes,
                                               long long send_limit, long long receive_bytes, long long final_limit,
                                               long long capacity_rows, long long ready_rows, long long* table,
                                               long long* blocks, long long* limits, long long* dims) {
  const int N = R / G, node = rank / G, local = rank % G;
  const long long* own = rows + rank * row_words;
  long long sent = 0, own_first = 0;
  for (int m = 0; m < N; ++m) {  // our records by node, in send-list order
    if (m < node) own_first += own[R + m];
    sent += own[R + m];
  }
  for (int g = 0; g < G; ++g) limits[g] = 0;
  long long a = 0, own_row = 0;
  int gates = 0;
  const int width = kGateBase + lanes;
  for (int s = 0; s < R; ++s) {  // limits run over the sources: before s, the rows the ranks before it fill
    const long long* row = rows + s * row_words;
    if (s % G == local) {  // source node s / G's block of our arrivals (its rank with our local index sends them)
      const int n = s / G;
      const long long c = row[R + node];
      long long* b = blocks + static_cast<long long>(n) * (1 + G);
      for (int g = 0; g < G; ++g) b[1 + g] = limits[g];
      if (n == node) own_row = a;
      if (n != node && c > 0)
        write_gate_row(table + static_cast<long long>(gates++) * width, a, c, n, node, lanes, bases);
      a += c;
      b[0] = a;
    }
    for (int g = 0; g < G; ++g) limits[g] += row[node * G + g];
  }
  bool fits = true, marked = true;  // marked: every final row of the node has a ready word (0: none are used)
  for (int g = 0; g < G; ++g) {
    fits = fits && limits[g] * final_bytes <= final_limit;
    marked = marked && (ready_rows == 0 || limits[g] <= ready_rows);
  }
  const bool go = sent * stride <= send_limit && a * stride <= receive_bytes && fits;
  for (int i = 0; i < kForwardDims; ++i) dims[i] = 0;
  dims[kReadGo] = go;
  dims[kReadRows] = a;
  dims[kReadFirstRow] = own_row;
  dims[kReadBlocks] = gates;
  dims[kReadOwnFirst] = own_first;
  dims[kReadOwnCount] = own[R + node];
  dims[kReadDims + kReadGo] = go && limits[local] <= capacity_rows && marked;
  dims[kReadDims + kReadRows] = limits[local];
}

}  // namespace

namespace {
SendPlanArgs send_plan_args(uintptr_t is_token_in_rank, int64_t num_tokens, int num_ranks, int ranks_per_node,
                            uintptr_t node_base, const SendPlanTables& t) {
  // (hop1_token and dest_rows may be empty, hence null: no token is sent anywhere)
  if (!t.dest_row_all || !t.row_of) throw std::invalid_argument("send_plan: dest_row_all and row_of need an address");
  return SendPlanArgs{reinterpret_cast<const bool*>(is_token_in_rank), num_tokens, num_ranks, ranks_per_node,
                      reinterpret_cast<const long long*>(node_base),
                      reinterpret_cast<long long*>(t.dest_row_all), reinterpret_cast<long long*>(t.hop1_token),
                      reinterpret_cast<long long*>(t.dest_rows), reinterpret_cast<int*>(t.row_of)};
}
}  // namespace

void count_row(uintptr_t out, uintptr_t is_token_in_rank, int64_t num_tokens, int num_ranks, int ranks_per_node,
               uintptr_t tokens_per_expert, bool tpe_int64, int num_experts, uintptr_t stream,
               const SendPlanTables* plan) {
  if (num_ranks <= 0 || ranks_per_node <= 0 || num_ranks % ranks_per_node)
    throw std::invalid_argument("count_row: ranks_per_node must divide num_ranks");
  if (num_experts > 0 && (!tokens_per_expert || num_experts % num_ranks))
    throw std::invalid_argument("count_row: the experts must be given and divisible by the ranks");
  const int64_t bins = num_ranks + num_ranks / ranks_per_node;
  if (bins > kCountRowMaxBins)
    throw std::invalid_argument("count_row: " + std::to_string(bins) + " bins exceed " +
                                std::to_string(kCountRowMaxBins) + " (use internode.plan.local_count_row)");
  if (num_tokens > 0 && !is_token_in_rank) throw std::invalid_argument("count_row: null is_token_in_rank");
  const CountRowArgs c{reinterpret_cast<long long*>(out), reinterpret_cast<const bool*>(is_token_in_rank), num_tokens,
                       num_ranks, ranks_per_node, reinterpret_cast<const void*>(tokens_per_expert), tpe_int64,
                       num_experts};
  const bool with_plan = plan && num_tokens > 0;
  const SendPlanArgs p = with_plan ? send_plan_args(is_token_in_rank, num_tokens, num_ranks, ranks_per_node, 0, *plan)
                                   : SendPlanArgs{};
  const int blocks = 1 + (with_plan ? num_ranks / ranks_per_node : 0);
  const size_t shared = size_t(with_plan ? std::max<int64_t>(bins, kPlanThreads) : bins) * sizeof(int);
  count_row_kernel<<<blocks, kPlanThreads, shared, reinterpret_cast<cudaStream_t>(stream)>>>(c, p, with_plan);
  check_launch("count_row");
}

void send_plan(uintptr_t is_token_in_rank, int64_t num_tokens, int num_ranks, int ranks_per_node, uintptr_t node_base,
               const SendPlanTables& tables, uintptr_t stream) {
  if (num_ranks <= 0 || ranks_per_node <= 0 || num_ranks % ranks_per_node)
    throw std::invalid_argument("send_plan: ranks_per_node must divide num_ranks");
  if (num_tokens <= 0) return;
  if (!is_token_in_rank) throw std::invalid_argument("send_plan: null is_token_in_rank");
  send_plan_kernel<<<num_ranks / ranks_per_node, kPlanThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      send_plan_args(is_token_in_rank, num_tokens, num_ranks, ranks_per_node, node_base, tables));
  check_launch("send_plan");
}

void pack_records(uintptr_t send, uintptr_t own_dst, int64_t own_first, int64_t own_count, int64_t stride,
                  uintptr_t hop1_token, uintptr_t dest_rows, int ranks_per_node, int64_t num_records,
                  const std::vector<PackColumn>& columns, int64_t src_idx_offset, int64_t dest_rows_offset,
                  uintptr_t stream, const DeviceNodeCounts& counted) {
  if (counted.own_dims && (counted.counts || send || !own_dst || own_first || own_count))
    throw std::invalid_argument("pack_records: our own records placed from the words (own_dims) go to own_dst only, "
                                "their range from the words");
  if (counted.counts) {
    if (counted.num_nodes < 1 || counted.skip_node < 0 || counted.skip_node >= counted.num_nodes)
      throw std::invalid_argument("pack_records: skip_node must name one of the num_nodes nodes");
    if (counted.send_limit < 0) throw std::invalid_argument("pack_records: negative send_limit");
    if (own_dst || own_first || own_count)
      throw std::invalid_argument("pack_records: records counted on the device skip our own node's (no own_dst)");
  }
  if (num_records <= 0) return;
  if (columns.size() > size_t(kMaxPackColumns))
    throw std::invalid_argument("pack_records: at most " + std::to_string(kMaxPackColumns) + " columns");
  if (src_idx_offset % 4 || dest_rows_offset % 4 || stride % 16)
    throw std::invalid_argument("pack_records: misaligned record layout");
  if (own_count > 0 && !own_dst) throw std::invalid_argument("pack_records: own records without a destination");
  PackArgs args{};
  args.num_columns = int(columns.size());
  for (size_t i = 0; i < columns.size(); ++i) {
    if (columns[i].offset < 0 || columns[i].offset + columns[i].bytes > src_idx_offset)
      throw std::invalid_argument("pack_records: column " + std::to_string(i) + " overlaps the record's index fields");
    args.columns[i] = columns[i];
  }
  const int per_block = kPackThreads / kPackGroup;
  const int blocks = int(std::min<int64_t>((num_records + per_block - 1) / per_block, 1024));
  pack_records_kernel<<<blocks, kPackThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<char*>(send), reinterpret_cast<char*>(own_dst), own_first, own_count, stride,
      reinterpret_cast<const long long*>(hop1_token), reinterpret_cast<const long long*>(dest_rows), ranks_per_node,
      num_records, args, src_idx_offset, dest_rows_offset, counted);
  check_launch("pack_records");
}

void unpack_records(uintptr_t src, int64_t src_stride, int64_t num_rows, int64_t out_rows,
                    const std::vector<PackColumn>& columns, const UnpackTopk& topk, int64_t src_idx_offset,
                    uintptr_t src_idx_out, int64_t arrival_offset, uintptr_t arrival_out, uintptr_t stream,
                    const ArrivalGate* gate, int64_t first_row, const ReadBeforeCounts& before,
                    const OwnRows& own, const RowReady& ready) {
  if (out_rows < num_rows) throw std::invalid_argument("unpack_records: fewer output rows than rows");
  if (ready.words && (gate || own.tokens || ready.epoch < 1))
    throw std::invalid_argument("unpack_records: ready words (the unpack beside the dispatch forward) need an epoch "
                                ">= 1, no gate and no own rows from the columns");
  if (before.dims && (first_row || bool(own.tokens) == (arrival_offset >= 0)))
    throw std::invalid_argument("unpack_records: read before the counts takes no first_row (it comes from the device), "
                                "and our own rows' tokens with one GPU per node (arrival = row), none with several "
                                "(the final rows, after the forward)");
  if (own.tokens && arrival_offset >= 0)
    throw std::invalid_argument("unpack_records: own rows from the columns only with one GPU per node (arrival = row)");
  if (own.tokens && !before.dims && own.first_row + own.count > num_rows)
    throw std::invalid_argument("unpack_records: our own rows end past the rows");
  // every field the reader takes from a record must lie in one of our columns (copy_row takes any alignment)
  std::vector<OwnField> fields{{topk.ids_offset, topk.num_topk > 0 ? 8 * int64_t(topk.num_topk) : 0, 8},
                               {topk.weights_offset, topk.weights_out && topk.num_topk > 0 ? 4 * int64_t(topk.num_topk)
                                                                                          : 0, 4}};
  for (const PackColumn& c : columns) fields.push_back({c.offset, c.bytes, 1});
  const OwnRowsArgs own_args = own_rows_args(own, fields, "unpack_records");
  if (first_row < 0 || first_row > num_rows)
    throw std::invalid_argument("unpack_records: first_row " + std::to_string(first_row) + " outside 0.." +
                                std::to_string(num_rows));
  if (out_rows <= 0) return;
  if (num_rows > 0 && !src) throw std::invalid_argument("unpack_records: null source");
  if (columns.size() > size_t(kMaxPackColumns))
    throw std::invalid_argument("unpack_records: at most " + std::to_string(kMaxPackColumns) + " columns");
  if (topk.num_topk > 0 && topk.weights_out && !topk.ids_out)
    throw std::invalid_argument("unpack_records: the weights are masked by the ids: give ids_out");
  if (src_idx_offset % 4 || (arrival_offset >= 0 && arrival_offset % 4) || topk.ids_offset % 8 ||
      topk.weights_offset % 4)
    throw std::invalid_argument("unpack_records: misaligned record layout");
  PackArgs args{};
  args.num_columns = int(columns.size());
  for (size_t i = 0; i < columns.size(); ++i) {
    if (!columns[i].rows || columns[i].bytes < 0 || columns[i].offset < 0)
      throw std::invalid_argument("unpack_records: column " + std::to_string(i) + " has no output or a bad range");
    args.columns[i] = columns[i];
  }
  const int per_block = kPackThreads / kPackGroup;
  int blocks = gated_grid(int(std::min<int64_t>((out_rows + per_block - 1) / per_block, 1024)), gate);
  if (ready.words && ready.max_grid > 0 && blocks > ready.max_grid) blocks = ready.max_grid;
  check_gate(gate, "unpack_records");
  auto launch = [&](auto kernel) {
    kernel<<<blocks + (gate ? 1 : 0), kPackThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        reinterpret_cast<const char*>(src), src_stride, num_rows, out_rows, args, topk, src_idx_offset,
        reinterpret_cast<long long*>(src_idx_out), arrival_offset, reinterpret_cast<long long*>(arrival_out),
        gate ? *gate : ArrivalGate{}, first_row, reinterpret_cast<const long long*>(before.dims), own_args,
        before.pad, ready);
  };
  if (gate)
    launch(unpack_records_kernel<true, false>);
  else if (ready.words)
    launch(unpack_records_kernel<false, true>);
  else
    launch(unpack_records_kernel<false, false>);
  check_launch("unpack_records");
}

namespace {

// The counter bases of gate_from_count_rows / forward_from_count_rows: `want` of them (sources x lanes), by value
// (at most kReadMaxCounters) or, with counter_bases empty, in the device table counter_bases_table.
ReadBases read_bases(const char* what, const std::vector<int64_t>& counter_bases, uintptr_t counter_bases_table,
                     size_t want, const char* sources) {
  ReadBases bases{};
  if (counter_bases_table) {
    if (!counter_bases.empty())
      throw std::invalid_argument(std::string(what) + ": give the counter bases by value or in counter_bases_table, "
                                  "not both");
    bases.table = reinterpret_cast<const long long*>(counter_bases_table);
    return bases;
  }
  if (counter_bases.size() != want || counter_bases.size() > size_t(kReadMaxCounters))
    throw std::invalid_argument(std::string(what) + ": give " + sources + " x lanes counter bases, at most " +
                                std::to_string(kReadMaxCounters) + " by value (more: counter_bases_table), got " +
                                std::to_string(counter_bases.size()));
  for (size_t i = 0; i < counter_bases.size(); ++i) bases.v[i] = counter_bases[i];
  return bases;
}

}  // namespace

void gate_from_count_rows(uintptr_t count_rows, int64_t row_words, int num_ranks, int rank, int num_lanes,
                          const std::vector<int64_t>& counter_bases, int64_t stride, int64_t send_limit,
                          int64_t receive_bytes, int64_t capacity_rows, uintptr_t table_out, uintptr_t dims_out,
                          uintptr_t stream, uintptr_t counter_bases_table) {
  if (num_ranks < 1 || rank < 0 || rank >= num_ranks || num_lanes < 1)
    throw std::invalid_argument("gate_from_count_rows: rank outside 0.." + std::to_string(num_ranks - 1) +
                                " or no lane");
  if (row_words < 2 * int64_t(num_ranks))
    throw std::invalid_argument("gate_from_count_rows: a count row has at least ranks + nodes words (one GPU per "
                                "node: 2 x ranks)");
  if (!count_rows || !table_out || !dims_out)
    throw std::invalid_argument("gate_from_count_rows: null count rows, table or dims");
  const ReadBases bases = read_bases("gate_from_count_rows", counter_bases, counter_bases_table,
                                     size_t(num_ranks) * size_t(num_lanes), "ranks");
  if (stride <= 0 || capacity_rows < 0) throw std::invalid_argument("gate_from_count_rows: bad stride or capacity");
  gate_from_count_rows_kernel<<<1, 1, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const long long*>(count_rows), row_words, num_ranks, rank, num_lanes,
      bases, stride, send_limit, receive_bytes, capacity_rows,
      reinterpret_cast<long long*>(table_out), reinterpret_cast<long long*>(dims_out));
  check_launch("gate_from_count_rows");
}

void forward_from_count_rows(uintptr_t count_rows, int64_t row_words, int num_ranks, int ranks_per_node, int rank,
                             int num_lanes, const std::vector<int64_t>& counter_bases, int64_t stride,
                             int64_t final_bytes, int64_t send_limit, int64_t receive_bytes, int64_t final_limit,
                             int64_t capacity_rows, int64_t ready_rows, uintptr_t table_out, uintptr_t blocks_out,
                             uintptr_t limits_out, uintptr_t dims_out, uintptr_t stream,
                             uintptr_t counter_bases_table) {
  if (ranks_per_node < 2 || num_ranks % ranks_per_node || rank < 0 || rank >= num_ranks || num_lanes < 1)
    throw std::invalid_argument("forward_from_count_rows: several GPUs per node dividing the ranks, a rank in 0.." +
                                std::to_string(num_ranks - 1) + " and a lane");
  const int nodes = num_ranks / ranks_per_node;
  if (row_words < int64_t(num_ranks) + nodes)
    throw std::invalid_argument("forward_from_count_rows: a count row has at least ranks + nodes words");
  if (!count_rows || !table_out || !blocks_out || !limits_out || !dims_out)
    throw std::invalid_argument("forward_from_count_rows: null count rows, table, blocks, limits or dims");
  const ReadBases bases = read_bases("forward_from_count_rows", counter_bases, counter_bases_table,
                                     size_t(nodes) * size_t(num_lanes), "nodes");
  if (stride <= 0 || final_bytes <= 0 || capacity_rows < 0 || ready_rows < 0)
    throw std::invalid_argument("forward_from_count_rows: bad stride, final row bytes, capacity or ready rows");
  forward_from_count_rows_kernel<<<1, 1, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const long long*>(count_rows), row_words, num_ranks, ranks_per_node, rank, num_lanes, bases,
      stride, final_bytes, send_limit, receive_bytes, final_limit, capacity_rows, ready_rows,
      reinterpret_cast<long long*>(table_out), reinterpret_cast<long long*>(blocks_out),
      reinterpret_cast<long long*>(limits_out), reinterpret_cast<long long*>(dims_out));
  check_launch("forward_from_count_rows");
}

namespace {

__global__ void gather_rows_by_arrival_kernel(int* out, int targets, long long max_arrivals,
                                              const long long* row_ends, int num_sources, const long long* arrival,
                                              long long num_rows, ErrorWord* err, StopFlag stop, int rank,
                                              int phase) {
  for (long long r = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; r < num_rows;
       r += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int lo = int(first_end_past(row_ends, 1, num_sources, r));  // r's source (num_sources: past them all)
    const int f = lo % targets;
    const long long a = arrival[r];
    if (lo >= num_sources || a < 0 || a >= max_arrivals) {
      report(err, stop, kErrScatterRange, rank, f, int(r), phase, a, max_arrivals);
      continue;
    }
    out[f * max_arrivals + a] = int(r);
  }
}

__global__ void forward_sum_rows_kernel(int* out, int targets, long long num_arrivals, long long rows_per_block,
                                        const long long* fwd_dest_rows) {
  const long long n = num_arrivals * targets;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long j = i / num_arrivals, a = i % num_arrivals;
    out[i] = fwd_dest_rows[a * targets + j] >= 0 ? int(j * rows_per_block + a) : -1;
  }
}

constexpr int kTableThreads = 256;

int table_blocks(long long n) {
  return int(std::max<long long>(1, std::min<long long>((n + kTableThreads - 1) / kTableThreads, 1024)));
}

}  // namespace

void gather_rows_by_arrival(uintptr_t out, int targets, int64_t max_arrivals, uintptr_t row_ends, int num_sources,
                            uintptr_t arrival, int64_t num_rows, uintptr_t stream, uintptr_t err,
                            uintptr_t stop_flag, int stop_generation, int rank, int phase) {
  if (targets < 1 || max_arrivals < 0 || num_rows < 0 || num_sources < 0)
    throw std::invalid_argument("gather_rows_by_arrival: needs targets >= 1 and no negative size");
  if (max_arrivals * targets > (int64_t(1) << 31) || num_rows > (int64_t(1) << 31))
    throw std::invalid_argument("gather_rows_by_arrival: rows are int32: at most 2^31 of them");
  if (!out || (num_rows > 0 && (!row_ends || !arrival || num_sources < 1)))
    throw std::invalid_argument("gather_rows_by_arrival: null pointer (or rows without sources)");
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (max_arrivals > 0)
    throw_on_cuda_error(
        cudaMemsetAsync(reinterpret_cast<void*>(out), 0xff, size_t(4) * size_t(targets) * size_t(max_arrivals), s),
        "internode", "gather_rows_by_arrival memset");
  if (num_rows == 0) return;
  gather_rows_by_arrival_kernel<<<table_blocks(num_rows), kTableThreads, 0, s>>>(
      reinterpret_cast<int*>(out), targets, max_arrivals, reinterpret_cast<const long long*>(row_ends), num_sources,
      reinterpret_cast<const long long*>(arrival), num_rows, reinterpret_cast<ErrorWord*>(err),
      StopFlag{reinterpret_cast<int32_t*>(stop_flag), stop_generation}, rank, phase);
  check_launch("gather_rows_by_arrival");
}

void forward_sum_rows(uintptr_t out, int targets, int64_t num_arrivals, int64_t rows_per_block,
                      uintptr_t fwd_dest_rows, uintptr_t stream) {
  if (targets < 1 || num_arrivals < 0 || num_arrivals > rows_per_block)
    throw std::invalid_argument("forward_sum_rows: needs targets >= 1 and 0 <= arrivals <= rows_per_block");
  if (rows_per_block * targets > (int64_t(1) << 31))
    throw std::invalid_argument("forward_sum_rows: rows are int32: at most 2^31 of them");
  if (num_arrivals == 0) return;
  if (!out || !fwd_dest_rows) throw std::invalid_argument("forward_sum_rows: null pointer");
  forward_sum_rows_kernel<<<table_blocks(num_arrivals * targets), kTableThreads, 0,
                            reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<int*>(out), targets, num_arrivals, rows_per_block,
      reinterpret_cast<const long long*>(fwd_dest_rows));
  check_launch("forward_sum_rows");
}

}  // namespace uccl_ep::internode
