// jitattn: prefill / append over the paged KV cache or ragged K/V on tensor cores. Compute-bound.
//
// FlashAttention-2 structure (Dao 2023, "FlashAttention-2", sections 3.1-3.2): a thread block owns
// kBlockM packed query rows of one KV head (the query heads of a GQA group are packed into the rows:
// packed row r = token * group_size + head_in_group), walks the visible K/V tiles of kBlockN keys,
// and keeps the output in registers. Each warp owns 16 rows: S = Q K^T and O += P V are
// mma.sync m16n8k16 (fp32 accumulate); Q, K, V come from shared memory through ldmatrix; K/V tiles
// arrive through cp.async kStages deep; P goes from the S accumulators to A fragments without
// touching shared memory. Tiles outside the causal/window bounds are never loaded; element masks are
// applied on boundary tiles only (and everywhere when the variant has its own mask). Q and K rows are
// head_dim_qk wide, V and O rows head_dim_vo (they differ only for ragged specs, e.g. 192/128).
#pragma once

#include "common.cuh"
#include "kv_load.cuh"
#include "softmax.cuh"
#include "variant.cuh"

namespace jitattn {

template <class S>
struct PrefillTraits {
  using DT = typename S::DTypeQ;
  static_assert(sizeof(DT) == 2, "tensor-core path takes 16-bit q/k/v");
  static constexpr int kHeadDim = S::kHeadDimQK;     // Q and K rows in global memory
  static constexpr int kHeadDimVO = S::kHeadDimVO;   // V and O rows in global memory
  // The MMA k-step and the O n-tile pairs are 16 wide: a head dim that is a multiple of 8 only pads
  // its shared-memory rows and register tiles with one zero chunk (global reads and writes stop at
  // the row); every kPadded branch is `if constexpr`, so a multiple of 16 compiles as before.
  static constexpr int kHeadDimPad = round_up(kHeadDim, 16);
  static constexpr int kHeadDimVOPad = round_up(kHeadDimVO, 16);
  static constexpr bool kPadded = kHeadDimPad != kHeadDim || kHeadDimVOPad != kHeadDimVO;
  static constexpr int kHeadDimMax = cmax(kHeadDimPad, kHeadDimVOPad);
  static constexpr int kNumWarps = 4;
  static constexpr int kThreads = 32 * kNumWarps;
  // m16 tiles per warp: two let each K/V fragment read from shared memory feed two mma (FA2's
  // 32 rows per warp; shared-memory bandwidth, not the tensor cores, bounds one tile per warp).
  // Past head_dim 128 the O accumulators of two tiles no longer fit in registers.
  // User functors add live registers per element: they keep one tile per warp (no spills).
  static constexpr int kMTiles = (kHeadDimMax <= 128 && !S::kHasMask && !S::kHasTransform) ? 2 : 1;
  static constexpr int kWarpRows = 16 * kMTiles;
  static constexpr int kBlockM = kWarpRows * kNumWarps;      // packed query rows per block
  // Keys per tile: the S accumulators (kMTiles x kBlockN / 8 x 4 registers) must fit beside O
  // (kMTiles x head_dim_vo / 8 x 4).
  static constexpr int kBlockN = (kHeadDimVOPad <= 64 || (kMTiles == 1 && kHeadDimVOPad <= 128)) ? 64 : 32;
  // K/V tiles in flight: a 32-key tile computes in less time than an L2 round trip, so it needs a
  // third stage to keep the tensor cores fed; 256-wide rows would cost the second block per SM.
  static constexpr int kStages = kHeadDimMax <= 128 ? 3 : 2;
  // Rows padded by 16 bytes: 8 consecutive rows then fall in 8 distinct 16-byte bank groups,
  // so ldmatrix is conflict-free for every head_dim that is a multiple of 16.
  static constexpr int kRowStride = kHeadDimPad + 8;     // elements, Q and K rows
  static constexpr int kRowStrideV = kHeadDimVOPad + 8;  // elements, V rows
  static constexpr int kChunks = kHeadDim / 8;           // 16-byte chunks per Q row in global memory
  static constexpr int kQBytes = kBlockM * kRowStride * 2;
  static constexpr int kTileBytes = kBlockN * kRowStride * 2;    // one K tile
  static constexpr int kTileBytesV = kBlockN * kRowStrideV * 2;  // one V tile
  // An FP8 cache lands raw in a staging area (cp.async cannot convert) and is widened to DT per tile.
  // Raw rows are head_dim bytes apart: 16-byte chunks, or 8-byte ones where a row ends in half a 16-byte
  // chunk (the widened tiles' pad columns are zeroed by prefill_zero_pads, as for 16-bit rows).
  static constexpr bool kKvFp8 = sizeof(typename S::DTypeKV) == 1;
  static constexpr int kRawChunkBytes = kv_copy_bytes<S>();
  static constexpr int kRawChunks = kHeadDim / kRawChunkBytes;  // chunks of an FP8 row
  static constexpr int kRawTileBytes = kKvFp8 ? 2 * kBlockN * kHeadDim : 0;  // K and V of one stage
  static constexpr int kSmemBytes = kQBytes + kStages * (kTileBytes + kTileBytesV + kRawTileBytes);
  static constexpr int kNTiles = kBlockN / 8;     // n-tiles of S per m-tile
  static constexpr int kDTiles = kHeadDimVOPad / 8;      // n-tiles of O per m-tile
  static constexpr int kDTilesOut = kHeadDimVO / 8;      // of them, the ones holding real output columns
  static_assert(kHeadDim % 8 == 0 && kHeadDimVO % 8 == 0, "head dims must be whole 16-byte chunks");
  static_assert(kBlockN % 16 == 0, "kBlockN must be a multiple of 16 (P is the A operand of P V)");
  static_assert(!kKvFp8 || kHeadDim == kHeadDimVO, "FP8 staging is for the paged cache (one K/V row width)");
};

// Finds the (sequence, m-tile) this block serves. Sequences with one query are skipped when the
// decode kernel serves them (p.prefill_skip_decode_rows). Warp 0 scans query_start_loc 32 sequences
// at a time. Returns false when the block has no work (the grid is an upper bound on tile count).
// kBlockM: packed rows per block of the calling kernel (prefill_sm90.cuh passes its own).
template <class S, int kBlockM = PrefillTraits<S>::kBlockM>
__device__ __forceinline__ bool prefill_find_tile(const Params& p, int block, int& seq, int& tile) {
  __shared__ int found[2];
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int base = 0, res_seq = -1, res_tile = 0;
    for (int b0 = 0; b0 < p.batch_size && res_seq < 0; b0 += 32) {
      const int b = b0 + lane;
      int tiles = 0;
      if (b < p.batch_size) {
        const int q0 = p.query_start_loc[b], q1 = p.query_start_loc[b + 1];
        const bool rows_exist = 0 <= q0 && q0 <= q1 && q1 <= p.total_q;  // else there is nothing to write
        if (rows_exist && !(p.prefill_skip_decode_rows && q1 - q0 == 1))
          tiles = ceil_div((q1 - q0) * S::kGroupSize, kBlockM);
      }
      int incl = tiles;
#pragma unroll
      for (int off = 1; off < 32; off *= 2) {
        const int n = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += n;
      }
      const unsigned hit = __ballot_sync(0xffffffffu, base + incl > block);
      if (hit) {
        const int l = __ffs(hit) - 1;
        res_seq = b0 + l;
        res_tile = block - base - __shfl_sync(0xffffffffu, incl - tiles, l);
      }
      base += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) {
      found[0] = res_seq;
      found[1] = res_tile;
    }
  }
  __syncthreads();
  seq = found[0];
  tile = found[1];
  return seq >= 0;
}

