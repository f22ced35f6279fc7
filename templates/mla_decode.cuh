// jitattn: multi-head latent attention (MLA) decode on tensor cores, over the paged latent cache.
//
// Absorbed form (FlashMLA, FlashInfer's MLA kernels, vLLM): each token's cache row is c_kv
// (kHeadDimVO values) then k_pe (kHeadDimQK - kHeadDimVO), one "KV head" shared by every query head;
// a score is one kHeadDimQK-long dot product and the output is the softmax-weighted sum of the first
// kHeadDimVO values of the same rows (V is a view of K, so each row is loaded once).
//
// One block serves (sequence, tile of 16 query rows, split): the rows are 16 query heads of one query
// token (a group of fewer heads pads the tile with zero rows), the m16 tile of every mma.sync; a block
// loops over its sequence's tiles (q_len * ceil(heads / 16) of them) in steps of gridDim.y. Per tile of
// kTileKeys keys, warp w computes S = Q K^T for keys 8w .. 8w + 7 (Q re-read from shared memory per
// k-step: its A fragments would take 144 registers), the scores meet in shared memory, and every warp
// runs the same online-softmax step on all of them (so the 4 warps' states are equal and need no
// merge), then O += P V for its quarter of the output dims: a 16 x 512 fp32 accumulator is 256
// registers per lane in one warp, 64 split over 4. A tile's rows share one query position, so one causal
// bound (decode_mma_softmax_step's single `hi`); a group below 16 heads with several queries per sequence
// pads each of its tiles and reads the cache once per query (packing them is later work). An FP8 cache is
// widened to q's dtype in shared memory once per tile (mla_widen_tile). Split-KV: MlaDecodeTraits::kSplitKV.
// sm_80 and sm_90a run the same mma.sync code (a wgmma version for sm_90a is later work).
#pragma once

#include "common.cuh"
#include "decode.cuh"
#include "decode_mma.cuh"
#include "kv_load.cuh"
#include "softmax.cuh"
#include "variant.cuh"

namespace jitattn {

// Most dynamic shared memory one block may take on sm_80 (163 KB; sm_90 allows kSmemPerSm).
constexpr int kSmemMaxSm80 = 163 * 1024;

template <class S>
struct MlaDecodeTraits {
  using DT = typename S::DTypeQ;
  using KV = typename S::DTypeKV;
  using MT = DT;  // mma operand type: q's dtype (an FP8 cache is widened to it)
  // An FP8 (e4m3) cache: raw rows are staged and widened, exactly, to q's dtype in shared memory once per tile
  // (mla_widen_tile), so the mma code and its fragments are the 16-bit ones (kFp8, which decode_mma_out_pair
  // reads, stays false); k_scale folds into the logit scale and, as v_scale, into the output's.
  static constexpr bool kFp8Cache = sizeof(KV) == 1;
  static constexpr bool kFp8 = false;
  static constexpr int kRows = 16;     // query rows per tile: the m16 of mma.sync
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kHeadTiles = ceil_div(S::kNumQoHeads, kRows);  // tiles per query token
  // Fragment rows g + 8 are padding when the group has at most 8 heads (decode_mma_softmax_step skips them).
  static constexpr int kRowHalves = S::kNumQoHeads <= 8 ? 1 : 2;
  static constexpr int kChunks = S::kHeadDimQK / 8;  // 16-byte chunks of a q row and of a 16-bit latent row
  static constexpr int kKvChunks = S::kHeadDimQK * static_cast<int>(sizeof(KV)) / 16;  // of a cache row
  static constexpr int kKvVec = 16 / static_cast<int>(sizeof(KV));                     // KV elements per chunk
  static constexpr int kKSteps = S::kHeadDimQK / 16;
  static constexpr int kWarpKeys = 8;                   // S = Q K^T: one n-tile of keys per warp
  static constexpr int kTileKeys = kWarps * kWarpKeys;  // keys per pipeline stage
  static constexpr int kDTiles = S::kHeadDimVO / 8;
  static constexpr int kWarpDTiles = kDTiles / kWarps;  // O = P V: this warp's n-tiles of output dims
  // Latent rows unpadded and XOR-swizzled (chunk c of row r at c ^ (r % 8)): ldmatrix of 8 rows at one
  // chunk hits 8 bank groups. Q rows padded by one chunk instead (an odd chunk count per row).
  static constexpr int kRowStride = S::kHeadDimQK;
  static constexpr int kQRowStride = S::kHeadDimQK + 8;
  static constexpr int kQBytes = kRows * kQRowStride * 2;
  static constexpr int kScoreStride = kTileKeys + 8;  // floats; conflict-free float2 reads of the score rows
  static constexpr int kScoreBytes = kRows * kScoreStride * 4;
  static constexpr int kStageBytes = kTileKeys * kRowStride * static_cast<int>(sizeof(KV));
  static constexpr int kWideBytes = kFp8Cache ? kTileKeys * kRowStride * 2 : 0;  // the widened tile
  static constexpr int kFixedBytes = kQBytes + kScoreBytes + kWideBytes;
  static constexpr int kStages = kFixedBytes + 3 * kStageBytes <= kSmemMaxSm80 ? 3 : 2;
  static constexpr int kSmemBytes = kFixedBytes + kStages * kStageBytes;
  static constexpr int kMinBlocksPerSM = 1;
  // Split-KV (partial states merged by the last split block, merge_splits_last_block) where the tiles are whole
  // groups of 16 heads, so that a tile's rows are consecutive rows of o: groups of 16, 32, 64, 128 (DeepSeek at
  // TP 8 .. 1). Other groups run one split whatever num_splits says (jitattn/planning.py plans one).
  static constexpr bool kSplitKV = S::kNumQoHeads % kRows == 0;

