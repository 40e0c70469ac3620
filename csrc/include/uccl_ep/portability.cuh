// One spelling of the GPU primitives the kernels need, for nvcc (CUDA) and hipcc (HIP/ROCm).
//
// The kernels talk to peer GPUs through IPC-mapped memory, so every publication of data to a peer is a
// system-scope release and every observation of a peer's flag a system-scope acquire. On CDNA (AMD) plain stores
// are not ordered with a later release by themselves across the fabric, so `publish_release` drains them first.
#pragma once

#include <cstdint>

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime.h>
#define UCCL_EP_HIP 1
// The host API the kernels' launchers use, spelled the CUDA way.
#define cudaError_t hipError_t
#define cudaSuccess hipSuccess
#define cudaStream_t hipStream_t
#define cudaGetErrorString hipGetErrorString
#define cudaGetLastError hipGetLastError
#define cudaMemsetAsync hipMemsetAsync
#define cudaMemcpy hipMemcpy
#define cudaMemcpyHostToDevice hipMemcpyHostToDevice
#define cudaMalloc hipMalloc
#define cudaFree hipFree
#define cudaMemset hipMemset
#define cudaHostAlloc hipHostMalloc
#define cudaHostAllocMapped hipHostMallocMapped
#define cudaHostGetDevicePointer hipHostGetDevicePointer
#define cudaFreeHost hipHostFree
#define cudaGetDevice hipGetDevice
#define cudaSetDevice hipSetDevice
#define cudaDeviceSynchronize hipDeviceSynchronize
#define cudaIpcMemHandle_t hipIpcMemHandle_t
#define cudaIpcGetMemHandle hipIpcGetMemHandle
#define cudaIpcOpenMemHandle hipIpcOpenMemHandle
#define cudaIpcCloseMemHandle hipIpcCloseMemHandle
#define cudaIpcMemLazyEnablePeerAccess hipIpcMemLazyEnablePeerAccess
#define cudaFuncSetAttribute hipFuncSetAttribute
#define cudaDeviceGetAttribute hipDeviceGetAttribute
#define cudaDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define cudaOccupancyMaxActiveBlocksPerMultiprocessor hipOccupancyMaxActiveBlocksPerMultiprocessor
#define cudaEvent_t hipEvent_t
#define cudaEventCreateWithFlags hipEventCreateWithFlags
#define cudaEventDisableTiming hipEventDisableTiming
#define cudaEventDestroy hipEventDestroy
#define cudaEventRecord hipEventRecord
#define cudaStreamCreateWithFlags hipStreamCreateWithFlags
#define cudaStreamNonBlocking hipStreamNonBlocking
#define cudaStreamDestroy hipStreamDestroy
#define cudaStreamSynchronize hipStreamSynchronize
#define cudaStreamWaitEvent hipStreamWaitEvent
#define cudaMemcpyAsync hipMemcpyAsync
#define cudaMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#else
#include <cuda_runtime.h>
#define UCCL_EP_CUDA 1
#endif

#define UCCL_HOST_DEVICE __host__ __device__ __forceinline__
#define UCCL_DEVICE __device__ __forceinline__

