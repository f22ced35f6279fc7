// jitattn: prefill / append over the paged KV cache or ragged K/V on Hopper warpgroup MMA (sm_90a only).
//
// Same contract and features as prefill_kernel (prefill.cuh): a block owns kBlockM packed query rows
// of one KV head (GQA heads packed into rows), walks the visible K/V tiles, skips tiles outside the
// causal/window bounds and masks elements on boundary tiles only, applies every Spec functor, writes
// lse, gives rows that see no key 0 / -inf and rows of invalid sequences NaN. What differs is the
// matrix engine: each consumer warpgroup (4 warps, 64 rows) computes S = Q K^T with
// wgmma.mma_async m64nNk16 reading Q and K from shared memory through matrix descriptors, and
// O += P V with P in registers (the A operand) and V from shared memory as an N-major B operand.
// Q, K and V tiles are kept in a swizzled layout wgmma reads (PTX ISA, "Asynchronous Warpgroup Level
// Matrix Shared Memory Layout"): a tile is stored as column blocks of kSwizzle elements (128-byte rows
// when the head dim is a multiple of 64, 64-byte rows for the other multiples of 32 such as 96,
// 32-byte rows for the odd multiples of 16); inside a block, row r's 16-byte chunks are permuted by
// an XOR with r's phase in its 8-row group (swizzled_offset), and every 8-row group is one swizzle
// atom. Warp specialisation: a last warpgroup only gathers the K/V rows (paged or ragged) into
// kStages stages with cp.async and hands them over through mbarriers (prefill_sm90_kernel says how);
// setmaxnreg moves its registers to the two (three at paged head dims 32, 48, 80, 96, 112) consumer
// warpgroups. Served here (PrefillLaunch in attention.cu.j2 picks this kernel in the sm_90a cubin
// only): 16-bit q/KV/o, head dims any multiple of 8 from 32 to 256, paged or ragged K/V (head_dim_qk
// may differ from head_dim_vo, e.g. 192 / 128). FP8 caches keep prefill_kernel. A multiple of 8 that is
// not one of 16 pads its tiles and MMA k-steps to 16 (PrefillSm90Traits::kTileQK / kTileVO), the pad
// chunks zeroed once in shared memory and never loaded, P V runs over the padded V tile and the
// epilogue stores the real dims only.
//
// The wgmma m64nN fp32 accumulator of a warpgroup is, per warp, N/8 mma.sync m16n8 C fragments
// (warp w owns rows 16w .. 16w + 15), and the register A operand of m64k16 is, per warp, an m16k16
// mma.sync A fragment: the softmax, masking and functor code is prefill_kernel's, indexed [n * 4 + j].
#pragma once

#include "common.cuh"
#include "kv_load.cuh"
#include "prefill.cuh"
#include "softmax.cuh"
#include "variant.cuh"
#include "wgmma_sm90.cuh"