  static_assert(kSameType<KV, DT> || kSameType<KV, __nv_fp8_e4m3>, "MLA decode: a cache of q's dtype or FP8 e4m3");
  static_assert(S::kNumKvHeads == 1, "MLA decode: one latent row per token");
  static_assert(kChunks % 8 == 0, "swizzled latent rows: a multiple of 8 chunks (head_dim_qk % 64 == 0)");
  static_assert(S::kHeadDimVO % (16 * kWarps) == 0, "each warp's output dims are whole pairs of n-tiles");
  static_assert(S::kHeadDimVO < S::kHeadDimQK, "V is a proper prefix of the latent row");
  static_assert(kSmemBytes <= kSmemMaxSm80, "MLA decode: the stages must fit one sm_80 block's shared memory");
};

// cp.async of the latent rows of keys [start, start + kTileKeys) into one stage (row r: key start + r),
// swizzled (16-bit rows; FP8 rows are staged as they are and swizzled when widened); page ids from KvPages
// (fetched a tile ahead), a page id out of range sets `bad` and reads page 0 (kv_row_in_page), rows at or
// past `end` zero-filled.
template <class S>
__device__ __forceinline__ void mla_load_tile(const Params& p, typename S::DTypeKV* stage, int start, int end,
                                              const KvPages<S, MlaDecodeTraits<S>::kTileKeys,
                                                            MlaDecodeTraits<S>::kThreads>& pages,
                                              bool& bad) {
  using T = MlaDecodeTraits<S>;
  using Pages = KvPages<S, T::kTileKeys, T::kThreads>;
  static_assert(Pages::kChunks == T::kKvChunks, "KvPages walks the same chunks");
#pragma unroll
  for (int j = 0; j < Pages::kIters; ++j) {
    const int c = threadIdx.x + j * T::kThreads;
    if (c < T::kTileKeys * T::kKvChunks) {
      const int row = c / T::kKvChunks, chunk = c % T::kKvChunks;
      const int kv_idx = start + row;
      const bool in = kv_idx < end;
      const auto* src = in ? kv_row_in_page<S>(p, pages.page[j], 0, kv_idx, 0, bad) + chunk * T::kKvVec : p.kv_cache;
      const int dst = T::kFp8Cache ? chunk : chunk ^ (row % 8);
      cp_async_16(stage + row * T::kRowStride + dst * T::kKvVec, src, in);
    }
  }
}

// FP8 cache: the staged raw rows of one tile widened to q's dtype (exact: every e4m3 value is a bf16 and an
// f16), into the swizzled 16-bit tile the mma code reads; 16 raw values (one chunk) per step.
template <class S>
__device__ __forceinline__ void mla_widen_tile(const typename S::DTypeKV* raw, typename S::DTypeQ* wide) {
  using T = MlaDecodeTraits<S>;
  using DT = typename S::DTypeQ;
  for (int e = threadIdx.x; e < T::kTileKeys * T::kKvChunks; e += T::kThreads) {
    const int row = e / T::kKvChunks, c = e % T::kKvChunks;
    auto store = [&](int half, const uint4& out) {  // 16-bit chunk 2c + half of the row
      *reinterpret_cast<uint4*>(wide + row * T::kRowStride + ((2 * c + half) ^ (row % 8)) * 8) = out;
    };
    widen16<typename S::DTypeKV, DT>(*reinterpret_cast<const uint4*>(raw + row * T::kRowStride + c * 16), store);
  }
}

// The 16 query rows of tile (token, head0): q[q_row + token, head0 + i] for i < 16 (rows past the
// group zero-filled) into shared memory, 16 bytes a copy.
template <class S>
__device__ __forceinline__ void mla_load_q(const Params& p, typename S::DTypeQ* sq, int q_row, int head0) {
  using T = MlaDecodeTraits<S>;
  const typename S::DTypeQ* base = p.q + q_row * p.q_stride_token;
  for (int e = threadIdx.x; e < T::kRows * T::kChunks; e += T::kThreads) {
    const int i = e / T::kChunks, c = e % T::kChunks;
    const bool in = head0 + i < S::kNumQoHeads;
    cp_async_16(sq + i * T::kQRowStride + c * 8, in ? base + (head0 + i) * S::kHeadDimQK + c * 8 : p.q, in);
  }
}

// merge_splits_last_block's view of a latent spec (MlaDecodeTraits::kSplitKV): each tile of 16 heads is a "KV
// head" of a GQA group of 16, and each query row (not each sequence) a "sequence": the partial states are
// (num_splits, total_q, heads, head_dim_vo), one counter per (query row, tile).
template <class S>
struct MlaMergeSpec {
  using DTypeO = typename S::DTypeO;
  static constexpr int kGroupSize = MlaDecodeTraits<S>::kRows;
  static constexpr int kNumQoHeads = S::kNumQoHeads;
  static constexpr int kNumKvHeads = S::kNumQoHeads / kGroupSize;
  static constexpr int kHeadDimVO = S::kHeadDimVO;
  static constexpr bool kSoftmax = true;
  static constexpr bool kHasSinks = false;
  static constexpr bool kHasOutTransform = false;
};

// One tile of 16 query rows (query token q_row, its position qo_idx, heads head0 ..) over keys [lo, hi)
// of sequence `batch`: the pipeline, then the output, or with num_splits > 1 this split's partial state
// and, in the last split block of the tile, the merge.
template <class S>
__device__ __forceinline__ void mla_decode_tile(const Params& p, uint8_t* smem, int split, int batch, int q_row,
                                                int qo_idx, int head0, int kv_len, int lo, int hi, bool bad) {
  using T = MlaDecodeTraits<S>;
  using DT = typename T::DT;
  using KV = typename S::DTypeKV;
  using MT = typename T::MT;
  DT* sq = reinterpret_cast<DT*>(smem);
  float* ss = reinterpret_cast<float*>(smem + T::kQBytes);
  DT* wide = reinterpret_cast<DT*>(smem + T::kQBytes + T::kScoreBytes);  // FP8 cache: the widened tile
  auto stage = [&](int s) { return reinterpret_cast<KV*>(smem + T::kFixedBytes + s * T::kStageBytes); };
  using Pages = KvPages<S, T::kTileKeys, T::kThreads>;

  // Prologue: Q with the first stage's group, kStages - 1 tiles in flight; page ids a tile ahead.
  mla_load_q<S>(p, sq, q_row, head0);
  Pages pages;
#pragma unroll
  for (int s = 0; s < T::kStages - 1; ++s) {
    const int start = lo + s * T::kTileKeys;
    pages.fetch(p, batch, start, hi);
    if (start < hi) mla_load_tile<S>(p, stage(s), start, hi, pages, bad);
    cp_async_commit();
  }
  pages.fetch(p, batch, lo + (T::kStages - 1) * T::kTileKeys, hi);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tig = lane % 4;
  auto chunk_at = [&](int chunk) { return chunk ^ (lane % 8); };  // ldmatrix rows start at multiples of 8
  float qk_scale[2];
  qk_scale[0] = qk_scale[1] = q_prescale<S>() * p.k_scale;
  float o[T::kWarpDTiles][4];
  zero_fill(o);
  SoftmaxState st[2] = {softmax_initial<S>(), softmax_initial<S>()};

  int it = 0;
  for (int start = lo; start < hi; start += T::kTileKeys, ++it) {
    cp_async_wait<T::kStages - 2>();
    __syncthreads();  // tile `it` (and Q) landed; every warp is done with the previous tile and its scores
    {
      const int next = start + (T::kStages - 1) * T::kTileKeys;
      if (next < hi) mla_load_tile<S>(p, stage((it + T::kStages - 1) % T::kStages), next, hi, pages, bad);
      cp_async_commit();
      pages.fetch(p, batch, next + T::kTileKeys, hi);
    }
    if constexpr (T::kFp8Cache) {
      mla_widen_tile<S>(stage(it % T::kStages), wide);
      __syncthreads();  // the widened tile is whole (the barrier above: no warp still reads the previous one)
    }
    const DT* sk;
    if constexpr (T::kFp8Cache) sk = wide;
    else sk = stage(it % T::kStages);
    // S = Q K^T for this warp's 8 keys: one ldmatrix_x4 of K gives two k-steps' B fragments.
    // Two accumulators, one per k-step of a K load: two chains of kKSteps / 2 dependent mma instead of one.
    float s_acc[2][4];
    zero_fill(s_acc);
#pragma unroll
    for (int kk = 0; kk < T::kKSteps; kk += 2) {
      uint32_t b[4];
      ldmatrix_x4(b, sk + (warp * T::kWarpKeys + lane % 8) * T::kRowStride + chunk_at(kk * 2 + lane / 8) * 8);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t a[4];
        ldmatrix_x4(a, sq + (lane % 16) * T::kQRowStride + (kk + h) * 16 + (lane / 16) * 8);
        mma_16816<MT>(s_acc[h], a, b[2 * h], b[2 * h + 1]);
      }
    }
    float s_own[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) s_own[i] = s_acc[0][i] + s_acc[1][i];
    *reinterpret_cast<float2*>(ss + g * T::kScoreStride + warp * 8 + 2 * tig) = make_float2(s_own[0], s_own[1]);
    *reinterpret_cast<float2*>(ss + (g + 8) * T::kScoreStride + warp * 8 + 2 * tig) = make_float2(s_own[2], s_own[3]);
    __syncthreads();
    constexpr int kN = T::kTileKeys / 8;  // n-tiles of the whole tile, as every warp reads them
    float s[kN][4];
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      const float2 top = *reinterpret_cast<const float2*>(ss + g * T::kScoreStride + n * 8 + 2 * tig);
      const float2 bottom = *reinterpret_cast<const float2*>(ss + (g + 8) * T::kScoreStride + n * 8 + 2 * tig);
      s[n][0] = top.x;
      s[n][1] = top.y;
      s[n][2] = bottom.x;
      s[n][3] = bottom.y;
    }
    decode_mma_softmax_step<S, T>(p, s, st, o, qk_scale, batch, 0, qo_idx, kv_len, start, hi, g, tig, bad);
#pragma unroll
    for (int j = 0; j < kN / 2; ++j) {  // P of 16 keys as the A operand of one k-step
      uint32_t a[4];
      decode_mma_p_operand<T, MT>(a, s, j);
      decode_mma_pv_16bit<T, MT, T::kWarpDTiles / 2>(o, a, sk, 16 * j, warp * T::kWarpDTiles, lane, chunk_at);
    }
  }
  cp_async_wait<0>();
  // Any thread's bad metadata poisons every output of the tile; past this barrier no warp reads shared
  // memory, so the next tile may load into it.
  const float poison = __syncthreads_or(bad) ? quiet_nan() : 0.f;
  const bool split_kv = T::kSplitKV && p.num_splits > 1;
