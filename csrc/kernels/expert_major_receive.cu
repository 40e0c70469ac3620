// The internode reader of an expert-major receive (expert_major_receive.hpp): each final row's payload goes straight to
// the expert-major rows of its local experts while later rows are still on the wire, so no copy of the whole receive
// follows the hop (docs/internode.md, "Expert-major rows in the reader").
#include "kernels/expert_major_receive.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "uccl_ep/block_lists.cuh"
#include "uccl_ep/cuda_errors.cuh"
#include "uccl_ep/portability.cuh"

#include "kernels/arrival_gate.cuh"
#include "kernels/expert_major.hpp"  // kMaxTopk
#include "kernels/gpu_wait.cuh"      // wait_flag
#include "kernels/record_copy.cuh"   // load_word

namespace uccl_ep::internode {
namespace {

// Blocks of 1024 threads, not unpack_records' 256: where ranks share a GPU the gated readers are held to a few blocks
// (Context::set_spin_blocks), and at 256 threads those kept too few rows in flight to follow the wire (~470 us behind
// the last chunk under MPS, session 29). How many warps share a row (expert_major_receive picks):
// - 4 with a grid of its own, a block step reading 8 rows: each row goes to up to top-k rows and one SM's stores bound
//   a step, so the rows of the hop's last chunk must spread over many SMs (at 32 rows a step the reader ended ~35 us
//   after the last chunk landed on 2x H200, against ~10 for unpack_records);
// - 1 in a grid held to a few blocks, a step reading 32 rows: there each block's throughput bounds the reader, and
//   a warp to a row finds each row's expert-major rows once (a reader launched late behind its hop, under MPS, ended
//   up to ~140 us after the last chunk with 4, ~40-60 with 1).
constexpr int kReceiveThreads = 1024;
constexpr int kWarps = kReceiveThreads / kWarpSize;
using expert_major::kMaxTopk;

// The source of final row r: the last s with source_rows[s] <= r (a source without rows shares its start with the
// next one, which is the one holding r).
__device__ __forceinline__ int source_of(const long long* source_rows, int num_sources, long long r) {
  int lo = 0, hi = num_sources - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (source_rows[mid] <= r) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Final row r: our own rows [lo, hi) are records rec.. of our send list, never packed (OwnRowsArgs' place, or the
// device words'); the others are in the arrivals.
struct RowPlace {
  long long lo, hi, rec;
  __device__ __forceinline__ bool own(long long r) const { return r >= lo && r < hi; }
};

// Byte `off` of row r's record: in the arrivals, or (our own rows) in the column holding it.
__device__ __forceinline__ const char* row_field(const ExpertMajorReceive& a, const OwnRowsArgs& own,
                                                 const RowPlace& at, long long r, long long off) {
  const char* row = reinterpret_cast<const char*>(a.src) + r * a.src_stride + off;
  return at.own(r) ? own.field(own.tokens[at.rec + r - at.lo], off, row) : row;
}

// Row r by one warp, all but its payload: its expert-major rows (from the record's ids and ranks, or the handle's
// slot_of) into `slots`; returns how many. The row's `writer` warp also writes the plan's columns at each of them
// when they are made here, slot_of, the scales, src_idx and arrival (the other warps of the row find the same rows).
template <bool kL2>
__device__ int place_row(const ExpertMajorReceive& a, const OwnRowsArgs& own, const RowPlace& at, long long r,
                         int lane, int* scratch, int* slots, bool writer) {
  const char* row = reinterpret_cast<const char*>(a.src) + r * a.src_stride;
  int* slot_of = reinterpret_cast<int*>(a.slot_of) + r * a.topk;
  const int s = a.slots_given ? 0 : source_of(reinterpret_cast<const long long*>(a.source_rows), a.num_sources, r);
  const int m = warp_compact<kWarps>(a.topk, lane, scratch, slots, [&](int k) -> int {
    if (a.slots_given) return slot_of[k];
    int p = -1;
    const long long e =
        load_word<kL2>(reinterpret_cast<const long long*>(row_field(a, own, at, r, a.ids_offset)) + k) -
        a.expert_lo;
    if (e >= 0 && e < a.num_local_experts) {
      const int rank = load_word<kL2>(reinterpret_cast<const int*>(row_field(a, own, at, r, a.ranks_offset)) + k);
      const long long* place = reinterpret_cast<const long long*>(a.places) + (s * a.num_local_experts + e) * 2;
      // a rank past the source's count (counts that do not match the ids) is dropped, never written out of bounds
      if (rank >= 0 && rank < place[1] && place[0] + rank < a.expert_rows) {
        const long long q = place[0] + rank;
        p = static_cast<int>(q);
        if (!writer) return p;
        reinterpret_cast<long long*>(a.em_token)[q] = r;
        reinterpret_cast<long long*>(a.em_slot)[q] = k;
        reinterpret_cast<long long*>(a.em_expert)[q] = e;
        if (a.em_weights)
          reinterpret_cast<float*>(a.em_weights)[q] =
              load_word<kL2>(reinterpret_cast<const float*>(row_field(a, own, at, r, a.weights_offset)) + k);
      }
    }
    if (writer) slot_of[k] = p;
    return p;
  });
  if (!writer) return m;
  float* out_scales = reinterpret_cast<float*>(a.out_scales);
  const float* scales =
      out_scales != nullptr ? reinterpret_cast<const float*>(row_field(a, own, at, r, a.scales_offset)) : nullptr;
  for (int sc = lane; out_scales != nullptr && sc < a.num_scales; sc += kWarpSize) {
    const float v = load_word<kL2>(scales + sc);
    for (int j = 0; j < m; ++j) out_scales[static_cast<long long>(slots[j]) * a.num_scales + sc] = v;
  }
  if (lane == 0) {
    if (a.src_idx_out)
      reinterpret_cast<long long*>(a.src_idx_out)[r] =
          at.own(r) ? own.tokens[at.rec + r - at.lo]
                    : load_word<kL2>(reinterpret_cast<const int*>(row + a.src_idx_offset));
    if (a.arrival_out)
      reinterpret_cast<long long*>(a.arrival_out)[r] =
          a.arrival_offset < 0 ? r : load_word<kL2>(reinterpret_cast<const int*>(row + a.arrival_offset));
  }
  return m;
}

// A tile of kWarps / warps_per_row rows per block step; with a gate, block 0 watches the counters (arrival_gate.cuh)
// and each tile waits for the chunks that carry it. Tiles run from first_row to the end, then from 0, as
// unpack_records'. The warps of a row each find its expert-major rows (no block barrier between finding and copying)
// and copy a share of its payload to them.
template <bool kGated, bool kReady>
__global__ void __launch_bounds__(kReceiveThreads) expert_major_receive_kernel(ExpertMajorReceive a, OwnRowsArgs own,
                                                                            ArrivalGate gate, long long first_row,
                                                                            int warps_per_row, RowReady ready) {
  constexpr bool kL2 = kGated || kReady;  // the rows are written by another GPU or engine during the kernel
  __shared__ int s_scratch[kWarps][kMaxTopk];
  __shared__ int s_slots[kWarps][kMaxTopk];
  __shared__ int s_ready[kWarps];
  __shared__ bool s_ok;
  const long long* dims = reinterpret_cast<const long long*>(a.dims);
  if (dims) {
    if (!dims[kReadGo]) return;  // the host reads after notify instead
    gate.blocks = int(dims[kReadBlocks]);
  }
  if constexpr (kGated) reader_begins(gate);
  if (kGated && blockIdx.x == 0) {
    gate_watch(gate);
    return;
  }
  const long long block = blockIdx.x - (kGated ? 1 : 0), grid = gridDim.x - (kGated ? 1 : 0);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  long long n = a.num_rows;
  RowPlace at{own.first_row, own.first_row + own.count, own.first_record};
  if (dims) {  // read before the counts: the words say where (the watcher above took its gate's rows from them)
    n = dims[kReadRows];
    first_row = at.lo = dims[kReadFirstRow];
    at.hi = at.lo + dims[kReadOwnCount];
    at.rec = dims[kReadOwnFirst];
  }
  const int units = static_cast<int>(a.x_bytes / 16);
  int4* out_x = reinterpret_cast<int4*>(a.out_x);
  const int tile_rows = kWarps / warps_per_row, tile_row = warp / warps_per_row, part = warp % warps_per_row;
  const int begin = part * units / warps_per_row, stop = (part + 1) * units / warps_per_row;
  const long long tiles_a = (n - first_row + tile_rows - 1) / tile_rows;
  const long long tiles_b = (first_row + tile_rows - 1) / tile_rows;
  for (long long t = block; t < tiles_a + tiles_b; t += grid) {
    long long lo, end;
    if (t < tiles_a) {
      lo = first_row + t * tile_rows;
      end = lo + tile_rows < n ? lo + tile_rows : n;
    } else {
      lo = (t - tiles_a) * tile_rows;
      end = lo + tile_rows < first_row ? lo + tile_rows : first_row;
    }
    if constexpr (kGated) {
      if (!block_gate_rows(gate, lo, end - 1, &s_ok)) return;
    }
    const long long r = lo + tile_row;
    if (r < end) {
      if constexpr (kReady) {
        // lane 0 acquires the row's ready word (the forwarder released it after its stores) and the warp barrier
        // orders the other lanes' reads after it; the warp leaves as one, since place_row's compaction syncs the
        // warp. A lane that gives up has reported (the first report wins, and the rank stops).
        if (lane == 0)
          s_ready[warp] = wait_flag(ready.words + r, ready.epoch, ready.timeout_ns, ready.err, ready.stop, ready.rank,
                                    ready.phase, -1, int(r), kErrRowNotReady);
        warp_sync();
        if (!s_ready[warp]) return;
      }
      int* slots = s_slots[warp];
      const int m = place_row<kL2>(a, own, at, r, lane, s_scratch[warp], slots, part == 0);
      const int4* src = reinterpret_cast<const int4*>(row_field(a, own, at, r, a.x_offset)) + begin;
      warp_copy_v4_to_each<4, kL2>(src, stop - begin, lane, m,
                                   [&](int j) { return out_x + static_cast<long long>(slots[j]) * units + begin; });
      warp_sync();  // the warp's slots are rewritten by its next row
    }
  }
  if constexpr (kGated) reader_ends(gate);
}

// expert_major_places (expert_major_receive.hpp): a thread per local expert sums its pairs over the sources and
// places each source's run in its segment; the segments' starts are one serial prefix (L is small).
__global__ void expert_major_places_kernel(const long long* rows, long long row_words, int R, int N, int rank, int L,
                                           int alignment, long long* places, int* info, long long* dims,
                                           long long capacity_rows) {
  __shared__ long long s_seg[kPlacesMaxExperts];
  const long long expert_col = R + N + static_cast<long long>(rank) * L;
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    long long raw = 0;
    for (int s = 0; s < R; ++s) raw += rows[s * row_words + expert_col + e];
    info[2 + e] = static_cast<int>(raw);
    s_seg[e] = (raw + alignment - 1) / alignment * alignment;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    long long at = 0;
    for (int e = 0; e < L; ++e) {
      const long long aligned = s_seg[e];
      s_seg[e] = at;
      at += aligned;
    }
    if (dims && at > capacity_rows) dims[kReadGo] = 0;  // the reader before the counts hands back
    long long n = 0;
    for (int s = 0; s < R; ++s) {
      places[s] = n;
      n += rows[s * row_words + rank];
    }
    places[R] = n;
    info[0] = static_cast<int>(n);
    info[1] = 0;
  }
  __syncthreads();
  long long* table = places + R + 1;
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    long long first = s_seg[e];
    for (int s = 0; s < R; ++s) {
      const long long sent = rows[s * row_words + expert_col + e];
      table[(static_cast<long long>(s) * L + e) * 2] = first;
      table[(static_cast<long long>(s) * L + e) * 2 + 1] = sent;
      first += sent;
    }
  }
}

}  // namespace

void expert_major_places(uintptr_t count_rows, int64_t row_words, int num_ranks, int num_nodes, int rank,
                         int num_local_experts, int alignment, uintptr_t places, uintptr_t info, uintptr_t stream,
                         uintptr_t dims, int64_t capacity_rows) {
  const auto bad = [](const std::string& what) { throw std::invalid_argument("expert_major_places: " + what); };
  if (dims && capacity_rows < 0) bad("give the expert-major outputs' capacity with dims");
  if (num_ranks < 1 || num_nodes < 1 || rank < 0 || rank >= num_ranks) bad("rank outside the group");
  if (num_local_experts < 1 || num_local_experts > kPlacesMaxExperts)
    bad("1.." + std::to_string(kPlacesMaxExperts) + " local experts");
  if (alignment < 1) bad("alignment must be >= 1");
  if (row_words < num_ranks + num_nodes + int64_t(num_ranks) * num_local_experts)
    bad("the count rows carry no per-expert counts for every rank's experts");
  if (!count_rows || !places || !info) bad("null count rows or output");
  expert_major_places_kernel<<<1, 256, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const long long*>(count_rows), row_words, num_ranks, num_nodes, rank, num_local_experts,
      alignment, reinterpret_cast<long long*>(places), reinterpret_cast<int*>(info),
      reinterpret_cast<long long*>(dims), capacity_rows);
  uccl_ep::check_launch("internode", "expert_major_places");
}

