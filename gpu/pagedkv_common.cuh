// Device helpers shared by pagedkv's kernels: element conversions, vector loads, cp.async, mma,
// ldmatrix, the hardware exp2.
//
// Compiled by NVRTC (never nvcc-only features): no <cstdint> (use <cuda/std/cstdint>), no
// INFINITY (use CUDART_INF_F from <math_constants.h>); the fp16/bf16 headers come from CuPy's
// include options. Targets sm_80 and newer (cp.async).
//
// The CPU SIMT emulator (gpu/emulator) compiles the same kernel text with a host compiler and
// PAGEDKV_EMULATOR defined: the few helpers below that are inline PTX or shared-memory
// declarations take the emulator's equivalents there. This header is the only place that
// differs; kernel bodies never test PAGEDKV_EMULATOR.
#pragma once

#include <cuda/std/cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

namespace pagedkv {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// The low (first) and high (second) element of a packed pair of 16-bit T, exactly, as floats.
template <typename T>
__device__ __forceinline__ float low_to_float(unsigned int pair);
template <typename T>
__device__ __forceinline__ float high_to_float(unsigned int pair);
template <>
__device__ __forceinline__ float low_to_float<__nv_bfloat16>(unsigned int pair) {
  return __uint_as_float(pair << 16);
}
template <>
__device__ __forceinline__ float high_to_float<__nv_bfloat16>(unsigned int pair) {
  return __uint_as_float(pair & 0xffff0000u);
}
template <>
__device__ __forceinline__ float low_to_float<__half>(unsigned int pair) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(pair & 0xffffu)));
}
template <>
__device__ __forceinline__ float high_to_float<__half>(unsigned int pair) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(pair >> 16)));
}

// x rounded to tf32 (10 fraction bits; to nearest, ties away from zero) as an fp32 bit pattern,
// for finite |x| < 2^127: the operand form of mma's .tf32 inputs.
__device__ __forceinline__ unsigned int to_tf32(float x) {
  return (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
}

// Reads N elements of T (N * sizeof(T) bytes, aligned to min(16, that size)) into floats.
template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* __restrict__ src, float* dst) {
  constexpr int kBytes = N * static_cast<int>(sizeof(T));
  if constexpr (kBytes % 16 == 0) {
    constexpr int kPer = 16 / static_cast<int>(sizeof(T));
#pragma unroll
    for (int v = 0; v < kBytes / 16; ++v) {
      const uint4 raw = reinterpret_cast<const uint4*>(src)[v];
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < kPer; ++i) dst[v * kPer + i] = to_float(e[i]);
    }
  } else if constexpr (kBytes == 8) {
    const uint2 raw = *reinterpret_cast<const uint2*>(src);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = to_float(e[i]);
  } else if constexpr (kBytes == 4) {
    const unsigned int raw = *reinterpret_cast<const unsigned int*>(src);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = to_float(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = to_float(src[i]);
  }
}

#ifdef PAGEDKV_EMULATOR
using ::simt::cp_async16;
using ::simt::dynamic_smem;
__device__ __forceinline__ void cp_async_commit() { ::simt::cp_async_commit(); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  ::simt::cp_async_wait(kPending);
}
template <typename T>
__attribute__((noinline)) void mma_m16n8k16(float* d, const unsigned int* a, const unsigned int* b,
                                            const float* c) {
  ::simt::mma_m16n8k16<T>(d, a, b, c, __builtin_return_address(0));
}
__attribute__((noinline)) inline void mma_m16n8k8_tf32(float* d, const unsigned int* a,
                                                       const unsigned int* b, const float* c) {
  ::simt::mma_m16n8k8_tf32(d, a, b, c, __builtin_return_address(0));
}
__attribute__((noinline)) inline void ldmatrix_x4(unsigned int* d, const void* row) {
  ::simt::ldmatrix_x4(d, row, false, __builtin_return_address(0));
}
__attribute__((noinline)) inline void ldmatrix_x4_trans(unsigned int* d, const void* row) {
  ::simt::ldmatrix_x4(d, row, true, __builtin_return_address(0));
}
inline float exp2_approx(float x) { return ::simt::exp2_approx(x); }
#else
// The CTA's dynamic shared memory (the launch's `shared_mem` bytes), 16-byte aligned.
__device__ __forceinline__ unsigned char* dynamic_smem() {
  extern __shared__ __align__(16) unsigned char pagedkv_dynamic_smem[];
  return pagedkv_dynamic_smem;
}

