// jitattn: device helpers shared by every kernel. Plain CUDA C++; no jinja in this file.
//
// PTX references: "Parallel Thread Execution ISA", sections on cp.async (9.7.9.25), ldmatrix
// (9.7.14.5.15) and mma.sync m16n8k16 fragment layouts (9.7.14.5.8).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace jitattn {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): softmax runs in base 2 (exp2 is one SFU op)
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -__builtin_huge_valf();

// Shared memory of one SM that blocks may take on sm_90 (228 KB less the 1 KB the hardware reserves
// for each resident block; also the most one block may take), and that reserve.
constexpr int kSmemPerSm = 227 * 1024;
constexpr int kSmemReservedPerBlock = 1024;
// The quiet-NaN bit pattern: written into the output of a row whose metadata or parameter reads were
// out of range (loud, where a clamped read would be silently wrong).
constexpr int kQuietNanBits = 0x7fc00000;

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int next_pow2(int x) { return x <= 1 ? 1 : 2 * next_pow2((x + 1) / 2); }
__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }
__host__ __device__ constexpr int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); }
__host__ __device__ constexpr int round_up(int a, int b) { return ceil_div(a, b) * b; }

// ---- element types ----------------------------------------------------------------------------
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return static_cast<float>(x); }

// Parameter reads yield float for floating types and int for integer types (jitattn/trace.py's C types).
__device__ __forceinline__ float to_param_value(float x) { return x; }
__device__ __forceinline__ float to_param_value(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_param_value(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ int to_param_value(int x) { return x; }
__device__ __forceinline__ int to_param_value(long long x) { return static_cast<int>(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }

// Two floats packed into one 32-bit register of T2 (lower column index in the low half).
template <class T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// The bytes of `raw` (a uint4 or a uint2) as N values of T, unpacked to floats.
template <class T, int N, class Raw>
__device__ __forceinline__ void unpack_raw(const Raw& raw, float (&out)[N]) {
  static_assert(N * sizeof(T) == sizeof(Raw), "unpack_raw reads exactly the bytes of raw");
  if constexpr (sizeof(T) == 1) {  // FP8 e4m3: two at a time through the half2 converter
    const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&raw);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const __half2 h = __half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3));
      const float2 f = __half22float2(h);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  } else {
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(e[i]);
  }
}

// 16 bytes of T unpacked to floats.
template <class T, int N>
__device__ __forceinline__ void unpack16(const uint4& raw, float (&out)[N]) {
  unpack_raw<T>(raw, out);
}

// N values of T, 16 or 8 bytes, read from a 16- or 8-byte aligned address and unpacked to floats.
template <class T, int N>
__device__ __forceinline__ void unpack_at(const void* src, float (&out)[N]) {
  if constexpr (N * sizeof(T) == 16) {
    unpack16<T>(*reinterpret_cast<const uint4*>(src), out);
  } else {
    unpack_raw<T>(*reinterpret_cast<const uint2*>(src), out);
  }
}

// One 16-byte chunk of 16 FP8 e4m3 values widened to 16-bit T (exact: every e4m3 value is a bf16 and an f16),
// handed out as two 16-byte chunks: store(0, elements 0-7), then store(1, elements 8-15); the caller places them.
template <class TIn, class T, class Store>
__device__ __forceinline__ void widen16(const uint4& raw, Store&& store) {
  static_assert(sizeof(TIn) == 1 && sizeof(T) == 2, "widen16: 8-bit values to 16-bit ones");
  float x[16];
  unpack16<TIn>(raw, x);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint4 out;
    out.x = pack2<T>(x[8 * half], x[8 * half + 1]);
    out.y = pack2<T>(x[8 * half + 2], x[8 * half + 3]);
    out.z = pack2<T>(x[8 * half + 4], x[8 * half + 5]);
    out.w = pack2<T>(x[8 * half + 6], x[8 * half + 7]);
    store(half, out);
  }
}

