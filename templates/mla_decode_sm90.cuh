// jitattn: multi-head latent attention (MLA) decode on Hopper warpgroup MMA (sm_90a only): two kernels, one
// for groups of more than 32 heads (below) and one with swapped operands for smaller groups (the TP 8 shape;
// "swapped operands" further down).
//
// Same contract as mla_decode_kernel (mla_decode.cuh: the absorbed form, V a prefix of each latent row,
// every query of the batch, NaN for bad metadata, split-KV with a fused merge); what differs is the tile and
// the matrix engine. A tile is 64 consecutive *flattened query rows* of one sequence: q and o are
// (total_q, H, D), so local row r of a sequence is (token r / H, head r % H) and 64 rows pack several
// speculative / MTP queries (or pad a small group with zero rows: at 16 heads and one query, 48 of them).
// Each row's causal bound is its own token's position. 256 threads = 2 warpgroups over keys in tiles of
// kTileKeys (64), double-buffered with cp.async (all threads load tile j + 1 while computing tile j; page ids a
// tile ahead): warpgroup w computes S for keys 32w .. 32w + 31 (wgmma m64n32k16, Q and K from swizzled shared
// memory), the two exchange row maxima through shared memory so both take the same running max (their
// softmax states stay equal and need no merge), exchange their halves of P (bf16 register A fragments), then
// each runs O[:, w * D_vo / 2 ..] += P V (wgmma m64n256k16, V = the K tile's first D_vo columns as an
// N-major B). k_scale folds into the logit scale, v_scale into the output's. Layout: FlashMLA's published shape.
// MlaLaunch (attention.cu.j2) picks a kernel in the sm_90a cubin for the specs it serves (kSupported; the
// swapped-operand kernel first).
#pragma once

#include "common.cuh"
#include "decode.cuh"
#include "kv_load.cuh"
#include "prefill_sm90.cuh"
#include "softmax.cuh"
#include "variant.cuh"

namespace jitattn {

template <class S>
struct MlaSm90Traits {
  using DT = typename S::DTypeQ;
  using KV = typename S::DTypeKV;
  static constexpr int kDQK = S::kHeadDimQK, kDVO = S::kHeadDimVO;
  static constexpr int kRows = 64;  // flattened query rows per tile: the m64 of wgmma
  static constexpr int kThreads = 256;
  static constexpr int kTileKeys = 64;
  static constexpr int kWgKeys = kTileKeys / 2;  // S = Q K^T: keys per warpgroup
  static constexpr int kWgDims = kDVO / 2;       // O = P V: output dims per warpgroup (the wgmma N)
  static constexpr int kW = 64;                  // 128-byte swizzle: column blocks of 64 elements
  static constexpr int kChunks = kDQK / 8;       // 16-byte chunks of a 16-bit row
  static constexpr int kQBytes = kRows * kDQK * 2;
  static constexpr int kTileBytes = kTileKeys * kDQK * 2;
  static constexpr int kStagesBytes = 2 * kTileBytes;  // double-buffered cache tiles
  static constexpr int kPBytes = 2 * 8 * 128 * 4;  // P halves: [warpgroup][register][thread] (uint32)
  static constexpr int kRowBytes = 2 * kRows * 4;  // row maxima (then sums): [warpgroup][row] floats
  // +1024: the dynamic shared memory base is aligned up to a swizzle atom by hand.
  static constexpr int kSmemBytes = kQBytes + kStagesBytes + kPBytes + kRowBytes + 1024;
  static constexpr int kMinBlocksPerSM = 1;
  // Specs served (groups of up to 32 heads take MlaSm90SwapTraits first; the rest keep mla_decode_kernel): 16-bit
  // q, a cache of q's dtype (an FP8 cache keeps the mma.sync kernel: widening each tile in shared memory made this
  // one slower there; the swapped kernel's register widening is untried here), latent rows
  // of whole swizzle columns, each warpgroup's output dims whole column blocks of one wgmma (N <= 256), the
  // plain causal softmax (latent specs take no variants today; a variant keeps the mma.sync kernel).
  static constexpr bool kSupported =
      sizeof(DT) == 2 && kSameType<KV, DT> && S::kNumKvHeads == 1 &&
      kDQK % kW == 0 && kDVO % (2 * kW) == 0 && kWgDims <= 256 && kDVO < kDQK && S::kSoftmax &&
      !S::kLogitsNatural && !S::kHasMask && !S::kHasSinks && !S::kHasOutTransform && S::kWindowLeft < 0 &&
      kSmemBytes <= kSmemPerSm;
  // Merge scratch (merge_rows_last_block) reuses the Q tile once the key loop is done.
  static_assert(!kSupported || kQBytes >= (kRows * (kMaxSplits + 2) + 1) * 4, "the merge scratch fits in Q's tile");
};

// The cache rows of one tile, one thread per (row, quarter): thread t serves row `row` (t / 4, permuted as
// Sm90KvLoader does so that the two rows of 8 consecutive threads differ by 4 and their swizzled chunk sets
// are disjoint) and chunks sub + 4m. One page id per thread, fetched a tile ahead.
template <class S>
struct MlaSm90Loader {
  using T = MlaSm90Traits<S>;
  using KV = typename S::DTypeKV;
  static constexpr int kPerThread = T::kChunks / 4;
  static_assert(T::kChunks % 4 == 0, "a cache row is whole quarters of 16-byte chunks");
  int row, sub, page;
  __device__ __forceinline__ explicit MlaSm90Loader(int tid) {
    const int q = tid / 4;
    row = (q & ~7) | ((q & 6) >> 1) | ((q & 1) << 2);
    sub = tid % 4;
  }
  __device__ __forceinline__ void fetch(const Params& p, int batch, int start, int end) {
    const int kv_idx = start + row;
    page = kv_idx < end ? page_of<S>(p, batch, kv_idx) : 0;
  }
  // cp.async of keys [start, start + kTileKeys) (rows at or past `end` zero-filled) into `dst`: swizzled
  // rows. A page id out of range sets `bad`.
  __device__ __forceinline__ void load(const Params& p, KV* dst, int start, int end, bool& bad) const {
    const int kv_idx = start + row;
    const bool in = kv_idx < end;
    const KV* src = in ? kv_row_in_page<S>(p, page, 0, kv_idx, 0, bad) : p.kv_cache;
#pragma unroll
    for (int m = 0; m < kPerThread; ++m) {
      const int chunk = sub + 4 * m;
      cp_async_16(dst + swizzled_offset<T::kTileKeys, T::kW>(row, chunk * 8), in ? src + chunk * 8 : p.kv_cache, in);
    }
  }
};

// The tile's query rows (flattened (token, head) rows r0 .. r0 + n_rows - 1 of the sequence whose first query
// row is q_row0; rows past n_rows zero-filled) into a swizzled kRows x kDQK tile, by kThreads threads.
template <class S, int kRows, int kThreads>
__device__ __forceinline__ void mla_load_q_sm90(const Params& p, typename S::DTypeQ* sq, int q_row0, int r0,
                                                int n_rows) {
  using DT = typename S::DTypeQ;
  constexpr int H = S::kNumQoHeads, kChunks = S::kHeadDimQK / 8;
  const DT* qbase = p.q + static_cast<long long>(q_row0) * p.q_stride_token;
  for (int e = threadIdx.x; e < kRows * kChunks; e += kThreads) {
    const int r = e / kChunks, c = e % kChunks;
    const int local = r0 + r;
    const bool in = r < n_rows;
    const DT* src = in ? qbase + static_cast<long long>(local / H) * p.q_stride_token + (local % H) * S::kHeadDimQK + c * 8
                       : p.q;
    cp_async_16(sq + swizzled_offset<kRows, 64>(r, c * 8), src, in);
  }
}

// Tile `tile` of sequence `batch` (flattened rows [64 tile, 64 tile + 64) of its q_len * H, the rest padding)
// over the keys of split `split`: the pipeline, then the output, or this split's partial state and, in the
// last split block of the tile, the merge (merge_rows_last_block).
template <class S>
__device__ __forceinline__ void mla_sm90_tile(const Params& p, uint8_t* smem, int split, int num_splits, int batch,
                                              int q_row0, int qo_len, int kv_len, bool ok, int tile) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = MlaSm90Traits<S>;
  using DT = typename T::DT;
  using KV = typename S::DTypeKV;
  constexpr int H = S::kNumQoHeads;
  DT* sq = reinterpret_cast<DT*>(smem);
  KV* stage0 = reinterpret_cast<KV*>(smem + T::kQBytes);
  auto stage = [&](int s) { return stage0 + s * (T::kTileBytes / 2); };
  uint32_t* sp = reinterpret_cast<uint32_t*>(smem + T::kQBytes + T::kStagesBytes);
  float* srow = reinterpret_cast<float*>(smem + T::kQBytes + T::kStagesBytes + T::kPBytes);

