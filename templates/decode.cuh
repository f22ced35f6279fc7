// jitattn: decode over the paged KV cache. One query row per sequence; memory-bound.
//
// One thread block serves (sequence, kv_head, split): all query heads of the GQA group share one
// read of each K/V row. K and V tiles stream into shared memory through cp.async, kStages deep,
// 16 bytes per thread per load. Threads form a (kBdx, kBdy, kBdz) grid: kBdx lanes along the head
// dim, kBdy query heads of the group, kBdz key slots. An FP8 row that ends in half a 16-byte chunk
// (head dims 72, 88, ...) moves in 8-byte chunks instead, copies, lanes and loads alike, so no row is
// padded. Each (ty, tz) keeps its own online-softmax state; states merge across tz at the end, and
// across splits (split-KV, partial states combined by log-sum-exp as in FlashDecoding, Dao et al. 2023)
// in the last split block of each (sequence, kv head) to finish (merge_splits_last_block).
#pragma once

#include "common.cuh"
#include "kv_load.cuh"
#include "softmax.cuh"
#include "variant.cuh"

namespace jitattn {

template <class S>
struct DecodeTraits {
  using DTypeKV = typename S::DTypeKV;
  static constexpr int kHeadDim = S::kHeadDimQK;
  static constexpr int kVec = kv_copy_bytes<S>() / sizeof(DTypeKV);  // elements per load (16 bytes, or 8)
  static constexpr int kChunks = kHeadDim / kVec;                      // chunks per K/V row
  static constexpr int kBdx = next_pow2(kChunks);     // lanes along head_dim (idle lanes when not a power of two)
  // Each thread serves up to 4 query heads of the group, so each K/V element it loads is converted
  // once and used for several heads (a thread per head converted each element group-size times: the
  // decode was issue-bound). 8 heads spill at 3 blocks/SM.
  static constexpr int kMaxHeadsPerThread = cmax(1, 32 / kVec);  // q and o: <= 32 floats each per thread
  static constexpr int kHeadsPerThread = ceil_div(S::kGroupSize, ceil_div(S::kGroupSize, kMaxHeadsPerThread));
  static constexpr int kBdy = ceil_div(S::kGroupSize, kHeadsPerThread);
  // Enough key slots for ~128 threads, rounded so the block is whole warps.
  static constexpr int kBdz = round_up(ceil_div(128, kBdx * kBdy), 32 / gcd(kBdx * kBdy, 32));
  static constexpr int kThreads = kBdx * kBdy * kBdz;
  // Register cap (memory-bound: occupancy first): 4 blocks per SM on a 16-bit cache; an FP8 cache (no
  // faster at 4) and key transforms (rope spills 64-166 bytes at 4's 128 registers) keep 3.
  static constexpr int kMinBlocksPerSM = sizeof(DTypeKV) == 2 && !S::kHasKTransform ? 4 : 3;
  // Keys per thread per tile: 4 (8 ran slower on Gemma-2 hd256).
  static constexpr int kMaxKeysPerThread = 4;
  // Scores of kKeysPerThread keys x kHeadsPerThread heads stay in registers: at most 32 of them.
  static constexpr int kKeysPerThread =
      cmax(1, cmin(cmin(ceil_div(32, kBdz), 32 / kHeadsPerThread), kMaxKeysPerThread));
  static constexpr int kTileKeys = kBdz * kKeysPerThread;  // keys per pipeline stage
  static constexpr int kRowBytes = kHeadDim * sizeof(DTypeKV);
  static constexpr int kStageBytes = 2 * kTileKeys * kRowBytes;  // K and V of one tile
  // ~48 KB of stages: 4 blocks (16 warps) per SM, each with 2 tiles in flight while it computes a third.
  static constexpr int kStageBudgetBytes = 48 * 1024;
  static constexpr int kStages = cmax(2, cmin(4, kStageBudgetBytes / kStageBytes));
  static constexpr int kSlots = kBdy * kHeadsPerThread;  // group-local head slots (>= group size)
  static constexpr int kMergeBytes = (kBdz * kSlots * (kHeadDim + 2) + kSlots) * 4;
  static constexpr int kSmemBytes = cmax(kStages * kStageBytes, kMergeBytes);