#pragma unroll
  for (int r = 0; r < T::kRowHalves; ++r) {
    const int head = head0 + g + 8 * r;
    const float d = group_sum<4>(st[r].d);  // every lane of the quad holds the row's sum
    if (head >= S::kNumQoHeads) continue;
    const long long row = static_cast<long long>(q_row) * S::kNumQoHeads + head;
    float scale;
    float* dst = nullptr;  // split-KV: this split's partial output row (float32), else o's row
    if (!split_kv) {
      float lse;
      scale = finalize_state<S>(p, head, SoftmaxState{st[r].m, d}, lse) * p.v_scale;
      if (warp == 0 && tig == 0 && p.lse != nullptr) p.lse[row] = lse + poison;
    } else {  // normalised, base 2 (merge_splits_last_block's convention), rows of all splits total_q apart
      const long long part = static_cast<long long>(split) * p.total_q * S::kNumQoHeads + row;
      scale = d > 0.f ? p.v_scale / d : 0.f;
      if (warp == 0 && tig == 0) p.partial_lse[part] = (d > 0.f ? st[r].m + __log2f(d) : kNegInf) + poison;
      dst = p.partial_o + part * S::kHeadDimVO;
    }
#pragma unroll
    for (int dt = 0; dt < T::kWarpDTiles; ++dt) {
      int dim;
      float value[2];
      decode_mma_out_pair<T>(o, warp * T::kWarpDTiles, dt, r, tig, dim, value);
      if (split_kv) {
        *reinterpret_cast<float2*>(dst + dim) = make_float2(value[0] * scale + poison, value[1] * scale + poison);
      } else {
        store2<typename S::DTypeO>(p.o + row * S::kHeadDimVO + dim, value[0] * scale + poison,
                                   value[1] * scale + poison);
      }
    }
  }
  if constexpr (T::kSplitKV) {
    if (split_kv && p.split_counters != nullptr) {
      Params merge = p;  // "sequences" are query rows here (MlaMergeSpec): total_q of them
      merge.batch_size = p.total_q;
      merge_splits_last_block<MlaMergeSpec<S>, T::kThreads>(merge, reinterpret_cast<float*>(smem), q_row,
                                                            head0 / T::kRows, q_row, qo_idx);
      __syncthreads();  // the merge scratch is read until here; the next tile loads into it
    }
  }
}

