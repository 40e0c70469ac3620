// Summing rows of 16-byte units in fp32 with the rounding torch uses, for the combine kernels of both paths
// (intranode: a token's copies in rank order; internode: a token's node partial sums in node order). BF16 is handled
// bit for bit without library types (round to nearest even, NaN kept), so results match reference.py exactly.
#pragma once

#include "uccl_ep/portability.cuh"

namespace uccl_ep {

// ---------------------------------------------------------------- bf16 helpers (bit exact, no library types)
UCCL_DEVICE float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
UCCL_DEVICE float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
UCCL_DEVICE uint32_t f32_to_bf16_bits(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);                        // round to nearest even
  return u >> 16;
}
UCCL_DEVICE uint32_t pack_bf16(float lo, float hi) { return f32_to_bf16_bits(lo) | (f32_to_bf16_bits(hi) << 16); }

UCCL_DEVICE void acc_unit(float (&acc)[8], const int4& v) {
  const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                         static_cast<uint32_t>(v.w)};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    acc[2 * q] += bf16_lo(w[q]);
    acc[2 * q + 1] += bf16_hi(w[q]);
  }
}
UCCL_DEVICE int4 pack_unit(const float (&acc)[8]) {
  int4 v;
  v.x = static_cast<int>(pack_bf16(acc[0], acc[1]));
  v.y = static_cast<int>(pack_bf16(acc[2], acc[3]));
  v.z = static_cast<int>(pack_bf16(acc[4], acc[5]));
  v.w = static_cast<int>(pack_bf16(acc[6], acc[7]));
  return v;
}

UCCL_DEVICE void acc_unit_f32(float (&acc)[8], const int4& v) {
  acc[0] += __int_as_float(v.x);
  acc[1] += __int_as_float(v.y);
  acc[2] += __int_as_float(v.z);
  acc[3] += __int_as_float(v.w);
}
UCCL_DEVICE int4 pack_unit_f32(const float (&acc)[8]) {
  return make_int4(__float_as_int(acc[0]), __float_as_int(acc[1]), __float_as_int(acc[2]), __float_as_int(acc[3]));
}
template <bool kF32>
UCCL_DEVICE void acc_any(float (&acc)[8], const int4& v) {
  if constexpr (kF32) acc_unit_f32(acc, v); else acc_unit(acc, v);
}
template <bool kF32>
UCCL_DEVICE int4 pack_any(const float (&acc)[8]) {
  if constexpr (kF32) return pack_unit_f32(acc); else return pack_unit(acc);
}

// Sum `n` rows of `units` 16-byte units each into one, in fp32 and in row order j = 0..n-1 (the order fixes the
// rounding, so results do not depend on the launch shape). `row(j)` gives row j's first unit; `store(u, v)` writes
// unit u of the sum. Why the shape: these kernels are latency-bound (a warp walks its rows one after the other), so
// each lane keeps kUnits units of up to kRows rows in flight per step: with 4 x 4, sixteen 16-byte loads.
// kCoherent: rows that a copy engine or a peer may still be writing while the kernel runs (L2 loads, see ld_cg_v4).
template <bool kF32, int kUnits = 4, int kRows = 4, bool kCoherent = false, typename RowOf, typename Store>
UCCL_DEVICE void warp_sum_rows(int n, int units, int lane, const RowOf& row, const Store& store) {
  for (int u0 = lane; u0 < units; u0 += kUnits * kWarpSize) {
    float acc[kUnits][8];
#pragma unroll
    for (int q = 0; q < kUnits; ++q)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[q][e] = 0.0f;
    for (int j0 = 0; j0 < n; j0 += kRows) {
      int4 v[kRows][kUnits];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (j0 + r < n) {
          const int4* src = row(j0 + r);
#pragma unroll
          for (int q = 0; q < kUnits; ++q)
            if (u0 + q * kWarpSize < units)
              v[r][q] = kCoherent ? ld_cg_v4(src + u0 + q * kWarpSize) : ld_nc_v4(src + u0 + q * kWarpSize);
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (j0 + r < n) {
#pragma unroll
          for (int q = 0; q < kUnits; ++q)
            if (u0 + q * kWarpSize < units) acc_any<kF32>(acc[q], v[r][q]);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kUnits; ++q)
      if (u0 + q * kWarpSize < units) store(u0 + q * kWarpSize, pack_any<kF32>(acc[q]));
  }
}

}  // namespace uccl_ep