  static_assert(kHeadDim % kVec == 0, "head_dim must be a whole number of chunks");
  static_assert(kBdx <= 32, "one K/V row must fit in one warp's lanes (head_dim <= 256)");
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "decode block must be whole warps");
  // Whether the rotate_half partner of a lane's chunk is one whole chunk D/2 away; else (72, 88: D/2
  // ends mid-chunk) the transforms read the partners one by one.
  static constexpr bool kPartnerChunks = (kHeadDim / 2) % kVec == 0;
  // A key transform sees the dequantised key (as the reference and prefill do), so an FP8 cache's
  // k_scale multiplies the key before it, not q: a transform need not be linear (x + c is not).
  static constexpr bool kScaleKeys = S::kHasKTransform && sizeof(DTypeKV) == 1;
};

// decode_kernel's read of a lane's chunk of a staged K/V row: V elements of DT at `addr` (16 bytes, or 8),
// into floats `out`, zeros where !lane_has_dims. A macro: as a function, inlined, it changed nvcc's code
// for 16-byte chunks.
#define JITATTN_DECODE_READ_CHUNK(out, addr)                         \
  if constexpr (V * sizeof(DT) == 16) {                              \
    uint4 raw = make_uint4(0, 0, 0, 0);                              \
    if (lane_has_dims) raw = *reinterpret_cast<const uint4*>(addr);  \
    unpack16<DT>(raw, out);                                          \
  } else {                                                           \
    uint2 raw = make_uint2(0, 0);                                    \
    if (lane_has_dims) raw = *reinterpret_cast<const uint2*>(addr);  \
    unpack_raw<DT>(raw, out);                                        \
  }

// The rotate_half partners (element (dim + D/2) % D) of the kVec elements of chunk tx of a row, one by
// one: for head dims whose D/2 is not whole 16-byte chunks (DecodeTraits::kPartnerChunks false).
template <class S, class DT, int kVec>
__device__ __forceinline__ void load_partners(const DT* row, int tx, bool has, float (&partner)[kVec]) {
  constexpr int D = S::kHeadDimQK;
#pragma unroll
  for (int i = 0; i < kVec; ++i) partner[i] = has ? to_float(row[(tx * kVec + i + D / 2) % D]) : 0.f;
}

// Keys [lo, hi) of split `split` of `num_splits` over the visible keys [kv_begin, kv_end): whole tiles of
// kTileKeys, the tiles dealt so that two splits differ by at most one tile (a split of ceil(keys /
// num_splits) rounded up to whole tiles left the last splits short or empty: 1 x 32768 at 33 splits of
// 16 tiles kept 8 of its 264 blocks idle).
// One split returns [kv_begin, kv_end) at once: the same bounds the division gives, without its two
// 64-bit divisions (div.s64, a software routine) before the first page-id read. (The tensor-core
// decode's whole-window mode keeps its own chunk rule: decode_mma_kernel.)
template <int kTileKeys>
__device__ __forceinline__ void split_range(int kv_begin, int kv_end, int split, int num_splits, int& lo, int& hi) {
  if (num_splits == 1) {
    lo = kv_begin;
    hi = kv_end;
    return;
  }
  const long long tiles = ceil_div(max(kv_end - kv_begin, 0), kTileKeys);
  lo = kv_begin + static_cast<int>(tiles * split / num_splits) * kTileKeys;
  hi = min(kv_end, kv_begin + static_cast<int>(tiles * (split + 1) / num_splits) * kTileKeys);
}

// Issue cp.async for keys [start, start + kTileKeys) into one stage; rows at or past `end` are zero-filled.
template <class S>
__device__ __forceinline__ void decode_load_tile(const Params& p, uint8_t* stage, int batch, int kv_head, int start,
                                                 int end, bool& bad) {
  using T = DecodeTraits<S>;
  using DT = typename S::DTypeKV;
  DT* sk = reinterpret_cast<DT*>(stage);
  load_kv_rows<S, T::kTileKeys, T::kHeadDim, T::kThreads>(p, sk, sk + T::kTileKeys * T::kHeadDim, batch, kv_head,
                                                          start, end, bad);
}

// Two consecutive output elements, in one 4-byte store where `dst` is 4-byte aligned (an `out`
// tensor may start at any element).
template <class T>
__device__ __forceinline__ void store2(T* dst, float a, float b) {
  if constexpr (sizeof(T) == 2) {
    if ((reinterpret_cast<uintptr_t>(dst) & 3) == 0) {
      *reinterpret_cast<uint32_t*>(dst) = pack2<T>(a, b);
      return;
    }
  }
  dst[0] = from_float<T>(a);
  dst[1] = from_float<T>(b);
}