// Accumulator fragments set to zero.
template <int kA, int kB>
__device__ __forceinline__ void zero_fill(float (&x)[kA][kB]) {
#pragma unroll
  for (int a = 0; a < kA; ++a)
#pragma unroll
    for (int b = 0; b < kB; ++b) x[a][b] = 0.f;
}

// N elements of T (a multiple of 16 bytes) from 16-byte aligned global or shared memory, as floats.
template <class T, int N>
__device__ __forceinline__ void load_floats(const T* src, float (&out)[N], bool valid) {
  constexpr int kPer = 16 / sizeof(T);
  static_assert(N % kPer == 0, "load_floats reads whole 16-byte chunks");
#pragma unroll
  for (int c = 0; c < N / kPer; ++c) {
    const uint4 raw = valid ? reinterpret_cast<const uint4*>(src)[c] : make_uint4(0, 0, 0, 0);
    float part[kPer];
    unpack16<T>(raw, part);
#pragma unroll
    for (int i = 0; i < kPer; ++i) out[c * kPer + i] = part[i];
  }
}

// ---- fast math ----------------------------------------------------------------------------------
__device__ __forceinline__ float quiet_nan() { return __int_as_float(kQuietNanBits); }
__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx: exp2(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// tanh through exp2: 1 - 2 / (2^(2x log2 e) + 1). Two SFU ops; absolute error ~1e-7, where
// tanh.approx.f32 (relative error 2^-11) would move a soft-capped logit of 50 by ~0.01.
__device__ __forceinline__ float fast_tanh(float x) {
  return 1.0f - __fdividef(2.0f, fast_exp2(2.0f * kLog2e * x) + 1.0f);
}

// ---- asynchronous copies (sm_80+) --------------------------------------------------------------
// Copies 16 bytes global -> shared, bypassing L1. When `pred` is false nothing is read and the
// destination is zero-filled (src-size 0), so out-of-range rows never bring garbage (or NaN) in.
// kL2Prefetch: L2 fetches the 128 aligned bytes around the copy (.L2::128B): a KV head's piece of an
// NHD token row that shares DRAM sectors with the next head's (hd72: 144 bytes) then comes in whole lines.
template <bool kL2Prefetch = false>
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool pred) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int src_size = pred ? 16 : 0;
  if constexpr (kL2Prefetch) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_size));
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_size));
  }
}
// The same for 8 bytes, through L1 (cp.async.cg takes 16 bytes only): FP8 rows that end in half a
// 16-byte chunk are whole 8-byte chunks, 8-byte aligned in the cache.
__device__ __forceinline__ void cp_async_8(void* smem, const void* gmem, bool pred) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int src_size = pred ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_size));
}
// cp_async_16 (with its L2 prefetch hint) or cp_async_8 by the copy's size.
template <int kBytes, bool kL2Prefetch = false>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem, bool pred) {
  static_assert(kBytes == 16 || kBytes == 8, "cp_async copies 16 or 8 bytes");
  if constexpr (kBytes == 16) {
    cp_async_16<kL2Prefetch>(smem, gmem, pred);
  } else {
    cp_async_8(smem, gmem, pred);
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ---- tensor-core fragments ----------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* smem) {  // lanes 0-15 give the row addresses
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* smem) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}

// Four FP8 e4m3 values (bytes 0..3 of `q`) as two f16x2 registers holding value * 2^-8: `lo` holds
// bytes 0 and 2 (low, high half), `hi` bytes 1 and 3. Bit moves only (no converter): the sign stays
// the top bit of its 16-bit half and the 7 exponent + mantissa bits move to f16's bits 13..7, so the
// f16 exponent is e4m3's (bias 7) read with bias 15: exactly value * 2^-8, e4m3 subnormals landing on
// f16 subnormals (checked on all 256 codes). The NaN codes 0x7f / 0xff read as +-480 (e4m3fn has no
// infinities). 7 integer ops per 4 values.
__device__ __forceinline__ void e4m3x4_to_f16x4_scaled(uint32_t q, uint32_t& lo, uint32_t& hi) {
  hi = (q & 0x80008000u) | ((q >> 1) & 0x3f803f80u);
  lo = ((q << 8) & 0x80008000u) | ((q << 7) & 0x3f803f80u);
}

