// pagedkv's CPU SIMT runtime: the CUDA built-ins our kernels use, for a host C++ compiler.
//
// A kernel's exact source (what NVRTC compiles) is compiled with g++ against this header
// (force-included, with PAGEDKV_EMULATOR defined) and run one CTA at a time, one fiber per CUDA
// thread. Between two synchronization points a fiber runs alone; the scheduler picks the next
// fiber at random (seeded), so every interleaving the barriers allow can happen: on even seeds
// any ready fiber, on odd seeds one of a randomly ranked warp's first (warps drift apart).
//
//   __syncthreads()        every live thread of the CTA must arrive at the same call site
//   __shfl_*_sync, votes   every lane named in the mask must arrive at the same call site
//   cp.async (16 bytes)    the destination holds NaN bytes (0xff) from issue until a
//                          cp.async.wait_group retires its group; the source is read then
//   mma.sync m16n8k16      bf16/fp16 inputs, fp32 accumulators, the PTX ISA fragment layouts
//   mma.sync m16n8k8 tf32  tf32 inputs (the low 13 bits of each .b32 ignored), fp32 accumulators
//   ldmatrix x4 (.trans)   four 8x8 16-bit tiles, one 16-byte shared-memory row per lane
//   shared memory          NaN bytes at CTA start; its end abuts a guard page
//
// Anything else a CTA does (deadlock, a divergent barrier or shuffle, a thread exiting with
// copies in flight) stops the run with a message naming the CTA, thread and call site. Memory
// ordering, timing, bank conflicts and inter-CTA concurrency are not modelled (gpu/README.md).
#pragma once

#define PAGEDKV_EMULATOR 1

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// ---- qualifiers --------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static_assert(false, "use pagedkv::dynamic_smem(): static __shared__ is not emulated");

#define CUDART_INF_F (__builtin_inff())

// ---- vector types and indices ------------------------------------------------------------------
struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
};
struct __attribute__((aligned(16))) uint4 {
  unsigned int x, y, z, w;
};
struct __attribute__((aligned(8))) uint2 {
  unsigned int x, y;
};
struct __attribute__((aligned(16))) float4 {
  float x, y, z, w;
};
struct __attribute__((aligned(8))) float2 {
  float x, y;
};

// ---- half and bfloat16 -------------------------------------------------------------------------
struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};
struct __attribute__((aligned(4))) __half2 {
  __half x, y;
};
struct __attribute__((aligned(4))) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline float __half2float(__half h) {
  _Float16 f;
  memcpy(&f, &h.bits, 2);
  return static_cast<float>(f);
}
inline __half __float2half_rn(float x) {
  const _Float16 f = static_cast<_Float16>(x);  // IEEE round to nearest even
  __half h;
  memcpy(&h.bits, &f, 2);
  return h;
}
inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  __nv_bfloat16 b;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    b.bits = static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  } else {
    b.bits = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  return b;
}
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}

// ---- math --------------------------------------------------------------------------------------
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline float __fdividef(float a, float b) { return a / b; }
inline unsigned int __float_as_uint(float x) {
  unsigned int u;
  memcpy(&u, &x, 4);
  return u;
}
inline float __uint_as_float(unsigned int u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}
inline float __frcp_rn(float a) { return 1.f / a; }