// Upper bound of the split-KV factor (jitattn/runtime.py caps num_splits below it).
constexpr int kMaxSplits = 64;

// The split-KV merge, fused into every decode kernel that splits. Every block calls it after writing its
// partial state; the last of the num_splits blocks of a tile to count itself in (one int per tile at
// p.split_counters[rows.counter()], zero between launches: that block resets it) merges the partials of the
// tile's rows 0 .. n_rows - 1 (n_rows <= kMaxRows) and writes their output and lse. No merge launch, and no
// wait for the whole grid (the "last block" pattern: __threadfence, then an atomic count). Rows
// (GroupMergeRows, FlatMergeRows) places row g: part(g) its partial state row, out(g) its o / lse row,
// head(g) its query head, finish(...) its output element; stride(p) is the rows between two splits' partial
// states. `scratch`: the block's merge scratch (free again), kMaxRows * (kMaxSplits + 2) + 1 words (no
// static __shared__: a kernel whose dynamic shared memory is exactly the 48 KB default limit would not
// launch).
template <class S, int kMaxRows, int kThreads, class Rows>
__device__ __forceinline__ void merge_rows_last_block(const Params& p, float* scratch, int n_rows, const Rows& rows) {
  int& last = reinterpret_cast<int*>(scratch)[kMaxRows * (kMaxSplits + 2)];
  __threadfence();  // this thread's partial writes are visible device-wide before the block counts itself
  __syncthreads();
  if (threadIdx.x == 0) {
    int* c = p.split_counters + rows.counter();
    last = atomicAdd(c, 1) == p.num_splits - 1;
    if (last) *c = 0;  // every split has counted: ready for the next launch (graph replays too)
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int n = min(p.num_splits, kMaxSplits);
  const long long stride = rows.stride(p);
  float* weight = scratch;                         // [kMaxRows][kMaxSplits]
  float* scale = weight + kMaxRows * kMaxSplits;   // [kMaxRows]
  float* poison = scale + kMaxRows;                // [kMaxRows]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // One warp per row: max over the splits' lse (base 2; a NaN one poisons the row), weights, sum.
  // Partials are read through L2 (__ldcg): other SMs wrote them during this launch.
  for (int g = warp; g < n_rows; g += kThreads / 32) {
    const long long part = rows.part(g);
    const float l0 = lane < n ? __ldcg(p.partial_lse + lane * stride + part) : kNegInf;
    const float l1 = lane + 32 < n ? __ldcg(p.partial_lse + (lane + 32) * stride + part) : kNegInf;
    const bool bad = __any_sync(0xffffffffu, isnan(l0) || isnan(l1));
    const float m = group_max<32>(fmaxf(l0, l1));
    const float w0 = S::kSoftmax ? rescale_factor(l0, m) : (lane < n ? 1.f : 0.f);
    const float w1 = S::kSoftmax ? rescale_factor(l1, m) : (lane + 32 < n ? 1.f : 0.f);
    weight[g * kMaxSplits + lane] = w0;
    weight[g * kMaxSplits + lane + 32] = w1;
    const float d = group_sum<32>(w0 + w1);
    if (lane == 0) {
      float lse;
      scale[g] = finalize_state<S>(p, rows.head(g), SoftmaxState{m, d}, lse);
      poison[g] = bad ? quiet_nan() : 0.f;
      if (p.lse != nullptr) p.lse[rows.out(g)] = lse + poison[g];
    }
  }
  __syncthreads();
  // Every output element of the rows, 4 at a time (head_dim_vo is a multiple of 16).
  constexpr int kQuads = S::kHeadDimVO / 4;
  for (int e = threadIdx.x; e < n_rows * kQuads; e += kThreads) {
    const int g = e / kQuads, i = (e % kQuads) * 4;
    const long long part = rows.part(g);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 16
    for (int s = 0; s < n; ++s) {
      const float w = weight[g * kMaxSplits + s];
      const float4 x = __ldcg(reinterpret_cast<const float4*>(p.partial_o + (s * stride + part) * S::kHeadDimVO + i));
      acc[0] = fmaf(w, x.x, acc[0]);
      acc[1] = fmaf(w, x.y, acc[1]);
      acc[2] = fmaf(w, x.z, acc[2]);
      acc[3] = fmaf(w, x.w, acc[3]);
    }
    const long long out = rows.out(g);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      p.o[out * S::kHeadDimVO + i + j] =
          from_float<typename S::DTypeO>(rows.finish(p, acc[j] * scale[g], poison[g], g, i + j));
  }
}

// merge_rows_last_block's rows for a GQA group: row g is query head kv_head * kGroupSize + g of sequence
// `batch` (partial states (num_splits, batch_size, heads, head_dim_vo)), written to query row q_row; one
// counter per (sequence, kv head); the output transform (if any) applies here.
template <class S>
struct GroupMergeRows {
  int batch, kv_head, q_row, qo_idx;
  __device__ __forceinline__ long long counter() const {
    return static_cast<long long>(batch) * S::kNumKvHeads + kv_head;
  }
  __device__ __forceinline__ static long long stride(const Params& p) {
    return static_cast<long long>(p.batch_size) * S::kNumQoHeads;
  }
  __device__ __forceinline__ int head(int g) const { return kv_head * S::kGroupSize + g; }
  __device__ __forceinline__ long long part(int g) const {
    return static_cast<long long>(batch) * S::kNumQoHeads + head(g);
  }
  __device__ __forceinline__ long long out(int g) const {
    return static_cast<long long>(q_row) * S::kNumQoHeads + head(g);
  }
  __device__ __forceinline__ float finish(const Params& p, float value, float poison, int g, int dim) const {
    bool oob = false;  // a parameter read out of range poisons this element
    if constexpr (S::kHasOutTransform) value = S::output_transform(p, value, batch, head(g), qo_idx, dim, oob);
    return value + poison + (oob ? quiet_nan() : 0.f);
  }
};

// merge_rows_last_block's rows for a tile of flattened (total_q * heads) query rows: row g is row row0 + g of
// partials and output alike, its head (row0 + g) % heads; the tile counts at tile_counter
// (mla_decode_sm90.cuh). Softmax, no output transform.
template <class S>
struct FlatMergeRows {
  static_assert(S::kSoftmax && !S::kHasOutTransform, "FlatMergeRows: softmax rows, no output transform");
  long long row0, tile_counter;
  __device__ __forceinline__ long long counter() const { return tile_counter; }
  __device__ __forceinline__ static long long stride(const Params& p) {
    return static_cast<long long>(p.total_q) * S::kNumQoHeads;
  }
  __device__ __forceinline__ int head(int g) const { return static_cast<int>((row0 + g) % S::kNumQoHeads); }
  __device__ __forceinline__ long long part(int g) const { return row0 + g; }
  __device__ __forceinline__ long long out(int g) const { return row0 + g; }
  __device__ __forceinline__ float finish(const Params&, float value, float poison, int, int) const {
    return value + poison;
  }
};

// The merge of a GQA decode block: the group of (sequence batch, kv_head), one counter per pair, written to
// query row q_row (position qo_idx).
template <class S, int kThreads>
__device__ __forceinline__ void merge_splits_last_block(const Params& p, float* scratch, int batch, int kv_head,
                                                        int q_row, int qo_idx) {
  merge_rows_last_block<S, S::kGroupSize, kThreads>(p, scratch, S::kGroupSize,
                                                    GroupMergeRows<S>{batch, kv_head, q_row, qo_idx});
}

// Merges the kZ partial states (one per key slot or warp) of every query head of the group and
// writes the output (or this split's partial state). Scratch `sm_m` (floats, filled by the caller):
// m[kZ][kSlots], d[kZ][kSlots], o[kZ][kSlots][head_dim_vo], then scale[kSlots]; slot g is group head g.
template <class S, int kZ, int kSlots, int kThreads>
__device__ __forceinline__ void decode_finish(const Params& p, float* sm_m, int split, int batch, int kv_head,
                                              int q_row, int qo_idx, float poison) {
  static_assert(kZ * kSlots * (S::kHeadDimVO + 2) + kSlots >= S::kGroupSize * (kMaxSplits + 2) + 1,
                "merge_splits_last_block's scratch must fit in the merge scratch");
  float* sm_d = sm_m + kZ * kSlots;
  float* sm_o = sm_d + kZ * kSlots;
  float* sm_scale = sm_o + kZ * kSlots * S::kHeadDimVO;
  // Per head: merged max and sum; weights replace the maxima; the lse (or partial lse) is written here.
  for (int g = threadIdx.x; g < S::kGroupSize; g += kThreads) {
    float m = kNegInf, d = 0.f;
    for (int z = 0; z < kZ; ++z) m = fmaxf(m, sm_m[z * kSlots + g]);
    for (int z = 0; z < kZ; ++z) {
      const float w = rescale_factor(sm_m[z * kSlots + g], m);
      sm_m[z * kSlots + g] = w;
      d += sm_d[z * kSlots + g] * w;
    }
    const int qo_head = kv_head * S::kGroupSize + g;
    if (p.num_splits == 1) {
      float lse;
      sm_scale[g] = finalize_state<S>(p, qo_head, SoftmaxState{m, d}, lse) * p.v_scale;
      if (p.lse != nullptr) p.lse[static_cast<long long>(q_row) * S::kNumQoHeads + qo_head] = lse + poison;
    } else if constexpr (S::kSoftmax) {  // normalised partial state, base 2: merged (and sinks added) by merge_splits
      const long long part = (static_cast<long long>(split) * p.batch_size + batch) * S::kNumQoHeads + qo_head;
      sm_scale[g] = d > 0.f ? p.v_scale / d : 0.f;
      p.partial_lse[part] = (d > 0.f ? m + __log2f(d) : kNegInf) + poison;
    } else {  // without softmax a partial is a plain sum; merge_splits adds them up
      const long long part = (static_cast<long long>(split) * p.batch_size + batch) * S::kNumQoHeads + qo_head;
      sm_scale[g] = p.v_scale;
      p.partial_lse[part] = poison;
    }
  }
  __syncthreads();
  // Every output element of the group, two at a time (head_dim_vo is even): consecutive threads write
  // consecutive pairs.
  constexpr int kPairs = S::kHeadDimVO / 2;
  for (int e = threadIdx.x; e < S::kGroupSize * kPairs; e += kThreads) {
    const int g = e / kPairs, i = (e % kPairs) * 2;
    float acc[2] = {0.f, 0.f};
#pragma unroll
    for (int z = 0; z < kZ; ++z) {
      const float w = sm_m[z * kSlots + g];
      const float2 x = *reinterpret_cast<const float2*>(sm_o + (z * kSlots + g) * S::kHeadDimVO + i);
      acc[0] = fmaf(w, x.x, acc[0]);
      acc[1] = fmaf(w, x.y, acc[1]);
    }
    const int qo_head = kv_head * S::kGroupSize + g;
    if (p.num_splits == 1) {
      float value[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        value[j] = acc[j] * sm_scale[g];
        bool oob = false;  // a parameter read out of range here poisons this element
        if constexpr (S::kHasOutTransform) value[j] = S::output_transform(p, value[j], batch, qo_head, qo_idx, i + j, oob);
        value[j] += poison + (oob ? quiet_nan() : 0.f);
      }
      store2<typename S::DTypeO>(p.o + (static_cast<long long>(q_row) * S::kNumQoHeads + qo_head) * S::kHeadDimVO + i,
                                 value[0], value[1]);
    } else {
      const long long part = (static_cast<long long>(split) * p.batch_size + batch) * S::kNumQoHeads + qo_head;
      *reinterpret_cast<float2*>(p.partial_o + part * S::kHeadDimVO + i) =
          make_float2(acc[0] * sm_scale[g] + poison, acc[1] * sm_scale[g] + poison);
    }
  }
  if (p.num_splits > 1 && p.split_counters != nullptr)
    merge_splits_last_block<S, kThreads>(p, sm_m, batch, kv_head, q_row, qo_idx);
}

// The decode row of sequence `batch`, for both decode kernels: its row of q and o and its key count;
// false when the sequence is not one query (the prefill kernel serves it) or its row lies outside q
// (nothing to read or write). One condition, no return inside: the kernel's own early return keeps
// the layout nvcc gives the two kernels.
template <class S>
__device__ __forceinline__ bool decode_row(const Params& p, int batch, int& q_row, int& kv_len) {
  // The metadata reads are issued together, before any branch: one round trip, not two.
  q_row = p.query_start_loc[batch];
  const int q_end = p.query_start_loc[batch + 1];
  kv_len = p.seq_lens[batch];
  return q_end - q_row == 1 && q_row >= 0 && q_row < p.total_q;
}

// The query rows [q_row0, q_end) of sequence `batch` and its key count, for both MLA decode kernels (every
// query of the batch): false when the rows are empty or lie outside q (nothing to read or write).
__device__ __forceinline__ bool latent_rows(const Params& p, int batch, int& q_row0, int& q_end, int& kv_len) {
  q_row0 = p.query_start_loc[batch];
  q_end = p.query_start_loc[batch + 1];
  kv_len = p.seq_lens[batch];
  return !(q_row0 < 0 || q_end > p.total_q || q_end <= q_row0);
}

template <class S>
__device__ __forceinline__ void decode_kernel(const Params& p) {
  using T = DecodeTraits<S>;
  using DT = typename S::DTypeKV;
  constexpr int H = T::kHeadsPerThread, KPT = T::kKeysPerThread, V = T::kVec;
  extern __shared__ __align__(16) uint8_t smem[];

  const int split = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
  int q_row, kv_len;
  if (!decode_row<S>(p, batch, q_row, kv_len)) return;
  const int qo_idx = kv_len - 1;
  int kv_begin, kv_end, lo, hi;
  bool bad = visible_keys<S>(sequence_ok<S>(p, 1, kv_len), qo_idx, qo_idx, kv_len, kv_begin, kv_end);
  split_range<T::kTileKeys>(kv_begin, kv_end, split, p.num_splits, lo, hi);

  const int tx = threadIdx.x % T::kBdx;
  const int ty = (threadIdx.x / T::kBdx) % T::kBdy;
  const int tz = threadIdx.x / (T::kBdx * T::kBdy);
  const bool lane_has_dims = tx < T::kChunks;

  // Query heads of this thread: group-local g = ty * H + h.
  float q[H][V], o[H][V];
  SoftmaxState st[H];
#pragma unroll
  for (int h = 0; h < H; ++h) {
    const int g = ty * H + h;
    const int qo_head = kv_head * S::kGroupSize + min(g, S::kGroupSize - 1);
    const typename S::DTypeQ* q_head = p.q + q_row * p.q_stride_token + qo_head * S::kHeadDimQK;
    const bool has_q = lane_has_dims && g < S::kGroupSize;
    load_floats<typename S::DTypeQ, V>(q_head + tx * V, q[h], has_q);  // V elements of the KV vector width
    if constexpr (S::kHasQTransform) {  // the rotate_half partner lies D/2 away: another chunk
      float partner[V];
      if constexpr (T::kPartnerChunks)
        load_floats<typename S::DTypeQ, V>(q_head + ((tx + T::kChunks / 2) % T::kChunks) * V, partner, has_q);
      else
        load_partners<S>(q_head, tx, has_q, partner);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int dim = tx * V + i;
        q[h][i] = S::query_transform(p, q[h][i], rotate_half_value(dim, T::kHeadDim, partner[i]), batch, qo_head,
                                     qo_idx, dim, bad);
      }
    }
#pragma unroll
    for (int i = 0; i < V; ++i) {
      q[h][i] *= q_prescale<S>() * (T::kScaleKeys ? 1.f : p.k_scale);  // an FP8 cache's K scale folds into q
      o[h][i] = 0.f;
    }
    st[h] = softmax_initial<S>();
  }

  // Prologue: kStages - 1 tiles in flight (issuing them before the q loads made no difference).
#pragma unroll
  for (int s = 0; s < T::kStages - 1; ++s) {
    const int start = lo + s * T::kTileKeys;
    if (start < hi) decode_load_tile<S>(p, smem + s * T::kStageBytes, batch, kv_head, start, hi, bad);
    cp_async_commit();
  }

  int it = 0;
  for (int start = lo; start < hi; start += T::kTileKeys, ++it) {
    cp_async_wait<T::kStages - 2>();
    __syncthreads();  // tile `it` landed for all threads; stage (it - 1) is free again
    {
      const int next = start + (T::kStages - 1) * T::kTileKeys;
      if (next < hi)
        decode_load_tile<S>(p, smem + ((it + T::kStages - 1) % T::kStages) * T::kStageBytes, batch, kv_head, next, hi,
                            bad);
      cp_async_commit();
    }
    const DT* sk = reinterpret_cast<const DT*>(smem + (it % T::kStages) * T::kStageBytes);
    const DT* sv = sk + T::kTileKeys * T::kHeadDim;

    float s[H][KPT];
#pragma unroll
    for (int j = 0; j < KPT; ++j) {
      const int row = tz + j * T::kBdz;
      float kf[V];
      JITATTN_DECODE_READ_CHUNK(kf, sk + row * T::kHeadDim + tx * V);
      if constexpr (S::kHasKTransform) {  // keys are transformed as they are read: the cache holds them raw
        float partner[V];
        if constexpr (T::kPartnerChunks) {
          JITATTN_DECODE_READ_CHUNK(partner, sk + row * T::kHeadDim + ((tx + T::kChunks / 2) % T::kChunks) * V);
        } else {
          load_partners<S>(sk + row * T::kHeadDim, tx, lane_has_dims, partner);
        }
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const int dim = tx * V + i;
          if constexpr (T::kScaleKeys) {
            kf[i] *= p.k_scale;
            partner[i] *= p.k_scale;
          }
          kf[i] = S::key_transform(p, kf[i], rotate_half_value(dim, T::kHeadDim, partner[i]), batch, kv_head,
                                   start + row, dim, bad);
        }
      }
#pragma unroll
      for (int h = 0; h < H; ++h) {
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < V; ++i) acc = fmaf(q[h][i], kf[i], acc);
        s[h][j] = group_sum<T::kBdx>(acc);
      }
    }