namespace jitattn {

template <bool B>
struct BoolConstant {
  static constexpr bool value = B;
};

template <int I>
struct IntConstant {
  static constexpr int value = I;
};
// f(IntConstant<0>{}), ..., f(IntConstant<N - 1>{}): a loop whose index is a compile-time constant.
template <int N, int I = 0, class F>
__device__ __forceinline__ void static_for(F&& f) {
  if constexpr (I < N) {
    f(IntConstant<I>{});
    static_for<N, I + 1>(f);
  }
}

template <class S>
struct PrefillSm90Traits {
  using DT = typename S::DTypeQ;
  // Q and K rows are kHeadDimQK wide in global memory, V and O rows kHeadDimVO (they differ only for
  // ragged specs, e.g. 192 / 128).
  static constexpr int kHeadDimQK = S::kHeadDimQK, kHeadDimVO = S::kHeadDimVO;
  // A head dim that is a multiple of 8 but not 16 pads its shared-memory tiles and MMA k-steps to
  // kTileQK / kTileVO, a multiple of kPadTo: the pad chunks are zeroed once and never loaded (global
  // reads and writes stop at the row). A multiple of 16 is its own tile width.
  static constexpr int kPadTo = 16;
  static constexpr int tile_for(int d) { return d % 16 == 0 ? d : round_up(d, kPadTo); }
  static constexpr int kTileQK = tile_for(kHeadDimQK), kTileVO = tile_for(kHeadDimVO);
  static constexpr bool kPadded = kTileQK != kHeadDimQK || kTileVO != kHeadDimVO;
  // Tile shapes and warpgroup counts follow the wider of the two tiles.
  static constexpr int kHeadDim = kTileQK > kTileVO ? kTileQK : kTileVO;
  static constexpr bool served_dim(int d) { return d % 8 == 0 && d >= 32 && d <= 256; }
  // Specs this kernel serves (the rest keep prefill_kernel): 16-bit q and KV of one type, head dims
  // that are multiples of 8 from 32 to 256.
  static constexpr bool kSupported = sizeof(DT) == 2 && sizeof(typename S::DTypeKV) == 2 &&
                                     sizeof(typename S::DTypeO) == 2 && served_dim(kHeadDimQK) &&
                                     served_dim(kHeadDimVO);
  // Swizzle width in elements: the widest wgmma layout (128, 64 or 32 bytes per row of a column
  // block) whose rows tile the head dim. 64 (128-byte swizzle) for head dims 64, 128, 192, 256; 32
  // (64-byte) for 32, 96, 160, 224; 16 (32-byte) for the odd multiples of 16 (48, 80, ...).
  // kSwizzle: Q and K tiles; kSwizzleVO: V tiles.
  static constexpr int swizzle_for(int d) { return d % 64 == 0 ? 64 : d % 32 == 0 ? 32 : 16; }
  static constexpr int kSwizzle = swizzle_for(kTileQK);
  static constexpr int kSwizzleVO = swizzle_for(kTileVO);
  // Warp specialisation (FlashAttention-3's layout): warpgroups 0 .. kConsumerWGs - 1 compute, 64 rows
  // each; the last warpgroup only loads K/V (cp.async into the stages) and runs on few registers.
  // Three consumer warpgroups (192 rows, 96-key tiles, as FlashAttention-3 at head dim 96) for the
  // paged specs of head dims up to 112 that are not multiples of 64 (faster than two with 128 x 128
  // tiles on Phi-3 hd96), two otherwise. At three, 160
  // registers per consumer thread: hd96 spills 12-28 bytes (plain) to 108 (ALiBi + windows); ragged
  // specs keep two, where tests/test_ragged.py asks for no spills.
  // Explicit query positions keep two as well: at three, hd96 spilled 24 / 52 bytes against 16 / 32 with
  // implicit positions (each row's position in registers).
  static constexpr int kConsumerWGs =
      !S::kRagged && !S::kExplicitPositions && kHeadDim % 64 != 0 && kHeadDim <= 112 ? 3 : 2;
  static constexpr int kConsumerThreads = 128 * kConsumerWGs;
  static constexpr int kThreads = kConsumerThreads + 128;
  static constexpr int kBlockM = 64 * kConsumerWGs;     // packed query rows per block
  // Keys per tile: S (kBlockN / 2 floats per thread) and O (kHeadDim / 2) share the registers (at
  // three consumer warpgroups, 160 each: 128-key tiles spilled 164 bytes at hd96, 96-key tiles 28).
  // Explicit query positions with a logits transform or mask: each row's position, hook position and batch
  // stay in registers beside S, P and O; at 128-key tiles that spilled (hd128 with hooks on batch and
  // positions 176 / 188 bytes where implicit positions spill none), so 64-key tiles.
  static constexpr bool kExplicitNarrow = S::kExplicitPositions && (S::kHasMask || S::kHasTransform);
  static constexpr int kBlockN = kConsumerWGs == 3 ? 96 : (kHeadDim <= 128 && !kExplicitNarrow) ? 128 : 64;
  // K/V stages in flight: three where they fit beside Q (up to head_dim 224; 230 KB at 128), else
  // two (head dims 240, 256).
  static constexpr int kSmemLimit = kSmemPerSm - 256;  // 256: the static __shared__ (barriers, flags)
  static constexpr int kMaxStages =
      (kSmemLimit - 1024 - kBlockM * kTileQK * 2) / (2 * kBlockN * (kTileQK + kTileVO));
  static constexpr int kStages = kMaxStages < 3 ? 2 : 3;
  // setmaxnreg: 384 threads start at 168 registers; the producer gives most of its share to the
  // consumers (40 x 128 + 232 x 256 = 168 x 384; at 24 the producer's page walk spilled). 512 threads
  // (three consumer warpgroups) start at 128: 32 x 128 + 160 x 384 = 128 x 512.
  // Ragged K/V with head_dim_qk != head_dim_vo and 128-key tiles: the producer's two row loops (Q/K
  // and V chunk counts differ) spilled 4-36 bytes at 40 (e.g. 64/128, 96/64); 56 x 128 + 224 x 256.
  static constexpr bool kWideProducer = S::kRagged && kHeadDimQK != kHeadDimVO && kBlockN == 128;
  static constexpr int kProducerRegs = kConsumerWGs == 3 ? 32 : kWideProducer ? 56 : 40;
  static constexpr int kConsumerRegs = kConsumerWGs == 3 ? 160 : kWideProducer ? 224 : 232;
  static constexpr int kChunks = kHeadDimQK / 8;    // 16-byte chunks per Q / K row in global memory
  static constexpr int kChunksVO = kHeadDimVO / 8;  // per V row
  static constexpr int kQBytes = kBlockM * kTileQK * 2;
  static constexpr int kStageBytes = kBlockN * (kTileQK + kTileVO) * 2;  // a K tile and a V tile
  // +1024: the dynamic shared memory base is aligned up to a swizzle atom by hand.
  static constexpr int kSmemBytes = kQBytes + kStages * kStageBytes + 1024;
  static_assert(!kSupported || kSmemBytes <= kSmemLimit, "stages exceed the shared memory of one SM");
  static constexpr int kNTiles = kBlockN / 8;   // n8 column groups of S
  // O += P V's N: the padded V tile (its pad columns are zero, and O's are never stored); N = the real
  // head_dim_vo (an odd multiple of 8) ran no faster.
  static constexpr int kPvN = kTileVO;
  static constexpr int kDTiles = kPvN / 8;           // n8 column groups of O
  static constexpr int kDTilesOut = kHeadDimVO / 8;  // of them, the ones holding real output columns
  // Inside each consumer warpgroup, the S = Q K^T MMAs of tile j are issued before O += P V of tile
  // j - 1 and the softmax of tile j runs while those P V MMAs run (FlashAttention-3, Shah et al. 2024,
  // sec. 3.2). Specs with a key transform keep the loop without overlap (both warpgroups transform
  // each tile in place between two barriers), and so do two-stage specs: a warpgroup in round j holds
  // tiles j and j - 1, which leaves the producer nothing to prefetch into (slower with overlap).
  static constexpr bool kOverlap = !S::kHasKTransform && kStages >= 3;
  static_assert(!kSupported || (kTileQK % kSwizzle == 0 && kTileVO % kSwizzleVO == 0 && kBlockN % 32 == 0),
                "tiles are whole swizzle columns");
};

// ---- wgmma (PTX ISA 9.7.15, sm_90a) ---------------------------------------------------------------
// Element offset of (row, col) in a swizzled tile of kRows rows (16-bit elements): column blocks of
// kW elements (rows of 2 * kW bytes: 128, 64 or 32), an 8-row group of a block is one swizzle atom
// (1024, 512 or 256 bytes), and row r's 16-byte chunk c sits at chunk position c ^ phase(r), phase =
// r % 8 (128-byte), (r % 8) / 2 (64-byte), (r % 8) / 4 (32-byte): the address bits 4.. XOR bits 7..
// of the swizzle modes (CUTLASS Swizzle<3,4,3>, <2,4,3>, <1,4,3>). `col` % 8 keeps its place.
template <int kRows, int kW>
__device__ __forceinline__ int swizzled_offset(int row, int col) {
  constexpr int kShift = kW == 64 ? 0 : kW == 32 ? 1 : 2;
  static_assert(kW == 64 || kW == 32 || kW == 16, "swizzle widths: 128, 64 or 32 bytes");
  return (col / kW) * kRows * kW + row * kW + ((((col % kW) / 8) ^ ((row % 8) >> kShift)) * 8) + (col % 8);
}

// Shared-memory matrix descriptor for a tile swizzled kW elements wide: start address, leading and
// stride byte offsets (all >> 4), layout type in bits 62-63 (1: 128-byte, 2: 64-byte, 3: 32-byte
// swizzle). K-major operands ignore the leading offset; for an N-major B it is the distance between
// column blocks. The stride offset is between 8-row groups (one atom: 16 * kW bytes).
template <int kW>
__device__ __forceinline__ uint64_t swizzled_desc(const void* smem_ptr, uint32_t lead_bytes) {
  constexpr uint64_t kLayout = kW == 64 ? 1 : kW == 32 ? 2 : 3;
  constexpr uint32_t kStrideBytes = 16 * kW;
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  return static_cast<uint64_t>((a & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lead_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((kStrideBytes >> 4) & 0x3FFF) << 32) | (kLayout << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins accumulator registers in place around asynchronous MMAs: the compiler must not read or move
// them between an issue and its wait.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Keeps an RS wgmma's A registers alive until its wait: the compiler must not reuse them while it runs.
__device__ __forceinline__ void wgmma_keep_fragment(const uint32_t (&a)[4]) {
  asm volatile("" ::"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]));
}
// Ordinary (generic-proxy) writes to shared memory that wgmma (async proxy) reads next: cp.async
// results and in-place transforms. Each writing thread fences before the barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// wgmma_ss<N, DT> (A and B from shared memory) and wgmma_rs<N, DT> (A from registers): wgmma_sm90.cuh.


// ---- mbarriers (PTX ISA 9.7.13.15), named barriers, setmaxnreg -------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Waits until the barrier's phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
// Adds `bytes` to the barrier's expected transaction count and arrives (the producer side of a bulk copy).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_inval(uint64_t* bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Makes mbarrier.init visible to the async proxy (the bulk copies that complete on the barrier).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Bulk copy (PTX ISA 9.7.9.25, cp.async.bulk, sm_90) of `bytes` (a multiple of 16; both addresses 16-byte
// aligned) from global to this block's shared memory, counted on bar's transaction count.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
// bar.sync on barrier `id` (0 is __syncthreads) for `count` threads (whole warps).
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// P (the S accumulators of a 64 x kN tile, one warpgroup's wgmma layout) as register A fragments of
// O += P V: n8 groups 2kk and 2kk + 1 form k-step kk.
template <class DT, int kSRegs, int kSteps>
__device__ __forceinline__ void pack_p_fragments(const float (&s)[kSRegs], uint32_t (&a)[kSteps][4]) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    a[kk][0] = pack2<DT>(s[(2 * kk) * 4 + 0], s[(2 * kk) * 4 + 1]);
    a[kk][1] = pack2<DT>(s[(2 * kk) * 4 + 2], s[(2 * kk) * 4 + 3]);
    a[kk][2] = pack2<DT>(s[(2 * kk + 1) * 4 + 0], s[(2 * kk + 1) * 4 + 1]);
    a[kk][3] = pack2<DT>(s[(2 * kk + 1) * 4 + 2], s[(2 * kk + 1) * 4 + 3]);
  }
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// cp.async of 16 bytes to shared address dst + kDst from gmem + kSrc bytes (src_size 0: zero-fill): the
// offsets are immediates of the instruction, so a run of copies from one row shares two address registers.
template <int kDst, int kSrc>
__device__ __forceinline__ void cp_async_16_at(uint32_t dst, const void* gmem, int src_size) {
  asm volatile("cp.async.cg.shared.global [%0+%1], [%2+%3], 16, %4;\n" ::"r"(dst), "n"(kDst), "l"(gmem), "n"(kSrc),
               "r"(src_size));
}

// The producer warpgroup's K/V loader. 4 threads per key row (each 16-byte chunk sub + 4m, so a warp
// instruction reads 64 contiguous bytes of 8 rows), 32 rows per pass: one page-table read per row and
// thread, done one tile ahead (fetch) so the dependent read is off the path to the next cp.async.
// 128-byte swizzle: the rows of a pass are permuted so that the two rows served by 8 consecutive
// threads differ by 4: their swizzled chunk sets are disjoint (no shared-memory bank conflicts on the
// writes). 64-byte swizzle: rows in order; the two rows of 8 threads (2k, 2k + 1) are 64 bytes apart,
// on disjoint banks. 32-byte swizzle: rows in order, two-way conflicts on the writes (the two
// column blocks of one chunk step share banks); head dims 48, 80, ... only.
template <class S>
struct Sm90KvLoader {
  using T = PrefillSm90Traits<S>;
  using KV = typename S::DTypeKV;
  // Specs with 128-byte swizzled K and V tiles of one width (head dims 64, 128, 192, 256; paged or
  // ragged): every copy of a pass is addressed from two registers plus immediates (load_128b). The
  // general path recomputes the swizzled offset and selects both pointers per 16-byte copy, about 20
  // instructions per cp.async, and on hd128 the producer warpgroup then bounded the kernel.
  // Not for padded tiles: its copies run over whole 128-byte rows.
  static constexpr bool kFast128B = T::kSwizzle == 64 && T::kHeadDimQK == T::kHeadDimVO && !T::kPadded;
  static constexpr int kPasses = T::kBlockN / 32;
  static constexpr int kChunksPerThread = (T::kChunks + 3) / 4;  // the last one partial at 48, 80, ...
  static constexpr int kChunksPerThreadVO = (T::kChunksVO + 3) / 4;
  int row0;  // row of pass 0
  int sub;   // first chunk
  // Paged: the page of each pass's row. Ragged: page[0] is the row of k / v holding key `start` (a
  // separate member for it changed the paged SASS: register allocation at hd256).
  int page[kPasses];
  __device__ __forceinline__ explicit Sm90KvLoader(int tid) {
    const int q = tid / 4;
    row0 = T::kSwizzle == 64 ? (q & ~7) | ((q & 6) >> 1) | ((q & 1) << 2) : q;
    sub = tid % 4;
  }
  __device__ __forceinline__ void fetch(const Params& p, int batch, int start, int end) {
    if constexpr (S::kRagged) {
      page[0] = p.kv_start_loc[batch] + start;
    } else {
#pragma unroll
      for (int i = 0; i < kPasses; ++i) {
        const int kv_idx = start + i * 32 + row0;
        page[i] = kv_idx < end ? page_of<S>(p, batch, kv_idx) : 0;
      }
    }
  }
  // load() for kFast128B (same contract). Thread (row0, sub) copies chunks sub + 4m of its rows;
  // chunk c of row r sits in column block c / 8 at byte (r * 8 + ((c % 8) ^ (r % 8))) * 16. With
  // sub < 4, (sub + 4m') ^ ph = (sub ^ ph) ^ 4m' (m' = m % 2), so the two in-block offsets are o0 and
  // o0 ^ 64; column blocks (kBlockN * 128 bytes), passes (32 rows = 4096 bytes; 32 keeps r % 8) and V
  // (the stage's V tile follows its K tile) are immediates.
  __device__ __forceinline__ void load_128b(const Params& p, KV* sk, int kv_head, int start, int end,
                                            bool& bad) const {
    constexpr int kColBlock = T::kBlockN * 128, kVOff = T::kBlockN * T::kTileQK * 2;
    const uint32_t o0 = smem_u32(sk) + row0 * 128 + ((sub ^ (row0 % 8)) * 16);
    const uint32_t o1 = o0 ^ 64;  // a tile starts 1024-aligned: the XOR stays inside the 128-byte row
    static_for<kPasses>([&](auto i_const) {
      constexpr int i = decltype(i_const)::value;
      const int kv_idx = start + i * 32 + row0;
      const bool in = kv_idx < end;
      const KV* kb;
      const KV* vb;
      if constexpr (S::kRagged) {
        const long long r = page[0] + i * 32 + row0;
        kb = (in ? p.k + r * p.k_stride_token + kv_head * p.k_stride_head : p.k) + sub * 8;
        vb = (in ? p.v + r * p.v_stride_token + kv_head * p.v_stride_head : p.v) + sub * 8;
      } else {
        kb = (in ? kv_row_in_page<S>(p, page[i], kv_head, kv_idx, 0, bad) : p.kv_cache) + sub * 8;
        vb = kb + p.kv_stride_kv;
      }
      const int src_size = in ? 16 : 0;
      auto copy = [&](auto m_const) {
        constexpr int m = decltype(m_const)::value;
        constexpr int kDst = (m / 2) * kColBlock + i * 4096;
        if constexpr (m % 2 == 0) {
          cp_async_16_at<kDst, m * 64>(o0, kb, src_size);
          cp_async_16_at<kDst + kVOff, m * 64>(o0, vb, src_size);
        } else {
          cp_async_16_at<kDst, m * 64>(o1, kb, src_size);
          cp_async_16_at<kDst + kVOff, m * 64>(o1, vb, src_size);
        }
      };
      static_for<kChunksPerThread>(copy);
    });
  }
  // cp.async of keys [start, start + kBlockN) (K and V) into two swizzled tiles; keys at or past `end`
  // are zero-filled. `page` must hold fetch(start, end). Ragged rows: k / v row page[0] + row,
  // token and head strides from Params (the sequence's bounds were checked by sequence_ok).
  __device__ __forceinline__ void load(const Params& p, KV* sk, KV* sv, int kv_head, int start, int end,
                                      bool& bad) const {
    if constexpr (kFast128B) {
      load_128b(p, sk, kv_head, start, end, bad);
    } else {
      load_general(p, sk, sv, kv_head, start, end, bad);
    }
  }
  __device__ __forceinline__ void load_general(const Params& p, KV* sk, KV* sv, int kv_head, int start, int end,
                                              bool& bad) const {
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int row = i * 32 + row0, kv_idx = start + row;
      const bool in = kv_idx < end;
      if constexpr (S::kRagged) {
        const long long r = page[0] + row;
        const KV* kb = in ? p.k + r * p.k_stride_token + kv_head * p.k_stride_head : p.k;
        const KV* vb = in ? p.v + r * p.v_stride_token + kv_head * p.v_stride_head : p.v;
#pragma unroll 2
        for (int m = 0; m < kChunksPerThread; ++m) {
          const int chunk = sub + 4 * m;
          if (T::kChunks % 4 != 0 && chunk >= T::kChunks) break;
          cp_async_16(sk + swizzled_offset<T::kBlockN, T::kSwizzle>(row, chunk * 8), in ? kb + chunk * 8 : p.k, in);
        }
#pragma unroll 2
        for (int m = 0; m < kChunksPerThreadVO; ++m) {
          const int chunk = sub + 4 * m;
          if (T::kChunksVO % 4 != 0 && chunk >= T::kChunksVO) break;
          cp_async_16(sv + swizzled_offset<T::kBlockN, T::kSwizzleVO>(row, chunk * 8), in ? vb + chunk * 8 : p.v, in);
        }
      } else {
        const KV* base = in ? kv_row_in_page<S>(p, page[i], kv_head, kv_idx, 0, bad) : p.kv_cache;
#pragma unroll 2  // fully unrolled, the hoisted 64-bit addresses spill at the producer's 40 registers
        for (int m = 0; m < kChunksPerThread; ++m) {
          const int chunk = sub + 4 * m;
          if (T::kChunks % 4 != 0 && chunk >= T::kChunks) break;
          const int off = swizzled_offset<T::kBlockN, T::kSwizzle>(row, chunk * 8);
          cp_async_16(sk + off, in ? base + chunk * 8 : p.kv_cache, in);
          cp_async_16(sv + off, in ? base + chunk * 8 + p.kv_stride_kv : p.kv_cache, in);
        }
      }
    }
  }
};

// Pipeline: stage s of tile j (s = j % kStages) is filled by the producer, which arrives on full[s]
// once its cp.async landed (and fenced for the async proxy); consumers wait on full[s] with parity
// (j / kStages) & 1, run S = Q K^T, the softmax and O += P V on it, and arrive on empty[s]; the
// producer waits on empty[s] before refilling it. No block-wide barrier inside the loop, so the two
// consumer warpgroups drift apart and the tensor cores serve one while the other runs its softmax.
template <class S>
__device__ __forceinline__ void prefill_sm90_kernel(const Params& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = PrefillSm90Traits<S>;
  using DT = typename T::DT;
  constexpr int kN = T::kBlockN, kDQK = T::kTileQK, kDVO = T::kTileVO;  // tile widths (padded)
  extern __shared__ __align__(16) uint8_t smem_sm90[];
  __shared__ uint64_t full_bar[T::kStages], empty_bar[T::kStages];
  __shared__ int bad_flag;
  uint8_t* smem = smem_sm90 + ((1024u - (smem_u32(smem_sm90) & 1023u)) & 1023u);
  DT* sq = reinterpret_cast<DT*>(smem);
  DT* skv = reinterpret_cast<DT*>(smem + T::kQBytes);  // [stage][K (kN x QK) | V (kN x VO)], swizzled
  auto stage_k = [&](int s) {
    if constexpr (kDQK == kDVO) {
      return skv + (2 * s) * kN * kDQK;
    } else {
      return skv + s * kN * (kDQK + kDVO);
    }
  };
  auto stage_v = [&](int s) {
    if constexpr (kDQK == kDVO) {
      return skv + (2 * s + 1) * kN * kDQK;
    } else {
      return skv + s * kN * (kDQK + kDVO) + kN * kDQK;
    }
  };

  int batch, tile;
  if (!prefill_find_tile<S, T::kBlockM>(p, gridDim.x - 1 - blockIdx.x, batch, tile)) return;
  const PrefillBlock b = prefill_block<S, T::kBlockM>(p, batch, tile);
  const int kv_head = b.kv_head, q_start = b.q_start, qo_len = b.qo_len, kv_len = b.kv_len;
  const int packed0 = b.packed0, packed_end = b.packed_end, qo_base = b.qo_base;
  // Explicit positions (prefill.cuh, ExplicitRows): each consumer warpgroup loads the tokens of its
  // rows (clamped into the sequence's rows); the block's range (the producer's tiles) is over all of them.
  constexpr int kConsumerWarps = T::kConsumerThreads / 32;
  ExplicitRows<S, T::kBlockM, kConsumerWarps>* xr = nullptr;  // shared memory only where positions are explicit
  const int tok0 = packed0 / S::kGroupSize;
  int xoff = 0, kbatch = batch;  // hooks: position offset; the key transform's batch
  int pos_lo = b.pos_lo, pos_hi = b.pos_hi;
  if constexpr (S::kExplicitPositions) {
    xr = &explicit_rows<S, T::kBlockM, kConsumerWarps>();
    if (threadIdx.x < T::kConsumerThreads) {
      const int wg_first = packed0 + (threadIdx.x / 128) * 64;
      explicit_rows_load<S, 128>(p, *xr, q_start, tok0, min(wg_first, packed_end - 1),
                                 min(wg_first + 63, packed_end - 1), threadIdx.x % 128, threadIdx.x / 32);
    }
    explicit_hook_offsets<S>(p, batch, q_start, xoff, kbatch);
    __syncthreads();
    explicit_rows_range<kConsumerWarps>(*xr, 0, pos_lo, pos_hi);
  }
  int kv_begin, kv_end;
  bool bad = visible_keys<S>(sequence_ok<S>(p, batch, qo_len, kv_len), pos_lo, pos_hi, kv_len, kv_begin, kv_end);
  const int n_first = (kv_begin / kN) * kN;
  const int num_tiles = kv_end > n_first ? ceil_div(kv_end - n_first, kN) : 0;

  // Pad columns zeroed once (no load writes them); the fence and the barrier below order them before any wgmma.
  if constexpr (T::kPadded) {
    zero_pad_columns<T::kBlockM, T::kHeadDimQK, kDQK, T::kThreads>(
        [&](int row, int col) { return sq + swizzled_offset<T::kBlockM, T::kSwizzle>(row, col); });
    zero_pad_columns<T::kStages * kN, T::kHeadDimQK, kDQK, T::kThreads>([&](int row, int col) {
      return stage_k(row / kN) + swizzled_offset<kN, T::kSwizzle>(row % kN, col);
    });
    zero_pad_columns<T::kStages * kN, T::kHeadDimVO, kDVO, T::kThreads>([&](int row, int col) {
      return stage_v(row / kN) + swizzled_offset<kN, T::kSwizzleVO>(row % kN, col);
    });
    fence_proxy_async();
  }
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < T::kStages; ++s) {
      mbar_init(&full_bar[s], 128);
      mbar_init(&empty_bar[s], T::kConsumerThreads);
    }
    bad_flag = 0;
  }
  __syncthreads();

  if (threadIdx.x >= T::kConsumerThreads) {  // ---- producer warpgroup ----
    setmaxnreg_dec<T::kProducerRegs>();
    Sm90KvLoader<S> loader(threadIdx.x - T::kConsumerThreads);
    if (num_tiles > 0) loader.fetch(p, batch, n_first, kv_end);
    // Tile `pending` is issued but not yet published on full[]. Publishing it before blocking on
    // empty[] matters with two stages: the consumers may be waiting for exactly that tile.
    int pending = -1;
    for (int j = 0; j < num_tiles; ++j) {
      const int s = j % T::kStages;
      if (j >= T::kStages) {
        if (pending >= 0) {
          cp_async_wait<0>();
          fence_proxy_async();
          mbar_arrive(&full_bar[pending % T::kStages]);
          pending = -1;
        }
        mbar_wait(&empty_bar[s], ((j / T::kStages) - 1) & 1);
      }
      loader.load(p, stage_k(s), stage_v(s), kv_head, n_first + j * kN, kv_end, bad);
      cp_async_commit();
      if (pending >= 0) {  // the tile before landed (this one may still be in flight)
        cp_async_wait<1>();
        fence_proxy_async();
        mbar_arrive(&full_bar[pending % T::kStages]);
      }
      pending = j;
      if (j + 1 < num_tiles) loader.fetch(p, batch, n_first + (j + 1) * kN, kv_end);
    }
    if (pending >= 0) {
      cp_async_wait<0>();
      fence_proxy_async();
      mbar_arrive(&full_bar[pending % T::kStages]);
    }
    if (bad) bad_flag = 1;
    named_barrier_sync(2, T::kThreads);
    return;
  }

  // ---- consumer warpgroups ----
  setmaxnreg_inc<T::kConsumerRegs>();
  const int wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tig = lane % 4;
  const int wg_row0 = wg * 64;
  // Positions of this warpgroup's rows (clamped into the block's rows): finer tile skipping and masking.
  int wg_lo, wg_hi;
  if constexpr (S::kExplicitPositions) {
    explicit_rows_range<4>(*xr, 4 * wg, wg_lo, wg_hi);
  } else {
    wg_lo = qo_base + min(packed0 + wg_row0, packed_end - 1) / S::kGroupSize;
    wg_hi = qo_base + min(packed0 + wg_row0 + 63, packed_end - 1) / S::kGroupSize;
  }
  int wg_kv_begin, wg_kv_end;
  visible_kv_range<S>(wg_lo, wg_hi, kv_len, wg_kv_begin, wg_kv_end);

  // Q tile -> swizzled shared memory (rows past the sequence zero-filled), by the consumers. The paged
  // call checks that q's heads are contiguous (stride head_dim_qk); a ragged q may be a padded view.
  auto q_head_offset = [&](int qo_head) {
    if constexpr (S::kRagged) {
      return static_cast<long long>(qo_head) * p.q_stride_head;
    } else {
      return qo_head * S::kHeadDimQK;
    }
  };
  prefill_load_q<S, T::kBlockM, T::kChunks, T::kConsumerThreads>(
      p, q_start, kv_head, packed0, packed_end,
      [&](int row, int chunk) { return sq + swizzled_offset<T::kBlockM, T::kSwizzle>(row, chunk * 8); }, q_head_offset);
  cp_async_commit();
  cp_async_wait<0>();
  if constexpr (S::kHasQTransform) {
    named_barrier_sync(1, T::kConsumerThreads);
    transform_tile_rows<S, true, T::kBlockM, T::kConsumerThreads>(
        p, [sq](int r, int d) { return sq + swizzled_offset<T::kBlockM, T::kSwizzle>(r, d); }, packed0, packed_end,
        qo_base, kv_head, batch, bad, xr, tok0, xoff);
  }
  fence_proxy_async();
  named_barrier_sync(1, T::kConsumerThreads);

  // Descriptors: this warpgroup's 64 Q rows (K-major A); K tiles (K-major B); V tiles (N-major B).
  constexpr int kW = T::kSwizzle, kWV = T::kSwizzleVO;
  const uint64_t q_desc = swizzled_desc<kW>(sq + wg_row0 * kW, 16);
  auto kstep_off = [](int kk, int rows) {  // 16-byte units from a tile's start to k-step kk (16 columns)
    return static_cast<uint64_t>((((kk * 16) / kW) * rows * kW + (kk * 16) % kW) * 2 / 16);
  };

  const int row0 = packed0 + wg_row0 + warp * 16 + g;  // packed row of accumulator row r: row0 + 8 * r
  // Explicit positions: what row r's masks and hooks see (registers, read once; re-reading shared memory
  // at each tile instead spilled more: hd128 with hooks on batch and positions 288 / 352 bytes).
  RowFrame frame[2];
  if constexpr (S::kExplicitPositions) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = min(row0 + 8 * r, packed_end - 1) / S::kGroupSize - tok0;
      const int pos = xr->pos[i];
      frame[r] = RowFrame{pos, pos + xoff, hooks_see_rows<S>() ? xr->batch[i] : batch, xoff};
    }
  }
  float o[T::kDTiles * 4];