namespace uccl_ep {

#if defined(UCCL_EP_HIP)
#if defined(__GFX9__) || defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__)
constexpr int kWarpSize = 64;
#else
constexpr int kWarpSize = 64;  // CDNA wavefront; RDNA is not a target
#endif
#else
constexpr int kWarpSize = 32;
#endif

// ---------------------------------------------------------------- time (deadlines of every spin)
UCCL_DEVICE uint64_t now_ns() {
#if defined(UCCL_EP_CUDA)
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#else
  // CDNA's constant wall clock runs at 100 MHz.
  return static_cast<uint64_t>(__builtin_amdgcn_s_memrealtime()) * 10ull;
#endif
}

// ---------------------------------------------------------------- scoped loads, stores, fences, atomics
UCCL_DEVICE void fence_system() { __threadfence_system(); }
UCCL_DEVICE void fence_device() { __threadfence(); }

UCCL_DEVICE int ld_acquire_sys(const int* p) {
#if defined(UCCL_EP_CUDA)
  int v;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#else
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
#endif
}

UCCL_DEVICE void st_release_sys(int* p, int v) {
#if defined(UCCL_EP_CUDA)
  asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#else
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
#endif
}

// 64-bit flags and counters: the copy-engine combine's row flags, the proxies' signal counters.
UCCL_DEVICE uint64_t ld_acquire_sys_u64(const uint64_t* p) {
#if defined(UCCL_EP_CUDA)
  uint64_t v;
  asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#else
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
#endif
}

UCCL_DEVICE int atomic_add_release_sys(int* p, int v) {
#if defined(UCCL_EP_CUDA)
  int old;
  asm volatile("atom.add.release.sys.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
#else
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
#endif
}

// Make every store this thread issued (to local or peer memory) visible system-wide before a following release.
// CUDA: the release store is cumulative after a fence. CDNA: flush the stores and write back the L2 explicitly.
UCCL_DEVICE void drain_stores_before_release() {
#if defined(UCCL_EP_CUDA)
  __threadfence_system();
#else
  __builtin_amdgcn_s_waitcnt(0);
  __threadfence_system();
#endif
}

// Publish a flag to a peer after this block's data stores: sync the block, drain, then one thread releases.
UCCL_DEVICE void publish_release(int* flag, int value) {
  drain_stores_before_release();
  st_release_sys(flag, value);
}

// Order shared-memory writes of one lane before reads by the other lanes of its warp/wavefront.
UCCL_DEVICE void warp_sync() {
#if defined(UCCL_EP_CUDA)
  __syncwarp();
#else
  __builtin_amdgcn_s_waitcnt(0);  // LDS stores of this wavefront have landed
  __builtin_amdgcn_wave_barrier();
#endif
}

// ---------------------------------------------------------------- 16-byte vector copies
struct alignas(16) Vec16 {
  int4 v;
};

UCCL_DEVICE int4 ld_nc_v4(const int4* p) {
#if defined(UCCL_EP_CUDA)
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
#else
  int4 v;
  v.data = __builtin_nontemporal_load(&p->data);
  return v;
#endif
}

UCCL_DEVICE int4 ld_v4(const int4* p) { return *p; }

// Loads of data another agent (a copy engine, a peer GPU) may still be writing while this kernel runs: served by L2,
// never by a possibly stale L1 / non-coherent line. Only read after an acquire of the flag that covers the data.
UCCL_DEVICE int4 ld_cg_v4(const int4* p) {
#if defined(UCCL_EP_CUDA)
  int4 v;
  asm volatile("ld.global.cg.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
#else
  const int* q = reinterpret_cast<const int*>(p);
  int4 v;
  v.x = __hip_atomic_load(q, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
  v.y = __hip_atomic_load(q + 1, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
  v.z = __hip_atomic_load(q + 2, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
  v.w = __hip_atomic_load(q + 3, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
  return v;
#endif
}

UCCL_DEVICE float ld_cg_f32(const float* p) {
#if defined(UCCL_EP_CUDA)
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
#else
  return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#endif
}

// ld_cg_v4 for any word type (int4, long long, int, float, char).
template <typename V>
UCCL_DEVICE V ld_cg(const V* p) {
#if defined(UCCL_EP_CUDA)
  return __ldcg(p);
#else
  return *reinterpret_cast<const volatile V*>(p);
#endif
}
template <>
UCCL_DEVICE int4 ld_cg<int4>(const int4* p) { return ld_cg_v4(p); }

UCCL_DEVICE void st_v4(int4* p, const int4& v) { *p = v; }

// Stores that go to a peer over NVLink/xGMI: skip L1 allocation; the data is consumed on the other GPU.
UCCL_DEVICE void st_na_v4(int4* p, const int4& v) {
#if defined(UCCL_EP_CUDA)
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
#else
  __builtin_nontemporal_store(v.data, &p->data);
#endif
}

// Copy `n` 16-byte units with the lanes of one warp, `kUnroll` loads in flight per lane before the stores.
template <int kUnroll = 4>
UCCL_DEVICE void warp_copy_v4(int4* __restrict__ dst, const int4* __restrict__ src, int n, int lane) {
  int i = lane;
  for (; i + (kUnroll - 1) * kWarpSize < n; i += kUnroll * kWarpSize) {
    int4 buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) buf[u] = ld_nc_v4(src + i + u * kWarpSize);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) st_na_v4(dst + i + u * kWarpSize, buf[u]);
  }
  for (; i < n; i += kWarpSize) st_na_v4(dst + i, ld_nc_v4(src + i));
}

// The same, loading each unit once and storing it to `num_dst` rows: dst_of(j) is the j-th destination row.
// kCoherent: the source may be landing while the kernel runs (a gated reader of arrivals): L2 loads (ld_cg_v4), never
// the non-coherent path, which may serve a line cached before the row landed.
template <int kUnroll = 4, bool kCoherent = false, typename DstOf>
UCCL_DEVICE void warp_copy_v4_to_each(const int4* __restrict__ src, int n, int lane, int num_dst, const DstOf& dst_of) {
  const auto load = [](const int4* p) { if constexpr (kCoherent) return ld_cg_v4(p); else return ld_nc_v4(p); };
  int i = lane;
  for (; i + (kUnroll - 1) * kWarpSize < n; i += kUnroll * kWarpSize) {
    int4 buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) buf[u] = load(src + i + u * kWarpSize);
    for (int j = 0; j < num_dst; ++j) {
      int4* dst = dst_of(j);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) st_na_v4(dst + i + u * kWarpSize, buf[u]);
    }
  }
  for (; i < n; i += kWarpSize) {
    const int4 v = load(src + i);
    for (int j = 0; j < num_dst; ++j) st_na_v4(dst_of(j) + i, v);
  }
}

}  // namespace uccl_ep