// What one prefill block serves, for both prefill kernels: packed query rows [packed0, packed_end) of
// sequence `batch` and KV head `kv_head`. pos_lo / pos_hi: the positions of its first and last row
// (implicit positions; the kernels overwrite them where positions are explicit).
struct PrefillBlock {
  int batch, kv_head;
  int q_start;  // the sequence's first row of q
  int qo_len, kv_len;
  int packed0, packed_end;
  int qo_base;  // position of the sequence's first query
  int pos_lo, pos_hi;
};

// The rows of the block that serves m-tile `tile` of sequence `batch` (prefill_find_tile). No branch
// inside: the kernels return early themselves (a return inside a helper changes nvcc's layout).
template <class S, int kBlockM>
__device__ __forceinline__ PrefillBlock prefill_block(const Params& p, int batch, int tile) {
  PrefillBlock b;
  b.batch = batch;
  b.kv_head = blockIdx.y;
  b.q_start = p.query_start_loc[b.batch];
  b.qo_len = p.query_start_loc[b.batch + 1] - b.q_start;
  b.kv_len = kv_length<S>(p, b.batch);
  b.packed0 = tile * kBlockM;
  b.packed_end = min(b.qo_len * S::kGroupSize, b.packed0 + kBlockM);
  b.qo_base = b.kv_len - b.qo_len;
  b.pos_lo = b.qo_base + b.packed0 / S::kGroupSize;
  b.pos_hi = b.qo_base + (b.packed_end - 1) / S::kGroupSize;
  return b;
}

// cp.async of keys [n0, n0 + kBlockN) (K and V) into one stage; keys at or past kv_end are zero-filled.
// With an FP8 cache the bytes go to the stage's raw area (`raw`), widened later by prefill_widen_kv.
template <class S>
__device__ __forceinline__ void prefill_load_kv(const Params& p, typename S::DTypeQ* sk, typename S::DTypeQ* sv,
                                                uint8_t* raw, int batch, int kv_head, int n0, int kv_end, bool& bad) {
  using T = PrefillTraits<S>;
  using KV = typename S::DTypeKV;
  if constexpr (T::kKvFp8) {  // raw rows of head_dim bytes, K then V
    KV* rk = reinterpret_cast<KV*>(raw);
    load_kv_rows<S, T::kBlockN, T::kHeadDim, T::kThreads>(p, rk, rk + T::kBlockN * T::kHeadDim, batch, kv_head, n0,
                                                          kv_end, bad);
  } else {
    load_kv_rows<S, T::kBlockN, T::kRowStride, T::kThreads, T::kRowStrideV>(
        p, reinterpret_cast<KV*>(sk), reinterpret_cast<KV*>(sv), batch, kv_head, n0, kv_end, bad);
  }
}