#pragma unroll
  for (int i = 0; i < T::kDTiles * 4; ++i) o[i] = 0.f;
  SoftmaxState st[2];
  st[0] = st[1] = softmax_initial<S>();
  constexpr float kScale = q_prescale<S>();

  // Which tiles this warpgroup computes: [j_lo, j_hi), the tiles some of its rows can see (a
  // contiguous range: causal and window bounds only cut tiles off the ends). It still waits for the
  // others and releases them, so that every stage is released by all consumer threads in order.
  if constexpr (T::kOverlap) {
    const int j_lo = min(num_tiles, max(0, wg_kv_begin - n_first) / kN);  // num_tiles is 0 for a bad sequence
    const int j_hi = max(j_lo, min(num_tiles, wg_kv_end > n_first ? ceil_div(wg_kv_end - n_first, kN) : 0));
    // Online softmax of the S tile at keys n0 .. n0 + kN - 1, in place (s becomes P, unnormalised).
    // A raised running max asks for O to be rescaled by alpha[r] (1: no rescale): the caller applies
    // it once no O += P V is in flight. When the logit is the scaled dot product itself (no logits
    // transform), the scale is applied inside exp2 (one FFMA per element) and to the row max.
    constexpr bool kFoldScale = !S::kLogitsNatural && S::kSoftmax && kScale > 0.f;
    auto softmax_rows = [&](float (&s)[T::kNTiles * 4], int n0, float (&alpha)[2], auto masked) {
      constexpr bool kMasked = decltype(masked)::value;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        alpha[r] = 1.f;
        const PrefillRow row = prefill_row<S>(row0 + 8 * r, packed_end, qo_base, kv_head);
        const RowFrame f = row_frame<S>(row, batch, frame[r]);
        // Row max and sum in 4 independent chains (n odd/even x e), not one dependent chain of kBlockN / 4.
        float part[4] = {kNegInf, kNegInf, kNegInf, kNegInf};
#pragma unroll
        for (int n = 0; n < T::kNTiles; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int kv_idx = n0 + n * 8 + 2 * tig + e;
            float v = s[n * 4 + 2 * r + e];
            if constexpr (!kFoldScale)
              v = transform_logit<S>(p, v * kScale, f.batch, row.head, kv_head, f.hpos, kv_idx + f.koff, qo_len,
                                     kv_len, bad);
            if constexpr (kMasked) {
              const bool ok = kv_idx < kv_end && kv_idx >= kv_begin && structurally_visible<S>(f.pos, kv_idx) &&
                              custom_visible<S>(p, f.batch, row.head, kv_head, f.hpos, kv_idx + f.koff, qo_len,
                                                kv_len, bad);
              v = ok ? v : masked_score<S>();
            }
            s[n * 4 + 2 * r + e] = v;
            part[(n % 2) * 2 + e] = fmaxf(part[(n % 2) * 2 + e], v);
          }
        if constexpr (!S::kSoftmax) continue;
        float tile_max = group_max<4>(fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3])));
        if constexpr (kFoldScale) tile_max *= kScale;  // -inf stays -inf
        // softmax_update_deferred's step in its own form: the rescale is left to the caller (alpha),
        // the sum runs in four chains like the max, and the scale folds into exp2.
        if (tile_max > st[r].m + kRescaleThreshold) {
          alpha[r] = rescale_factor(st[r].m, tile_max);
          st[r].m = tile_max;
          st[r].d *= alpha[r];
        }
        const float m_use = st[r].m == kNegInf ? 0.f : st[r].m;
        part[0] = part[1] = part[2] = part[3] = 0.f;