  const int rows_total = qo_len * H;
  const int r0 = tile * T::kRows;                       // first local flattened row of the tile
  const int n_rows = min(T::kRows, rows_total - r0);    // real rows; the rest are zero padding
  const int tok_lo = r0 / H, tok_hi = (r0 + n_rows - 1) / H;
  int kv_begin, kv_end, lo, hi;
  bool bad = visible_keys<S>(ok, kv_len - qo_len + tok_lo, kv_len - qo_len + tok_hi, kv_len, kv_begin, kv_end);
  split_range<T::kTileKeys>(kv_begin, kv_end, split, num_splits, lo, hi);

  // Prologue: Q (rows past the tile's real rows zero-filled) and the first tile; page ids a tile ahead.
  mla_load_q_sm90<S, T::kRows, T::kThreads>(p, sq, q_row0, r0, n_rows);
  MlaSm90Loader<S> loader(threadIdx.x);
  loader.fetch(p, batch, lo, hi);
  if (lo < hi) loader.load(p, stage(0), lo, hi, bad);
  cp_async_commit();
  loader.fetch(p, batch, lo + T::kTileKeys, hi);

  const int wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tig = lane % 4;
  const int wt = threadIdx.x % 128;  // thread within its warpgroup
  // This thread's two accumulator rows (tile rows rr[0], rr[0] + 8) and their last visible key + 1.
  int rr[2], row_end[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    rr[r] = warp * 16 + g + 8 * r;
    const int tok = min(r0 + rr[r], r0 + n_rows - 1) / H;  // padding rows take the last real row's bound
    row_end[r] = min(hi, kv_len - qo_len + tok + 1);
  }
  const float qk_scale = q_prescale<S>() * p.k_scale;
  const uint64_t q_desc = swizzled_desc<T::kW>(sq, 16);
  auto kstep_off = [](int kk) {  // 16-byte units from a 64-row tile's start to k-step kk (16 columns)
    return static_cast<uint64_t>((((kk * 16) / T::kW) * 64 * T::kW + (kk * 16) % T::kW) * 2 / 16);
  };
  float o[T::kWgDims / 2];
#pragma unroll
  for (int i = 0; i < T::kWgDims / 2; ++i) o[i] = 0.f;
  SoftmaxState st[2] = {softmax_initial<S>(), softmax_initial<S>()};