// FP8 cache: widen one stage's raw K and V to DT (applying k_scale / v_scale) in the padded tiles, a raw
// chunk (kB = 16 or 8 values) at a time into kB / 8 16-byte chunks of DT.
template <class S>
__device__ __forceinline__ void prefill_widen_kv(const Params& p, const uint8_t* raw, typename S::DTypeQ* sk,
                                                 typename S::DTypeQ* sv) {
  using T = PrefillTraits<S>;
  using DT = typename T::DT;
  constexpr int kB = T::kRawChunkBytes;
  for (int c = threadIdx.x; c < 2 * T::kBlockN * T::kRawChunks; c += T::kThreads) {
    const int which = c / (T::kBlockN * T::kRawChunks), rc = c % (T::kBlockN * T::kRawChunks);
    const int row = rc / T::kRawChunks, chunk = rc % T::kRawChunks;
    float f[kB];
    unpack_at<typename S::DTypeKV>(raw + (which * T::kBlockN + row) * T::kHeadDim + chunk * kB, f);
    const float scale = which == 0 ? p.k_scale : p.v_scale;
    uint32_t w[kB / 2];
#pragma unroll
    for (int i = 0; i < kB / 2; ++i) w[i] = pack2<DT>(f[2 * i] * scale, f[2 * i + 1] * scale);
    uint4* dst = reinterpret_cast<uint4*>((which == 0 ? sk : sv) + row * T::kRowStride + chunk * kB);
    dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
    if constexpr (kB == 16) dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
}

// Per-thread view of one accumulator row: m-tile mt, r = 0 -> fragment row g, r = 1 -> row g + 8.
// Recomputed where needed rather than kept: registers are the scarce resource of this kernel.
struct PrefillRow {
  int pos;      // absolute query position
  int head;     // query head
  bool valid;   // inside the sequence
};

template <class S>
__device__ __forceinline__ PrefillRow prefill_row(int packed, int packed_end, int qo_base, int kv_head) {
  return PrefillRow{qo_base + packed / S::kGroupSize, kv_head * S::kGroupSize + packed % S::kGroupSize,
                    packed < packed_end};
}

// ---- explicit query positions (S::kExplicitPositions; cascade attention's passes) -------------------
// Query token t has position P = query_positions[t] in its sequence's key frame (causal / window
// bounds, the tile range), its hooks see batch functor_batch[t], and the positions the hooks see are
// shifted by the sequence's position_offset (query P + off, key j + off). P is arbitrary per token (not
// monotonic, possibly >= kv_len), so a block's key range comes from the min / max P over its rows.
// Each block loads its tokens' P and batch once into shared memory (ExplicitRows): a group of threads
// (a warp of prefill_kernel, a consumer warpgroup of prefill_sm90_kernel) loads the tokens of its own
// packed rows and each of its warps leaves the min / max P it saw in lo / hi; after one barrier every
// thread reads its rows' P and batch into registers and the block's (or warpgroup's) range from lo / hi.
template <class S>
__host__ __device__ constexpr bool hooks_see_rows() {  // whether any hook reads batch / positions (else functor_batch is not read)
  return S::kHasTransform || S::kHasMask || S::kHasQTransform || S::kHasKTransform || S::kHasOutTransform;
}

// The sequence's offset added to the positions the hooks see, and the batch its key transform sees
// (its first token's); left as they are when no hook reads them.
template <class S>
__device__ __forceinline__ void explicit_hook_offsets(const Params& p, int batch, int q_start, int& xoff, int& kbatch) {
  if constexpr (hooks_see_rows<S>()) {
    xoff = p.position_offset[batch];
    kbatch = p.functor_batch[q_start];
  }
}

template <class S, int kBlockM, int kWarps>
struct ExplicitRows {
  // Tokens of kBlockM packed rows starting anywhere (a tile may start inside a token's GQA group).
  static constexpr int kTokens = (kBlockM - 1) / S::kGroupSize + 2;
  int pos[kTokens];    // token tok0 + i: position in the key frame
  int batch[kTokens];  // token tok0 + i: the batch its hooks see
  int lo[kWarps];      // min / max position over the tokens each loading warp loaded
  int hi[kWarps];
};

// The block's ExplicitRows (one static shared object per kernel that calls this).
template <class S, int kBlockM, int kWarps>
__device__ __forceinline__ ExplicitRows<S, kBlockM, kWarps>& explicit_rows() {
  __shared__ ExplicitRows<S, kBlockM, kWarps> rows;
  return rows;
}

// A group of kGroupThreads threads (whole warps; `tid`: this thread's index in it, `warp`: its warp's
// slot in x.lo / x.hi) loads the tokens of packed rows [a, b] (inclusive, both inside the sequence):
// x.pos / x.batch at token - tok0. Every warp of the group writes its slot (INT_MAX / INT_MIN: none).
template <class S, int kGroupThreads, class X>
__device__ __forceinline__ void explicit_rows_load(const Params& p, X& x, int q_start, int tok0, int a, int b,
                                                   int tid, int warp) {
  int lo = 0x7fffffff, hi = -0x7fffffff - 1;
  for (int t = a / S::kGroupSize + tid; t <= b / S::kGroupSize; t += kGroupThreads) {
    const int pos = p.query_positions[q_start + t];
    x.pos[t - tok0] = pos;
    if constexpr (hooks_see_rows<S>()) x.batch[t - tok0] = p.functor_batch[q_start + t];
    lo = min(lo, pos);
    hi = max(hi, pos);
  }
  lo = __reduce_min_sync(0xffffffffu, lo);
  hi = __reduce_max_sync(0xffffffffu, hi);
  if (tid % 32 == 0) {
    x.lo[warp] = lo;
    x.hi[warp] = hi;
  }
}

// Min / max over slots [first, first + n) of x.lo / x.hi.
template <int kN, class X>
__device__ __forceinline__ void explicit_rows_range(const X& x, int first, int& lo, int& hi) {
  lo = x.lo[first];
  hi = x.hi[first];
#pragma unroll
  for (int i = 1; i < kN; ++i) {
    lo = min(lo, x.lo[first + i]);
    hi = max(hi, x.hi[first + i]);
  }
}

// What the hooks of one query row see: its position in the key frame (masks), the position and batch
// the hooks get, and the offset added to key positions for the hooks. Implicit positions: pos for both,
// the sequence index, no offset.
struct RowFrame {
  int pos;    // key frame: causal / window bounds
  int hpos;   // hooks' query position (pos + offset)
  int batch;  // hooks' batch
  int koff;   // added to key positions for the hooks
};

// Row `row`'s frame: `explicit_frame` (read once per kernel) where positions are explicit.
template <class S>
__device__ __forceinline__ RowFrame row_frame(const PrefillRow& row, int batch, const RowFrame& explicit_frame) {
  RowFrame f{row.pos, row.pos, batch, 0};
  if constexpr (S::kExplicitPositions) f = explicit_frame;
  return f;
}

// The output stores of one accumulator row, in both prefill kernels: each column pair scaled, through
// the output transform, poisoned if needed and stored as one 32-bit pair. o(d, e): this thread's
// accumulator of column 8 d + 2 tig + e; `out`: the row's output.
template <class S, int kDTiles, class Acc>
__device__ __forceinline__ void prefill_store_pairs(const Params& p, typename S::DTypeO* out, float scale,
                                                    const RowFrame& f, int head, int tig, float poison, Acc o) {
#pragma unroll
  for (int d = 0; d < kDTiles; ++d) {
    float v0 = o(d, 0) * scale, v1 = o(d, 1) * scale;
    if constexpr (S::kHasOutTransform) {
      bool oob = false;
      const int dim = d * 8 + 2 * tig;
      v0 = S::output_transform(p, v0, f.batch, head, f.hpos, dim, oob);
      v1 = S::output_transform(p, v1, f.batch, head, f.hpos, dim + 1, oob);
      if (oob) v0 = v1 = quiet_nan();
    }
    *reinterpret_cast<uint32_t*>(out + d * 8 + 2 * tig) = pack2<typename S::DTypeO>(v0 + poison, v1 + poison);
  }
}

// One score row of a key tile at keys n0 .. in both prefill kernels: logits through the variant,
// element masks unless full_tile, then the online-softmax step (the scores become the weights P;
// rescale_o(alpha) rescales the row's output). s(n, e): the row's score of key n0 + 8 n + 2 tig + e.
template <class S, int kNTiles, class Score, class RescaleO>
__device__ __forceinline__ void prefill_softmax_row(const Params& p, SoftmaxState& st, const PrefillRow& row,
                                                    const RowFrame& f, int kv_head, int n0, int tig, int kv_begin,
                                                    int kv_end, int qo_len, int kv_len, bool full_tile, bool& bad,
                                                    Score s, RescaleO rescale_o) {
  constexpr float kScale = q_prescale<S>();
  float tile_max = kNegInf;
  for_each_row_key<kNTiles>(n0, tig, [&](int n, int e, int kv_idx) {
    float v = transform_logit<S>(p, s(n, e) * kScale, f.batch, row.head, kv_head, f.hpos, kv_idx + f.koff, qo_len,
                                 kv_len, bad);
    if (!full_tile)
      v = apply_masks<S>(p, v, f.batch, row.head, kv_head, f.hpos, kv_idx + f.koff, qo_len, kv_len, bad,
                         [&](auto custom) {
                           return kv_idx < kv_end && kv_idx >= kv_begin && structurally_visible<S>(f.pos, kv_idx) &&
                                  custom();
                         });
    s(n, e) = v;
    tile_max = fmaxf(tile_max, v);
  });
  if constexpr (S::kSoftmax) {  // (without softmax the weights are the scores as they are)
    tile_max = group_max<4>(tile_max);
    softmax_update_deferred<kNTiles, 2>(st, tile_max, tile_max > st.m + kRescaleThreshold, s, rescale_o);
  }
}

// The epilogue of one accumulator row (packed row `packed`) in both prefill kernels: the quad's partial
// sums, finalize_state (sinks), then, for a row inside the sequence, its output pairs and lse.
// o(d, e): as prefill_store_pairs.
template <class S, int kDTiles, class Acc>
__device__ __forceinline__ void prefill_finish_row(const Params& p, SoftmaxState& st, int packed, const PrefillBlock& b,
                                                   const RowFrame& explicit_frame, int tig, float poison, Acc o) {
  const PrefillRow row = prefill_row<S>(packed, b.packed_end, b.qo_base, b.kv_head);
  const RowFrame f = row_frame<S>(row, b.batch, explicit_frame);
  st.d = group_sum<4>(st.d);
  float lse;
  const float scale = finalize_state<S>(p, row.head, st, lse);
  if (!row.valid) return;
  const long long row_head = static_cast<long long>(b.q_start + packed / S::kGroupSize) * S::kNumQoHeads + row.head;
  prefill_store_pairs<S, kDTiles>(p, p.o + row_head * S::kHeadDimVO, scale, f, row.head, tig, poison, o);
  if (tig == 0 && p.lse != nullptr) p.lse[row_head] = lse + poison;
}

// S = Q K^T for the warp's kMTiles x 16 rows and kBlockN keys (fp32 accumulators).
template <class S>
__device__ __forceinline__ void prefill_qk(float (&s)[PrefillTraits<S>::kMTiles][PrefillTraits<S>::kNTiles][4],
                                           const typename S::DTypeQ* sq, const typename S::DTypeQ* sk,
                                           int warp_row0, int lane) {
  using T = PrefillTraits<S>;
  using DT = typename T::DT;
#pragma unroll
  for (int mt = 0; mt < T::kMTiles; ++mt)
#pragma unroll
    for (int n = 0; n < T::kNTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[mt][n][i] = 0.f;
#pragma unroll
  for (int kk = 0; kk < T::kHeadDimPad / 16; ++kk) {
    uint32_t a[T::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < T::kMTiles; ++mt)
      ldmatrix_x4(a[mt], sq + (warp_row0 + mt * 16 + lane % 16) * T::kRowStride + kk * 16 + (lane / 16) * 8);
#pragma unroll
    for (int n2 = 0; n2 < T::kNTiles / 2; ++n2) {
      uint32_t b[4];  // keys n2*16 .. +15, dims kk*16 .. +15: B fragments of two n-tiles
      ldmatrix_x4(b, sk + (n2 * 16 + lane % 8 + (lane / 16) * 8) * T::kRowStride + kk * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
      for (int mt = 0; mt < T::kMTiles; ++mt) {
        mma_16816<DT>(s[mt][2 * n2], a[mt], b[0], b[1]);
        mma_16816<DT>(s[mt][2 * n2 + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// O += P V, where P (the probabilities in s) is used directly as the A operand: the accumulators
// of n-tiles (2k, 2k+1) are exactly the A fragment of k-step k (FA2's register reuse).
template <class S>
__device__ __forceinline__ void prefill_pv(float (&o)[PrefillTraits<S>::kMTiles][PrefillTraits<S>::kDTiles][4],
                                           const float (&s)[PrefillTraits<S>::kMTiles][PrefillTraits<S>::kNTiles][4],
                                           const typename S::DTypeQ* sv, int lane) {
  using T = PrefillTraits<S>;
  using DT = typename T::DT;
#pragma unroll
  for (int kk = 0; kk < T::kBlockN / 16; ++kk) {
    uint32_t a[T::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < T::kMTiles; ++mt) {
      a[mt][0] = pack2<DT>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
      a[mt][1] = pack2<DT>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
      a[mt][2] = pack2<DT>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
      a[mt][3] = pack2<DT>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int d2 = 0; d2 < T::kDTiles / 2; ++d2) {
      uint32_t b[4];  // keys kk*16 .. +15, dims d2*16 .. +15, transposed: B fragments of two n-tiles
      ldmatrix_x4_trans(b, sv + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * T::kRowStrideV + d2 * 16 + (lane / 16) * 8);
#pragma unroll
      for (int mt = 0; mt < T::kMTiles; ++mt) {
        mma_16816<DT>(o[mt][2 * d2], a[mt], b[0], b[1]);
        mma_16816<DT>(o[mt][2 * d2 + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// The query (kIsQuery) or key transform of one rotate_half pair: elements d and d + half (x0, x1) of
// packed query row / key `row` become y0, y1. Explicit positions (S::kExplicitPositions): a query row's
// position and batch come from `x` (token row / group - tok0, offset `off`); keys are at row + off
// (batch: the sequence's first token's).
template <class S, bool kIsQuery, class X>
__device__ __forceinline__ void transform_pair(const Params& p, float x0, float x1, float& y0, float& y1, int row,
                                               int end, int qo_base, int kv_head, int batch, int d, int half,
                                               bool& oob, const X* x, int tok0, int off) {
  if constexpr (kIsQuery) {
    const PrefillRow q = prefill_row<S>(row, end, qo_base, kv_head);
    int qpos = q.pos, qbatch = batch;
    if constexpr (S::kExplicitPositions) {
      const int i = row / S::kGroupSize - tok0;
      qpos = x->pos[i] + off;
      qbatch = x->batch[i];
    }
    y0 = S::query_transform(p, x0, -x1, qbatch, q.head, qpos, d, oob);
    y1 = S::query_transform(p, x1, x0, qbatch, q.head, qpos, d + half, oob);
  } else {
    y0 = S::key_transform(p, x0, -x1, batch, kv_head, row + off, d, oob);
    y1 = S::key_transform(p, x1, x0, batch, kv_head, row + off, d + half, oob);
  }
}

// Applies the query (kIsQuery) or key transform in place to kRows rows of a shared-memory tile, by
// kThreads threads, in rotate_half pairs (dim, dim + D/2) so no element is read after its partner was
// overwritten; at(r, d): element d of row r (both prefill kernels' tile layouts). Row r is packed query
// row first + r (queries) or key first + r (keys); rows at or past `end` are skipped. Explicit
// positions: as transform_pair (x, tok0, off).
template <class S, bool kIsQuery, int kRows, int kThreads, class At, class X>
__device__ __forceinline__ void transform_tile_rows(const Params& p, At at, int first, int end, int qo_base,
                                                    int kv_head, int batch, bool& oob, const X* x, int tok0, int off) {
  using DT = typename S::DTypeQ;
  constexpr int kHalf = S::kHeadDimQK / 2;
  for (int i = threadIdx.x; i < kRows * kHalf; i += kThreads) {
    const int r = i / kHalf, d = i % kHalf;
    if (first + r >= end) continue;
    DT* e0 = at(r, d);
    DT* e1 = at(r, d + kHalf);
    const float x0 = to_float(*e0), x1 = to_float(*e1);
    float y0, y1;
    transform_pair<S, kIsQuery>(p, x0, x1, y0, y1, first + r, end, qo_base, kv_head, batch, d, kHalf, oob, x, tok0,
                                off);
    *e0 = from_float<DT>(y0);
    *e1 = from_float<DT>(y1);
  }
}

// Q rows of the block -> shared memory by kThreads threads (rows past the sequence zero-filled), in both
// prefill kernels: chunk `chunk` (8 elements) of packed row packed0 + row goes to dst(row, chunk);
// head_offset(qo_head): where the head starts in a row of q.
template <class S, int kRows, int kChunks, int kThreads, class Dst, class HeadOffset>
__device__ __forceinline__ void prefill_load_q(const Params& p, int q_start, int kv_head, int packed0, int packed_end,
                                               Dst dst, HeadOffset head_offset) {
#pragma unroll
  for (int c = threadIdx.x; c < kRows * kChunks; c += kThreads) {
    const int row = c / kChunks, chunk = c % kChunks;
    const int packed = packed0 + row;
    const bool in = packed < packed_end;
    const int token = packed / S::kGroupSize, qo_head = kv_head * S::kGroupSize + packed % S::kGroupSize;
    const typename S::DTypeQ* src =
        in ? p.q + static_cast<long long>(q_start + token) * p.q_stride_token + head_offset(qo_head) + chunk * 8 : p.q;
    cp_async_16(dst(row, chunk), src, in);
  }
}

// Zeroes columns [kCol0, kCol1) (whole 16-byte chunks) of kRows rows, by kThreads threads; at(row, col):
// the address of element col of row `row` in the caller's tile layout.
template <int kRows, int kCol0, int kCol1, int kThreads, class At>
__device__ __forceinline__ void zero_pad_columns(At at) {
  constexpr int kPad = (kCol1 - kCol0) / 8;
  static_assert(kCol0 % 8 == 0 && kCol1 % 8 == 0, "pads are whole 16-byte chunks");
  if constexpr (kPad > 0) {
    for (int c = threadIdx.x; c < kRows * kPad; c += kThreads)
      *reinterpret_cast<uint4*>(at(c / kPad, kCol0 + (c % kPad) * 8)) = make_uint4(0, 0, 0, 0);
  }
}

// A padded head dim (PrefillTraits::kPadded): zero the pad columns of the Q tile and of every stage's
// K and V tiles once, before any load. No load or transform writes them afterwards, so zero Q and K
// pads add nothing to the scores and zero V pads fill only the output columns that are never stored.
template <class S>
__device__ __forceinline__ void prefill_zero_pads(typename S::DTypeQ* sq, typename S::DTypeQ* skv) {
  using T = PrefillTraits<S>;
  constexpr int kStageElems = T::kBlockN * (T::kRowStride + T::kRowStrideV);
  constexpr int kStageRows = T::kStages * T::kBlockN;
  zero_pad_columns<T::kBlockM, T::kHeadDim, T::kHeadDimPad, T::kThreads>(
      [&](int row, int col) { return sq + row * T::kRowStride + col; });
  zero_pad_columns<kStageRows, T::kHeadDim, T::kHeadDimPad, T::kThreads>([&](int row, int col) {
    return skv + (row / T::kBlockN) * kStageElems + (row % T::kBlockN) * T::kRowStride + col;
  });
  zero_pad_columns<kStageRows, T::kHeadDimVO, T::kHeadDimVOPad, T::kThreads>([&](int row, int col) {
    return skv + (row / T::kBlockN) * kStageElems + T::kBlockN * T::kRowStride + (row % T::kBlockN) * T::kRowStrideV +
           col;
  });
}

template <class S>
__device__ __forceinline__ void prefill_kernel(const Params& p) {
  using T = PrefillTraits<S>;
  using DT = typename T::DT;
  constexpr int MT = T::kMTiles;
  extern __shared__ __align__(16) uint8_t smem[];
  DT* sq = reinterpret_cast<DT*>(smem);
  DT* skv = reinterpret_cast<DT*>(smem + T::kQBytes);  // [stage]: K [kBlockN][kRowStride], V [kBlockN][kRowStrideV]
  constexpr int kStageElems = T::kBlockN * (T::kRowStride + T::kRowStrideV);
  auto stage_k = [&](int s) { return skv + s * kStageElems; };
  auto stage_v = [&](int s) { return skv + s * kStageElems + T::kBlockN * T::kRowStride; };
  auto stage_raw = [&](int s) {
    return smem + T::kQBytes + T::kStages * (T::kTileBytes + T::kTileBytesV) + s * T::kRawTileBytes;
  };

  // Heavy (late, causal) tiles first: walk the grid backwards.
  int batch, tile;
  if (!prefill_find_tile<S, T::kBlockM>(p, gridDim.x - 1 - blockIdx.x, batch, tile)) return;
  const PrefillBlock b = prefill_block<S, T::kBlockM>(p, batch, tile);
  const int kv_head = b.kv_head, q_start = b.q_start, qo_len = b.qo_len, kv_len = b.kv_len;
  const int packed0 = b.packed0, packed_end = b.packed_end, qo_base = b.qo_base;
  // Explicit positions: each warp loads the tokens of its rows (clamped into the sequence's rows);
  // frame[mt][r]: what row (mt, r)'s masks and hooks see (registers, read once).
  ExplicitRows<S, T::kBlockM, T::kNumWarps>* xr = nullptr;  // shared memory only where positions are explicit
  const int tok0 = packed0 / S::kGroupSize;
  int xoff = 0, kbatch = batch;  // hooks: position offset; the key transform's batch
  RowFrame frame[MT][2];
  int pos_lo = b.pos_lo, pos_hi = b.pos_hi;
  if constexpr (S::kExplicitPositions) {
    const int w = threadIdx.x / 32, w_row0 = packed0 + w * T::kWarpRows;
    xr = &explicit_rows<S, T::kBlockM, T::kNumWarps>();
    explicit_rows_load<S, 32>(p, *xr, q_start, tok0, min(w_row0, packed_end - 1),
                              min(w_row0 + T::kWarpRows - 1, packed_end - 1), threadIdx.x % 32, w);
    explicit_hook_offsets<S>(p, batch, q_start, xoff, kbatch);
    __syncthreads();
    explicit_rows_range<T::kNumWarps>(*xr, 0, pos_lo, pos_hi);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = min(w_row0 + (threadIdx.x % 32) / 4 + mt * 16 + 8 * r, packed_end - 1) / S::kGroupSize - tok0;
        const int pos = xr->pos[i];
        frame[mt][r] = RowFrame{pos, pos + xoff, hooks_see_rows<S>() ? xr->batch[i] : batch, xoff};
      }
  }
  int kv_begin, kv_end;
  bool bad = visible_keys<S>(sequence_ok<S>(p, batch, qo_len, kv_len), pos_lo, pos_hi, kv_len, kv_begin, kv_end);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tig = lane % 4;  // mma fragment coordinates: row group, thread in group
  const int warp_row0 = warp * T::kWarpRows;

  if constexpr (T::kPadded) prefill_zero_pads<S>(sq, skv);  // ordered before the first read by the loop's barrier
  prefill_load_q<S, T::kBlockM, T::kChunks, T::kThreads>(
      p, q_start, kv_head, packed0, packed_end, [&](int row, int chunk) { return sq + row * T::kRowStride + chunk * 8; },
      [&](int qo_head) { return qo_head * p.q_stride_head; });
  if constexpr (S::kHasQTransform) {  // Q gets its own group: transformed in place before any tile is used
    cp_async_commit();
  }
  const int n_first = (kv_begin / T::kBlockN) * T::kBlockN;
  // Prologue: Q and the first kStages - 1 tiles in flight (one commit group each; Q rides with tile 0).
#pragma unroll
  for (int stg = 0; stg < T::kStages - 1; ++stg) {
    const int n = n_first + stg * T::kBlockN;
    if (n < kv_end) prefill_load_kv<S>(p, stage_k(stg), stage_v(stg), stage_raw(stg), batch, kv_head, n, kv_end, bad);
    cp_async_commit();
  }
  if constexpr (S::kHasQTransform) {
    cp_async_wait<T::kStages - 1>();  // Q (the oldest group) has landed; the tiles may still be in flight
    __syncthreads();
    transform_tile_rows<S, true, T::kBlockM, T::kThreads>(
        p, [sq](int r, int d) { return sq + r * T::kRowStride + d; }, packed0, packed_end, qo_base, kv_head, batch, bad,
        xr, tok0, xoff);
    __syncthreads();
  }

  const int row0 = packed0 + warp_row0 + g;  // packed row of (mt, r) is row0 + mt * 16 + 8 * r
  float o[MT][T::kDTiles][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int d = 0; d < T::kDTiles; ++d)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[mt][d][i] = 0.f;
  SoftmaxState st[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) st[mt][0] = st[mt][1] = softmax_initial<S>();

  int it = 0;
  for (int n0 = n_first; n0 < kv_end; n0 += T::kBlockN, ++it) {
    cp_async_wait<T::kStages - 2>();
    __syncthreads();  // tile `it` landed for everyone, and everyone is done with tile it - 1's stage
    {
      const int n_next = n0 + (T::kStages - 1) * T::kBlockN;
      const int st_next = (it + T::kStages - 1) % T::kStages;
      if (n_next < kv_end)
        prefill_load_kv<S>(p, stage_k(st_next), stage_v(st_next), stage_raw(st_next), batch, kv_head, n_next, kv_end,
                           bad);
      cp_async_commit();
    }
    const int stage = it % T::kStages;
    if constexpr (T::kKvFp8) {
      prefill_widen_kv<S>(p, stage_raw(stage), stage_k(stage), stage_v(stage));
      __syncthreads();
    }
    if constexpr (S::kHasKTransform) {  // the cache holds raw keys: transform this tile in place
      DT* sk = stage_k(stage);
      transform_tile_rows<S, false, T::kBlockN, T::kThreads>(
          p, [sk](int r, int d) { return sk + r * T::kRowStride + d; }, n0, kv_end, 0, kv_head, kbatch, bad, xr, 0, xoff);
      __syncthreads();
    }

    float s[MT][T::kNTiles][4];
    prefill_qk<S>(s, sq, stage_k(stage), warp_row0, lane);

    // Variant, masks and the online softmax update. Element masks only on boundary tiles.
    const bool full_tile = !S::kHasMask && n0 + T::kBlockN <= kv_len &&
                           (!S::kCausal || n0 + T::kBlockN - 1 <= pos_lo) &&
                           (S::kWindowLeft < 0 || n0 >= pos_hi - S::kWindowLeft) &&
                           (S::kWindowRight < 0 || n0 + T::kBlockN - 1 <= pos_lo + S::kWindowRight);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const PrefillRow row = prefill_row<S>(row0 + mt * 16 + 8 * r, packed_end, qo_base, kv_head);
        prefill_softmax_row<S, T::kNTiles>(
            p, st[mt][r], row, row_frame<S>(row, batch, frame[mt][r]), kv_head, n0, tig, kv_begin, kv_end, qo_len,
            kv_len, full_tile, bad, [&](int n, int e) -> float& { return s[mt][n][2 * r + e]; }, [&](float alpha) {
#pragma unroll
              for (int d = 0; d < T::kDTiles; ++d) {
                o[mt][d][2 * r] *= alpha;
                o[mt][d][2 * r + 1] *= alpha;
              }
            });
      }

    prefill_pv<S>(o, s, stage_v(stage), lane);
  }
  cp_async_wait<0>();
  const float poison = __syncthreads_or(bad) ? quiet_nan() : 0.f;

  // Epilogue: finish each row (sum the quad's partial sums, fold sinks) and store.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      prefill_finish_row<S, T::kDTilesOut>(p, st[mt][r], row0 + mt * 16 + 8 * r, b, frame[mt][r], tig, poison,
                                           [&](int d, int e) { return o[mt][d][2 * r + e]; });
}

}  // namespace jitattn