#pragma unroll
        for (int n = 0; n < T::kNTiles; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float x = s[n * 4 + 2 * r + e];
            const float pe = fast_exp2(kFoldScale ? fmaf(x, kScale, -m_use) : x - m_use);
            s[n * 4 + 2 * r + e] = pe;
            part[(n % 2) * 2 + e] += pe;
          }
        st[r].d += (part[0] + part[1]) + (part[2] + part[3]);
      }
    };
    // Elements are masked on boundary tiles only: one branch per tile, not one per element.
    auto softmax_tile = [&](float (&s)[T::kNTiles * 4], int n0, float (&alpha)[2]) {
      const bool full_tile = !S::kHasMask && n0 + kN <= kv_len && (!S::kCausal || n0 + kN - 1 <= wg_lo) &&
                             (S::kWindowLeft < 0 || n0 >= wg_hi - S::kWindowLeft) &&
                             (S::kWindowRight < 0 || n0 + kN - 1 <= wg_lo + S::kWindowRight);
      if (full_tile) {
        softmax_rows(s, n0, alpha, BoolConstant<false>{});
      } else {
        softmax_rows(s, n0, alpha, BoolConstant<true>{});
      }
    };
    // Round j issues S(j) = Q K_j^T and then O += P(j-1) V_{j-1} (the tensor cores run them in order),
    // waits for S(j) only, runs the softmax of tile j while the P V MMAs run, then waits for those,
    // releases stage j - 1 and applies tile j's O rescale; P(j) waits in registers (bf16 A fragments)
    // for the next round. The MMAs sit in straight-line code (a prologue round with S only, a steady
    // loop, an epilogue with P V only): under a branch that ptxas cannot prove uniform it serialises
    // every wgmma (warning C7520).
    float s[T::kNTiles * 4];
    uint32_t a[kN / 16][4];
    auto wait_full = [&](int j) {
      mbar_wait(&full_bar[j % T::kStages], (j / T::kStages) & 1);
      fence_proxy_async();  // the producer fenced its cp.async writes before arriving; this side too
    };
    auto skip_tile = [&](int j) {  // no row of this warpgroup sees tile j
      wait_full(j);
      mbar_arrive(&empty_bar[j % T::kStages]);
    };
    auto issue_s = [&](int j) {
      const uint64_t k_desc = swizzled_desc<kW>(stage_k(j % T::kStages), 16);
#pragma unroll
      for (int kk = 0; kk < kDQK / 16; ++kk)
        wgmma_ss<kN, DT>(s, q_desc + kstep_off(kk, T::kBlockM), k_desc + kstep_off(kk, kN), kk > 0 ? 1 : 0);
      wgmma_commit();
    };
    auto issue_pv = [&](int j) {
      const uint64_t v_desc = swizzled_desc<kWV>(stage_v(j % T::kStages), kN * kWV * 2);
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk)
        wgmma_rs<T::kPvN, DT>(o, a[kk], v_desc + static_cast<uint64_t>(kk * 16 * kWV * 2 / 16), 1);
      wgmma_commit();
    };
    auto rescale_and_pack = [&](const float (&alpha)[2]) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (alpha[r] != 1.f) {
#pragma unroll
          for (int d = 0; d < T::kDTiles; ++d) {
            o[d * 4 + 2 * r] *= alpha[r];
            o[d * 4 + 2 * r + 1] *= alpha[r];
          }
        }
      }
      // P as register A fragments of O += P V (n8 groups 2kk, 2kk + 1 = k-step kk).
      pack_p_fragments<DT>(s, a);
    };

    for (int j = 0; j < j_lo; ++j) skip_tile(j);
    if (j_lo < j_hi) {
      {  // prologue: S(j_lo) alone
        float alpha[2];
        wait_full(j_lo);
        wgmma_fence();
        issue_s(j_lo);
        wgmma_wait<0>();
        wgmma_fence_operands(s);
        softmax_tile(s, n_first + j_lo * kN, alpha);
        rescale_and_pack(alpha);
      }
      for (int j = j_lo + 1; j < j_hi; ++j) {
        float alpha[2];
        wait_full(j);
        wgmma_fence_operands(o);
        wgmma_fence();  // o (rescaled) and a (packed) were written by ordinary instructions
        issue_s(j);
        issue_pv(j - 1);
        wgmma_wait<1>();  // S(j) done; the P V MMAs may still run
        wgmma_fence_operands(s);
        softmax_tile(s, n_first + j * kN, alpha);
        wgmma_wait<0>();
        wgmma_fence_operands(o);
        mbar_arrive(&empty_bar[(j - 1) % T::kStages]);  // this thread is done with stage j - 1
        rescale_and_pack(alpha);
      }
      {  // epilogue: O += P V of the last tile
        wgmma_fence_operands(o);
        wgmma_fence();
        issue_pv(j_hi - 1);
        wgmma_wait<0>();
        wgmma_fence_operands(o);
        mbar_arrive(&empty_bar[(j_hi - 1) % T::kStages]);
      }
    }
    for (int j = j_hi; j < num_tiles; ++j) skip_tile(j);
  } else {
  for (int j = 0; j < num_tiles; ++j) {
    const int n0 = n_first + j * kN;
    const int stage = j % T::kStages;
    mbar_wait(&full_bar[stage], (j / T::kStages) & 1);
    fence_proxy_async();  // the producer fenced its cp.async writes before arriving; this side too
    if constexpr (S::kHasKTransform) {  // the cache holds raw keys: both warpgroups transform the tile
      named_barrier_sync(1, T::kConsumerThreads);
      DT* sk = stage_k(stage);
      transform_tile_rows<S, false, kN, T::kConsumerThreads>(
          p, [sk](int r, int d) { return sk + swizzled_offset<kN, T::kSwizzle>(r, d); }, n0, kv_end, 0, kv_head, kbatch,
          bad, xr, 0, xoff);
      fence_proxy_async();
      named_barrier_sync(1, T::kConsumerThreads);
    }
    // A tile none of this warpgroup's rows can see (causal / window): skip it (uniform per warpgroup).
    const bool skip = n0 >= wg_kv_end || n0 + kN <= wg_kv_begin;

    // S = Q K^T: head_dim / 16 wgmma, 64 x kBlockN per warpgroup.
    float s[T::kNTiles * 4];
    if (!skip) {
      const uint64_t k_desc = swizzled_desc<kW>(stage_k(stage), 16);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kDQK / 16; ++kk)
        wgmma_ss<kN, DT>(s, q_desc + kstep_off(kk, T::kBlockM), k_desc + kstep_off(kk, kN), kk > 0 ? 1 : 0);
      wgmma_commit();
    }
    if (skip) {
      mbar_arrive(&empty_bar[stage]);
      continue;
    }
    wgmma_wait<0>();
    wgmma_fence_operands(s);
    const bool full_tile = !S::kHasMask && n0 + kN <= kv_len && (!S::kCausal || n0 + kN - 1 <= wg_lo) &&
                           (S::kWindowLeft < 0 || n0 >= wg_hi - S::kWindowLeft) &&
                           (S::kWindowRight < 0 || n0 + kN - 1 <= wg_lo + S::kWindowRight);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const PrefillRow row = prefill_row<S>(row0 + 8 * r, packed_end, qo_base, kv_head);
      prefill_softmax_row<S, T::kNTiles>(
          p, st[r], row, row_frame<S>(row, batch, frame[r]), kv_head, n0, tig, kv_begin, kv_end, qo_len, kv_len,
          full_tile, bad, [&](int n, int e) -> float& { return s[n * 4 + 2 * r + e]; }, [&](float alpha) {
#pragma unroll
            for (int d = 0; d < T::kDTiles; ++d) {
              o[d * 4 + 2 * r] *= alpha;
              o[d * 4 + 2 * r + 1] *= alpha;
            }
          });
    }

    // O += P V: P from the S accumulators as register A fragments (n8 groups 2kk, 2kk + 1 = k-step kk).
    {
      const uint64_t v_desc = swizzled_desc<kWV>(stage_v(stage), kN * kWV * 2);
      uint32_t a[kN / 16][4];
      pack_p_fragments<DT>(s, a);
      wgmma_fence_operands(o);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk)
        wgmma_rs<T::kPvN, DT>(o, a[kk], v_desc + static_cast<uint64_t>(kk * 16 * kWV * 2 / 16), 1);
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operands(o);
    }
    mbar_arrive(&empty_bar[stage]);  // this thread is done with the stage
  }
  }  // kOverlap
  if (bad) bad_flag = 1;
  named_barrier_sync(2, T::kThreads);  // every bad flag (the producer's page lookups too) is in
  const float poison = bad_flag ? quiet_nan() : 0.f;

#pragma unroll
  for (int r = 0; r < 2; ++r)
    prefill_finish_row<S, T::kDTilesOut>(p, st[r], row0 + 8 * r, b, frame[r], tig, poison,
                                      [&](int d, int e) { return o[d * 4 + 2 * r + e]; });
#else
  __trap();  // only the sm_90a cubin dispatches here (PrefillLaunch)
#endif
}

}  // namespace jitattn