  int it = 0;
  for (int start = lo; start < hi; start += T::kTileKeys, ++it) {
    cp_async_wait<0>();
    fence_proxy_async();  // this thread's cp.async writes, read next by wgmma (the async proxy)
    __syncthreads();      // the tile (and Q) landed; every thread is done with the previous tile
    {
      const int next = start + T::kTileKeys;
      if (next < hi) loader.load(p, stage((it + 1) % 2), next, hi, bad);
      cp_async_commit();
      loader.fetch(p, batch, next + T::kTileKeys, hi);
    }
    const DT* sk = reinterpret_cast<const DT*>(stage(it % 2));

    // S = Q K^T for this warpgroup's 32 keys (rows 32 wg .. of the tile: whole swizzle atoms).
    float s[T::kWgKeys / 2];
    {
      const uint64_t k_desc = swizzled_desc<T::kW>(sk + wg * T::kWgKeys * T::kW, 16);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < T::kDQK / 16; ++kk)
        wgmma_ss<T::kWgKeys, DT>(s, q_desc + kstep_off(kk), k_desc + kstep_off(kk), kk > 0 ? 1 : 0);
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operands(s);
    }
    // Scale, causal mask (each row its own bound), row maxima over this warpgroup's keys.
    const int key0 = start + wg * T::kWgKeys;
    float own_max[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float m = kNegInf;
#pragma unroll
      for (int n = 0; n < T::kWgKeys / 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int kv_idx = key0 + n * 8 + 2 * tig + e;
          float v = s[n * 4 + 2 * r + e] * qk_scale;
          v = kv_idx < row_end[r] ? v : kNegInf;
          s[n * 4 + 2 * r + e] = v;
          m = fmaxf(m, v);
        }
      own_max[r] = group_max<4>(m);
      if (tig == 0) srow[wg * T::kRows + rr[r]] = own_max[r];
    }
    named_barrier_sync(1, T::kThreads);
    // Both warpgroups take the same tile max, so their running states stay equal (deferred rescaling,
    // softmax_update_deferred's rule).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float tile_max = fmaxf(own_max[r], srow[(1 - wg) * T::kRows + rr[r]]);
      if (tile_max > st[r].m + kRescaleThreshold) {
        const float alpha = rescale_factor(st[r].m, tile_max);
        st[r].m = tile_max;
        st[r].d *= alpha;
#pragma unroll
        for (int d = 0; d < T::kWgDims / 8; ++d) {
          o[d * 4 + 2 * r] *= alpha;
          o[d * 4 + 2 * r + 1] *= alpha;
        }
      }
      const float m_use = st[r].m == kNegInf ? 0.f : st[r].m;
#pragma unroll
      for (int n = 0; n < T::kWgKeys / 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = fast_exp2(s[n * 4 + 2 * r + e] - m_use);
          s[n * 4 + 2 * r + e] = pe;
          st[r].d += pe;  // this warpgroup's share of the row sum
        }
    }
    // P: this warpgroup's half as A fragments (k-steps 2 wg, 2 wg + 1 of the tile); the other half from the
    // thread at the same place of the other warpgroup, which holds the same rows.
    uint32_t a[T::kTileKeys / 16][4];
    {
      uint32_t own[T::kWgKeys / 16][4];
      pack_p_fragments<DT>(s, own);
#pragma unroll
      for (int kk = 0; kk < T::kWgKeys / 16; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) sp[(wg * 8 + kk * 4 + i) * 128 + wt] = own[kk][i];
      named_barrier_sync(1, T::kThreads);
#pragma unroll
      for (int kk = 0; kk < T::kWgKeys / 16; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // selects, not a register array indexed by wg (that went to the stack)
          const uint32_t other = sp[((1 - wg) * 8 + kk * 4 + i) * 128 + wt];
          a[kk][i] = wg == 0 ? own[kk][i] : other;
          a[2 + kk][i] = wg == 0 ? other : own[kk][i];
        }
    }
    // O[:, wg * kWgDims ..] += P V: V is the tile's first kDVO columns, an N-major B (column blocks 64 rows x
    // 128 bytes apart).
    {
      const uint64_t v_desc =
          swizzled_desc<T::kW>(sk + (wg * T::kWgDims / T::kW) * T::kTileKeys * T::kW, T::kTileKeys * T::kW * 2);
      wgmma_fence_operands(o);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < T::kTileKeys / 16; ++kk)
        wgmma_rs<T::kWgDims, DT>(o, a[kk], v_desc + static_cast<uint64_t>(kk * 16 * T::kW * 2 / 16), 1);
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operands(o);
    }
  }
  cp_async_wait<0>();
  // Any thread's bad metadata poisons every output of the tile.
  const float poison = __syncthreads_or(bad) ? quiet_nan() : 0.f;
  float row_sum[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] = group_sum<4>(st[r].d);
    if (tig == 0) srow[wg * T::kRows + rr[r]] = row_sum[r];
  }
  __syncthreads();
  const bool split_kv = num_splits > 1;
  const long long flat0 = static_cast<long long>(q_row0) * H + r0;  // o / lse row of the tile's row 0
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float d = row_sum[r] + srow[(1 - wg) * T::kRows + rr[r]];
    if (rr[r] >= n_rows) continue;
    const long long row = flat0 + rr[r];
    const int head = (r0 + rr[r]) % H;
    float scale;
    float* dst = nullptr;
    if (!split_kv) {
      float lse;
      scale = finalize_state<S>(p, head, SoftmaxState{st[r].m, d}, lse) * p.v_scale;
      if (wg == 0 && tig == 0 && p.lse != nullptr) p.lse[row] = lse + poison;
    } else {  // normalised, base 2 (the merge's convention), rows of all splits total_q * H apart
      const long long part = static_cast<long long>(split) * p.total_q * H + row;
      scale = d > 0.f ? p.v_scale / d : 0.f;
      if (wg == 0 && tig == 0) p.partial_lse[part] = (d > 0.f ? st[r].m + __log2f(d) : kNegInf) + poison;
      dst = p.partial_o + part * T::kDVO;
    }