void expert_major_receive(const ExpertMajorReceive& a, uintptr_t stream, const ArrivalGate* gate, int64_t first_row,
                          const OwnRows& own, const RowReady& ready) {
  const auto bad = [](const std::string& what) { throw std::invalid_argument("expert_major_receive: " + what); };
  if (a.topk < 0 || a.topk > kMaxTopk) bad("top-k must be 0.." + std::to_string(kMaxTopk));
  if (first_row < 0 || first_row > a.num_rows)
    bad("first_row " + std::to_string(first_row) + " outside 0.." + std::to_string(a.num_rows));
  if (a.x_bytes % 16 || a.x_offset % 16 || a.src_stride % 16 || a.src % 16 || a.out_x % 16)
    bad("payload rows must be a multiple of 16 bytes at 16-byte aligned addresses");
  if (a.num_scales > 0 && a.out_scales && (a.scales_offset % 4 || a.out_scales % 4)) bad("misaligned scales");
  if (a.src_idx_offset % 4 || (a.arrival_offset >= 0 && a.arrival_offset % 4)) bad("misaligned record layout");
  if (!a.slots_given) {
    if (a.ids_offset < 0 || a.ids_offset % 8 || a.ranks_offset < 0 || a.ranks_offset % 4 ||
        (a.em_weights && (a.weights_offset < 0 || a.weights_offset % 4)))
      bad("the records need the ids (8-byte aligned), the pair ranks and, with em_weights, the weights");
  }
  if (own.tokens && a.arrival_offset >= 0) bad("own rows from the columns only with one GPU per node (arrival = row)");
  if (ready.words && (gate || own.tokens || ready.epoch < 1))
    bad("ready words (the receive beside the dispatch forward) need an epoch >= 1, no gate and no own rows from the "
        "columns");
  if (a.dims && (first_row || a.slots_given || bool(own.tokens) == (a.arrival_offset >= 0)))
    bad("read before the counts takes no first_row (it comes from the device) and no slots, and our own rows' tokens "
        "with one GPU per node (arrival = row), none with several (the final rows, after the forward)");
  if (!a.dims && own.first_row + own.count > a.num_rows && own.count > 0) bad("our own rows end past the rows");
  const int64_t k = a.topk, ids = a.slots_given ? 0 : 8 * k, ranks = a.slots_given ? 0 : 4 * k;
  const OwnRowsArgs own_args = own_rows_args(
      own, {{a.x_offset, a.x_bytes, 16}, {a.scales_offset, a.out_scales ? 4 * a.num_scales : 0, 4},
            {a.ids_offset, ids, 8}, {a.ranks_offset, ranks, 4},
            {a.weights_offset, a.em_weights && !a.slots_given ? 4 * k : 0, 4}},
      "expert_major_receive");
  if (a.num_rows <= 0) return;  // (a rank that receives nothing has empty, null, outputs)
  if (!a.slots_given) {
    if (a.num_sources < 1 || a.num_local_experts < 1 || !a.source_rows || !a.places)
      bad("give the sources' first rows and the places of their pairs");
    if (!a.em_token || !a.em_slot || !a.em_expert) bad("give em_token, em_slot and em_expert");
  }
  if (!a.src || !a.out_x || (a.topk > 0 && !a.slot_of)) bad("null source, output or slot_of");
  check_gate(gate, "expert_major_receive");
  // (see kReceiveThreads: a grid held to a few blocks, beside the forward too, gives each row one warp)
  const bool held = (gate && gate->max_grid > 0) || (ready.words && ready.max_grid > 0);
  const int warps_per_row = held ? 1 : 4;
  const int64_t tile_rows = kWarps / warps_per_row;
  int blocks = gated_grid(int(std::min<int64_t>((a.num_rows + tile_rows - 1) / tile_rows, 1024)), gate);
  // ready.max_grid counts unpack_records' blocks (kPackThreads): the same threads in our blocks of 1024
  if (ready.words && ready.max_grid > 0)
    blocks = std::min(blocks, std::max(1, ready.max_grid * kPackThreads / kReceiveThreads));
  auto launch = [&](auto kernel) {
    kernel<<<blocks + (gate ? 1 : 0), kReceiveThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        a, own_args, gate ? *gate : ArrivalGate{}, first_row, warps_per_row, ready);
  };
  if (gate)
    launch(expert_major_receive_kernel<true, false>);
  else if (ready.words)
    launch(expert_major_receive_kernel<false, true>);
  else
    launch(expert_major_receive_kernel<false, false>);
  uccl_ep::check_launch("internode", "expert_major_receive");
}

}  // namespace uccl_ep::internode