namespace simt {

// ---- fibers and the CTA scheduler ----------------------------------------------------------------
enum class Wait { kNone, kBarrier, kWarp };
enum class WarpOp {
  kShflXor, kShflIdx, kShflDown, kShflUp, kBallot, kAny, kAll, kSync, kMma, kLdmatrix
};

struct CpAsync {
  unsigned char* dst;
  const unsigned char* src;
  int src_bytes;
  long long group;
};

struct Thread {
  void* sp = nullptr;  // saved stack pointer while switched out
  unsigned char* stack = nullptr;
  dim3 idx;
  int linear = 0;
  bool done = false;
  Wait wait = Wait::kNone;
  const void* site = nullptr;  // call site of the pending barrier / warp op
  WarpOp op = WarpOp::kSync;
  unsigned int mask = 0;
  int arg = 0;  // lane mask / source lane / delta
  int width = 32;
  uint64_t value = 0;
  uint64_t result = 0;
  const void* payload = nullptr;  // kMma / kLdmatrix: this lane's operands (on its own stack)
  std::vector<CpAsync> copies;
  long long committed = 0;  // cp.async groups committed so far
};

struct Cta {
  dim3 block_idx, grid_dim, block_dim;
  std::vector<Thread> threads;
  Thread* current = nullptr;
  void* scheduler_sp = nullptr;
  unsigned char* smem = nullptr;
  size_t smem_bytes = 0;
};

Cta& cta();
[[noreturn]] void fail(const char* format, ...) __attribute__((format(printf, 1, 2)));
void yield_to_scheduler();
uint64_t warp_collective(WarpOp op, unsigned int mask, uint64_t value, int arg, int width,
                         const void* site);
void barrier(const void* site);
enum class MmaKind { kF16K16, kBf16K16, kTf32K8 };
struct MmaOperands {
  float* d;
  const uint32_t* a;
  const uint32_t* b;
  const float* c;
  MmaKind kind;
};
void warp_mma(const MmaOperands& operands, const void* site);
struct LdmatrixOperands {
  uint32_t* d;
  const void* row;
  bool trans;
};
void warp_ldmatrix(const LdmatrixOperands& operands, const void* site);
void cp_async(void* dst, const void* src, int src_bytes);
void cp_async_commit();
void cp_async_wait(int pending);

template <typename T>
inline uint64_t to_bits(T value) {
  static_assert(sizeof(T) <= 8, "shuffle of at most 64 bits");
  uint64_t bits = 0;
  memcpy(&bits, &value, sizeof(T));
  return bits;
}
template <typename T>
inline T from_bits(uint64_t bits) {
  T value;
  memcpy(&value, &bits, sizeof(T));
  return value;
}

}  // namespace simt

// ---- the built-in variables ----------------------------------------------------------------------
#define threadIdx (::simt::cta().current->idx)
#define blockIdx (::simt::cta().block_idx)
#define blockDim (::simt::cta().block_dim)
#define gridDim (::simt::cta().grid_dim)

// ---- synchronization built-ins (the call site is the caller's return address) -------------------
__attribute__((noinline)) inline void __syncthreads() {
  ::simt::barrier(__builtin_return_address(0));
}
__attribute__((noinline)) inline void __syncwarp(unsigned int mask = 0xffffffffu) {
  ::simt::warp_collective(::simt::WarpOp::kSync, mask, 0, 0, 32, __builtin_return_address(0));
}
template <typename T>
__attribute__((noinline)) T __shfl_xor_sync(unsigned int mask, T value, int lane_mask,
                                            int width = 32) {
  return ::simt::from_bits<T>(::simt::warp_collective(::simt::WarpOp::kShflXor, mask,
                                                      ::simt::to_bits(value), lane_mask, width,
                                                      __builtin_return_address(0)));
}
template <typename T>
__attribute__((noinline)) T __shfl_sync(unsigned int mask, T value, int src_lane, int width = 32) {
  return ::simt::from_bits<T>(::simt::warp_collective(::simt::WarpOp::kShflIdx, mask,
                                                      ::simt::to_bits(value), src_lane, width,
                                                      __builtin_return_address(0)));
}
template <typename T>
__attribute__((noinline)) T __shfl_down_sync(unsigned int mask, T value, unsigned int delta,
                                             int width = 32) {
  return ::simt::from_bits<T>(::simt::warp_collective(::simt::WarpOp::kShflDown, mask,
                                                      ::simt::to_bits(value),
                                                      static_cast<int>(delta), width,
                                                      __builtin_return_address(0)));
}
template <typename T>
__attribute__((noinline)) T __shfl_up_sync(unsigned int mask, T value, unsigned int delta,
                                           int width = 32) {
  return ::simt::from_bits<T>(::simt::warp_collective(::simt::WarpOp::kShflUp, mask,
                                                      ::simt::to_bits(value),
                                                      static_cast<int>(delta), width,
                                                      __builtin_return_address(0)));
}
__attribute__((noinline)) inline unsigned int __ballot_sync(unsigned int mask, int predicate) {
  return static_cast<unsigned int>(::simt::warp_collective(
      ::simt::WarpOp::kBallot, mask, predicate != 0, 0, 32, __builtin_return_address(0)));
}
__attribute__((noinline)) inline int __any_sync(unsigned int mask, int predicate) {
  return static_cast<int>(::simt::warp_collective(::simt::WarpOp::kAny, mask, predicate != 0, 0,
                                                  32, __builtin_return_address(0)));
}
__attribute__((noinline)) inline int __all_sync(unsigned int mask, int predicate) {
  return static_cast<int>(::simt::warp_collective(::simt::WarpOp::kAll, mask, predicate != 0, 0,
                                                  32, __builtin_return_address(0)));
}