#pragma unroll
    for (int n = 0; n < T::kWgDims / 8; ++n) {
      const int dim = wg * T::kWgDims + n * 8 + 2 * tig;
      const float v0 = o[n * 4 + 2 * r] * scale + poison, v1 = o[n * 4 + 2 * r + 1] * scale + poison;
      if (split_kv) {
        *reinterpret_cast<float2*>(dst + dim) = make_float2(v0, v1);
      } else {
        store2<typename S::DTypeO>(p.o + row * T::kDVO + dim, v0, v1);
      }
    }
  }
  if (split_kv && p.split_counters != nullptr) {
    // One counter per (query row, 64-row tile slot of a query's heads): tile t of the sequence starting at
    // query row q_row0 counts at q_row0 * ceil(H / 64) + t (t < q_len * ceil(H / 64)).
    const long long counter = static_cast<long long>(q_row0) * ceil_div(H, T::kRows) + tile;
    merge_rows_last_block<S, T::kRows, T::kThreads>(p, reinterpret_cast<float*>(smem), n_rows,
                                                    FlatMergeRows<S>{flat0, counter});
  }
  __syncthreads();  // shared memory (rows, merge scratch) is read until here; the next tile loads into it
#endif
}

// ---- swapped operands: small groups (the TP 8 shape) -------------------------------------------------
// With 16 heads and one query, 48 of the 64 rows above are padding: 4x the MMA work the rows need, which makes
// the memory-bound shape compute-bound. Here the query rows are the wgmma N instead (kRows: 16 or 32) and the keys
// its M: S^T = K Q^T and O^T = V^T P^T, A from registers (ldmatrix of the K tile, ldmatrix.trans of its V
// columns), B from shared memory (Q, and P^T written there), both K-major. One warpgroup; thread (warp w, lane)
// holds keys 16w + lane / 4 (+ 8) of each tile and rows 8j + 2 (lane % 4) (+ 1), so a row's softmax runs over
// the M dimension: its maximum and sum meet across the 4 warps in shared memory, and every thread holding the
// row keeps the same running state. Cache rows arrive by bulk copy (cp.async.bulk, one per row, completing on
// the stage's mbarrier), issued by all 4 warps: with a 16-byte cp.async per thread and chunk, the copies' issue,
// not DRAM, was the limit (ncu, BENCHMARKS.md, #20). 16-bit tiles are row-major with rows padded by 16 bytes
// (ldmatrix's 8 rows hit distinct banks). An FP8 cache stays raw in shared memory (rows padded likewise) and its
// A fragments widen in registers (mla_fp8_k_fragments, mla_fp8_vt_fragments): half the shared-memory bytes of a
// 16-bit tile, so at 16 rows two blocks fit per SM. The swapped-operand form is the one FlashInfer and
// TensorRT-LLM use for small-M GEMMs; the tile and layouts are this kernel's own.
template <class S>
struct MlaSm90SwapTraits {
  using DT = typename S::DTypeQ;
  using KV = typename S::DTypeKV;
  static constexpr int kDQK = S::kHeadDimQK, kDVO = S::kHeadDimVO;
  static constexpr int kRows = S::kNumQoHeads <= 16 ? 16 : 32;  // flattened query rows per tile: the wgmma N
  static constexpr int kThreads = 128;
  static constexpr int kTileKeys = 64;  // the wgmma M of S^T
  static constexpr int kW = 64;         // Q and P^T: 128-byte swizzle
  static constexpr bool kFp8Cache = sizeof(KV) == 1;
  // An FP8 cache at 16 rows: 2 stages and 2 blocks per SM; at 32 rows (Q twice the size) 4 stages and one.
  static constexpr int kStages = kFp8Cache && kRows == 32 ? 4 : 2;
  static constexpr int kDBlocks = kDVO / 64;  // m64 blocks of O^T
  static constexpr int kCols = kRows / 4;     // query rows per thread
  static constexpr int kPitch = kDQK + 8;     // elements between the rows of a 16-bit tile
  static constexpr int kCacheRowBytes = kDQK * static_cast<int>(sizeof(KV));
  static constexpr int kStagePitch = kCacheRowBytes + 16;  // bytes between staged rows (8 ldmatrix rows: 8 banks)
  static constexpr int kKGroup = kRows == 16 ? 12 : kFp8Cache ? 4 : 6;  // S^T k-steps whose A fragments load together
  static constexpr int kVGroup = kRows == 16 ? 2 : 1;   // O^T k-steps likewise
  static constexpr int kQBytes = kRows * kDQK * 2;
  static constexpr int kStageBytes = kTileKeys * kStagePitch;
  static constexpr int kPBytes = kRows * kTileKeys * 2;
  static constexpr int kColBytes = 4 * kRows * 4;  // [warp][row] floats: maxima, then sums
  static constexpr int kBarBytes = 8 * kStages;
  static constexpr int kSmemBytes =
      kQBytes + kStages * kStageBytes + kPBytes + kColBytes + kBarBytes + 1024;
  static constexpr int kMinBlocksPerSM = kFp8Cache && kRows == 16 ? 2 : 1;
  static constexpr bool kSupported =
      sizeof(DT) == 2 && (kSameType<KV, DT> || kSameType<KV, __nv_fp8_e4m3>) && S::kNumKvHeads == 1 &&
      S::kNumQoHeads <= 32 && kDQK % kW == 0 && kDVO % kW == 0 && kDVO < kDQK && kDQK % 16 == 0 && S::kSoftmax &&
      !S::kLogitsNatural && !S::kHasMask && !S::kHasSinks && !S::kHasOutTransform && S::kWindowLeft < 0 &&
      kSmemBytes <= kSmemPerSm;
  static_assert(!kSupported || kQBytes >= (kRows * (kMaxSplits + 2) + 1) * 4, "the merge scratch fits in Q's tile");
};