// 16-byte global -> shared copy that bypasses L1; copies zeros instead when `pred` is false
// (src-size 0: nothing is read, `src` only has to be a valid address).
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* src, bool pred) {
  const unsigned int dst = static_cast<unsigned int>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most kPending of this thread's committed cp.async groups are in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// D = A B + C for one warp: A 16x16 (row-major), B 16x8 (column-major) of T, C and D 16x8 fp32,
// in the fragment layouts of the PTX ISA (mma.sync.aligned.m16n8k16.row.col). Every lane of the
// warp must call it; d may alias c.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float* d, const unsigned int* a,
                                             const unsigned int* b, const float* c);
template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float* d, const unsigned int* a,
                                                            const unsigned int* b,
                                                            const float* c) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}
template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float* d, const unsigned int* a,
                                                     const unsigned int* b, const float* c) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}

// D = A B + C for one warp with tf32 inputs (fp32 bit patterns, the low 13 bits ignored: round
// with to_tf32 first): A 16x8 row-major in 4 registers, a0 (g, tig), a1 (g + 8, tig),
// a2 (g, tig + 4), a3 (g + 8, tig + 4); B 8x8 column-major in 2, b0 (tig, g), b1 (tig + 4, g);
// C and D as m16n8k16's (g = lane / 4, tig = lane % 4). Every lane must call it.
__device__ __forceinline__ void mma_m16n8k8_tf32(float* d, const unsigned int* a,
                                                 const unsigned int* b, const float* c) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}

// Four 8x8 tiles of 16-bit elements from shared memory, one warp: lane l passes the address of
// row l % 8 of tile l / 8 (16 bytes, 16-byte aligned); d[i] gets tile i's elements (row l / 4,
// columns 2 (l % 4) + {0, 1}), the first in the low half. Every lane must call it.
__device__ __forceinline__ void ldmatrix_x4(unsigned int* d, const void* row) {
  const unsigned int address = static_cast<unsigned int>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(address));
}

// As ldmatrix_x4, each tile transposed: d[i] gets (rows 2 (l % 4) + {0, 1}, column l / 4).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int* d, const void* row) {
  const unsigned int address = static_cast<unsigned int>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(address));
}

// 2^x by the hardware's approximation (ex2.approx.ftz: within 2 ulp; a subnormal result is 0).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
#endif

__device__ __forceinline__ void cp_async_wait_all() { cp_async_wait<0>(); }

// What one attention CTA works on, shared by both attention kernels. Work item blockIdx.x holds
// rows [row0, row0 + n_rows) of sequence seq (row = token_in_seq * group_size + head_in_group);
// query j of a sequence with q_len new tokens out of seq_len sits at position
// seq_len - q_len + j and sees keys p' <= p and, with a window W > 0, p' > p - W. The CTA reads
// [first row's window start, last row's position], cut into gridDim.z splits whose tiles of
// kTileN keys are dealt out evenly: two splits differ by at most one tile.
struct CtaKeys {
  int seq;       // the sequence
  int row0;      // its first row
  int q_start;   // its first query token
  int context;   // positions before its first query token
  int n_rows;    // live rows, <= kRows
  int kv_start;  // this split's first key
  int kv_stop;   // one past its last key
  int n_tiles;   // tiles of kTileN keys from kv_start
};

template <int kRows, int kTileN>
__device__ __forceinline__ CtaKeys cta_keys(const int* __restrict__ query_start_loc,
                                            const int* __restrict__ seq_lens,
                                            const int* __restrict__ work_seq,
                                            const int* __restrict__ work_row, int group_size,
                                            int sliding_window) {
  CtaKeys c;
  c.seq = work_seq[blockIdx.x];
  c.row0 = work_row[blockIdx.x];
  c.q_start = query_start_loc[c.seq];
  const int q_len = query_start_loc[c.seq + 1] - c.q_start;
  c.context = seq_lens[c.seq] - q_len;
  c.n_rows = min(kRows, q_len * group_size - c.row0);
  const int first_pos = c.context + c.row0 / group_size;
  const int last_pos = c.context + (c.row0 + c.n_rows - 1) / group_size;
  const int kv_begin = sliding_window > 0 ? max(0, first_pos - sliding_window + 1) : 0;
  const int kv_end = last_pos + 1;
  const int split = blockIdx.z;
  const int num_splits = gridDim.z;
  const int range_tiles = (kv_end - kv_begin + kTileN - 1) / kTileN;
  const int tile_lo = static_cast<int>(static_cast<long long>(split) * range_tiles / num_splits);
  const int tile_hi =
      static_cast<int>(static_cast<long long>(split + 1) * range_tiles / num_splits);
  c.kv_start = kv_begin + tile_lo * kTileN;
  c.kv_stop = min(kv_end, kv_begin + tile_hi * kTileN);
  c.n_tiles = tile_hi - tile_lo;
  return c;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

}  // namespace pagedkv