// ---- the hooks pagedkv_common.cuh calls instead of its inline PTX --------------------------------
namespace simt {

inline unsigned char* dynamic_smem() { return cta().smem; }

inline void cp_async16(void* smem_dst, const void* src, bool pred) {
  cp_async(smem_dst, src, pred ? 16 : 0);
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32: one warp multiplies a 16x16
// tile A (row-major) by a 16x8 tile B (column-major) into a 16x8 fp32 tile D = A B + C. Each
// lane holds its fragments in registers as the PTX ISA lays them out (groupID = lane / 4,
// tig = lane % 4): A in 4 .b32 registers of 2 elements, rows {g, g + 8}, columns
// {2 tig, 2 tig + 1} + {0, 8}; B in 2 registers, rows (k) {2 tig, 2 tig + 1} + {0, 8}, column
// g; C and D in 4 floats, rows {g, g + 8}, columns {2 tig, 2 tig + 1}. The warp's lanes meet
// as in a shuffle (all 32 must arrive), then every lane gets its part of D.
template <typename T>
inline void mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4],
                         const void* site) {
  static_assert(sizeof(T) == 2, "bf16 or fp16 inputs");
  const bool bf16 = std::is_same<T, __nv_bfloat16>::value;
  warp_mma(MmaOperands{d, a, b, c, bf16 ? MmaKind::kBf16K16 : MmaKind::kF16K16}, site);
}

// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32: A 16x8 in 4 registers (rows {g, g + 8},
// columns {tig, tig + 4}: a0 (g, tig), a1 (g + 8, tig), a2 (g, tig + 4), a3 (g + 8, tig + 4)),
// B 8x8 in 2 (rows (k) {tig, tig + 4}, column g), C and D as m16n8k16's. Each .b32 register is
// read as an fp32 bit pattern whose low 13 bits are ignored (tf32 keeps 10 fraction bits).
inline void mma_m16n8k8_tf32(float d[4], const uint32_t a[4], const uint32_t b[2],
                             const float c[4], const void* site) {
  warp_mma(MmaOperands{d, a, b, c, MmaKind::kTf32K8}, site);
}

// ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16: lane l names row l % 8 of matrix l / 8 (16
// bytes of shared memory, 16-byte aligned); register i of lane l gets matrix i's elements
// (row l / 4, columns 2 (l % 4) + {0, 1}), or with .trans (rows 2 (l % 4) + {0, 1}, column l / 4),
// the lower-numbered element in the low half.
inline void ldmatrix_x4(uint32_t d[4], const void* row, bool trans, const void* site) {
  warp_ldmatrix(LdmatrixOperands{d, row, trans}, site);
}

// ex2.approx.ftz.f32: 2^x; a subnormal result is flushed to +0 as the hardware does (its
// approximation error, within 2 ulp, is not modelled: this is the correctly rounded exp2f).
inline float exp2_approx(float x) {
  const float y = exp2f(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y;
}

// ---- kernel entries: each kernel object lists its instantiations; the driver links them ----
using Body = void (*)(void* const*);

struct Entry {
  const char* name;
  Body invoke;
  std::string signature;  // one code per parameter: p (pointer), i4 i8 (integers), f4 f8
};

template <typename T>
std::string code_of() {
  if (std::is_pointer<T>::value) return "p";
  return std::string(std::is_floating_point<T>::value ? "f" : "i") + std::to_string(sizeof(T));
}

template <typename... A, size_t... I>
void invoke_with(void (*kernel)(A...), void* const* args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

template <auto Kernel>
struct EntryOf;
template <typename... A, void (*Kernel)(A...)>
struct EntryOf<Kernel> {
  static void invoke(void* const* args) { invoke_with(Kernel, args, std::index_sequence_for<A...>{}); }
  static std::string signature() {
    std::string codes;
    ((codes += code_of<std::remove_cv_t<A>>() + " "), ...);
    return codes;
  }
};

template <auto Kernel>
Entry make_entry(const char* name) {
  return Entry{name, &EntryOf<Kernel>::invoke, EntryOf<Kernel>::signature()};
}

}  // namespace simt