// The cache rows of one 64-key tile by bulk copy: lane l < 16 of warp w copies row 16w + l (one cp.async.bulk;
// the copies of a warp issue one after another, so all 4 warps share them) or zero-fills it at or past `end`,
// so that no stale or uninitialised value meets a masked key's zero weight. Each warp's lane 0 declares its
// rows' bytes on the stage's barrier (initialised for 4 arrivals) before they are copied. Page ids are fetched a
// tile ahead; a page id out of range sets `bad` and reads page 0 (kv_row_in_page).
template <class S>
struct MlaBulkLoader {
  using T = MlaSm90SwapTraits<S>;
  static constexpr int kRowsPerWarp = T::kTileKeys / 4;
  int page;
  __device__ __forceinline__ int row() const { return threadIdx.x / 32 * kRowsPerWarp + threadIdx.x % kRowsPerWarp; }
  __device__ __forceinline__ void fetch(const Params& p, int batch, int start, int end) {
    const int kv_idx = start + row();
    page = kv_idx < end ? page_of<S>(p, batch, kv_idx) : 0;
  }
  __device__ __forceinline__ void issue(const Params& p, uint8_t* dst, uint64_t* bar, int start, int end,
                                        bool& bad) const {
    const int lane = threadIdx.x % 32, first = start + threadIdx.x / 32 * kRowsPerWarp;
    const int rows = max(0, min(kRowsPerWarp, end - first));
    if (lane == 0) mbar_arrive_expect_tx(bar, static_cast<uint32_t>(rows * T::kCacheRowBytes));
    __syncwarp();
    if (lane >= kRowsPerWarp) return;
    const int kv_idx = start + row();
    uint8_t* to = dst + row() * T::kStagePitch;
    if (kv_idx < end) {
      bulk_copy_g2s(to, kv_row_in_page<S>(p, page, 0, kv_idx, 0, bad), T::kCacheRowBytes, bar);
    } else {
      for (int c = 0; c < T::kCacheRowBytes / 16; ++c) reinterpret_cast<uint4*>(to)[c] = make_uint4(0, 0, 0, 0);
    }
  }
};

// Four e4m3 values (the bytes of q) as two pairs of 16-bit DT: lo = bytes 0 and 2, hi = bytes 1 and 3
// (e4m3x4_to_f16x4's order; exact: every e4m3 value is a bf16 and an f16), times 1 / kE4m3Unscale.
template <class DT>
__device__ __forceinline__ void e4m3x4_to_pairs(uint32_t q, uint32_t& lo, uint32_t& hi) {
  e4m3x4_to_f16x4(q, lo, hi);
  if constexpr (kSameType<DT, __nv_bfloat16>) {
    const float2 l = __half22float2(*reinterpret_cast<const __half2*>(&lo));
    const float2 h = __half22float2(*reinterpret_cast<const __half2*>(&hi));
    lo = pack2<DT>(l.x, l.y);
    hi = pack2<DT>(h.x, h.y);
  }
}

// FP8 cache, S^T's A: k-steps kk and kk + 1 (32 head dims) of this thread's two key rows from the raw tile, one
// ldmatrix.x4 (m0 / m1: keys 0-7 / 8-15 at bytes 16 kk .. + 15, m2 / m3 the next 16 bytes). A thread's register
// holds dims 4 tig .. 4 tig + 3 of a 16-dim step, widened to pairs (4 tig, 4 tig + 2) and (4 tig + 1, 4 tig + 3):
// the fragment's k order is every step's even dims, then its odd ones, and Q is stored in that order
// (mla_deinterleave_q).
template <class S>
__device__ __forceinline__ void mla_fp8_k_fragments(const uint8_t* raw, int kk, uint32_t (&a0)[4], uint32_t (&a1)[4]) {
  using T = MlaSm90SwapTraits<S>;
  const int lane = threadIdx.x % 32;
  const int row = threadIdx.x / 32 * 16 + lane % 8 + 8 * ((lane / 8) % 2);
  uint32_t r[4];
  ldmatrix_x4(r, raw + row * T::kStagePitch + kk * 16 + 16 * (lane / 16));
  e4m3x4_to_pairs<typename S::DTypeQ>(r[0], a0[0], a0[2]);
  e4m3x4_to_pairs<typename S::DTypeQ>(r[1], a0[1], a0[3]);
  e4m3x4_to_pairs<typename S::DTypeQ>(r[2], a1[0], a1[2]);
  e4m3x4_to_pairs<typename S::DTypeQ>(r[3], a1[1], a1[3]);
}

