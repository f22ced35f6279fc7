// jitattn: multi-head latent attention (MLA) decode on Hopper warpgroup MMA (sm_90a only).
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
// MlaLaunch (attention.cu.j2) picks this kernel in the sm_90a cubin for the specs it serves (kSupported).
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
  // Specs served (the rest keep mla_decode_kernel): 16-bit q, a cache of q's dtype (an FP8 cache keeps the
  // mma.sync kernel: widening each tile in shared memory made this one slower there), latent rows
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
  {
    const DT* qbase = p.q + static_cast<long long>(q_row0) * p.q_stride_token;
    for (int e = threadIdx.x; e < T::kRows * T::kChunks; e += T::kThreads) {
      const int r = e / T::kChunks, c = e % T::kChunks;
      const int local = r0 + r;
      const bool in = r < n_rows;
      const DT* src = in ? qbase + static_cast<long long>(local / H) * p.q_stride_token + (local % H) * T::kDQK + c * 8
                         : p.q;
      cp_async_16(sq + swizzled_offset<T::kRows, T::kW>(r, c * 8), src, in);
    }
  }
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

// Grid (num_splits, tile slots, batch): a block loops over its sequence's ceil(q_len * H / 64) tiles in steps
// of gridDim.y. Metadata checks as mla_decode_kernel's.
template <class S>
__device__ __forceinline__ void mla_decode_sm90_kernel(const Params& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = MlaSm90Traits<S>;
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
  for (int tile = blockIdx.y; tile < tiles; tile += gridDim.y)
    mla_sm90_tile<S>(p, smem, split, num_splits, batch, q_row0, qo_len, kv_len, ok, tile);
#else
  __trap();  // only the sm_90a cubin dispatches here (MlaLaunch)
#endif
}

}  // namespace jitattn