// The converter instead where there is one (sm_89 and later: cvt.rn.f16x2.e4m3x2, PTX ISA 7.8): the
// same two registers, holding the values themselves (exact: every e4m3 value is an f16), the NaN codes
// read as NaN; one byte permute and two conversions per 4 values (fewer instructions than the bit path).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define JITATTN_E4M3_BY_CVT 1
#else
#define JITATTN_E4M3_BY_CVT 0
#endif
// What the widened values are multiplied by to be the cache's values (the logit and output scales
// take it): 2^8 after the bit moves, 1 after the converter.
constexpr float kE4m3Unscale = JITATTN_E4M3_BY_CVT ? 1.f : 256.f;

__device__ __forceinline__ void e4m3x4_to_f16x4(uint32_t q, uint32_t& lo, uint32_t& hi) {
#if JITATTN_E4M3_BY_CVT
  const uint32_t pairs = __byte_perm(q, 0u, 0x3120);  // bytes 0, 2 | 1, 3
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi) : "r"(pairs));
#else
  e4m3x4_to_f16x4_scaled(q, lo, hi);
#endif
}

// Whether A and B are one type (the templates include no <type_traits>).
template <class A, class B>
constexpr bool kSameType = false;
template <class A>
constexpr bool kSameType<A, A> = true;

// D = A * B + D for one m16n8k16 tile: A row-major 16x16, B "col" 16x8, fp32 accumulate; T is
// __nv_bfloat16 or __half (PTX type bf16 or f16).
template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  static_assert(kSameType<T, __nv_bfloat16> || kSameType<T, __half>, "mma_16816: T is __nv_bfloat16 or __half");
// One asm text for both types: AB, the PTX type, is pasted into the instruction string.
#define JITATTN_MMA_16816(AB)                                                                                  \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." AB "." AB ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, " \
               "{%8, %9}, {%0, %1, %2, %3};\n"                                                                 \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
  if constexpr (kSameType<T, __nv_bfloat16>)
    JITATTN_MMA_16816("bf16");
  else
    JITATTN_MMA_16816("f16");
#undef JITATTN_MMA_16816
}

// This thread's keys of one m16n8 accumulator row over kN n-tiles from key0: f(n, e, kv_idx) for the
// score in n-tile n, column 2 tig + e, which is key kv_idx = key0 + 8 n + 2 tig + e.
template <int kN, class F>
__device__ __forceinline__ void for_each_row_key(int key0, int tig, F f) {
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) f(n, e, key0 + n * 8 + 2 * tig + e);
}

// ---- warp reductions ----------------------------------------------------------------------------
// Reduce over aligned groups of `kWidth` lanes (a power of two <= 32).
template <int kWidth>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int off = kWidth / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}
template <int kWidth>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int off = kWidth / 2; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

}  // namespace jitattn

// ---- helpers the traced functors call (jitattn/trace.py) -----------------------------------------
namespace jitattn {
// Python's floor division and modulo (C++ truncates toward zero; (-3) // 2 must be -2).
__device__ __forceinline__ int floor_div(int a, int b) {
  const int q = a / b;
  return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ int floor_mod(int a, int b) { return a - floor_div(a, b) * b; }
__device__ __forceinline__ float floor_div(float a, float b) { return floorf(a / b); }
__device__ __forceinline__ float floor_mod(float a, float b) { return a - floorf(a / b) * b; }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// A bounds-checked read of a variant parameter: an index outside [0, numel) reads element 0 and
// sets `oob`, which turns the row's output into NaN (loud) instead of reading out of bounds.
template <class T>
__device__ __forceinline__ auto read_param(const T* ptr, int idx, int numel, bool& oob) {
  const bool in = static_cast<unsigned>(idx) < static_cast<unsigned>(numel);
  oob = oob || !in;
  return to_param_value(ptr[in ? idx : 0]);
}
}  // namespace jitattn