// FP8 cache, O^T's A: keys 16 kk .. 16 kk + 15 of output blocks b and b + 1 (this warp's 16 dims of each), one
// ldmatrix.x4.trans (m0 / m1: keys 0-7 / 8-15 of block b, m2 / m3 of block b + 1). On 8-bit data the transpose
// moves byte pairs: a register holds keys (2 tig, 2 tig + 1) x dims (2 g, 2 g + 1), widened to one pair per dim,
// so fragment row g is dim 2 g and row g + 8 dim 2 g + 1 (the epilogue's `dim`).
template <class S>
__device__ __forceinline__ void mla_fp8_vt_fragments(const uint8_t* raw, int kk, int b, uint32_t (&v0)[4],
                                                     uint32_t (&v1)[4]) {
  using T = MlaSm90SwapTraits<S>;
  const int lane = threadIdx.x % 32;
  const int key = kk * 16 + lane % 8 + 8 * ((lane / 8) % 2);
  uint32_t r[4];
  ldmatrix_x4_trans(r, raw + key * T::kStagePitch + 64 * (b + lane / 16) + 16 * (threadIdx.x / 32));
  e4m3x4_to_pairs<typename S::DTypeQ>(r[0], v0[0], v0[1]);
  e4m3x4_to_pairs<typename S::DTypeQ>(r[1], v0[2], v0[3]);
  e4m3x4_to_pairs<typename S::DTypeQ>(r[2], v1[0], v1[1]);
  e4m3x4_to_pairs<typename S::DTypeQ>(r[3], v1[2], v1[3]);
}

// FP8 cache: every 16 dims of each Q row in the k order of mla_fp8_k_fragments (even dims, then odd ones).
template <class S, int N>
__device__ __forceinline__ void mla_deinterleave_q(typename S::DTypeQ* sq) {
  constexpr int kSteps = S::kHeadDimQK / 16;
  for (int e = threadIdx.x; e < N * kSteps; e += MlaSm90SwapTraits<S>::kThreads) {
    const int r = e / kSteps, k = 16 * (e % kSteps);
    uint4* lo = reinterpret_cast<uint4*>(sq + swizzled_offset<N, 64>(r, k));
    uint4* hi = reinterpret_cast<uint4*>(sq + swizzled_offset<N, 64>(r, k + 8));
    const uint4 x = *lo, y = *hi;
    *lo = make_uint4(__byte_perm(x.x, x.y, 0x5410), __byte_perm(x.z, x.w, 0x5410), __byte_perm(y.x, y.y, 0x5410),
                     __byte_perm(y.z, y.w, 0x5410));
    *hi = make_uint4(__byte_perm(x.x, x.y, 0x7632), __byte_perm(x.z, x.w, 0x7632), __byte_perm(y.x, y.y, 0x7632),
                     __byte_perm(y.z, y.w, 0x7632));
  }
}

template <class S>
__device__ __forceinline__ void mla_sm90_swap_tile(const Params& p, uint8_t* smem, int split, int num_splits,
                                                   int batch, int q_row0, int qo_len, int kv_len, bool ok, int tile) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = MlaSm90SwapTraits<S>;
  using DT = typename T::DT;
  constexpr int H = S::kNumQoHeads, N = T::kRows, kW = T::kW;
  DT* sq = reinterpret_cast<DT*>(smem);
  uint8_t* stages = smem + T::kQBytes;
  auto stage = [&](int s) { return stages + s * T::kStageBytes; };
  DT* sp = reinterpret_cast<DT*>(stages + T::kStages * T::kStageBytes);
  float* scol = reinterpret_cast<float*>(stages + T::kStages * T::kStageBytes + T::kPBytes);
  uint64_t* bars = reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(scol) + T::kColBytes);

  const int rows_total = qo_len * H;
  const int r0 = tile * N;
  const int n_rows = min(N, rows_total - r0);
  const int tok_lo = r0 / H, tok_hi = (r0 + n_rows - 1) / H;
  int kv_begin, kv_end, lo, hi;
  bool bad = visible_keys<S>(ok, kv_len - qo_len + tok_lo, kv_len - qo_len + tok_hi, kv_len, kv_begin, kv_end);
  split_range<T::kTileKeys>(kv_begin, kv_end, split, num_splits, lo, hi);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tig = lane % 4;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < T::kStages; ++s) mbar_init(&bars[s], 4);  // one arrival per warp (MlaBulkLoader)
    fence_mbarrier_init();
  }
  mla_load_q_sm90<S, N, T::kThreads>(p, sq, q_row0, r0, n_rows);
  cp_async_commit();
  __syncthreads();  // the barriers are initialised
  // Every stage fills in the prologue; a stage refills as soon as its tile is read.
  MlaBulkLoader<S> loader;
  auto refill = [&](int s, int start) {
    if (start < hi) {
      loader.issue(p, stage(s), &bars[s], start, hi, bad);
      loader.fetch(p, batch, start + T::kTileKeys, hi);
    }
  };
  loader.fetch(p, batch, lo, hi);
#pragma unroll
  for (int s = 0; s < T::kStages; ++s) refill(s, lo + s * T::kTileKeys);
  cp_async_wait<0>();
  if constexpr (T::kFp8Cache) {
    __syncthreads();
    mla_deinterleave_q<S, N>(sq);
  }
  fence_proxy_async();  // Q (cp.async) and the zero-filled rows, read by wgmma / ldmatrix next
  __syncthreads();

  auto col_of = [&](int c) { return 8 * (c / 2) + 2 * tig + c % 2; };  // query row (tile-local) of column c
  int col_end[T::kCols];  // each row's last visible key + 1 (padding rows take the last real row's)