#pragma unroll
    for (int h = 0; h < H; ++h) {
      const int qo_head = kv_head * S::kGroupSize + min(ty * H + h, S::kGroupSize - 1);
      float tile_max = kNegInf;
#pragma unroll
      for (int j = 0; j < KPT; ++j) {
        const int kv_idx = start + tz + j * T::kBdz;
        const float v = transform_logit<S>(p, s[h][j], batch, qo_head, kv_head, qo_idx, kv_idx, 1, kv_len, bad);
        const bool ok = kv_idx < hi && custom_visible<S>(p, batch, qo_head, kv_head, qo_idx, kv_idx, 1, kv_len, bad);
        s[h][j] = ok ? v : masked_score<S>();
        tile_max = fmaxf(tile_max, s[h][j]);
      }
      if constexpr (S::kSoftmax) {  // (without softmax the weights are used as they are)
        const SoftmaxStep step = softmax_step(st[h], tile_max);
#pragma unroll
        for (int i = 0; i < V; ++i) o[h][i] *= step.alpha;
#pragma unroll
        for (int j = 0; j < KPT; ++j) {
          s[h][j] = fast_exp2(s[h][j] - step.m_use);
          st[h].d += s[h][j];
        }
      }
    }
#pragma unroll
    for (int j = 0; j < KPT; ++j) {
      const int row = tz + j * T::kBdz;
      float vf[V];
      JITATTN_DECODE_READ_CHUNK(vf, sv + row * T::kHeadDim + tx * V);
#pragma unroll
      for (int h = 0; h < H; ++h)
#pragma unroll
        for (int i = 0; i < V; ++i) o[h][i] = fmaf(s[h][j], vf[i], o[h][i]);
    }
  }
  cp_async_wait<0>();
  // All stages idle (shared memory is reused for the merge below); any thread's bad metadata poisons the row.
  const float poison = __syncthreads_or(bad) ? quiet_nan() : 0.f;

  // Merge the kBdz key-slot states of each head, all threads at once. Scratch (floats):
  // m[kBdz][kSlots] (then the merge weights), d[kBdz][kSlots], o[kBdz][kSlots][kHeadDim], scale[kSlots].
  constexpr int kSlots = T::kSlots;
  float* sm_m = reinterpret_cast<float*>(smem);
  float* sm_d = sm_m + T::kBdz * kSlots;
  float* sm_o = sm_d + T::kBdz * kSlots;
#pragma unroll
  for (int h = 0; h < H; ++h) {
    const int slot = tz * kSlots + ty * H + h;
    if (tx == 0) {
      sm_m[slot] = st[h].m;
      sm_d[slot] = st[h].d;
    }
    if (lane_has_dims)
#pragma unroll
      for (int i = 0; i < V; ++i) sm_o[slot * T::kHeadDim + tx * V + i] = o[h][i];
  }
  __syncthreads();
  decode_finish<S, T::kBdz, kSlots, T::kThreads>(p, sm_m, split, batch, kv_head, q_row, qo_idx, poison);
}
#undef JITATTN_DECODE_READ_CHUNK

}  // namespace jitattn