// Grid (num_splits, row-tile slots, batch). Every query of a sequence is served here (speculative /
// MTP decode brings several): query token t sits at position kv_len - q_len + t and sees the keys up
// to it. A sequence whose metadata fails (more queries than keys, more keys than its block_table row
// holds, a page id out of range) writes NaN; one whose rows lie outside q writes nothing.
template <class S>
__device__ __forceinline__ void mla_decode_kernel(const Params& p) {
  using T = MlaDecodeTraits<S>;
  extern __shared__ __align__(16) uint8_t smem[];
  const int split = blockIdx.x, batch = blockIdx.z;
  // Without split-KV one split serves the tile (min, not the constant 1: with a constant key range nvcc
  // hoisted the prologue's addresses and spilled ~440 bytes at 255 registers, sm_90a).
  const int num_splits = T::kSplitKV ? p.num_splits : min(p.num_splits, 1);
  if (split >= num_splits) return;
  int q_row0, q_end, kv_len;
  if (!latent_rows(p, batch, q_row0, q_end, kv_len)) return;
  const int qo_len = q_end - q_row0;
  const bool ok = sequence_ok<S>(p, qo_len, kv_len);
  for (int tile = blockIdx.y; tile < qo_len * T::kHeadTiles; tile += gridDim.y) {
    const int token = tile / T::kHeadTiles, head0 = (tile % T::kHeadTiles) * T::kRows;
    const int qo_idx = kv_len - qo_len + token;
    int kv_begin, kv_end, lo, hi;
    const bool bad = visible_keys<S>(ok, qo_idx, qo_idx, kv_len, kv_begin, kv_end);
    split_range<T::kTileKeys>(kv_begin, kv_end, split, num_splits, lo, hi);
    mla_decode_tile<S>(p, smem, split, batch, q_row0 + token, qo_idx, head0, kv_len, lo, hi, bad);
  }
}

}  // namespace jitattn