#pragma unroll
  for (int c = 0; c < T::kCols; ++c) {
    const int tok = min(r0 + col_of(c), r0 + n_rows - 1) / H;
    col_end[c] = min(hi, kv_len - qo_len + tok + 1);
  }
  const float unscale = T::kFp8Cache ? kE4m3Unscale : 1.f;  // what the widened FP8 values are multiplied by
  const float qk_scale = q_prescale<S>() * p.k_scale * unscale;
  const uint64_t q_desc = swizzled_desc<kW>(sq, 16);
  const uint64_t p_desc = swizzled_desc<kW>(sp, 16);
  auto qstep_off = [](int kk) {  // 16-byte units from Q's start to k-step kk (column blocks of N rows)
    return static_cast<uint64_t>((((kk * 16) / kW) * N * kW + (kk * 16) % kW) * 2 / 16);
  };
  // ldmatrix row addresses (matrices 0-3 of an x4: rows 0-7 / 8-15 x columns 0-7 / 8-15 of a 16 x 16 block)
  const int a_row = warp * 16 + lane % 8 + 8 * ((lane / 8) % 2), a_col = 8 * (lane / 16);  // K: keys x dims
  const int v_key = lane % 8 + 8 * (lane / 16), v_dim = warp * 16 + 8 * ((lane / 8) % 2);  // V^T, transposed
  float o[T::kDBlocks][N / 2];
#pragma unroll
  for (int b = 0; b < T::kDBlocks; ++b)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) o[b][i] = 0.f;
  SoftmaxState st[T::kCols];
#pragma unroll
  for (int c = 0; c < T::kCols; ++c) st[c] = softmax_initial<S>();

  int it = 0;
  for (int start = lo; start < hi; start += T::kTileKeys, ++it) {
    mbar_wait(&bars[it % T::kStages], (it / T::kStages) & 1);  // tile `it` landed
    const uint8_t* raw = stage(it % T::kStages);
    const DT* sk = reinterpret_cast<const DT*>(raw);
    // S^T = K Q^T: 64 keys x N rows; A fragments kKGroup k-steps at a time, in two register sets (group g + 1
    // loads while group g multiplies).
    float s[N / 2];
    {
      uint32_t a[2][T::kKGroup][4];
      constexpr int kGroups = T::kDQK / 16 / T::kKGroup;
#pragma unroll
      for (int gi = 0; gi < kGroups; ++gi) {
        const int k0 = gi * T::kKGroup;
        if constexpr (T::kFp8Cache) {
#pragma unroll
          for (int i = 0; i < T::kKGroup; i += 2)
            mla_fp8_k_fragments<S>(raw, k0 + i, a[gi % 2][i], a[gi % 2][i + 1]);
        } else {
#pragma unroll
          for (int i = 0; i < T::kKGroup; ++i)
            ldmatrix_x4(a[gi % 2][i], sk + a_row * T::kPitch + (k0 + i) * 16 + a_col);
        }
        wgmma_fence();
#pragma unroll
        for (int i = 0; i < T::kKGroup; ++i)
          wgmma_rs_kb<N, DT>(s, a[gi % 2][i], q_desc + qstep_off(k0 + i), k0 + i > 0 ? 1 : 0);
        wgmma_commit();
        if (gi > 0) {
          wgmma_wait<1>();  // group gi - 1 is done: its fragments' registers may be reused
#pragma unroll
          for (int i = 0; i < T::kKGroup; ++i)
            wgmma_keep_fragment(a[(gi + 1) % 2][i]);
        }
      }
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < T::kKGroup; ++i)
        wgmma_keep_fragment(a[(kGroups - 1) % 2][i]);
      wgmma_fence_operands(s);
    }
    // Scale, causal mask (each row its own bound), each row's maximum over this warp's 16 keys.
    const int key0 = start + warp * 16 + g;
#pragma unroll
    for (int c = 0; c < T::kCols; ++c) {
      float m = kNegInf;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = (c / 2) * 4 + 2 * r + c % 2;
        float v = s[i] * qk_scale;
        v = key0 + 8 * r < col_end[c] ? v : kNegInf;
        s[i] = v;
        m = fmaxf(m, v);
      }
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
      if (g == 0) scol[warp * N + col_of(c)] = m;
    }
    __syncthreads();
    // Every thread holding a row takes the same tile maximum, so the running states stay equal (deferred
    // rescaling, softmax_update_deferred's rule); this thread's keys add its share of the row sum.
#pragma unroll
    for (int c = 0; c < T::kCols; ++c) {
      const int col = col_of(c);
      const float tile_max = fmaxf(fmaxf(scol[col], scol[N + col]), fmaxf(scol[2 * N + col], scol[3 * N + col]));
      if (tile_max > st[c].m + kRescaleThreshold) {
        const float alpha = rescale_factor(st[c].m, tile_max);
        st[c].m = tile_max;
        st[c].d *= alpha;
#pragma unroll
        for (int b = 0; b < T::kDBlocks; ++b) {
          o[b][(c / 2) * 4 + c % 2] *= alpha;
          o[b][(c / 2) * 4 + 2 + c % 2] *= alpha;
        }
      }
      const float m_use = st[c].m == kNegInf ? 0.f : st[c].m;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = (c / 2) * 4 + 2 * r + c % 2;
        const float pe = fast_exp2(s[i] - m_use);
        st[c].d += pe;
        sp[swizzled_offset<N, kW>(col, warp * 16 + g + 8 * r)] = from_float<DT>(pe);  // P^T, K-major
      }
    }
    fence_proxy_async();  // P^T, read next by wgmma
    __syncthreads();
    // O^T += V^T P^T: block b is output dims 64b .. 64b + 63; A fragments kVGroup k-steps (16 keys) at a time.
