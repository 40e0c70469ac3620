// Device code shared by the kernels that write wire records (internode_plan.cu: pack_records, unpack_records;
// internode.cu: pack_and_push): a record's columns copied by a group of 32 threads, in the widest words the
// alignment allows. One definition, so the fused pack_and_push writes exactly the bytes pack_records does.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "uccl_ep/portability.cuh"

#include "kernels/arrival_gate.cuh"
#include "kernels/internode_plan.hpp"

namespace uccl_ep::internode {

constexpr int kPackThreads = 256;
constexpr int kPackGroup = 32;  // threads per record in pack_records and unpack_records (pack_and_push: a block)

// The first of n ascending ends (ends[i * stride]) past r, or n when none is: which block of rows r falls in, where
// each block ends where the next begins (empty blocks end where the one before does). A few dozen blocks at most
// (source ranks or nodes), so a binary search per row.
__device__ __forceinline__ long long first_end_past(const long long* ends, long long stride, long long n, long long r) {
  long long lo = 0, hi = n;
  while (lo < hi) {
    const long long mid = (lo + hi) / 2;
    if (ends[mid * stride] > r) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

// The record list runs by destination node: with `counts` the records per node (our count row's node columns),
// node m's records start after those of nodes 0..m-1. Returns every node's records together; *before: node m's first.
__device__ __forceinline__ long long records_by_node(const long long* counts, int num_nodes, int m,
                                                     long long* before) {
  long long total = 0;
  *before = 0;
  for (int n = 0; n < num_nodes; ++n) {
    if (n == m) *before = total;
    total += counts[n];
  }
  return total;
}

struct PackArgs {
  PackColumn columns[kMaxPackColumns];
  int num_columns;
};

// kCoherent: the source may be landing while the kernel runs (gated reads of arrivals): L2 loads, so that a line
// cached with the unlanded head of a later row is never served (ld_cg_v4).
template <bool kCoherent, typename V>
__device__ __forceinline__ V load_word(const V* p) {
  if constexpr (kCoherent) return ld_cg(p); else return *p;
}

template <typename V, bool kCoherent>
__device__ __forceinline__ void copy_bytes(char* dst, const char* src, long long bytes, int lane, int width) {
  for (long long w = lane; w < bytes / static_cast<long long>(sizeof(V)); w += width)
    reinterpret_cast<V*>(dst)[w] = load_word<kCoherent>(reinterpret_cast<const V*>(src) + w);
}

// One row of a column by `width` threads (a group of 32 unless said), in the widest words its alignment allows
// (payload rows: 16 bytes).
template <bool kCoherent = false>
__device__ __forceinline__ void copy_row(char* dst, const char* src, long long bytes, int lane,
                                         int width = kPackGroup) {
  const unsigned long long align = reinterpret_cast<unsigned long long>(src) |
                                   reinterpret_cast<unsigned long long>(dst) | static_cast<unsigned long long>(bytes);
  if (align % 16 == 0) copy_bytes<int4, kCoherent>(dst, src, bytes, lane, width);
  else if (align % 8 == 0) copy_bytes<long long, kCoherent>(dst, src, bytes, lane, width);
  else if (align % 4 == 0) copy_bytes<int, kCoherent>(dst, src, bytes, lane, width);
  else copy_bytes<char, kCoherent>(dst, src, bytes, lane, width);
}

// Record `rec` carries row `t` of every column, then (src_idx_offset >= 0) t as int32 at src_idx_offset and
// (G > 0) the record's G final rows as int32 at dest_rows_offset. By `width` threads (`lane`: 0.. width - 1).
__device__ __forceinline__ void write_record(char* rec, long long t, const PackArgs& args,
                                             long long src_idx_offset, const long long* dest_rows_of_record,
                                             int G, long long dest_rows_offset, int lane, int width = kPackGroup) {
  for (int c = 0; c < args.num_columns; ++c) {
    const PackColumn& col = args.columns[c];
    copy_row(rec + col.offset, reinterpret_cast<const char*>(col.rows) + t * col.bytes, col.bytes, lane, width);
  }
  if (src_idx_offset >= 0 && lane == 0) *reinterpret_cast<int*>(rec + src_idx_offset) = int(t);
  for (int g = lane; g < G; g += width)
    reinterpret_cast<int*>(rec + dest_rows_offset)[g] = int(dest_rows_of_record[g]);
}

// OwnRows (internode_plan.hpp) as a kernel takes it: our own node's final rows [first_row, first_row + count) come
// from the columns at the tokens of our send list's records first_record.. (count 0: none).
struct OwnRowsArgs {
  long long first_row, count, first_record;
  const long long* tokens;
  PackArgs columns;

  // byte `off` of the record our columns would make at `token`; `fallback` where no column holds it (the host checks
  // that every field a reader takes lies in one: own_rows_args)
  __device__ __forceinline__ const char* field(long long token, long long off, const char* fallback) const {
    for (int j = 0; j < columns.num_columns; ++j) {
      const PackColumn& c = columns.columns[j];
      if (off >= c.offset && off < c.offset + c.bytes)
        return reinterpret_cast<const char*>(c.rows) + token * c.bytes + (off - c.offset);
    }
    return fallback;
  }
};

// A field of the record that a reader takes, and the alignment its loads need (bytes 0: not taken).
struct OwnField {
  int64_t offset, bytes, align;
};

// The kernel's OwnRowsArgs from the host's OwnRows, checked: at most kMaxPackColumns columns, and every field the
// reader takes within one column, at an address its loads may use at every token. `what` names the caller.
inline OwnRowsArgs own_rows_args(const OwnRows& own, const std::vector<OwnField>& fields, const char* what) {
  OwnRowsArgs a{};
  a.first_row = own.first_row;
  a.count = own.count;
  a.first_record = own.first_record;
  a.tokens = reinterpret_cast<const long long*>(own.tokens);
  if (!own.tokens) return a;  // none: every row is read from the records
  const std::string who(what);
  if (own.first_row < 0 || own.count < 0 || own.first_record < 0)
    throw std::invalid_argument(who + ": negative own rows");
  if (own.columns.size() > size_t(kMaxPackColumns))
    throw std::invalid_argument(who + ": at most " + std::to_string(kMaxPackColumns) + " own columns");
  a.columns.num_columns = int(own.columns.size());
  for (size_t i = 0; i < own.columns.size(); ++i) a.columns.columns[i] = own.columns[i];
  for (const OwnField& f : fields) {
    if (f.bytes <= 0) continue;
    bool ok = false;
    for (const PackColumn& c : own.columns)
      ok = ok || (c.rows && f.offset >= c.offset && f.offset + f.bytes <= c.offset + c.bytes &&
                  (c.rows + uint64_t(f.offset - c.offset)) % f.align == 0 && c.bytes % f.align == 0);
    if (!ok)
      throw std::invalid_argument(who + ": the record's field at byte " + std::to_string(f.offset) + " (" +
                                  std::to_string(f.bytes) + " bytes) lies in none of the own columns, or not " +
                                  std::to_string(f.align) + "-byte aligned there");
  }
  return a;
}

}  // namespace uccl_ep::internode
