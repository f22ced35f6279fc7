// jitattn: wgmma.mma_async m64nNk16 wrappers (PTX ISA 9.7.15, sm_90a), fp32 accumulators, for N = 8, 16, ..., 256.
// wgmma_ss: D(64 x N) (+)= A(64 x 16, smem, K-major) * B(16 x N, smem, K-major).
// wgmma_rs: D(64 x N) (+)= A(64 x 16, registers) * B(16 x N, smem, N-major).
// wgmma_rs_kb: D(64 x N) (+)= A(64 x 16, registers) * B(16 x N, smem, K-major), the swapped-operand MMAs of
// mla_decode_sm90.cuh.
// scale_d = 0 overwrites D. Both scale A and B by +1; the layouts come with the descriptors.
// A wgmma instruction names every accumulator register in its PTX text, so each N has its own asm
// string: the wrappers are written once here, as a macro, and wgmma_sm90_rows.cuh (written by
// gen_wgmma_sm90.py) expands it for each N with that N's operand numbers.
#pragma once

#include <cstdint>

namespace jitattn {

template <int N, class DT>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d);
template <int N, class DT>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db, int scale_d);
template <int N, class DT>
__device__ __forceinline__ void wgmma_rs_kb(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db, int scale_d);

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Eight accumulators from d[b] as asm outputs.
#define JITATTN_WGMMA_D8(b)                                                                                    \
  "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]), "+f"(d[b + 6]), \
      "+f"(d[b + 7])
// One RS-form specialisation: NAME, with B's transpose flag TB ("1": B N-major, "0": K-major).
#define JITATTN_WGMMA_RS_FN(NAME, TB, N, DT, TY, D, RS, RS_P, ...)                                            \
  template <>                                                                                                 \
  __device__ __forceinline__ void NAME<N, DT>(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db,         \
                                              int scale_d) {                                                  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " RS_P ", 0;\n"                                            \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" D "}, " RS                   \
                 ", p, 1, 1, " TB ";\n}\n"                                                                     \
                 : __VA_ARGS__                                                                                \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));                       \
  }
// wgmma_ss, wgmma_rs and wgmma_rs_kb of one N for the 16-bit type DT (PTX type TY). D: the accumulators' operands
// ("%0, ..., %(N/2 - 1)"); SS, RS: the operands after them (A and B; A's four registers and B); SS_P,
// RS_P: scale_d's operand; the rest: the outputs that bind D.
#define JITATTN_WGMMA(N, DT, TY, D, SS, SS_P, RS, RS_P, ...)                                                  \
  template <>                                                                                                 \
  __device__ __forceinline__ void wgmma_ss<N, DT>(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SS_P ", 0;\n"                                            \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" D "}, " SS                   \
                 ", p, 1, 1, 0, 0;\n}\n"                                                                      \
                 : __VA_ARGS__                                                                                \
                 : "l"(da), "l"(db), "r"(scale_d));                                                           \
  }                                                                                                           \
  JITATTN_WGMMA_RS_FN(wgmma_rs, "1", N, DT, TY, D, RS, RS_P, __VA_ARGS__)                                    \
  JITATTN_WGMMA_RS_FN(wgmma_rs_kb, "0", N, DT, TY, D, RS, RS_P, __VA_ARGS__)
#define JITATTN_WGMMA_BF16_F16(N, ...) \
  JITATTN_WGMMA(N, __nv_bfloat16, "bf16", __VA_ARGS__) JITATTN_WGMMA(N, __half, "f16", __VA_ARGS__)

#include "wgmma_sm90_rows.cuh"

#undef JITATTN_WGMMA_BF16_F16
#undef JITATTN_WGMMA
#undef JITATTN_WGMMA_RS_FN
#undef JITATTN_WGMMA_D8
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace jitattn