#pragma unroll
    for (int k0 = 0; k0 < T::kTileKeys / 16; k0 += T::kVGroup) {
      uint32_t v[T::kVGroup][T::kDBlocks][4];
#pragma unroll
      for (int i = 0; i < T::kVGroup; ++i) {
        if constexpr (T::kFp8Cache) {
#pragma unroll
          for (int b = 0; b < T::kDBlocks; b += 2) mla_fp8_vt_fragments<S>(raw, k0 + i, b, v[i][b], v[i][b + 1]);
        } else {
#pragma unroll
          for (int b = 0; b < T::kDBlocks; ++b)
            ldmatrix_x4_trans(v[i][b], sk + ((k0 + i) * 16 + v_key) * T::kPitch + 64 * b + v_dim);
        }
      }
#pragma unroll
      for (int b = 0; b < T::kDBlocks; ++b) wgmma_fence_operands(o[b]);
      wgmma_fence();
#pragma unroll
      for (int i = 0; i < T::kVGroup; ++i)
#pragma unroll
        for (int b = 0; b < T::kDBlocks; ++b) wgmma_rs_kb<N, DT>(o[b], v[i][b], p_desc + (k0 + i) * 2, 1);
      wgmma_commit();
      wgmma_wait<0>();
#pragma unroll
      for (int b = 0; b < T::kDBlocks; ++b) wgmma_fence_operands(o[b]);
    }
    __syncthreads();  // every thread has read the stage: it refills
    refill(it % T::kStages, start + T::kStages * T::kTileKeys);
  }
  // Any thread's bad metadata poisons every output of the tile (the barrier also ends the loop's reads of scol).
  const float poison = __syncthreads_or(bad) ? quiet_nan() : 0.f;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < T::kStages; ++s) mbar_inval(&bars[s]);  // every issued tile was waited for
  }
#pragma unroll
  for (int c = 0; c < T::kCols; ++c) {
    float d = st[c].d;
    d += __shfl_xor_sync(0xffffffffu, d, 4);
    d += __shfl_xor_sync(0xffffffffu, d, 8);
    d += __shfl_xor_sync(0xffffffffu, d, 16);
    if (g == 0) scol[warp * N + col_of(c)] = d;
  }
  __syncthreads();
  const bool split_kv = num_splits > 1;
  const long long flat0 = static_cast<long long>(q_row0) * H + r0;  // o / lse row of the tile's row 0
#pragma unroll
  for (int c = 0; c < T::kCols; ++c) {
    const int col = col_of(c);
    if (col >= n_rows) continue;
    const float d = scol[col] + scol[N + col] + scol[2 * N + col] + scol[3 * N + col];
    const long long row = flat0 + col;
    const int head = (r0 + col) % H;
    float scale;
    float* dst = nullptr;
    if (!split_kv) {
      float lse;
      scale = finalize_state<S>(p, head, SoftmaxState{st[c].m, d}, lse) * p.v_scale * unscale;
      if (warp == 0 && g == 0 && p.lse != nullptr) p.lse[row] = lse + poison;
    } else {  // normalised, base 2 (the merge's convention), rows of all splits total_q * H apart
      const long long part = static_cast<long long>(split) * p.total_q * H + row;
      scale = d > 0.f ? p.v_scale * unscale / d : 0.f;
      if (warp == 0 && g == 0) p.partial_lse[part] = (d > 0.f ? st[c].m + __log2f(d) : kNegInf) + poison;
      dst = p.partial_o + part * T::kDVO;
    }
#pragma unroll
    for (int b = 0; b < T::kDBlocks; ++b)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int dim = 64 * b + 16 * warp + (T::kFp8Cache ? 2 * g + r : g + 8 * r);  // mla_fp8_vt_fragments
        const float v = o[b][(c / 2) * 4 + 2 * r + c % 2] * scale + poison;
        if (split_kv) {
          dst[dim] = v;
        } else {
          p.o[row * T::kDVO + dim] = from_float<typename S::DTypeO>(v);
        }
      }
  }
  if (split_kv && p.split_counters != nullptr) {
    const long long counter = static_cast<long long>(q_row0) * ceil_div(H, N) + tile;  // as mla_sm90_tile's
    merge_rows_last_block<S, N, T::kThreads>(p, reinterpret_cast<float*>(smem), n_rows,
                                             FlatMergeRows<S>{flat0, counter});
  }
  __syncthreads();  // shared memory (sums, merge scratch) is read until here; the next tile loads into it
#endif
}

// Grid (num_splits, tile slots, batch): a block loops over its sequence's ceil(q_len * H / kRows) tiles in steps
// of gridDim.y; T (MlaSm90Traits or MlaSm90SwapTraits) picks the tile. Metadata checks as mla_decode_kernel's.
template <class S, class T>
__device__ __forceinline__ void mla_decode_sm90_kernel(const Params& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(16) uint8_t smem_mla[];
  uint8_t* smem = smem_mla + ((1024u - (smem_u32(smem_mla) & 1023u)) & 1023u);
  const int split = blockIdx.x, batch = blockIdx.z;
  const int num_splits = p.num_splits;
  if (split >= num_splits) return;
  int q_row0, q_end, kv_len;
  if (!latent_rows(p, batch, q_row0, q_end, kv_len)) return;
  const int qo_len = q_end - q_row0;
  const bool ok = sequence_ok<S>(p, qo_len, kv_len);
  const int tiles = ceil_div(qo_len * S::kNumQoHeads, T::kRows);
  for (int tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
    if constexpr (kSameType<T, MlaSm90SwapTraits<S>>)
      mla_sm90_swap_tile<S>(p, smem, split, num_splits, batch, q_row0, qo_len, kv_len, ok, tile);
    else
      mla_sm90_tile<S>(p, smem, split, num_splits, batch, q_row0, qo_len, kv_len, ok, tile);
  }
#else
  __trap();  // only the sm_90a cubin dispatches here (MlaLaunch)
#endif
}

}  // namespace jitattn
